"""`llmctl doctor --bundle DIR`: a support bundle to attach to a bug report, in the spirit of vLLM's
collect-env and nvidia-bug-report.sh: the doctor report, `nvidia-smi -q` and its topology matrix, the
installed packages, the NVIDIA lines of the kernel log and the environment with secret values masked."""

from __future__ import annotations

import fnmatch
import json
import shutil
import subprocess
from pathlib import Path
from typing import Any, Mapping, Optional

from llmctl.checks.probe import Host

MASK = "***"
# Environment names whose values are credentials (matched case-insensitively).
SECRET_PATTERNS = ("*_KEY", "*_TOKEN", "*PASSWORD*", "*SECRET*")
KERNEL_WORDS = ("NVRM", "Xid", "SXid", "nvidia", "nvswitch")
COMMANDS = {"nvidia-smi-q.txt": ["nvidia-smi", "-q"], "nvidia-smi-topo.txt": ["nvidia-smi", "topo", "-m"]}


def is_secret(name: str) -> bool:
    return any(fnmatch.fnmatchcase(name.upper(), pattern) for pattern in SECRET_PATTERNS)


def mask_environment(env: Mapping[str, str]) -> dict[str, str]:
    """The environment, sorted, with every credential-like variable's value replaced by MASK."""
    return {name: MASK if is_secret(name) else value for name, value in sorted(env.items())}


def installed_packages() -> list[str]:
    """`pip freeze`-style name==version lines of this interpreter's distributions."""
    from importlib.metadata import distributions

    seen = {(d.metadata["Name"] or "?"): d.version for d in distributions()}
    return [f"{name}=={version}" for name, version in sorted(seen.items(), key=lambda kv: kv[0].lower())]


def _run(command: list[str]) -> tuple[Optional[str], str]:
    """(output, note): output None when the tool is absent or failed, and the note says why."""
    if shutil.which(command[0]) is None:
        return None, f"{command[0]} is not on PATH"
    try:
        proc = subprocess.run(command, capture_output=True, text=True, timeout=60)
    except (OSError, subprocess.TimeoutExpired) as exc:
        return None, f"{' '.join(command)}: {exc}"
    if proc.returncode != 0:
        return None, f"{' '.join(command)} exited {proc.returncode}: {proc.stderr.strip()[:200]}"
    return proc.stdout, "ok"


def write_bundle(folder: Path, report: dict[str, Any], host: Host) -> dict[str, str]:
    """Write the bundle's files into folder; returns file name -> "ok" or why it is missing (also in
    bundle.json)."""
    folder.mkdir(parents=True, exist_ok=True)
    written: dict[str, str] = {}

    def put(name: str, text: str) -> None:
        (folder / name).write_text(text)
        written[name] = "ok"

    put("doctor.json", json.dumps(report, indent=2, default=str) + "\n")
    for name, command in COMMANDS.items():
        output, note = _run(command)
        if output is None:
            written[name] = note
        else:
            put(name, output)
    put("pip-freeze.txt", "\n".join(installed_packages()) + "\n")
    put("environment.txt", "".join(f"{k}={v}\n" for k, v in mask_environment(host.env).items()))
    log = host.kernel_log.get()
    if log.source is None:
        written["kernel-nvidia.txt"] = f"kernel log not readable: {log.error}"
    else:
        put("kernel-nvidia.txt", "".join(line + "\n" for line in log.lines if any(w in line for w in KERNEL_WORDS)))
    (folder / "bundle.json").write_text(json.dumps({"files": written, "masked": list(SECRET_PATTERNS)}, indent=2) + "\n")
    return written
