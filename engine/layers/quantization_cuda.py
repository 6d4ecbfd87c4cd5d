"""Quantised linears on CUDA: run-time layouts of a `GroupedIntWeight` for torch's CUDA kernels, and `fp8`.

`install_grouped_weight` (engine/layers/quantization.py) hands a weight whose codes live on a CUDA device to
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

`--quantization fp8` (`Fp8LinearMethod`): e4m3 weights, quantised on load from the full-precision
checkpoint with one float32 scale per output channel (amax / 448) where `torch._scaled_mm` takes row-wise
scales here (Hopper, bfloat16 output), else one per tensor; activations are quantised per call the same way
(per token, or per tensor) and multiplied by `torch._scaled_mm` on the fp8 tensor cores of sm_89+ (Ada,
Hopper, Blackwell). Refused with a clear error on CPU and on older GPUs. The quantise and matmul functions
are plain torch (CPU has `_scaled_mm` too), so CPU tests run them; only the engine refuses fp8 off CUDA.
"""

from __future__ import annotations

import functools
import logging
from typing import TYPE_CHECKING, Callable, Optional

import torch

from llmctl.engine.errors import EngineArgsError
from llmctl.engine.layers.linear import LinearBase, UnquantizedLinearMethod

if TYPE_CHECKING:
    from llmctl.engine.layers.quantization import GroupedIntWeight

logger = logging.getLogger(__name__)

INT4_CUDA_GROUPS = (32, 64, 128, 256)  # tinygemm's group sizes
INNER_K_TILES = (8, 4, 2)  # tinygemm's choices, widest first: inputs must be a multiple of tiles x 16
FP8_MAX = torch.finfo(torch.float8_e4m3fn).max  # 448
RowQuantizer = Callable[[torch.Tensor], tuple[torch.Tensor, torch.Tensor]]  # x [M, K] -> codes, scales [M, 1]
FP8_MIN_CAPABILITY = (8, 9)
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


# ---- fp8 ----------------------------------------------------------------------------------------------

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


def fp8_linear_method(device: torch.device, dtype: torch.dtype) -> Fp8LinearMethod:
    check_fp8_device(device)
    per_channel = rowwise_fp8_runs(device, dtype)
    quantize_rows = triton_row_quantizer(device) if per_channel else None
    logger.info("linear layers: fp8 e4m3, %s scales, %s activations on %s%s",
                "per-channel" if per_channel else "per-tensor", dtype, device,
                " (quantised per token by a Triton kernel)" if quantize_rows else "")
    return Fp8LinearMethod(per_channel, quantize_rows)


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
