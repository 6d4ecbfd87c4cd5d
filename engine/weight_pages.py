"""The CPU weights in transparent huge pages: one 2 MiB-aligned anonymous mapping the model's weight storages
are copied into, in module order (the decode step's call order), advised MADV_HUGEPAGE.

A batch-1 decode step streams every weight once, and with 4 KiB pages each page is a TLB miss and a new start
for the hardware prefetchers, which stop at page boundaries (a SmolLM-135M int4-g32 token reads 75 MB: 18,000
pages, six times what the L2 TLB of a Zen 4 core maps). glibc's heap, where the loader's tensors live, gets
huge pages only where the system's THP mode is `always`; `madvise` is the common default. 2 MiB pages make
a token's GEMVs 1.17-1.36x faster on a 2-core Zen 4 (benchmarks/results/2026-12-04-quantization-weights-kv-pool-2-mib.md).

Every tensor the modules reach their weights through (parameters, tensor attributes, the tensors inside
dataclass attributes such as `KernelParts`) is re-pointed at the copy with `Tensor.set_`, so views keep
sharing memory and the old storage is freed; a `KernelWeight`'s cached kernel arguments are rebound.
Models under `MIN_TOTAL_BYTES` of such storages stay where they are (the TLB maps them anyway).
`LLMCTL_HUGE_PAGES=0` turns it off.
"""

from __future__ import annotations

import ctypes
import dataclasses
import logging
import math
import mmap
import os
from pathlib import Path
from typing import Iterator, Optional

import torch

from llmctl.engine.host import release_free_heap
from llmctl.engine.kernels.quant import KernelWeight

logger = logging.getLogger(__name__)

HUGE_PAGE = 2 << 20
MIN_STORAGE_BYTES = 64 << 10  # smaller storages (norms, biases) stay: they are not what a step streams
MIN_TOTAL_BYTES = 16 << 20
RELEASE_EVERY_BYTES = 256 << 20  # hand freed heap back while copying, so the peak stays about one model
ALIGN = 64
ENV = "LLMCTL_HUGE_PAGES"
THP_MODE = Path("/sys/kernel/mm/transparent_hugepage/enabled")


def huge_pages_available() -> bool:
    """Linux with transparent huge pages in `always` or `madvise` mode, and not turned off by LLMCTL_HUGE_PAGES=0."""
    if os.environ.get(ENV, "") == "0" or not hasattr(mmap, "MADV_HUGEPAGE"):
        return False
    try:
        return "[never]" not in THP_MODE.read_text()
    except OSError:
        return False


def move_weights_to_huge_pages(model: torch.nn.Module) -> int:
    """Copy the model's CPU weight storages into one huge-page mapping; returns the bytes moved (0: nothing
    moved, THP unavailable or the weights too small)."""
    if not huge_pages_available():
        return 0
    holders: list[object] = []
    groups: dict[int, list[torch.Tensor]] = {}
    for tensor in _weight_tensors(model, holders):
        groups.setdefault(tensor.untyped_storage().data_ptr(), []).append(tensor)
    sizes = {key: _aligned(tensors[0].untyped_storage().nbytes()) for key, tensors in groups.items()}
    total = sum(sizes.values())
    if total < MIN_TOTAL_BYTES:
        return 0
    arena = _huge_page_arena(total)
    storage, position, since_release = arena.untyped_storage(), 0, 0
    with torch.no_grad():
        for key, tensors in groups.items():
            old = tensors[0].untyped_storage()
            arena[position:position + old.nbytes()].copy_(torch.empty(0, dtype=torch.uint8).set_(old))
            for tensor in tensors:
                byte_offset = position + tensor.storage_offset() * tensor.element_size()
                tensor.set_(storage, byte_offset // tensor.element_size(), tensor.shape, tensor.stride())
            del old
            position += sizes[key]
            since_release += sizes[key]
            if since_release >= RELEASE_EVERY_BYTES:
                release_free_heap()
                since_release = 0
    for holder in holders:
        holder.rebind()
    logger.info("weights: %.1f MiB in transparent huge pages", total / 2**20)
    return total


def huge_page_zeros(shape: tuple[int, ...], dtype: torch.dtype) -> Optional[torch.Tensor]:
    """A zero CPU tensor in its own huge-page mapping (None: THP unavailable, or under MIN_TOTAL_BYTES), its
    pages touched now as torch.zeros' are."""
    nbytes = math.prod(shape) * dtype.itemsize
    if nbytes < MIN_TOTAL_BYTES or not huge_pages_available():
        return None
    return _huge_page_arena(nbytes).zero_().view(dtype).view(shape)


def _aligned(nbytes: int) -> int:
    return -(-nbytes // ALIGN) * ALIGN


def _huge_page_arena(nbytes: int) -> torch.Tensor:
    """uint8 [nbytes] over a fresh anonymous mapping, starting on a 2 MiB boundary and advised MADV_HUGEPAGE
    (the tensor keeps the mapping alive)."""
    span = -(-nbytes // HUGE_PAGE) * HUGE_PAGE
    region = mmap.mmap(-1, span + HUGE_PAGE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    start = -ctypes.addressof(ctypes.c_char.from_buffer(region)) % HUGE_PAGE
    region.madvise(mmap.MADV_HUGEPAGE, start, span)
    return torch.frombuffer(region, dtype=torch.uint8, offset=start, count=nbytes)


def _weight_tensors(model: torch.nn.Module, holders: list[object]) -> Iterator[torch.Tensor]:
    """The CPU tensors (strided, on storages of MIN_STORAGE_BYTES+) the modules hold, each object once; the
    `KernelWeight`s among their attributes go to `holders`."""
    seen: set[int] = set()
    for module in model.modules():
        values = [*module._parameters.values(), *module._buffers.values(),
                  *(v for k, v in vars(module).items() if k not in ("_parameters", "_buffers", "_modules"))]
        for value in values:  # live attributes (the list itself is not: its id may come back)
            for tensor in _tensors_in(value, holders, seen):
                if (tensor.device.type == "cpu" and tensor.layout == torch.strided
                        and tensor.untyped_storage().nbytes() >= MIN_STORAGE_BYTES):
                    yield tensor


def _tensors_in(value: object, holders: list[object], seen: set[int]) -> Iterator[torch.Tensor]:
    if id(value) in seen:
        return
    seen.add(id(value))
    if isinstance(value, torch.Tensor):
        yield value
    elif isinstance(value, (list, tuple)):
        for item in value:
            yield from _tensors_in(item, holders, seen)
    elif dataclasses.is_dataclass(value) and not isinstance(value, type):
        if isinstance(value, KernelWeight):
            holders.append(value)
        for field in dataclasses.fields(value):
            yield from _tensors_in(getattr(value, field.name), holders, seen)
