"""Progress display for profiling runs: a Rich spinner or bar on stderr when it is a terminal,
nothing at all when piped (so `--json` output and logs stay clean)."""

from __future__ import annotations

import contextlib
import threading
import time
from typing import Iterator, Optional

from llmctl.output import is_interactive, stderr_console


class Steps:
    """A handle the caller advances; a no-op when there is no terminal."""

    def __init__(self, progress=None, task=None):
        self._progress, self._task = progress, task

    def advance(self, n: int = 1, **fields) -> None:
        if self._progress is not None:
            self._progress.update(self._task, advance=n, **fields)


@contextlib.contextmanager
def steps(message: str, total: int, detail: str = "") -> Iterator[Steps]:
    """A bar of `total` steps; `advance(detail=...)` updates the text after it."""
    console = stderr_console()
    if not is_interactive(console):
        yield Steps()
        return
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    columns = (TextColumn(message), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(), TextColumn("{task.fields[detail]}"))
    with Progress(*columns, console=console, transient=True) as progress:
        yield Steps(progress, progress.add_task(message, total=total, detail=detail))


@contextlib.contextmanager
def waiting(message: str, duration_s: Optional[float] = None) -> Iterator[None]:
    """A spinner with elapsed time, or a bar filling over `duration_s` when the run has a known length."""
    console = stderr_console()
    if not is_interactive(console):
        yield
        return
    from rich.progress import BarColumn, Progress, SpinnerColumn, TextColumn, TimeElapsedColumn

    columns = [SpinnerColumn(), TextColumn(message)]
    if duration_s:
        columns.append(BarColumn())
    columns.append(TimeElapsedColumn())
    with Progress(*columns, console=console, transient=True) as progress:
        task = progress.add_task(message, total=duration_s or None)
        done = threading.Event()
        ticker = threading.Thread(target=_tick, args=(progress, task, done), daemon=True)
        ticker.start()
        try:
            yield
        finally:
            done.set()
            ticker.join()


def _tick(progress, task, done: threading.Event) -> None:
    start = time.monotonic()
    while not done.wait(0.2):
        progress.update(task, completed=time.monotonic() - start)


def note(message: str) -> None:
    """A dim status line on stderr, only on a terminal."""
    console = stderr_console()
    if is_interactive(console):
        console.print(message, style="dim", markup=False, highlight=False)
