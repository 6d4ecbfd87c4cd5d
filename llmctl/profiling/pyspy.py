"""`llmctl profile cpu`: py-spy record / dump / top against a PID or a workload llmctl starts.

py-spy's own `record -- CMD` does not report the workload's exit status, so llmctl starts the
workload itself and attaches with `record --pid`; it then knows how the workload ended and fails
when the workload failed. py-spy runs in its own process group so that Ctrl-C reaches it exactly
once, from llmctl, and it still writes the profile.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
import time
from dataclasses import dataclass
from typing import Optional

from llmctl.errors import UserError
from llmctl.profiling import procs, ui
from llmctl.profiling.artifacts import Manifest

OUTPUT_NAMES = {
    "flamegraph": "flamegraph.svg",
    "speedscope": "profile.speedscope.json",
    "chrometrace": "profile.chrometrace.json",
    "raw": "profile.txt",
}
LOG_NAME = "py-spy.log"
WORKLOAD_EXIT_WAIT_S = 30.0  # py-spy needs a moment to notice the workload ended and write the file


@dataclass
class Sampling:
    rate: int = 100
    native: bool = False
    subprocesses: bool = False
    idle: bool = False
    gil: bool = False

    def flags(self, *, with_rate: bool = True) -> list[str]:
        out = ["--rate", str(self.rate)] if with_rate else []
        for name in ("native", "subprocesses", "idle", "gil"):
            if getattr(self, name):
                out.append(f"--{name}")
        return out


@dataclass
class CpuPlan:
    pyspy: str
    sampling: Sampling
    pid: Optional[int] = None
    workload: Optional[list[str]] = None
    duration: Optional[int] = None
    fmt: str = "flamegraph"
    json_mode: bool = False

    def target_pid_text(self) -> str:
        return str(self.pid) if self.pid is not None else "<workload-pid>"


def record_argv(plan: CpuPlan, pid: str, output: str) -> list[str]:
    argv = [plan.pyspy, "record", "--pid", pid, "--output", output, "--format", plan.fmt]
    if plan.duration:
        argv += ["--duration", str(plan.duration)]
    return argv + plan.sampling.flags()


def dump_argv(plan: CpuPlan, pid: str) -> list[str]:
    flags = [f for f in plan.sampling.flags(with_rate=False) if f in ("--native", "--subprocesses")]
    return [plan.pyspy, "dump", "--pid", pid, *flags] + (["--json"] if plan.json_mode else [])


def top_argv(plan: CpuPlan, pid: str) -> list[str]:
    return [plan.pyspy, "top", "--pid", pid, *plan.sampling.flags()]


def run_record(plan: CpuPlan, manifest: Manifest) -> None:
    """Sample the target until the duration ends, the target exits or Ctrl-C; fill in `manifest`."""
    output = manifest.output_dir / OUTPUT_NAMES[plan.fmt]
    log_path = manifest.output_dir / LOG_NAME
    workload = _start_workload(plan, manifest)
    pid = workload.pid if workload else plan.pid
    manifest.command = record_argv(plan, str(pid), str(output))
    manifest.target_pids = [pid]
    with log_path.open("w") as log:
        tool = procs.spawn(manifest.command, stdout=log, stderr=subprocess.STDOUT, own_group=True)
        try:
            with ui.waiting(f"py-spy sampling PID {pid} at {plan.sampling.rate} Hz", plan.duration):
                tool_rc, workload_rc, stopped = _supervise(tool, workload)
        except KeyboardInterrupt:
            procs.stop(tool)  # SIGINT: py-spy writes what it has
            workload_rc = procs.after_interrupt(workload)
            _collect(manifest, output, log_path)
            manifest.finish("interrupted", workload_rc, "interrupted (Ctrl-C); the profile holds the samples taken so far")
            manifest.write()
            raise
    _collect(manifest, output, log_path)
    _judge(manifest, output, log_path, tool_rc, workload, workload_rc, stopped)


def _start_workload(plan: CpuPlan, manifest: Manifest) -> Optional[subprocess.Popen]:
    if not plan.workload:
        return None
    manifest.workload_command = list(plan.workload)
    ui.note(f"llmctl: running {procs.shell_join(plan.workload)} under py-spy; Ctrl-C stops it and keeps the profile")
    # With --json the workload's stdout would corrupt the manifest: send it to stderr.
    return procs.spawn(plan.workload, stdout=sys.stderr if plan.json_mode else None)


def _supervise(tool: subprocess.Popen, workload: Optional[subprocess.Popen]) -> tuple[Optional[int], Optional[int], bool]:
    """Wait for py-spy and the workload; returns (py-spy status, workload status, workload stopped by us)."""
    while True:
        if tool.poll() is not None:
            if workload is None:
                return tool.returncode, None, False
            time.sleep(0.1)  # py-spy may have ended because the workload just did
            if workload.poll() is not None:
                return tool.returncode, workload.returncode, False
            return tool.returncode, procs.stop(workload), True  # --duration is over (or py-spy failed)
        if workload is not None and workload.poll() is not None:
            return procs.wait_or_stop(tool, WORKLOAD_EXIT_WAIT_S), workload.returncode, False
        time.sleep(0.05)


def _collect(manifest: Manifest, output, log_path) -> None:
    manifest.add_file(output)
    manifest.add_file(log_path)
    counts = re.search(r"Samples: (\d+) Errors: (\d+)", _read(log_path))
    if counts:
        manifest.result.update(samples=int(counts.group(1)), errors=int(counts.group(2)))
    if output.exists():
        manifest.result["profile"] = output.name


def _judge(manifest: Manifest, output, log_path, tool_rc, workload, workload_rc, stopped: bool) -> None:
    if workload is not None:
        manifest.result["workload_status"] = procs.describe_status(workload_rc)
        manifest.result["workload_stopped_by_llmctl"] = stopped
    if not output.exists():
        hint = ("; if the workload is a wrapper (shell script, launcher) around Python, add --subprocesses"
                if workload is not None and "--subprocesses" not in manifest.command else "")
        manifest.finish("tool_failed", workload_rc, f"py-spy wrote no profile ({procs.describe_status(tool_rc)}): "
                        f"{last_line(_read(log_path)) or 'no output'}{hint}")
    elif workload is not None and not stopped and workload_rc != 0:
        manifest.finish("workload_failed", workload_rc, f"the workload failed ({procs.describe_status(workload_rc)}); "
                        f"its profile is in {output}")
    else:
        manifest.finish("ok", workload_rc)
    manifest.write()


def run_dump(plan: CpuPlan, manifest: Manifest) -> str:
    """Stacks of every thread right now; returns py-spy's text (or JSON text with --json)."""
    manifest.command = dump_argv(plan, str(plan.pid))
    manifest.target_pids = [plan.pid]
    proc = subprocess.run(manifest.command, capture_output=True, text=True)
    name = "dump.json" if plan.json_mode else "dump.txt"
    (manifest.output_dir / name).write_text(proc.stdout)
    manifest.add_file(manifest.output_dir / name)
    if proc.returncode != 0:
        manifest.finish("tool_failed", None, f"py-spy dump failed: {last_line(proc.stderr or proc.stdout) or 'no output'}")
    else:
        if plan.json_mode:
            manifest.result["stacks"] = json.loads(proc.stdout)
        manifest.finish("ok")
    manifest.write()
    return proc.stdout


def run_top(plan: CpuPlan) -> Optional[int]:
    """py-spy's live view on this terminal; returns the workload's exit status when llmctl started one."""
    if not (sys.stdout.isatty() and sys.stdin.isatty()):
        raise UserError("--top is a live terminal view and needs a TTY; use --duration (a recorded profile) or --dump")
    workload = procs.spawn(plan.workload) if plan.workload else None
    pid = workload.pid if workload else plan.pid
    try:
        subprocess.run(top_argv(plan, str(pid)))
    except KeyboardInterrupt:
        pass  # py-spy top got the same Ctrl-C and has exited
    if workload is None:
        return None
    return workload.poll() if workload.poll() is not None else procs.stop(workload)


def last_line(text: str) -> str:
    """The line that explains a tool's failure: its last `Error...` line, else its last line (no backtraces)."""
    lines = [line.strip() for line in text.splitlines() if line.strip() and not line.startswith(("Stack backtrace", " "))]
    errors = [line for line in lines if line.lower().startswith("error")]
    return (errors or lines or [""])[-1]


def _read(path) -> str:
    try:
        return path.read_text(errors="replace")
    except OSError:
        return ""
