"""Engine steps bracketed for an external CUDA profiler.

Nsight Systems run as `nsys profile --capture-range=cudaProfilerApi` records only between
cudaProfilerStart and cudaProfilerStop. `--cuda-profiler-steps START:STOP` makes every rank call
start before its step START and stop after step STOP-1 (steps that ran a batch, counted from 0 on each
rank; the ranks run the same steps), and wraps each of those steps in an NVTX range "step N", so the
capture holds warm steps only and names them. `llmctl profile nsys -- CMD` sets the flag.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import TYPE_CHECKING, Callable, Iterator, Optional

from llmctl.engine.errors import EngineArgsError

if TYPE_CHECKING:  # torch is imported where a profiler is built: EngineArgs validates ranges without it
    import torch


@dataclass(frozen=True)
class StepRange:
    """Steps [start, stop) of a rank, counted over the steps that ran a batch."""

    start: int
    stop: int

    @classmethod
    def parse(cls, text: str) -> "StepRange":
        start, sep, stop = text.partition(":")
        try:
            parsed = cls(int(start), int(stop)) if sep else None
        except ValueError:
            parsed = None
        if parsed is None or parsed.start < 0 or parsed.stop <= parsed.start:
            raise EngineArgsError(f"cuda_profiler_steps {text!r}: expected START:STOP with 0 <= START < STOP "
                                  "(engine steps, e.g. 10:20)")
        return parsed


class ProfilerSteps:
    """Counts a rank's steps and calls `start`/`stop` at the range's ends, an NVTX range around each step
    inside it. The calls are injectable: the default ones are torch.cuda.profiler's and torch.cuda.nvtx's."""

    def __init__(self, steps: StepRange, start: Callable[[], None], stop: Callable[[], None],
                 push: Callable[[str], object], pop: Callable[[], object]):
        self.steps = steps
        self._start, self._stop, self._push, self._pop = start, stop, push, pop
        self.count = 0
        self.started = False

    @classmethod
    def for_device(cls, text: Optional[str], device: "torch.device") -> Optional["ProfilerSteps"]:
        import torch

        if text is None:
            return None
        steps = StepRange.parse(text)
        if device.type != "cuda":
            raise EngineArgsError(f"cuda_profiler_steps needs a CUDA device (the engine runs on {device.type})")
        return cls(steps, torch.cuda.profiler.start, torch.cuda.profiler.stop, torch.cuda.nvtx.range_push,
                   torch.cuda.nvtx.range_pop)

    @contextlib.contextmanager
    def step(self) -> Iterator[Callable[[bool], None]]:
        """Around one step; the step calls the yielded function with whether it ran a batch (an idle step
        is not counted)."""
        inside = self.steps.start <= self.count < self.steps.stop
        if inside and not self.started:
            self.started = True
            self._start()
        if inside:
            self._push(f"step {self.count}")
        ran = [False]
        try:
            yield lambda value: ran.__setitem__(0, value)
        finally:
            if inside:
                self._pop()
            if ran[0]:
                self.count += 1
                if self.count == self.steps.stop:
                    self._stop()


def step_bracket(profiler: Optional[ProfilerSteps]) -> contextlib.AbstractContextManager:
    """`profiler.step()`, or a bracket that does nothing when no profiler range was asked for."""
    return contextlib.nullcontext(lambda ran: None) if profiler is None else profiler.step()
