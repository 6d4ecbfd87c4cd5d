"""Rotary position embedding in place, rotate-half (GPT-NeoX) style, the one the Llama family uses here:
each head's first half x1 and second half x2 become (x1 cos - x2 sin, x2 cos + x1 sin), computed in
float32 and rounded once to the activations' dtype."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from llmctl.engine.kernels.triton._rows import warps_for


@triton.jit
def _rotary_kernel(x_ptr, cos_ptr, sin_ptr, x_stride, heads, half,
                   BLOCK_HEADS: tl.constexpr, BLOCK_HALF: tl.constexpr):
    token = tl.program_id(0).to(tl.int64)
    head = tl.program_id(1) * BLOCK_HEADS + tl.arange(0, BLOCK_HEADS)
    dim = tl.arange(0, BLOCK_HALF)
    dim_mask = dim < half
    cos = tl.load(cos_ptr + token * half + dim, mask=dim_mask, other=0.0).to(tl.float32)
    sin = tl.load(sin_ptr + token * half + dim, mask=dim_mask, other=0.0).to(tl.float32)
    first = x_ptr + token * x_stride + head[:, None] * (2 * half) + dim[None, :]
    mask = (head[:, None] < heads) & dim_mask[None, :]
    x1 = tl.load(first, mask=mask, other=0.0)
    x2 = tl.load(first + half, mask=mask, other=0.0)
    a, b = x1.to(tl.float32), x2.to(tl.float32)
    tl.store(first, (a * cos[None, :] - b * sin[None, :]).to(x1.dtype), mask=mask)
    tl.store(first + half, (b * cos[None, :] + a * sin[None, :]).to(x1.dtype), mask=mask)


def rotary_(x: torch.Tensor, heads: int, head_dim: int, cos: torch.Tensor, sin: torch.Tensor) -> None:
    """RoPE in place on the first `heads` heads of each row of the 2-D `x` [tokens, >= heads * head_dim]
    (rows may be strided, as q and k inside a fused qkv output); cos/sin hold head_dim / 2 values per token."""
    if x.dim() != 2 or x.stride(1) != 1 or head_dim % 2 or heads * head_dim > x.shape[1]:
        raise ValueError(f"rotary_: needs x [tokens, >= {heads} * {head_dim}] with a contiguous last dimension "
                         f"and an even head_dim, got shape {tuple(x.shape)} strides {x.stride()}")
    tokens, half = x.shape[0], head_dim // 2
    tables = [t.reshape(tokens, half) for t in (cos, sin)]
    if any(not t.is_contiguous() or t.device != x.device for t in tables):
        raise ValueError(f"rotary_: cos/sin must be contiguous [{tokens}, {half}] on {x.device}")
    if not tokens or not heads:
        return
    block_half = triton.next_power_of_2(half)
    block_heads = max(1, min(triton.next_power_of_2(heads), 4096 // block_half))
    grid = (tokens, triton.cdiv(heads, block_heads))
    _rotary_kernel[grid](x, tables[0], tables[1], x.stride(0), heads, half, BLOCK_HEADS=block_heads,
                         BLOCK_HALF=block_half, num_warps=warps_for(block_heads * block_half))
