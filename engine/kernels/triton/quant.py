"""Per-token dynamic fp8 (e4m3) quantisation of activations for the fp8 linears: one program per row finds
the row's largest magnitude, scales it to 448 and writes the codes and the row's float32 scale, the values of
engine/layers/quantization/fp8.py's `quantize_fp8(x, per_channel=True)` in one kernel instead of five."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from llmctl.engine.kernels.triton._rows import num_rows, row_layout, warps_for

FP8 = torch.float8_e4m3fn
FP8_MAX = torch.finfo(FP8).max
MIN_SCALE = torch.finfo(torch.float32).tiny  # an all-zero row keeps a positive scale


@triton.jit
def _per_token_fp8_kernel(x_ptr, codes_ptr, scale_ptr, size, x_stride, fp8_max, min_scale, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    mask = cols < size
    x = tl.load(x_ptr + row * x_stride + cols, mask=mask, other=0.0).to(tl.float32)
    # IEEE divisions (a GPU's `/` is approximate): the scales and codes of torch's `quantize_fp8`, bit for bit
    scale = tl.maximum(tl.div_rn(tl.max(tl.abs(x), axis=0), fp8_max), min_scale)
    codes = tl.clamp(tl.div_rn(x, scale), -fp8_max, fp8_max)
    tl.store(codes_ptr + row * size + cols, codes.to(codes_ptr.dtype.element_ty), mask=mask)
    tl.store(scale_ptr + row, scale)


def per_token_quant_fp8(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x [rows, size] -> (e4m3 codes [rows, size], float32 scales [rows, 1]) with x ≈ codes * scale."""
    if x.dim() != 2:
        raise ValueError(f"per_token_quant_fp8: needs a 2-D [rows, size], got shape {tuple(x.shape)}")
    row_layout(x, "per_token_quant_fp8")
    codes = torch.empty(x.shape, dtype=FP8, device=x.device)
    scales = torch.empty(x.shape[0], 1, dtype=torch.float32, device=x.device)
    if num_rows(x):
        block = triton.next_power_of_2(x.shape[1])
        _per_token_fp8_kernel[(x.shape[0],)](x, codes, scales, x.shape[1], x.stride(0), FP8_MAX, MIN_SCALE,
                                             BLOCK=block, num_warps=warps_for(block))
    return codes, scales
