"""Device memory readings the runner plans its start-up with (CUDA only; None on CPU).

The runner sizes the KV pool and the decode graphs from --gpu-memory-utilization with two readings:
free/total memory of its device, and how much a piece of work (the profile forward, one graph
capture) takes. Both are local: nothing process-wide (peak-memory statistics other code may read)
is reset. CPU tests hand the runner an object with the same two methods and fake numbers, so the
start-up sequence itself runs for real without a GPU.
"""

from __future__ import annotations

import gc
from typing import Callable, Optional, Protocol

import torch


class DeviceMemory(Protocol):
    def free_and_total(self) -> tuple[int, int]:
        """Free and total bytes of the device, after returning cached-but-unused blocks."""

    def growth(self, work: Callable[[], object]) -> int:
        """Bytes of device memory `work` left taken or passed through at its peak (never negative)."""


class CudaMemory:
    """`DeviceMemory` of one CUDA device."""

    def __init__(self, device: torch.device):
        self.device = device

    def free_and_total(self) -> tuple[int, int]:
        # mem_get_info counts the caching allocator's free-but-reserved blocks as used: return them first
        # (an engine dropped earlier in this process may also still hold its pool in a reference cycle).
        gc.collect()
        torch.cuda.empty_cache()
        return torch.cuda.mem_get_info(self.device)

    def growth(self, work: Callable[[], object]) -> int:
        """Measured without resetting the device's peak statistics: after `empty_cache` the allocator
        keeps every segment it grows during `work` until the next `empty_cache`, so the growth of reserved
        memory bounds the peak of what `work` allocated through torch; the drop in free memory also counts
        what libraries (cuBLAS, flash-attn, graph instantiation) took outside the allocator."""
        torch.cuda.synchronize(self.device)
        torch.cuda.empty_cache()
        reserved = torch.cuda.memory_reserved(self.device)
        free, _ = torch.cuda.mem_get_info(self.device)
        work()
        torch.cuda.synchronize(self.device)
        free_after, _ = torch.cuda.mem_get_info(self.device)
        return max(torch.cuda.memory_reserved(self.device) - reserved, free - free_after, 0)


def device_memory(device: torch.device) -> Optional[DeviceMemory]:
    """The readings for `device`'s memory budget: CUDA devices have one, the CPU does not."""
    return CudaMemory(device) if device.type == "cuda" else None
