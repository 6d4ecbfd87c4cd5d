"""`llmctl profile mem`: capture allocations with memray (run a Python workload, or attach to a PID
for a while) and render the chosen reports (flamegraph / table HTML, summary text, stats JSON).

memray runs under this interpreter (`python -m memray`), so the tool llmctl checked is the one used.
`memray run` returns the workload's own exit status; `memray attach --duration` returns at once
and tracks in the background, so llmctl waits for the capture file to be finalised.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional

from llmctl.errors import UserError
from llmctl.profiling import procs, ui
from llmctl.profiling.artifacts import Manifest

REPORTS = ("flamegraph", "table", "summary", "stats")
LEAK_REPORTS = ("flamegraph", "table")
CAPTURE_NAME = "capture.bin"
REPORT_NAMES = {"flamegraph": "flamegraph.html", "table": "table.html", "summary": "summary.txt", "stats": "stats.json"}
SETTLE_S = 1.0
FINALISE_TIMEOUT_S = 60.0
FINALISE_GRACE_S = 10.0  # a second SIGINT must not cut memray's capture short


@dataclass
class MemPlan:
    pid: Optional[int] = None
    workload: Optional[list[str]] = None
    duration: int = 10
    native: bool = False
    follow_fork: bool = False
    trace_python_allocators: bool = False
    reports: list[str] = field(default_factory=lambda: ["flamegraph"])
    leaks: bool = False
    json_mode: bool = False


def memray_base() -> list[str]:
    return [sys.executable, "-m", "memray"]


def memray_target(workload: list[str]) -> list[str]:
    """What follows `memray run`: `-m module ...`, `-c code`, or a Python file (a console script such as
    `llmctl` counts: it is a Python file). A leading `python` is dropped: memray runs its own interpreter."""
    if not workload:
        raise UserError("give the workload after --, e.g. llmctl profile mem -- work.py ARGS")
    first, rest = workload[0], workload[1:]
    if first in ("-m", "-c"):
        if not rest:
            raise UserError(f"{first} needs a {'module' if first == '-m' else 'program'} after it")
        return workload
    if os.path.basename(first).startswith("python") and shutil.which(first) and not first.endswith(".py"):
        return memray_target(rest)
    path = first if os.path.exists(first) else shutil.which(first)
    if path and procs.is_python_source(path):
        return [path, *rest]
    raise UserError(f"memray profiles Python programs: {first!r} is not a Python script, '-m module' or a Python "
                    "console script (e.g. llmctl profile mem -- work.py, -- -m package.module, -- llmctl generate hi)")


def capture_argv(plan: MemPlan, capture: Path) -> list[str]:
    flags = [f"--{name.replace('_', '-')}" for name in ("native", "follow_fork", "trace_python_allocators")
             if getattr(plan, name)]
    if plan.pid is not None:
        return [*memray_base(), "attach", str(plan.pid), "--output", str(capture), "--force",
                "--duration", str(plan.duration), *flags]
    return [*memray_base(), "run", "--quiet", "--output", str(capture), "--force", *flags, *memray_target(plan.workload or [])]


def report_argv(report: str, capture: Path, output: Path, leaks: bool) -> list[str]:
    if report == "stats":
        return [*memray_base(), "stats", "--json", "--output", str(output), "--force", str(capture)]
    if report == "summary":
        return [*memray_base(), "summary", str(capture)]
    return [*memray_base(), report, "--output", str(output), "--force", *(["--leaks"] if leaks else []), str(capture)]


def run_capture(plan: MemPlan, manifest: Manifest) -> None:
    """Capture allocations into capture.bin, then render the reports; fills in `manifest`."""
    capture = manifest.output_dir / CAPTURE_NAME
    manifest.command = capture_argv(plan, capture)
    try:
        if plan.pid is not None:
            status = _attach(plan, manifest, capture)
        else:
            status = _run_workload(plan, manifest)
    except KeyboardInterrupt:
        if plan.pid is not None:
            _detach(plan.pid)  # stop tracking so the capture file is closed
            _wait_finalised(capture, plan.pid, timeout_s=10.0)
        manifest.add_file(capture)
        if capture.exists():
            _render_reports(plan, manifest, capture)
        manifest.finish("interrupted", None, "interrupted (Ctrl-C); the reports cover what was captured until then")
        manifest.write()
        raise
    manifest.add_file(capture)
    if not capture.exists():
        manifest.finish("tool_failed", status, f"memray wrote no capture ({procs.describe_status(status)})"
                        + _log_tail(manifest))
        manifest.write()
        return
    _render_reports(plan, manifest, capture)
    if plan.pid is None and status != 0:
        manifest.finish("workload_failed", status,
                        f"the workload failed ({procs.describe_status(status)}); its memory profile is in {manifest.output_dir}")
    else:
        manifest.finish("ok", status)
    manifest.write()


def _run_workload(plan: MemPlan, manifest: Manifest) -> Optional[int]:
    manifest.workload_command = list(plan.workload or [])
    ui.note(f"llmctl: running {procs.shell_join(manifest.workload_command)} under memray")
    proc = procs.spawn(manifest.command, stdout=sys.stderr if plan.json_mode else None)
    manifest.target_pids = [proc.pid]
    try:
        return proc.wait()
    except KeyboardInterrupt:
        procs.after_interrupt(proc, delay_s=FINALISE_GRACE_S)  # memray closes the capture as the workload exits
        raise


def _attach(plan: MemPlan, manifest: Manifest, capture: Path) -> Optional[int]:
    manifest.target_pids = [plan.pid]
    log = manifest.output_dir / "memray.log"
    with log.open("w") as handle:
        rc = subprocess.run(manifest.command, stdout=handle, stderr=subprocess.STDOUT).returncode
    manifest.add_file(log)
    if rc != 0:
        return rc
    with ui.waiting(f"memray tracking PID {plan.pid}", plan.duration):
        deadline = time.monotonic() + plan.duration
        while time.monotonic() < deadline and _alive(plan.pid):
            time.sleep(0.2)
    _wait_finalised(capture, plan.pid, FINALISE_TIMEOUT_S)
    return rc


def _detach(pid: int) -> None:
    if _alive(pid):
        subprocess.run([*memray_base(), "detach", str(pid)], capture_output=True, timeout=60)


def _wait_finalised(capture: Path, pid: int, timeout_s: float) -> None:
    """The tracker in the target writes the file until it stops: wait until its size stops changing and
    memray can read it."""
    deadline = time.monotonic() + timeout_s
    last = -1
    while time.monotonic() < deadline:
        size = capture.stat().st_size if capture.exists() else -1
        if size > 0 and size == last and _readable(capture):
            return
        last = size
        time.sleep(SETTLE_S)


def _readable(capture: Path) -> bool:
    from memray import FileReader

    try:
        reader = FileReader(str(capture))
        return reader.metadata.end_time is not None
    except (OSError, RuntimeError, ValueError):
        return False


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _render_reports(plan: MemPlan, manifest: Manifest, capture: Path) -> None:
    manifest.result["reports"] = {}
    for report in plan.reports:
        output = manifest.output_dir / REPORT_NAMES[report]
        argv = report_argv(report, capture, output, plan.leaks and report in LEAK_REPORTS)
        with ui.waiting(f"memray {report}"):
            proc = subprocess.run(argv, capture_output=True, text=True, env={**os.environ, "COLUMNS": "160"})
        if report == "summary" and proc.returncode == 0:
            output.write_text(proc.stdout)
        manifest.add_file(output)
        manifest.result["reports"][report] = {"command": argv, "file": output.name if output.exists() else None,
                                              "exit_status": proc.returncode}
        if proc.returncode != 0:
            manifest.result["reports"][report]["error"] = (proc.stderr or proc.stdout).strip()[-500:]
    manifest.result.update(peak_memory_bytes=_peak(capture), capture=capture.name)


def _peak(capture: Path) -> Optional[int]:
    from memray import FileReader

    try:
        return int(FileReader(str(capture)).metadata.peak_memory)
    except (OSError, RuntimeError, ValueError):
        return None


def _log_tail(manifest: Manifest) -> str:
    log = manifest.output_dir / "memray.log"
    if not log.exists():
        return ""
    from llmctl.profiling.pyspy import last_line

    line = last_line(log.read_text(errors="replace"))
    return f": {line} (full output in {log})" if line else f" (see {log})"
