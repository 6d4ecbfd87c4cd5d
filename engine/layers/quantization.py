"""Weight-only quantisation applied on the fly to a full-precision checkpoint (`--quantization`).

`Int8LinearMethod`: symmetric int8 per output channel (scale = max|w_row| / 127). The layer loads the
checkpoint's weight in the model dtype exactly like an unquantised linear, then
`process_weights_after_loading` replaces it by int8 codes [out, in] and scales [out] (model dtype), so
only the quantised form stays in memory. The forward is `torch._weight_int8pack_mm` on CPU
(../shared/CPU-FACTS.md section 2: qkv 960x576 at M=1 43 µs against about 80 µs for bf16 F.linear,
relative error 8e-3 with bf16 activations; fp32 activations run too, exactly but 5x slower, so
bf16 is the dtype to quantise with), and dequantise-then-`F.linear` elsewhere.

`Int4LinearMethod` (`int4`, `int4-g32`, `int4-g64`, `int4-g128`; `int4` is group 128): symmetric int4 per
group of inputs, CPU only, the same way with torch's CPU int4 kernels.
"""

from __future__ import annotations

import logging

import torch
import torch.nn.functional as F
from torch import nn

from llmctl.engine.errors import EngineArgsError, ModelLoadError
from llmctl.engine.layers.linear import LinearBase, LinearMethod, UnquantizedLinearMethod

logger = logging.getLogger(__name__)

INT8_MAX = 127
INT4_MAX, INT4_OFFSET = 7, 8  # signed codes -8..7 stored as 0..15


def quantize_int8_per_channel(weight: torch.Tensor, scale_dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """weight [out, in] -> (int8 codes [out, in], scales [out] of `scale_dtype`), w ≈ codes * scale.
    The codes are rounded against the scale as stored, so dequantising with it is the reference."""
    amax = weight.detach().float().abs().amax(dim=1)
    scale = (amax / INT8_MAX).clamp(min=torch.finfo(torch.float32).tiny).to(scale_dtype)
    codes = torch.round(weight.float() / scale.float()[:, None]).clamp(-INT8_MAX, INT8_MAX).to(torch.int8)
    return codes, scale


def dequantize_int8(codes: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """The float32 weight the int8 codes and scales stand for."""
    return codes.float() * scale.float()[:, None]


class Int8LinearMethod(UnquantizedLinearMethod):
    """Loads like an unquantised linear (same shards and loaders), keeps int8 codes + per-row scales."""

    def process_weights_after_loading(self, layer: LinearBase) -> None:
        codes, scale = quantize_int8_per_channel(layer.weight.data, layer.weight.dtype)
        # Re-registering `weight` drops the layer's reference to the full-precision tensor (a tied lm_head's
        # stays the embedding's, which the embedding lookup needs anyway).
        layer.weight = nn.Parameter(codes, requires_grad=False)
        layer.weight_scale = nn.Parameter(scale, requires_grad=False)

    def apply(self, layer: LinearBase, x: torch.Tensor) -> torch.Tensor:
        rows = x.reshape(-1, x.shape[-1])
        if rows.device.type == "cpu":
            out = torch._weight_int8pack_mm(rows.contiguous(), layer.weight, layer.weight_scale)
        else:
            out = F.linear(rows, layer.weight.to(rows.dtype)) * layer.weight_scale
        if layer.bias is not None:
            out = out + layer.bias
        return out.reshape(*x.shape[:-1], layer.out_features)


def quantize_int4_grouped(weight: torch.Tensor, group_size: int,
                          scale_dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """weight [out, in] -> (codes 0..15 as int32 [out, in], scales [out, in / group_size] of `scale_dtype`):
    symmetric, w ≈ (code - 8) * scale per group of `group_size` inputs (tinygemm's convention, zero 0)."""
    out_features, in_features = weight.shape
    groups = weight.detach().float().view(out_features, in_features // group_size, group_size)
    scale = (groups.abs().amax(dim=-1) / INT4_MAX).clamp(min=torch.finfo(torch.float32).tiny).to(scale_dtype)
    codes = torch.round(groups / scale.float()[..., None]).clamp(-INT4_MAX - 1, INT4_MAX) + INT4_OFFSET
    return codes.to(torch.int32).view(out_features, in_features), scale


def dequantize_int4(codes: torch.Tensor, scale: torch.Tensor, group_size: int) -> torch.Tensor:
    """The float32 weight the int4 codes and group scales stand for."""
    out_features, in_features = codes.shape
    groups = (codes.float() - INT4_OFFSET).view(out_features, in_features // group_size, group_size)
    return (groups * scale.float()[..., None]).view(out_features, in_features)


class Int4LinearMethod(UnquantizedLinearMethod):
    """Grouped symmetric int4 on CPU: loads like an unquantised linear, keeps the weight packed two codes a
    byte by `torch._convert_weight_to_int4pack_for_cpu` and [in / group, out, 2] scales-and-zeros (zeros 0),
    applied with `torch._weight_int4pack_mm_for_cpu` (CPU-FACTS section 2: gate_up at M=1 57 µs against
    129 µs for int8; relative error 7.8e-2 at group 32)."""

    def __init__(self, group_size: int):
        self.group_size = group_size

    def create_weights(self, layer: LinearBase, bias: bool, dtype: torch.dtype) -> None:
        if layer.in_features % self.group_size:
            raise ModelLoadError(f"int4 group size {self.group_size} does not divide a linear's {layer.in_features} "
                                 "inputs; choose a smaller group (int4-g32, int4-g64)")
        super().create_weights(layer, bias, dtype)

    def process_weights_after_loading(self, layer: LinearBase) -> None:
        codes, scale = quantize_int4_grouped(layer.weight.data, self.group_size, layer.weight.dtype)
        packed = torch._convert_weight_to_int4pack_for_cpu(codes, 1)
        scales_and_zeros = torch.stack([scale, torch.zeros_like(scale)], dim=-1).transpose(0, 1).contiguous()
        layer.weight = nn.Parameter(packed, requires_grad=False)  # the full-precision tensor is dropped
        layer.weight_scales_and_zeros = nn.Parameter(scales_and_zeros, requires_grad=False)

    def apply(self, layer: LinearBase, x: torch.Tensor) -> torch.Tensor:
        rows = x.reshape(-1, x.shape[-1]).contiguous()
        out = torch._weight_int4pack_mm_for_cpu(rows, layer.weight, self.group_size, layer.weight_scales_and_zeros)
        if layer.bias is not None:
            out = out + layer.bias
        return out.reshape(*x.shape[:-1], layer.out_features)


INT4_GROUP_SIZES = {"int4": 128, "int4-g32": 32, "int4-g64": 64, "int4-g128": 128}


def quantized_linear_method(quantization: str, device: torch.device, dtype: torch.dtype) -> LinearMethod:
    """The linear method for `--quantization` (names from `EngineArgs`' ON_THE_FLY_QUANTIZATIONS)."""
    if quantization != "int8" and quantization not in INT4_GROUP_SIZES:
        raise EngineArgsError(f"quantization {quantization!r} is not supported (supported: int8, "
                              f"{', '.join(INT4_GROUP_SIZES)})")
    if dtype not in (torch.bfloat16, torch.float16, torch.float32):
        raise EngineArgsError(f"--quantization {quantization} needs a float dtype, got {dtype}")
    if quantization in INT4_GROUP_SIZES and device.type != "cpu":
        raise EngineArgsError(f"--quantization {quantization} runs on CPU only (device {device})")
    if device.type == "cpu" and dtype is torch.float32:
        logger.warning("quantised weights with float32 activations run about 5x slower than with bfloat16 "
                       "(--dtype bfloat16)")
    if quantization == "int8":
        method: LinearMethod = Int8LinearMethod()
    else:
        method = Int4LinearMethod(INT4_GROUP_SIZES[quantization])
    logger.info("linear layers: %s (%s, %s activations on %s)", type(method).__name__, quantization, dtype, device)
    return method
