"""`--quantization fp8`: e4m3 weights with float32 scales, multiplied on the fp8 tensor cores of sm_89+.

The weights are quantised on load from the full-precision checkpoint with one float32 scale per output channel
(amax / 448) where `torch._scaled_mm` takes row-wise scales here (Hopper, bfloat16 output), else one per tensor;
activations are quantised per call the same way (per token, or per tensor) and multiplied by `torch._scaled_mm`
(Ada, Hopper, Blackwell). Refused with a clear error on CPU and on older GPUs. The quantise and matmul
functions are plain torch (CPU has `_scaled_mm` too), so CPU tests run them; only the engine refuses fp8 off
CUDA.
"""

from __future__ import annotations

import functools
import logging
from dataclasses import dataclass
from typing import Any, Callable, Optional, Sequence

import torch

from llmctl.engine.errors import EngineArgsError
from llmctl.engine.layers.linear import LinearBase, UnquantizedLinearMethod
from llmctl.engine.layers.quantization.base import (LinearMethods, LinearTarget, QuantizationConfig,
                                                    check_float_dtype)

logger = logging.getLogger(__name__)

FP8_MAX = torch.finfo(torch.float8_e4m3fn).max  # 448
FP8_MIN_CAPABILITY = (8, 9)
RowQuantizer = Callable[[torch.Tensor], tuple[torch.Tensor, torch.Tensor]]  # x [M, K] -> codes, scales [M, 1]


def quantize_fp8(weight: torch.Tensor, per_channel: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """[rows, cols] -> (e4m3 [rows, cols], float32 scales [rows, 1] per row or a 0-d one per tensor), with
    x ≈ codes * scale; the largest magnitude of each row (or of the tensor) maps to 448."""
    values = weight.detach().float()
    amax = values.abs().amax(dim=1, keepdim=True) if per_channel else values.abs().amax()
    scale = (amax / FP8_MAX).clamp(min=torch.finfo(torch.float32).tiny)
    codes = (values / scale).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
    return codes, scale


def dequantize_fp8(codes: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    return codes.float() * scale


def fp8_linear(x: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor, per_channel: bool,
               bias: Optional[torch.Tensor] = None, quantize_rows: Optional[RowQuantizer] = None) -> torch.Tensor:
    """x [M, K] (16-bit or float32) times the e4m3 `weight` [N, K] with its scales ([N, 1] or 0-d):
    x is quantised to e4m3 per row (per_channel: by `quantize_rows` where given) or per tensor, then one
    `torch._scaled_mm`."""
    if per_channel and quantize_rows is not None:
        x_codes, x_scale = quantize_rows(x)
    else:
        x_codes, x_scale = quantize_fp8(x, per_channel)
    # _scaled_mm takes the second operand column-major: the [N, K] row-major weight transposed is that;
    # its row-wise scales are [1, N].
    scale_b = weight_scale.view(1, -1) if per_channel else weight_scale
    out = torch._scaled_mm(x_codes, weight.t(), scale_a=x_scale, scale_b=scale_b, out_dtype=x.dtype)
    return out if bias is None else out + bias


@functools.cache
def rowwise_fp8_runs(device: torch.device, dtype: torch.dtype) -> bool:
    """Row-wise scales (one per token and per output channel) need Hopper-class kernels and bf16 output."""
    try:
        weight, scale = quantize_fp8(torch.ones(32, 32, device=device), per_channel=True)
        fp8_linear(torch.ones(16, 32, dtype=dtype, device=device), weight, scale, per_channel=True)
    except RuntimeError as exc:
        logger.info("fp8 with row-wise scales does not run on %s (%s): one scale per tensor", device, exc)
        return False
    return True


def check_fp8_device(device: torch.device) -> None:
    if device.type != "cuda":
        raise EngineArgsError(f"--quantization fp8 needs a CUDA GPU with fp8 tensor cores (sm_89+: Ada, Hopper); "
                              f"device {device} has none: use --quantization int8 or int4 on CPU")
    capability = torch.cuda.get_device_capability(device)
    if capability < FP8_MIN_CAPABILITY:
        name = torch.cuda.get_device_name(device)
        raise EngineArgsError(f"--quantization fp8 needs compute capability 8.9+ (Ada, Hopper); {name} is "
                              f"{capability[0]}.{capability[1]}: use --quantization int8 or int4")


class Fp8LinearMethod(UnquantizedLinearMethod):
    """`--quantization fp8`: loads like an unquantised linear, then keeps the e4m3 weight and its float32
    scales only (1 byte per weight). `quantize_rows`: the per-token activation quantiser (None: torch ops)."""

    quantized = True

    def __init__(self, per_channel: bool, quantize_rows: Optional[RowQuantizer] = None):
        self.per_channel = per_channel
        self.quantize_rows = quantize_rows

    def process_weights_after_loading(self, layer: LinearBase) -> None:
        if layer.in_features % 16 or layer.out_features % 16:
            raise EngineArgsError(f"--quantization fp8 needs linears whose sizes are multiples of 16 "
                                  f"(torch._scaled_mm); this model has one of {layer.in_features} inputs and "
                                  f"{layer.out_features} outputs")
        codes, scale = quantize_fp8(layer.weight.data, self.per_channel)
        layer.weight = torch.nn.Parameter(codes, requires_grad=False)  # the full-precision weight is dropped
        layer.weight_scale = torch.nn.Parameter(scale, requires_grad=False)

    def apply(self, layer: LinearBase, x: torch.Tensor) -> torch.Tensor:
        rows = x.reshape(-1, x.shape[-1])
        out = fp8_linear(rows, layer.weight, layer.weight_scale, self.per_channel, layer.bias, self.quantize_rows)
        return out.reshape(*x.shape[:-1], layer.out_features)


def triton_row_quantizer(device: torch.device) -> Optional[RowQuantizer]:
    """engine/kernels/triton/quant.py's per-token quantiser on `device`'s CUDA GPU, or None without triton."""
    try:
        from llmctl.engine.kernels.triton.quant import per_token_quant_fp8
    except Exception as exc:  # noqa: BLE001 - a missing or broken triton build means "not available"
        logger.info("Triton fp8 activation quantisation unavailable (%s): torch ops", exc)
        return None
    on_device = torch.cuda.device(device)  # Triton launches on the current device, not the tensor's

    def quantize_rows(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        with on_device:
            return per_token_quant_fp8(x)

    return quantize_rows


@dataclass(frozen=True)
class Fp8Config(QuantizationConfig):
    """`--quantization fp8` (no options)."""

    @classmethod
    def from_quantization_config(cls, raw: dict[str, Any], source: str, linear_names: Sequence[str]) -> "Fp8Config":
        return cls()

    def linear_methods(self, target: LinearTarget) -> LinearMethods:
        check_float_dtype("fp8", target.dtype)
        check_fp8_device(target.device)
        per_channel = rowwise_fp8_runs(target.device, target.dtype)
        quantize_rows = triton_row_quantizer(target.device) if per_channel else None
        logger.info("linear layers: fp8 e4m3, %s scales, %s activations on %s%s",
                    "per-channel" if per_channel else "per-tensor", target.dtype, target.device,
                    " (quantised per token by a Triton kernel)" if quantize_rows else "")
        return LinearMethods(Fp8LinearMethod(per_channel, quantize_rows))

    def describe(self) -> str:
        return "fp8"
