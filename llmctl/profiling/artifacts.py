"""Artifact folders of `llmctl profile`: one timestamped folder per run holding the profiler's files
and a `manifest.json` that says what ran (tool, version, exact command, PIDs, duration, exit status,
files). The manifest is written even when the run fails or is interrupted, so a half-finished
profile is still explained."""

from __future__ import annotations

import datetime as _dt
import json
import os
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional

from llmctl.errors import UserError

DEFAULT_ROOT = "llmctl-profiles"
MANIFEST = "manifest.json"


def default_output_dir(kind: str, now: Optional[_dt.datetime] = None, root: Path = Path(DEFAULT_ROOT)) -> Path:
    """`./llmctl-profiles/<kind>-<YYYYmmdd-HHMMSS>`, suffixed `-2`, `-3`... when that name is taken."""
    stamp = (now or _dt.datetime.now()).strftime("%Y%m%d-%H%M%S")
    candidate = root / f"{kind}-{stamp}"
    counter = 2
    while candidate.exists():
        candidate = root / f"{kind}-{stamp}-{counter}"
        counter += 1
    return candidate


def prepare_output_dir(path: Optional[Path], kind: str) -> Path:
    folder = Path(path) if path is not None else default_output_dir(kind)
    if folder.exists() and not folder.is_dir():
        raise UserError(f"--output-dir {folder} exists and is not a folder")
    try:
        folder.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise UserError(f"cannot create {folder}: {exc.strerror or exc}") from None
    if not os.access(folder, os.W_OK):
        raise UserError(f"cannot write to {folder}")
    return folder.resolve()


@dataclass
class Manifest:
    """What one profiling run did; `to_dict()` is the JSON written to manifest.json and printed by --json."""

    kind: str
    tool: str
    tool_version: Optional[str]
    command: list[str]
    output_dir: Path
    target_pids: list[int] = field(default_factory=list)
    workload_command: Optional[list[str]] = None
    started_at: str = field(default_factory=lambda: _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"))
    duration_s: Optional[float] = None
    exit_status: Optional[int] = None
    status: str = "running"
    message: Optional[str] = None
    files: list[str] = field(default_factory=list)
    result: dict[str, Any] = field(default_factory=dict)
    _t0: float = field(default_factory=time.monotonic, repr=False)

    def add_file(self, path: Path) -> None:
        """Record `path` (inside the output folder) if it was actually written."""
        path = Path(path)
        if path.exists():
            name = str(path.resolve().relative_to(self.output_dir)) if path.is_absolute() else str(path)
            if name not in self.files:
                self.files.append(name)

    def finish(self, status: str, exit_status: Optional[int] = None, message: Optional[str] = None) -> None:
        self.status = status
        self.exit_status = exit_status
        self.message = message
        self.duration_s = round(time.monotonic() - self._t0, 3)

    def to_dict(self) -> dict[str, Any]:
        return {
            "kind": self.kind, "tool": {"name": self.tool, "version": self.tool_version},
            "command": self.command, "workload_command": self.workload_command, "target_pids": self.target_pids,
            "started_at": self.started_at, "duration_s": self.duration_s, "exit_status": self.exit_status,
            "status": self.status, "message": self.message, "output_dir": str(self.output_dir),
            "files": sorted(set(self.files) | {MANIFEST}), "result": self.result,
        }

    def write(self) -> Path:
        """Write manifest.json atomically (a reader never sees half a file)."""
        target = self.output_dir / MANIFEST
        tmp = target.with_suffix(".json.tmp")
        tmp.write_text(json.dumps(self.to_dict(), indent=2, default=str) + "\n")
        os.replace(tmp, target)
        return target


def new_manifest(kind: str, tool: str, version: Optional[str], output_dir: Optional[Path],
                 command: Optional[list[str]] = None) -> Manifest:
    """The manifest of a run starting now, in its prepared artifact folder."""
    return Manifest(kind=kind, tool=tool, tool_version=version, command=command or [],
                    output_dir=prepare_output_dir(output_dir, kind))


def resolved_command(ctx: Any, leave_out: tuple[str, ...] = ("config", "dry_run", "json_output")) -> list[str]:
    """The fully resolved llmctl command line of an in-process profile (flags from env/config spelled
    out), from the click context of the command that runs it."""
    import enum

    argv = ctx.command_path.split()
    for param in ctx.command.params:
        value = ctx.params.get(param.name)
        if param.name in leave_out or value is None or value == []:
            continue
        if param.param_type_name == "argument":
            argv.append(str(value))
        elif param.is_flag:
            if param.secondary_opts:
                argv.append(param.opts[0] if value else param.secondary_opts[0])
            elif value:
                argv.append(param.opts[0])
        else:
            argv += [param.opts[0], str(value.value if isinstance(value, enum.Enum) else value)]
    return argv


def redacted(argv: list[str], flag: str) -> list[str]:
    """`argv` with the value after `flag` replaced by *** (a key must not land in the manifest)."""
    return [("***" if i and argv[i - 1] == flag else arg) for i, arg in enumerate(argv)]
