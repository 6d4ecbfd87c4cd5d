"""Child processes of `llmctl profile`: start a workload or a profiler, stop it gently
(SIGINT, then SIGTERM, then SIGKILL), and describe how it ended."""

from __future__ import annotations

import os
import shlex
import signal
import subprocess
import time
from typing import IO, Optional, Sequence

from llmctl.errors import UserError

GRACE_S = 5.0


def spawn(argv: Sequence[str], *, stdout: Optional[IO] = None, stderr: Optional[IO] = None,
          own_group: bool = False) -> subprocess.Popen:
    """Start `argv`. `own_group` keeps a terminal Ctrl-C away from it, so llmctl decides when it stops."""
    try:
        return subprocess.Popen(list(argv), stdout=stdout, stderr=stderr, start_new_session=own_group)
    except FileNotFoundError:
        raise UserError(f"command not found: {argv[0]}") from None
    except PermissionError:
        raise UserError(f"not executable: {argv[0]}") from None


def stop(proc: subprocess.Popen, *, first: int = signal.SIGINT, grace_s: float = GRACE_S) -> Optional[int]:
    """Ask `proc` to stop with `first`, escalating to SIGTERM and SIGKILL; returns its exit status."""
    for sig in (first, signal.SIGTERM, signal.SIGKILL):
        if proc.poll() is not None:
            break
        try:
            proc.send_signal(sig)
        except ProcessLookupError:
            break
        try:
            proc.wait(timeout=grace_s)
        except subprocess.TimeoutExpired:
            continue
    return proc.poll()


def wait_or_stop(proc: subprocess.Popen, timeout_s: float) -> Optional[int]:
    """Wait up to `timeout_s` for `proc` to end by itself, then stop it."""
    try:
        return proc.wait(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        return stop(proc)


def after_interrupt(proc: Optional[subprocess.Popen], delay_s: float = 1.0) -> Optional[int]:
    """After Ctrl-C: a process in our terminal's group got the SIGINT too; give it `delay_s` to act on it
    before sending one ourselves (for a SIGINT sent to llmctl alone), then stop it."""
    if proc is None:
        return None
    deadline = time.monotonic() + delay_s
    while proc.poll() is None and time.monotonic() < deadline:
        time.sleep(0.05)
    return stop(proc) if proc.poll() is None else proc.returncode


def describe_status(returncode: Optional[int]) -> str:
    if returncode is None:
        return "still running"
    if returncode < 0:
        try:
            return f"killed by {signal.Signals(-returncode).name}"
        except ValueError:
            return f"killed by signal {-returncode}"
    return f"exit status {returncode}"


def shell_join(argv: Sequence[str]) -> str:
    return " ".join(shlex.quote(str(a)) for a in argv)


def is_python_source(path: str) -> bool:
    """A `.py` file, or a script whose shebang runs Python (console scripts such as `llmctl`)."""
    if path.endswith(".py"):
        return os.path.isfile(path)
    try:
        with open(path, "rb") as handle:
            first = handle.readline(200)
    except OSError:
        return False
    return first.startswith(b"#!") and b"python" in first
