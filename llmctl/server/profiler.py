"""`torch.profiler` sessions behind `/start_profile` and `/stop_profile` (servers started with
`--profile-dir`). Both calls run on the engine thread, where the model's ops execute; the session is
made on the main thread, which initialises Kineto there (`init_kineto_on_this_thread`)."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any, Optional


def _activities() -> list:
    import torch
    from torch.profiler import ProfilerActivity

    return [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if torch.cuda.is_available() else [])


class TorchProfilerSession:
    def __init__(self, folder: Path):
        from llmctl.profiling import init_kineto_on_this_thread

        self.folder = Path(folder)
        self._profiler: Optional[Any] = None
        self._started = 0.0
        init_kineto_on_this_thread(_activities())

    @property
    def active(self) -> bool:
        return self._profiler is not None

    def start(self) -> None:
        from torch.profiler import profile

        self.folder.mkdir(parents=True, exist_ok=True)
        profiler = profile(activities=_activities(), record_shapes=True, with_stack=False)
        profiler.start()
        self._profiler, self._started = profiler, time.time()

    def stop(self) -> Path:
        """Stop recording and write a Chrome/Perfetto trace; returns its path."""
        profiler, self._profiler = self._profiler, None
        if profiler is None:
            raise RuntimeError("no profile is being recorded")
        profiler.stop()
        stamp = time.strftime("%Y%m%d-%H%M%S", time.localtime(self._started))
        path = self.folder / f"llmctl-trace-{stamp}-{int(self._started * 1000) % 1000:03d}.json.gz"
        profiler.export_chrome_trace(str(path))
        return path
