"""Weight-only quantisation applied on the fly to a full-precision checkpoint (`--quantization`).

`Int8LinearMethod`: symmetric int8 per output channel (scale = max|w_row| / 127). The layer loads the
checkpoint's weight in the model dtype exactly like an unquantised linear, then
`process_weights_after_loading` replaces it by int8 codes [out, in] and scales [out] (model dtype), so
only the quantised form stays in memory. The forward is `torch._weight_int8pack_mm` on CPU
(../shared/CPU-FACTS.md section 2: qkv 960x576 at M=1 43 µs against about 80 µs for bf16 F.linear,
relative error 8e-3 with bf16 activations; fp32 activations run too, exactly but 5x slower, so
bf16 is the dtype to quantise with), and dequantise-then-`F.linear` elsewhere.
"""

from __future__ import annotations

import logging

import torch
import torch.nn.functional as F
from torch import nn

from llmctl.engine.errors import EngineArgsError
from llmctl.engine.layers.linear import LinearBase, LinearMethod, UnquantizedLinearMethod

logger = logging.getLogger(__name__)

INT8_MAX = 127


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


def quantized_linear_method(quantization: str, device: torch.device, dtype: torch.dtype) -> LinearMethod:
    """The linear method for `--quantization` (names from `EngineArgs`' ON_THE_FLY_QUANTIZATIONS)."""
    if quantization != "int8":
        raise EngineArgsError(f"quantization {quantization!r} is not supported (supported: int8)")
    if dtype not in (torch.bfloat16, torch.float16, torch.float32):
        raise EngineArgsError(f"--quantization int8 needs a float dtype, got {dtype}")
    if device.type == "cpu" and dtype is torch.float32:
        logger.warning("int8 weights with float32 activations run about 5x slower than with bfloat16 "
                       "(--dtype bfloat16)")
    logger.info("linear layers: Int8LinearMethod (int8 weights, %s activations on %s)", dtype, device)
    return Int8LinearMethod()
