"""Quantised linears on CUDA: the run-time layouts of a `GroupedIntWeight` for torch's CUDA kernels.

`install_grouped_weight` (grouped.py) hands a weight whose codes live on a CUDA device to
`cuda_layout`, which picks the first of these the device runs:
- `int4pack-cuda`: 4 bits, groups of 32/64/128/256, outputs a multiple of 8, inputs a multiple of
  `inner_k_tiles` x 16, bfloat16 activations: tinygemm (`torch._convert_weight_to_int4pack` on a uint8
  [out, in / 2] tensor holding input 2j in the high nibble and 2j + 1 in the low one, then
  `torch._weight_int4pack_mm` with the same [in / group, out, 2] scales-and-offsets the CPU kernel takes:
  w = (q - 8) * scale + offset, offset = (8 - zero) * scale). tinygemm needs sm_80+;
- `int8pack-cuda`: 8 bits, one symmetric group per row: `torch._weight_int8pack_mm` where this torch build
  has it for CUDA;
- otherwise the portable `dequant` layout (codes dequantised to the activation dtype for each call).
Each kernel is probed once per device and dtype on a tiny weight, so a build or a GPU without it falls back
instead of failing mid-serve.
"""

from __future__ import annotations

import functools
import logging
from typing import TYPE_CHECKING, Optional

import torch

from llmctl.engine.layers.linear import LinearBase

if TYPE_CHECKING:
    from llmctl.engine.layers.quantization.grouped import GroupedIntWeight

logger = logging.getLogger(__name__)

INT4_CUDA_GROUPS = (32, 64, 128, 256)  # tinygemm's group sizes
INNER_K_TILES = (8, 4, 2)  # tinygemm's choices, widest first: inputs must be a multiple of tiles x 16
CUDA_LAYOUTS = ("int4pack-cuda", "int8pack-cuda")


# ---- int4 / int8 on CUDA --------------------------------------------------------------------------------

def pack_int4_tinygemm(codes: torch.Tensor) -> torch.Tensor:
    """uint8 [out, in] codes 0..15 -> uint8 [out, in / 2] as tinygemm's CUDA packer reads them: input 2j in
    the high nibble, 2j + 1 in the low one (the opposite of the portable `pack_int4`)."""
    return (codes[:, 0::2] << 4) | codes[:, 1::2]


def unpack_int4_tinygemm(packed: torch.Tensor) -> torch.Tensor:
    """The inverse of `pack_int4_tinygemm`."""
    return torch.stack([packed >> 4, packed & 0xF], dim=-1).view(packed.shape[0], -1)


def inner_k_tiles(in_features: int) -> Optional[int]:
    """The widest tinygemm k-tiling that divides `in_features` (None: none does)."""
    return next((tiles for tiles in INNER_K_TILES if in_features % (tiles * 16) == 0), None)


def int4_cuda_fits(weight: "GroupedIntWeight") -> bool:
    return (weight.bits == 4 and weight.group_size in INT4_CUDA_GROUPS and weight.out_features % 8 == 0
            and inner_k_tiles(weight.in_features) is not None)


def int8_cuda_fits(weight: "GroupedIntWeight") -> bool:
    return weight.bits == 8 and weight.num_groups == 1 and weight.is_symmetric()


def _has_cuda_kernel(op: str) -> bool:
    return torch._C._dispatch_has_kernel_for_dispatch_key(f"aten::{op}", "CUDA")


@functools.cache
def _int4_kernel_runs(device: torch.device, dtype: torch.dtype) -> bool:
    """tinygemm on a 16 x 256 weight, groups of 32: bfloat16 activations, sm_80+, a build that has it."""
    if dtype is not torch.bfloat16 or not _has_cuda_kernel("_weight_int4pack_mm"):
        return False
    try:
        packed = torch._convert_weight_to_int4pack(torch.zeros(16, 128, dtype=torch.uint8, device=device), 8)
        scales = torch.ones(256 // 32, 16, 2, dtype=dtype, device=device)
        torch._weight_int4pack_mm(torch.zeros(1, 256, dtype=dtype, device=device), packed, 32, scales)
    except RuntimeError as exc:
        logger.info("tinygemm int4 does not run on %s (%s): int4 weights dequantise per call", device, exc)
        return False
    return True


@functools.cache
def _int8_kernel_runs(device: torch.device, dtype: torch.dtype) -> bool:
    if not _has_cuda_kernel("_weight_int8pack_mm"):
        return False
    try:
        torch._weight_int8pack_mm(torch.zeros(1, 32, dtype=dtype, device=device),
                                  torch.zeros(16, 32, dtype=torch.int8, device=device),
                                  torch.ones(16, dtype=dtype, device=device))
    except RuntimeError as exc:
        logger.info("torch._weight_int8pack_mm does not run on %s (%s): int8 weights dequantise per call", device, exc)
        return False
    return True


def cuda_layout(weight: "GroupedIntWeight", dtype: torch.dtype) -> Optional[str]:
    """The CUDA kernel layout for `weight` (on a CUDA device) with `dtype` activations, or None (dequant)."""
    device = weight.codes.device
    if int4_cuda_fits(weight) and _int4_kernel_runs(device, dtype):
        return "int4pack-cuda"
    if int8_cuda_fits(weight) and _int8_kernel_runs(device, dtype):
        return "int8pack-cuda"
    return None


def install_cuda_layout(layer: LinearBase, weight: "GroupedIntWeight", layout: str, dtype: torch.dtype,
                        scales_and_offsets: torch.Tensor) -> dict[str, torch.Tensor]:
    """The parameters of `layout` for `weight` (registered by the caller): `scales_and_offsets` is the
    tinygemm [in / group, out, 2] tensor the CPU int4 layout builds the same way."""
    if layout == "int4pack-cuda":
        layer.quant_inner_k_tiles = inner_k_tiles(weight.in_features)
        packed = torch._convert_weight_to_int4pack(pack_int4_tinygemm(weight.codes).contiguous(),
                                                   layer.quant_inner_k_tiles)
        return {"weight": packed, "weight_scales_and_zeros": scales_and_offsets}
    signed = (weight.codes.to(torch.int16) - weight.midpoint).to(torch.int8)
    return {"weight": signed, "weight_scale": weight.scales[:, 0].to(dtype)}


def apply_cuda_layout(layer: LinearBase, rows: torch.Tensor) -> torch.Tensor:
    if layer.quant_layout == "int4pack-cuda":
        return torch._weight_int4pack_mm(rows.contiguous(), layer.weight, layer.quant_group_size,
                                         layer.weight_scales_and_zeros)
    return torch._weight_int8pack_mm(rows.contiguous(), layer.weight, layer.weight_scale)
