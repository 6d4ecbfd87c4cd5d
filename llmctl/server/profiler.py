"""`torch.profiler` sessions behind `/start_profile` and `/stop_profile` (servers started with
`--profile-dir`). Both calls run on the engine thread, where the model's ops execute."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any, Optional


class TorchProfilerSession:
    def __init__(self, folder: Path):
        self.folder = Path(folder)
        self._profiler: Optional[Any] = None
        self._started = 0.0

    @property
    def active(self) -> bool:
        return self._profiler is not None

    def start(self) -> None:
        import torch
        from torch.profiler import ProfilerActivity, profile

        from llmctl.profiling import quiet_kineto

        quiet_kineto()

        activities = [ProfilerActivity.CPU]
        if torch.cuda.is_available():
            activities.append(ProfilerActivity.CUDA)
        self.folder.mkdir(parents=True, exist_ok=True)
        profiler = profile(activities=activities, record_shapes=True, with_stack=False)
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
