"""Native CPU kernels, built on first use with the host's C compiler (`build.py`) and bound with ctypes.

Two libraries, their C cut by concern behind common.h (ISA guards, bf16 helpers, AMX set-up, the decode step's
descriptors): the CPU library (`CPU_SOURCES`: attention, elementwise ops, bf16 linears, the decode step; AVX-512
only) bound by `cpu.CpuKernels` and `decode_stack.DecodeStack`, and the quantised library (`quant.py`, also built
for AVX2). The engine runs without them (the torch paths stay correct everywhere); `cpu_kernels_for` hands the
model and its linear method the CPU library where it is built. No compiler, a failed build, a CPU without AVX-512,
or `LLMCTL_DISABLE_CPU_KERNELS=1` means `load_cpu_kernels()` returns None and the torch path is used.
"""

from __future__ import annotations

import logging
from functools import lru_cache
from pathlib import Path
from typing import Optional

import torch

from .build import DISABLE_ENV, FLAGS, build_library, disabled, find_compiler
from .cpu import CpuKernels, PagedRows
from .decode_stack import DecodeStack
from .tracing import profiled

logger = logging.getLogger(__name__)

CPU_SOURCES = tuple(Path(__file__).with_name(name) for name in ("attention.c", "elementwise.c", "linear_bf16.c",
                                                                  "decode_step.c"))
CPU_LIBRARY = "cpu_kernels"

__all__ = ["CPU_LIBRARY", "CPU_SOURCES", "CpuKernels", "DISABLE_ENV", "DecodeStack", "FLAGS", "PagedRows",
           "build_library", "cpu_kernels_for", "disabled", "find_compiler", "load_cpu_kernels", "profiled"]


@lru_cache(maxsize=1)
def load_cpu_kernels() -> Optional[CpuKernels]:
    """The built kernels, or None (logged once) when they cannot be used here."""
    library = build_library(CPU_SOURCES, FLAGS, "CPU decode attention uses the slower torch path", CPU_LIBRARY)
    if library is None:
        return None
    try:
        if library.kernel_vector_bits() != 512:
            logger.info("CPU kernels need AVX-512: using the torch paths")
            return None
        return CpuKernels(library)
    except AttributeError as exc:
        logger.warning("CPU kernels unavailable (%s): using the torch path", exc)
        return None


def cpu_kernels_for(device: torch.device, dtype: torch.dtype) -> Optional[CpuKernels]:
    """The kernels a model on `device` in `dtype` is built with: None off CPU or for a dtype they lack."""
    if device.type != "cpu":
        return None
    kernels = load_cpu_kernels()
    return kernels if kernels is not None and dtype in kernels.dtypes else None
