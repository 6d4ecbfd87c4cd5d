"""RMSNorm and fused residual add + RMSNorm: one program per row, the whole row in registers.

Rounding follows torch's `F.rms_norm` (and transformers'): the normalisation in float32, rounded to the
activations' dtype, then multiplied by the weight in that dtype; the residual sum is rounded to the dtype
before it is normalised, as `residual + x` is.
"""

from __future__ import annotations

from typing import Optional

import torch
import triton
import triton.language as tl

from llmctl.engine.kernels.triton._rows import num_rows, row_layout, warps_for


@triton.jit
def _rms_norm_kernel(x_ptr, residual_ptr, weight_ptr, out_ptr, size, eps,
                     x_inner, x_outer_stride, x_inner_stride,
                     r_inner, r_outer_stride, r_inner_stride,
                     HAS_RESIDUAL: tl.constexpr, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    mask = cols < size
    x_row = x_ptr + (row // x_inner) * x_outer_stride + (row % x_inner) * x_inner_stride
    x = tl.load(x_row + cols, mask=mask, other=0.0)
    if HAS_RESIDUAL:
        r_row = residual_ptr + (row // r_inner) * r_outer_stride + (row % r_inner) * r_inner_stride
        residual = tl.load(r_row + cols, mask=mask, other=0.0)
        x = (x.to(tl.float32) + residual.to(tl.float32)).to(residual.dtype)
        tl.store(r_row + cols, x, mask=mask)
    values = x.to(tl.float32)
    inverse_rms = tl.rsqrt(tl.sum(values * values, axis=0) / size + eps)
    normed = (values * inverse_rms).to(x.dtype)
    weight = tl.load(weight_ptr + cols, mask=mask, other=0.0)
    out = (normed.to(tl.float32) * weight.to(tl.float32)).to(out_ptr.dtype.element_ty)
    tl.store(out_ptr + row * size + cols, out, mask=mask)


def _launch(x: torch.Tensor, weight: torch.Tensor, eps: float, residual: Optional[torch.Tensor],
            op: str) -> torch.Tensor:
    x_layout = row_layout(x, op)
    size = x.shape[-1]
    if weight.shape != (size,) or weight.stride(0) != 1:
        raise ValueError(f"{op}: the weight must be a contiguous [{size}]")
    r_layout = x_layout
    if residual is not None:
        if residual.shape != x.shape or residual.dtype != x.dtype:
            raise ValueError(f"{op}: the residual {tuple(residual.shape)} {residual.dtype} must match the input "
                             f"{tuple(x.shape)} {x.dtype}")
        r_layout = row_layout(residual, op)
    out = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    rows = num_rows(x)
    if rows:
        block = triton.next_power_of_2(size)
        _rms_norm_kernel[(rows,)](x, residual if residual is not None else x, weight, out, size, eps,
                                  *x_layout, *r_layout, HAS_RESIDUAL=residual is not None, BLOCK=block,
                                  num_warps=warps_for(block))
    return out


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm(x) * weight over the last dimension of a [rows, size] or [tokens, heads, size] tensor
    (rows may be strided); the output is a new contiguous tensor."""
    return _launch(x, weight, eps, None, "rms_norm")


def fused_add_rms_norm(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor,
                       eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """`residual += x` in place, then RMSNorm of that sum: returns (normed, residual) in one pass."""
    return _launch(x, weight, eps, residual, "fused_add_rms_norm"), residual
