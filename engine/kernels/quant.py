"""Native GEMV for grouped integer weights with bfloat16 activations (`quant_kernels.c`).

Built on first use like `cpu_kernels.c` (same cache, `LLMCTL_DISABLE_CPU_KERNELS=1` turns them off) but as
a library of its own, because it also builds for CPUs with AVX2 and no AVX-512 (the attention and norm
kernels need AVX-512): `load_quant_kernels()` gives the AVX-512 body where the CPU has AVX512-BF16, the
AVX2 + FMA + F16C body elsewhere, and None without a compiler or on other CPUs. `load_quant_kernels("avx2")`
builds the AVX2 body on any x86 CPU that runs it (the tests check both bodies here).

`QuantKernels.pack` turns codes, scales and zeros into the kernel's layout (see the C source): 8-bit codes
as they are, 4-bit codes four to a 16-bit word (`pack_q4`), scales and zeros as float16.
"""

from __future__ import annotations

import ctypes
import logging
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path
from typing import Optional

import torch

from llmctl.engine.kernels import FLAGS, build_library

logger = logging.getLogger(__name__)

SOURCE = Path(__file__).with_name("quant_kernels.c")
TARGETS = {"native": FLAGS, "avx2": tuple(f for f in FLAGS if f != "-march=native") + ("-march=haswell",)}
FP16 = torch.finfo(torch.float16)
_POINTER, _INT64 = ctypes.c_void_p, ctypes.c_int64


@dataclass(frozen=True)
class KernelWeight:
    """A grouped weight in the kernel's layout (all contiguous, on the CPU)."""

    codes: torch.Tensor  # uint8 [n, k] (8 bits) or [n, k / 2] (4 bits)
    scales: torch.Tensor  # float16 [n, groups]
    zeros: Optional[torch.Tensor]  # float16 [n, groups] or None (the midpoint)
    bits: int
    group_size: int
    in_features: int


class QuantKernels:
    """Typed entry point of the built library; shapes and dtypes are checked before any pointer is passed."""

    def __init__(self, library: ctypes.CDLL):
        self.isa = int(library.quant_kernel_isa())  # 512 or 256
        self._gemv = library.quant_gemv_bf16
        self._gemv.argtypes = [_POINTER] * 3 + [ctypes.c_int] + [_POINTER] * 3 + [_INT64] * 4 + [ctypes.c_int]
        self._gemv.restype = ctypes.c_int
        self._dequantize = library.quant_dequantize_bf16
        self._dequantize.argtypes = [_POINTER] * 3 + [ctypes.c_int, _POINTER] + [_INT64] * 3 + [ctypes.c_int]
        self._dequantize.restype = ctypes.c_int

    @staticmethod
    def unsupported(bits: int, group_size: int, in_features: int) -> Optional[str]:
        """Why the kernels cannot run this weight shape (None: they can)."""
        if bits == 8:
            return None if group_size % 16 == 0 else f"8-bit groups must be a multiple of 16 inputs, got {group_size}"
        if bits != 4:
            return f"{bits}-bit codes are not supported"
        if in_features % 64:
            return f"4-bit weights need a multiple of 64 inputs, got {in_features}"
        if group_size != 32 and group_size % 64:
            return f"4-bit groups must be 32 or a multiple of 64 inputs, got {group_size}"
        return None

    def pack(self, codes: torch.Tensor, scales: torch.Tensor, zeros: Optional[torch.Tensor], bits: int,
             group_size: int) -> KernelWeight:
        """uint8 codes [n, k] (0..2^bits - 1), float scales and zeros [n, k / group_size] -> the kernel's layout."""
        n, k = codes.shape
        problem = self.unsupported(bits, group_size, k)
        if problem:
            raise ValueError(f"quant kernels: {problem}")
        if bits == 4:
            codes = pack_q4(codes)
        return KernelWeight(codes.contiguous(), scales.to(torch.float16).contiguous(),
                            None if zeros is None else zeros.to(torch.float16).contiguous(), bits, group_size, k)

    def gemv(self, weight: KernelWeight, x: torch.Tensor, bias: Optional[torch.Tensor] = None) -> torch.Tensor:
        """x [m, k] bf16 @ the dequantised weight [n, k].T (+ bias [n]) -> bf16 [m, n], one pass over the weight."""
        n, k = weight.codes.shape[0], weight.in_features
        if x.dtype != torch.bfloat16 or x.dim() != 2 or x.shape[1] != k or not x.is_contiguous() or x.device.type != "cpu":
            raise ValueError(f"quant gemv: the input must be a contiguous bf16 [m, {k}] CPU tensor, got "
                             f"{x.dtype} {tuple(x.shape)}")
        self._check_weight(weight)
        if bias is not None and (bias.dtype != torch.bfloat16 or tuple(bias.shape) != (n,) or not bias.is_contiguous()):
            raise ValueError(f"quant gemv: the bias must be a contiguous bf16 [{n}]")
        out = x.new_empty(x.shape[0], n)
        if x.shape[0] == 0:
            return out
        done = self._gemv(weight.codes.data_ptr(), weight.scales.data_ptr(),
                          weight.zeros.data_ptr() if weight.zeros is not None else None, weight.bits, x.data_ptr(),
                          bias.data_ptr() if bias is not None else None, out.data_ptr(), x.shape[0], n, k,
                          weight.group_size, torch.get_num_threads())
        if not done:
            raise ValueError(f"quant gemv: the kernel refused {weight.bits}-bit weights [{n}, {k}] in groups of "
                             f"{weight.group_size}")
        return out

    def dequantize(self, weight: KernelWeight) -> torch.Tensor:
        """The bf16 weight [n, k] (for many rows: one GEMM on it is faster than the GEMV)."""
        self._check_weight(weight)
        n, k = weight.codes.shape[0], weight.in_features
        out = torch.empty(n, k, dtype=torch.bfloat16)
        if not self._dequantize(weight.codes.data_ptr(), weight.scales.data_ptr(),
                                weight.zeros.data_ptr() if weight.zeros is not None else None, weight.bits,
                                out.data_ptr(), n, k, weight.group_size, torch.get_num_threads()):
            raise ValueError(f"quant dequantize: the kernel refused {weight.bits}-bit weights [{n}, {k}] in groups of "
                             f"{weight.group_size}")
        return out

    @staticmethod
    def _check_weight(weight: KernelWeight) -> None:
        n = weight.codes.shape[0]
        k, groups = weight.in_features, weight.in_features // weight.group_size
        expected_codes = (n, k if weight.bits == 8 else k // 2)
        if weight.codes.dtype != torch.uint8 or tuple(weight.codes.shape) != expected_codes:
            raise ValueError(f"quant gemv: codes must be uint8 {expected_codes}")
        for name, tensor in (("scales", weight.scales), ("zeros", weight.zeros)):
            if tensor is not None and (tensor.dtype != torch.float16 or tuple(tensor.shape) != (n, groups)
                                       or not tensor.is_contiguous()):
                raise ValueError(f"quant gemv: {name} must be contiguous float16 {(n, groups)}")


def pack_q4(codes: torch.Tensor) -> torch.Tensor:
    """uint8 codes [n, k] (k a multiple of 64) -> the 4-bit kernel layout [n, k / 2] (see quant_kernels.c)."""
    n, k = codes.shape
    full = k // 128 * 128
    blocks = codes[:, :full].reshape(n, k // 128, 4, 32).to(torch.int16)  # [row, block, nibble t, word w]
    words = blocks[:, :, 0] | blocks[:, :, 1] << 4 | blocks[:, :, 2] << 8 | blocks[:, :, 3] << 12
    packed = [words.contiguous().view(torch.uint8).reshape(n, full // 2)]  # little-endian words as bytes
    if k > full:
        tail = codes[:, full:].reshape(n, 2, 32)
        packed.append(tail[:, 0] | tail[:, 1] << 4)
    return torch.cat(packed, dim=1)


def unpack_q4(packed: torch.Tensor, in_features: int) -> torch.Tensor:
    """The inverse of `pack_q4`: uint8 codes [n, in_features]."""
    n, full = packed.shape[0], in_features // 128 * 128
    words = packed[:, :full // 2].contiguous().view(torch.int16).reshape(n, full // 128, 1, 32).to(torch.int32)
    nibbles = (words >> torch.tensor([0, 4, 8, 12], dtype=torch.int32).view(1, 1, 4, 1)) & 0xF
    parts = [nibbles.reshape(n, full)]
    if in_features > full:
        tail = packed[:, full // 2:]
        parts += [tail & 0xF, tail >> 4]
    return torch.cat(parts, dim=1).to(torch.uint8)


def fits_float16(values: torch.Tensor) -> bool:
    """Whether float16 holds `values` to its own precision: finite, and none flushed below its normal range."""
    magnitude = values.detach().float().abs()
    return bool(torch.all(magnitude <= FP16.max)) and bool(torch.all((magnitude == 0) | (magnitude >= FP16.tiny)))


@lru_cache(maxsize=None)
def load_quant_kernels(target: str = "native") -> Optional[QuantKernels]:
    """The built kernels for `target` ("native": this CPU's best body; "avx2"), or None (logged) if unavailable."""
    library = build_library(SOURCE, TARGETS[target], "quantised linears use torch's kernels")
    if library is None:
        return None
    if library.quant_kernel_isa() == 0:
        logger.info("quantised GEMV kernels need AVX2 (or AVX-512 with BF16): using torch's kernels")
        return None
    return QuantKernels(library)
