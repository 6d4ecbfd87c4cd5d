"""Native GEMV for grouped integer weights with bfloat16 activations (quant_gemv.c, quant_amx.c, quant_bf16.c; the
layout in quant_simd.h).

Built on first use like the CPU library (same cache, `LLMCTL_DISABLE_CPU_KERNELS=1` turns them off) but as
a library of its own, because it also builds for CPUs with AVX2 and no AVX-512 (the attention and norm
kernels need AVX-512): `load_quant_kernels()` gives the AVX-512 body where the CPU has AVX512-BW (with VNNI
dot products where it has those), the AVX2 + FMA + F16C body elsewhere, and None without a compiler or on
other CPUs. `load_quant_kernels("avx2")` builds the AVX2 body on any x86 CPU that runs it (the tests check
both bodies here). Both bodies read one layout: 4- and 8-bit codes, 6-bit ones (GGUF's 5- and 6-bit types) as
the 8-bit layout with each 64-byte chunk in 48 bytes, and 8-bit codes that take only the 16 values of IQ4_NL's grid
(GGUF's IQ4_NL and IQ4_XS) as the 8-bit layout with each chunk's bytes stored as grid indices in 32 bytes
(`IQ4_CODES`); the AMX kernels take 4 and 8 bits only. `pack_parts` stores each run of a weight's output rows in
the format that holds its codes in the fewest bytes (`KernelParts`), so a fused GGUF layer whose shards are of
different types keeps each shard's own width.

Besides the GEMV (`gemv`, every row count), the library has dequantising GEMMs for many rows: on AMX tiles
(`gemm_amx`, `gemm_amx_int8`, where the CPU has AMX) and, on CPUs with AVX512-BF16 and no AMX, `gemm_bf16`
(vdpbf16ps on a per-call bf16 copy of a pair of blocks at a time); engine/layers/quantization/grouped.py chooses.

`QuantKernels.pack` turns codes, scales and zeros into that layout (see quant_simd.h): output rows in
blocks of 16, each block's codes in 64-byte chunks of 16 rows x 4 (8-bit) or 8 (4-bit) inputs
(`interleave_codes`), scales and zeros as float16 [blocks, groups, 16] (`interleave_groups`); the padded
rows of the last block have scale 0 and are never written.
"""

from __future__ import annotations

import ctypes
import logging
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path
from typing import NamedTuple, Optional

import torch

from .build import FLAGS, build_library
from .tracing import profiled

logger = logging.getLogger(__name__)

SOURCES = tuple(Path(__file__).with_name(name) for name in ("quant_gemv.c", "quant_amx.c", "quant_bf16.c"))
LIBRARY = "quant_kernels"
_PORTABLE = tuple(f for f in FLAGS if f != "-march=native")
# "skylake-avx512": the AVX-512 body without VNNI, VBMI and AVX512-BF16 (Skylake-X to Ice Lake), for the tests
TARGETS = {"native": FLAGS, "avx2": _PORTABLE + ("-march=haswell",), "skylake-avx512": _PORTABLE + ("-march=skylake-avx512",)}
FP16 = torch.finfo(torch.float16)
BLOCK, CHUNK = 16, 64  # output rows per block, bytes per chunk (quant_simd.h)
# The kernels' code formats: 4, 6 and 8 bits, and IQ4_CODES: 8-bit codes from IQ4_GRID, stored as 4-bit indices
# into it (quant_simd.h: 0x48, stored in 4 bits, computed in 8)
IQ4_CODES = 0x48
# ggml's kvalues_iq4nl (IQ4_NL and IQ4_XS dequantise to d * kvalue) + 128: the 8-bit codes they load as
IQ4_GRID = (1, 24, 45, 63, 79, 93, 106, 118, 129, 141, 153, 166, 181, 197, 217, 241)
STEP = {8: 4, 6: 4, 4: 8, IQ4_CODES: 4}  # inputs per chunk
# bytes a chunk is stored in: 6-bit codes are the 8-bit layout's chunks, each in 48 bytes (quant_simd.h SIX_CHUNK),
# IQ4_CODES ones each in 32 (GRID_CHUNK)
CHUNK_BYTES = {8: CHUNK, 6: 48, 4: CHUNK, IQ4_CODES: 32}
_POINTER, _INT64 = ctypes.c_void_p, ctypes.c_int64


@dataclass(frozen=True)
class KernelWeight:
    """A grouped weight in the kernel's layout (all contiguous, on the CPU)."""

    codes: torch.Tensor  # uint8 [blocks, k / STEP, CHUNK_BYTES]: 16 output rows x STEP inputs a chunk
    scales: torch.Tensor  # float16 [blocks, groups, 16]
    zeros: Optional[torch.Tensor]  # float16 [blocks, groups, 16] or None (the midpoint)
    bits: int  # the code format: 4, 6, 8 or IQ4_CODES
    group_size: int
    in_features: int
    out_features: int

    def __post_init__(self) -> None:
        """Checked once here (the dataclass is frozen), so a call checks only its activations."""
        blocks, k = -(-self.out_features // BLOCK), self.in_features
        groups = (blocks, k // self.group_size, BLOCK)
        expected_codes = (blocks, k // STEP[self.bits], CHUNK_BYTES[self.bits])
        if self.codes.dtype != torch.uint8 or tuple(self.codes.shape) != expected_codes \
                or not self.codes.is_contiguous() or self.codes.device.type != "cpu":
            raise ValueError(f"quant gemv: codes must be contiguous uint8 {expected_codes} CPU tensors")
        for name, tensor in (("scales", self.scales), ("zeros", self.zeros)):
            if tensor is not None and (tensor.dtype != torch.float16 or tuple(tensor.shape) != groups
                                       or not tensor.is_contiguous() or tensor.device.type != "cpu"):
                raise ValueError(f"quant gemv: {name} must be contiguous float16 {groups} CPU tensors")
        self.rebind()

    def rebind(self) -> None:
        """Cache the kernel's weight arguments (the tensors above keep the memory alive); again after the tensors
        were moved in place (engine/weight_pages.py)."""
        object.__setattr__(self, "arguments", (self.codes.data_ptr(), self.scales.data_ptr(),
                                               None if self.zeros is None else self.zeros.data_ptr(), self.bits))


@dataclass(frozen=True)
class KernelParts:
    """A weight's output rows as consecutive parts, each a `KernelWeight` of its own code format and group
    (`QuantKernels.pack_parts`): `parts[i]` holds rows [starts[i], starts[i] + its out_features). Every part's codes,
    scales and zeros are views of the flat `codes`, `scales` and `zeros` (None where no part has zeros), the
    storage a layer registers."""

    parts: tuple[KernelWeight, ...]
    starts: tuple[int, ...]
    codes: torch.Tensor
    scales: torch.Tensor
    zeros: Optional[torch.Tensor]

    @property
    def out_features(self) -> int:
        return self.starts[-1] + self.parts[-1].out_features

    @property
    def in_features(self) -> int:
        return self.parts[0].in_features

    @classmethod
    def of(cls, weights: list[KernelWeight]) -> "KernelParts":
        """`weights` (consecutive rows) moved into one flat storage each for codes, scales and zeros."""
        flat = {name: [getattr(w, name) for w in weights if getattr(w, name) is not None]
                for name in ("codes", "scales", "zeros")}
        storage = {name: (tensors[0].reshape(-1) if len(tensors) == 1 else torch.cat([t.reshape(-1) for t in tensors]))
                   if tensors else None for name, tensors in flat.items()}
        offsets, parts, starts, start = dict.fromkeys(storage, 0), [], [], 0
        for weight in weights:
            views = {}
            for name in storage:
                tensor = getattr(weight, name)
                if tensor is not None:
                    views[name] = storage[name][offsets[name]:offsets[name] + tensor.numel()].view(tensor.shape)
                    offsets[name] += tensor.numel()
            parts.append(KernelWeight(views["codes"], views["scales"], views.get("zeros"), weight.bits,
                                      weight.group_size, weight.in_features, weight.out_features))
            starts.append(start)
            start += weight.out_features
        return cls(tuple(parts), tuple(starts), storage["codes"], storage["scales"], storage["zeros"])


@dataclass(frozen=True)
class QuantRowOperand:
    """A quantised linear's operand for the native decode step (`CpuKernels.decode_stack`, kind `"quant"`): its
    weight's parts and the library whose GEMV the layer's forward runs on them, so the step calls that same
    function."""

    kernels: "QuantKernels"
    weight: KernelParts

    def stack_fields(self) -> list[tuple[int, ...]]:
        """`StackLinear`'s fields (common.h) after the kind, one tuple per part: codes, scales, zeros (0: the
        midpoint), code format, group size, the addresses of the GEMV that also prefetches the next linear
        (quant_gemv_bf16_chain) and of its one-row share for a thread of the caller's region
        (quant_gemv_bf16_share), the part's rows (the descriptor's next-part address is the caller's)."""
        fields = []
        for part in self.weight.parts:
            codes, scales, zeros, bits = part.arguments
            fields.append((codes, scales, zeros or 0, bits, part.group_size, self.kernels.chain_gemv_address,
                           self.kernels.share_gemv_address, part.out_features))
        return fields


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
        # for the native decode step: decode_step.c's decode_stack_bf16 calls this library's GEMV by address, the
        # variant that also prefetches the start of the linear the step runs next
        self.chain_gemv_address = ctypes.cast(library.quant_gemv_bf16_chain, ctypes.c_void_p).value
        self.share_gemv_address = ctypes.cast(library.quant_gemv_bf16_share, ctypes.c_void_p).value
        self._gemm_amx = library.quant_gemm_amx_bf16
        self._gemm_amx.argtypes = self._gemv.argtypes
        self._gemm_amx.restype = ctypes.c_int
        self._gemm_amx_int8 = library.quant_gemm_amx_int8
        self._gemm_amx_int8.argtypes = self._gemv.argtypes
        self._gemm_amx_int8.restype = ctypes.c_int
        self._dequantize_amx = library.quant_dequantize_amx_bf16
        self._dequantize_amx.argtypes = self._dequantize.argtypes
        self._dequantize_amx.restype = ctypes.c_int
        self._x_block_of = library.quant_x_block_of
        self._x_block_of.argtypes = [_INT64, ctypes.c_int]
        self._x_block_of.restype = _INT64
        self._gemm_bf16 = library.quant_gemm_bf16
        self._gemm_bf16.argtypes = self._gemv.argtypes
        self._gemm_bf16.restype = ctypes.c_int
        # False without AMX in the build (the AVX2 body, older compilers) or where Linux refuses the tile state
        self.has_amx = bool(library.quant_amx_enable())
        # the dequantising bf16 GEMM for CPUs without AMX: AVX-512 builds on CPUs with AVX512-BF16
        self.has_bf16_gemm = bool(library.quant_bf16_gemm_available()) and not self.has_amx

    @lru_cache(maxsize=None)  # asked per batched call of a layer (`bf16_gemm_min_rows`): one ctypes call per shape
    def x_block(self, group_size: int, bits: int) -> int:
        """Inputs per x block of the GEMV for this weight (the C `x_block_of`: the group up to 256 inputs, else its
        largest divisor that fits): each block ends in a float epilogue, so short ones cost the GEMV more."""
        return self._x_block_of(group_size, bits)

    def int8_tile_depth(self, group_size: int, bits: int) -> int:
        """Inputs per AMX-INT8 tile `gemm_amx_int8` uses for this weight: 64 or 32 (its x blocks, the C
        `x_block_of`, whole multiples of it), 0 where it does not run it."""
        block = self.x_block(group_size, bits)
        return 0 if block == 0 else 64 if block % 64 == 0 else 32 if block % 32 == 0 else 0

    @staticmethod
    def unsupported(bits: int, group_size: int, in_features: int) -> Optional[str]:
        """Why the kernels cannot run this weight shape (None: they can)."""
        if bits not in STEP:
            return f"{bits}-bit codes are not supported"
        step = STEP[bits]
        if group_size < 1 or in_features % group_size:
            return f"group size {group_size} does not divide the {in_features} inputs"
        if group_size % step:
            return f"{bits}-bit groups must be a multiple of {step} inputs, got {group_size}"
        return None

    def pack(self, codes: torch.Tensor, scales: torch.Tensor, zeros: Optional[torch.Tensor], bits: int,
             group_size: int) -> KernelWeight:
        """uint8 codes [n, k] (0..2^bits - 1; IQ4_CODES: 8-bit codes in IQ4_GRID), float scales and zeros
        [n, k / group_size] -> the kernel's layout in that one code format (`pack_parts` chooses formats)."""
        n, k = codes.shape
        problem = self.unsupported(bits, group_size, k)
        if problem:
            raise ValueError(f"quant kernels: {problem}")
        return KernelWeight(interleave_codes(codes, bits), interleave_groups(scales.to(torch.float16)),
                            None if zeros is None else interleave_groups(zeros.to(torch.float16)), bits, group_size,
                            k, n)

    def pack_parts(self, codes: torch.Tensor, scales: torch.Tensor, zeros: Optional[torch.Tensor], bits: int,
                   group_size: int) -> KernelParts:
        """`pack`'s weight with each run of output rows in the format that holds its codes in the fewest bytes
        (`plan_parts`): a fused GGUF layer keeps its Q4_K q/k in 4 bits in groups of 32 beside a Q6_K v, where one
        format for all rows takes the widest bits and the smallest group."""
        problem = self.unsupported(bits, group_size, codes.shape[1])
        if problem:
            raise ValueError(f"quant kernels: {problem}")
        weights = []
        for plan in plan_parts(codes, scales, zeros, bits, group_size):
            rows = slice(plan.start, plan.end)
            part_codes = codes[rows] if plan.shift == 0 else codes[rows] - plan.shift
            part_zeros = None if zeros is None else zeros[rows].float() - plan.shift
            part_scales, part_zeros, group = coarsest_groups(scales[rows], part_zeros, group_size, codes.shape[1])
            weights.append(self.pack(part_codes, part_scales, part_zeros, plan.bits, group))
        return KernelParts.of(weights)

    @profiled("quant_gemv")
    def gemv(self, weight: KernelWeight, x: torch.Tensor, bias: Optional[torch.Tensor] = None) -> torch.Tensor:
        """x [m, k] bf16 @ the dequantised weight [n, k].T (+ bias [n]) -> bf16 [m, n], one pass over the weight."""
        return self._run(self._gemv, "gemv", weight, x, bias)

    @staticmethod
    def _run(kernel, what: str, weight: KernelWeight, x: torch.Tensor, bias: Optional[torch.Tensor]) -> torch.Tensor:
        n, k = weight.out_features, weight.in_features
        if x.dtype != torch.bfloat16 or x.dim() != 2 or x.shape[1] != k or not x.is_contiguous() or x.device.type != "cpu":
            raise ValueError(f"quant {what}: the input must be a contiguous bf16 [m, {k}] CPU tensor, got "
                             f"{x.dtype} {tuple(x.shape)}")
        if bias is not None and (bias.dtype != torch.bfloat16 or tuple(bias.shape) != (n,) or not bias.is_contiguous()):
            raise ValueError(f"quant {what}: the bias must be a contiguous bf16 [{n}]")
        out = x.new_empty(x.shape[0], n)
        if x.shape[0] == 0:
            return out
        done = kernel(*weight.arguments, x.data_ptr(), bias.data_ptr() if bias is not None else None,
                      out.data_ptr(), x.shape[0], n, k, weight.group_size, torch.get_num_threads())
        if not done:
            raise ValueError(f"quant {what}: the kernel refused {weight.bits}-bit weights [{n}, {k}] in groups of "
                             f"{weight.group_size} (or found no memory)")
        return out

    @profiled("quant_gemm_amx")
    def gemm_amx(self, weight: KernelWeight, x: torch.Tensor, bias: Optional[torch.Tensor] = None) -> torch.Tensor:
        """`gemv`'s product on AMX tiles (needs `has_amx`): the weight dequantised once per call into bf16 B
        tiles, bitwise `dequantize`'s values, each tile used by every row; each output element is the native
        bf16 AMX kernel's on that weight, so a row's result does not depend on the other rows."""
        if not self.has_amx:
            raise ValueError("quant gemm_amx: this CPU or build has no AMX tiles")
        return self._run(self._gemm_amx, "gemm_amx", weight, x, bias)

    @profiled("quant_gemm_amx_int8")
    def gemm_amx_int8(self, weight: KernelWeight, x: torch.Tensor, bias: Optional[torch.Tensor] = None) -> torch.Tensor:
        """`gemv`'s product, bitwise, on AMX-INT8 tiles (needs `has_amx`): the codes are the B tiles, x the
        GEMV's int16 blocks split into two bytes; for weights whose x blocks are whole multiples of 32 inputs
        (`int8_tile_depth`)."""
        if not self.has_amx:
            raise ValueError("quant gemm_amx_int8: this CPU or build has no AMX tiles")
        return self._run(self._gemm_amx_int8, "gemm_amx_int8", weight, x, bias)

    @profiled("quant_gemm_bf16")
    def gemm_bf16(self, weight: KernelWeight, x: torch.Tensor, bias: Optional[torch.Tensor] = None) -> torch.Tensor:
        """`gemv`'s product for many rows on CPUs with AVX512-BF16 and no AMX (`has_bf16_gemm`): the weight
        dequantised per call, a pair of 16-row blocks at a time, into bf16 (bitwise `dequantize`'s values), every
        row against it with bf16 pair dot products (x as it is, float32 sums); a row's result does not depend on
        the other rows."""
        if not self.has_bf16_gemm:
            raise ValueError("quant gemm_bf16: this build has no AVX512-BF16 GEMM (or the CPU has AMX)")
        return self._run(self._gemm_bf16, "gemm_bf16", weight, x, bias)

    @profiled("quant_dequantize_amx")
    def dequantize_amx(self, weight: KernelWeight) -> torch.Tensor:
        """The bf16 weight in `CpuKernels.pack_amx`'s tile layout (needs `has_amx`), bitwise
        `pack_amx(dequantize(weight))`: for `CpuKernels.gemm_amx` where its blocking beats `gemm_amx`'s."""
        n, k = weight.out_features, weight.in_features
        if not self.has_amx:
            raise ValueError("quant dequantize_amx: this CPU or build has no AMX tiles")
        out = torch.empty(-(-n // 64) * 2, -(-k // 32), 2, 16, 16, 2, dtype=torch.bfloat16)
        if not self._dequantize_amx(*weight.arguments, out.data_ptr(), n, k, weight.group_size,
                                    torch.get_num_threads()):
            raise ValueError(f"quant dequantize_amx: the kernel refused {weight.bits}-bit weights [{n}, {k}] in "
                             f"groups of {weight.group_size}")
        return out

    @profiled("quant_dequantize")
    def dequantize(self, weight: KernelWeight) -> torch.Tensor:
        """The bf16 weight [n, k] (for many rows: one GEMM on it is faster than the GEMV)."""
        n, k = weight.out_features, weight.in_features
        out = torch.empty(n, k, dtype=torch.bfloat16)
        if not self._dequantize(*weight.arguments, out.data_ptr(), n, k, weight.group_size, torch.get_num_threads()):
            raise ValueError(f"quant dequantize: the kernel refused {weight.bits}-bit weights [{n}, {k}] in groups of "
                             f"{weight.group_size}")
        return out

def _padded_rows(values: torch.Tensor) -> torch.Tensor:
    """[n, ...] -> [blocks * 16, ...], the added rows zero (scale 0: they compute 0 and are never stored)."""
    n = values.shape[0]
    padding = -n % BLOCK
    if padding == 0:
        return values
    return torch.cat([values, values.new_zeros(padding, *values.shape[1:])])


def interleave_codes(codes: torch.Tensor, bits: int) -> torch.Tensor:
    """uint8 codes [n, k] -> the kernel's layout [blocks, k / STEP, CHUNK_BYTES] (see quant_simd.h): per chunk,
    16-bit word 2i + e of row i holds (8 bits) inputs e and 2 + e in its low and high byte, (4 bits)
    inputs 2t + e in nibble t; 6 bits: the 8-bit chunk's 64 bytes stored in 48 (`_six_bit_chunks`)."""
    if bits == 6:
        return _six_bit_chunks(interleave_codes(codes, 8))
    if bits == IQ4_CODES:
        indices = _grid_indices(codes)
        if indices is None:
            raise ValueError("quant kernels: IQ4_CODES codes must all lie in IQ4_GRID")
        return _six_bit_chunks(interleave_codes(indices, 8))[..., :32].contiguous()
    n, k = codes.shape
    step = STEP[bits]
    rows = _padded_rows(codes).to(torch.int32)
    blocks = rows.shape[0] // BLOCK
    # [block, row i, chunk, part, e] with input = chunk * step + 2 * part + e
    parts = rows.view(blocks, BLOCK, k // step, step // 2, 2)
    words = sum(parts[:, :, :, t, :] << (bits * t) for t in range(step // 2))  # [block, i, chunk, e]
    words = words.permute(0, 2, 1, 3).to(torch.int16).contiguous()  # [block, chunk, i, e]
    return words.view(torch.uint8).view(blocks, k // step, CHUNK)


class PartPlan(NamedTuple):
    start: int  # output rows [start, end)
    end: int
    bits: int  # the code format
    shift: int  # subtracted from the codes (and zeros): symmetric codes narrowed keep their midpoint's distance


# A weight splits into parts only where a part saves at least this many bytes of codes against the weight's own
# format: each part is one more GEMV call in a decode step (a parallel region, x prepared again, the stream's ramp);
# SmolLM-135M Q4_K_M's 110 KB splits ran no faster, a hidden-1024 IQ4_XS qkv's 655 KB ones ~4 % faster.
PART_MIN_SAVED_BYTES = 256 << 10
_NARROWER = (4, IQ4_CODES, 6, 8)  # code formats by bytes a code (4-bit codes compute cheaper than IQ4's lookup)


def _stored_bytes(bits: int) -> float:
    return CHUNK_BYTES[bits] / (BLOCK * STEP[bits])


def plan_parts(codes: torch.Tensor, scales: torch.Tensor, zeros: Optional[torch.Tensor], bits: int,
               group_size: int) -> list[PartPlan]:
    """Runs of 16-row blocks whose codes a narrower format holds (4 bits: codes 0..15; IQ4_CODES: 8-bit codes
    on IQ4_GRID; 6 bits: 0..63), each its own part where it saves PART_MIN_SAVED_BYTES (or is a part anyway: it
    holds every row, or its neighbours are other parts), the rest in `bits`. With zeros None (symmetric at the
    midpoint) a narrower part's codes shift by the two midpoints' difference, so it stays symmetric at its own: a
    fused GGUF layer's Q4_0 rows widened to 8 bits (q + 120) return to 4."""
    n, k = codes.shape
    if n == 0:
        return [PartPlan(0, 0, bits, 0)]
    blocks = -(-n // BLOCK)
    low, high = codes.amin(dim=1).int(), codes.amax(dim=1).int()
    padding = blocks * BLOCK - n
    low = torch.cat([low, low.new_full((padding,), 255)]).view(blocks, BLOCK).amin(dim=1).tolist()
    high = torch.cat([high, high.new_zeros(padding)]).view(blocks, BLOCK).amax(dim=1).tolist()
    on_grid = _blocks_on_grid(codes, low, high) if bits == 8 else [False] * blocks
    candidates = [(candidate, (1 << (bits - 1)) - (1 << (candidate - 1)) if zeros is None and candidate != IQ4_CODES
                   else 0) for candidate in _NARROWER
                  if _stored_bytes(candidate) < _stored_bytes(bits)
                  and QuantKernels.unsupported(candidate, group_size, k) is None]
    plans = []
    for block in range(blocks):
        chosen = next(((candidate, shift) for candidate, shift in candidates
                       if (on_grid[block] if candidate == IQ4_CODES
                           else low[block] - shift >= 0 and high[block] - shift < 1 << candidate)), (bits, 0))
        plans.append(PartPlan(block * BLOCK, min(n, (block + 1) * BLOCK), *chosen))
    plans = _merged_runs(plans)
    if len(plans) == 1:  # all rows in one narrower format: no part more
        return plans
    merged = _merged_runs([plan if plan.bits == bits or (_stored_bytes(bits) - _stored_bytes(plan.bits))
                           * (plan.end - plan.start) * k >= PART_MIN_SAVED_BYTES
                           else PartPlan(plan.start, plan.end, bits, 0) for plan in plans])
    # a run put back in `bits` that merged with nothing is a part anyway: it keeps its narrower format
    narrowest = {(plan.start, plan.end): plan for plan in plans}
    return [narrowest.get((plan.start, plan.end), plan) for plan in merged]


def _merged_runs(plans: list[PartPlan]) -> list[PartPlan]:
    """Neighbouring plans of the same format and shift as one."""
    merged: list[PartPlan] = []
    for plan in plans:
        if merged and (merged[-1].bits, merged[-1].shift) == (plan.bits, plan.shift):
            merged[-1] = merged[-1]._replace(end=plan.end)
        else:
            merged.append(plan)
    return merged


def coarsest_groups(scales: torch.Tensor, zeros: Optional[torch.Tensor], group_size: int,
                    in_features: int) -> tuple[torch.Tensor, Optional[torch.Tensor], int]:
    """Scales (and zeros) [rows, in / group_size] as the largest groups over which they repeat: a Q4_K part of a
    fused layer widened to Q6_K's groups of 16 returns to its own 32 (half the scale bytes)."""
    while scales.numel() and in_features % (2 * group_size) == 0:
        pairs = scales.view(scales.shape[0], -1, 2)
        zero_pairs = None if zeros is None else zeros.view(zeros.shape[0], -1, 2)
        if not torch.equal(pairs[..., 0], pairs[..., 1]) or (
                zero_pairs is not None and not torch.equal(zero_pairs[..., 0], zero_pairs[..., 1])):
            break
        scales, zeros = pairs[..., 0], None if zero_pairs is None else zero_pairs[..., 0]
        group_size *= 2
    return scales.contiguous(), None if zeros is None else zeros.contiguous(), group_size


def _blocks_on_grid(codes: torch.Tensor, low: list[int], high: list[int]) -> list[bool]:
    """Per 16-row block (its lowest and highest code given), whether all its codes lie in IQ4_GRID. Only blocks
    inside the grid's range are looked at, so int8 and Q8_0 weights (each row reaching 255 or 0) cost no pass."""
    return [IQ4_GRID[0] <= low[block] and high[block] <= IQ4_GRID[-1]
            and _grid_indices(codes[block * BLOCK:(block + 1) * BLOCK]) is not None for block in range(len(low))]


def _grid_indices(codes: torch.Tensor) -> Optional[torch.Tensor]:
    """uint8 codes [n, k] -> their indices into IQ4_GRID (uint8), or None where a code is not in it."""
    index = torch.full((256,), 255, dtype=torch.uint8)
    index[list(IQ4_GRID)] = torch.arange(len(IQ4_GRID), dtype=torch.uint8)
    indices = index[codes.long()]
    return None if bool((indices == 255).any()) else indices


def _six_bit_chunks(chunks: torch.Tensor) -> torch.Tensor:
    """8-bit layout chunks [..., 64] of codes below 64 -> [..., 48]: the 64 bytes' low nibbles two a byte (byte t:
    bytes 2t and 2t + 1), then their high 2 bits four a byte (byte i: row i's bytes 4i + j at bits 2j)."""
    nibbles = chunks & 0x0F
    high = (chunks >> 4).view(*chunks.shape[:-1], BLOCK, 4)
    packed_high = high[..., 0] | high[..., 1] << 2 | high[..., 2] << 4 | high[..., 3] << 6
    return torch.cat([nibbles[..., 0::2] | nibbles[..., 1::2] << 4, packed_high], dim=-1)


def _eight_bit_chunks(chunks: torch.Tensor) -> torch.Tensor:
    """The inverse of `_six_bit_chunks`."""
    nibbles = torch.stack([chunks[..., :32] & 0x0F, chunks[..., :32] >> 4], dim=-1).flatten(-2)
    high = torch.stack([(chunks[..., 32:] >> (2 * j)) & 0x03 for j in range(4)], dim=-1).flatten(-2)
    return nibbles | high << 4


def deinterleave_codes(packed: torch.Tensor, bits: int, out_features: int) -> torch.Tensor:
    """The inverse of `interleave_codes`: uint8 codes [out_features, k]."""
    if bits == 6:
        return deinterleave_codes(_eight_bit_chunks(packed), 8, out_features)
    if bits == IQ4_CODES:
        high_bits = packed.new_zeros(*packed.shape[:-1], 16)
        indices = deinterleave_codes(_eight_bit_chunks(torch.cat([packed, high_bits], dim=-1)), 8, out_features)
        return torch.tensor(IQ4_GRID, dtype=torch.uint8)[indices.long()]
    blocks, chunks = packed.shape[:2]
    step = STEP[bits]
    words = packed.contiguous().view(torch.int16).view(blocks, chunks, BLOCK, 2).to(torch.int32) & 0xFFFF
    shifts = torch.arange(step // 2, dtype=torch.int32) * bits
    parts = (words[..., None, :] >> shifts.view(-1, 1)) & ((1 << bits) - 1)  # [block, chunk, i, part, e]
    codes = parts.permute(0, 2, 1, 3, 4).reshape(blocks * BLOCK, chunks * step)
    return codes[:out_features].to(torch.uint8)


def interleave_groups(values: torch.Tensor) -> torch.Tensor:
    """[n, groups] per-row group values -> [blocks, groups, 16]."""
    rows = _padded_rows(values)
    return rows.view(-1, BLOCK, rows.shape[1]).transpose(1, 2).contiguous()


def deinterleave_groups(values: torch.Tensor, out_features: int) -> torch.Tensor:
    """The inverse of `interleave_groups`: [out_features, groups]."""
    return values.transpose(1, 2).reshape(-1, values.shape[1])[:out_features]


def fits_float16(values: torch.Tensor) -> bool:
    """Whether float16 holds `values` to its own precision: finite, and none flushed below its normal range."""
    magnitude = values.detach().float().abs()
    return bool(torch.all(magnitude <= FP16.max)) and bool(torch.all((magnitude == 0) | (magnitude >= FP16.tiny)))


@lru_cache(maxsize=None)
def load_quant_kernels(target: str = "native") -> Optional[QuantKernels]:
    """The built kernels for `target` ("native": this CPU's best body; "avx2", "skylake-avx512": the bodies older
    CPUs get, for the tests), or None (logged) if unavailable."""
    library = build_library(SOURCES, TARGETS[target], "quantised linears use torch's kernels", LIBRARY)
    if library is None:
        return None
    if library.quant_kernel_isa() == 0:
        logger.info("quantised GEMV kernels need AVX2 (or AVX-512 with BF16): using torch's kernels")
        return None
    return QuantKernels(library)
