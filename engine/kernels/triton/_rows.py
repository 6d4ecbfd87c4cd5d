"""How the Triton kernels address rows: a tensor's last dimension is a contiguous row, and its rows are
given by (index // inner) * outer_stride + (index % inner) * inner_stride, so a [tokens, heads, dim] view
into a fused projection (rows strided by the projection's width) needs no copy."""

from __future__ import annotations

import torch

MAX_ROW = 65536  # one program holds a whole row in registers (a power-of-two block of it)


def row_layout(x: torch.Tensor, op: str) -> tuple[int, int, int]:
    """(inner, outer_stride, inner_stride) of a 2-D or 3-D tensor whose last dimension is contiguous."""
    if x.dim() not in (2, 3) or x.stride(-1) != 1:
        raise ValueError(f"{op}: needs a 2-D or 3-D tensor with a contiguous last dimension, got shape "
                         f"{tuple(x.shape)} strides {x.stride()}")
    if x.shape[-1] > MAX_ROW:
        raise ValueError(f"{op}: rows of {x.shape[-1]} elements exceed the {MAX_ROW} one program holds")
    if x.dim() == 2:
        return 1, x.stride(0), 0
    return x.shape[1], x.stride(0), x.stride(1)


def num_rows(x: torch.Tensor) -> int:
    return x.numel() // x.shape[-1] if x.shape[-1] else 0


def warps_for(block: int) -> int:
    """Enough warps that each thread holds a few elements of a row, at most 16."""
    return max(1, min(16, block // 256))
