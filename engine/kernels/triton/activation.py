"""SiLU(gate) * up over a merged [gate | up] projection output, rounded as torch's `F.silu(gate) * up`."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from llmctl.engine.kernels.triton._rows import num_rows

BLOCK = 1024


@triton.jit
def _silu_and_mul_kernel(gate_up_ptr, out_ptr, size, in_stride, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < size
    gate = tl.load(gate_up_ptr + row * in_stride + cols, mask=mask, other=0.0).to(tl.float32)
    up = tl.load(gate_up_ptr + row * in_stride + size + cols, mask=mask, other=0.0)
    silu = (gate / (1.0 + tl.exp(-gate))).to(up.dtype)
    out = (silu.to(tl.float32) * up.to(tl.float32)).to(up.dtype)
    tl.store(out_ptr + row * size + cols, out, mask=mask)


def silu_and_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """[rows, 2 * size] laid out as [gate | up] -> silu(gate) * up [rows, size] (rows may be strided)."""
    if gate_up.dim() != 2 or gate_up.stride(-1) != 1 or gate_up.shape[-1] % 2:
        raise ValueError(f"silu_and_mul: needs a 2-D [rows, 2 * size] with a contiguous last dimension, got "
                         f"shape {tuple(gate_up.shape)} strides {gate_up.stride()}")
    size = gate_up.shape[-1] // 2
    out = torch.empty(gate_up.shape[0], size, dtype=gate_up.dtype, device=gate_up.device)
    rows = num_rows(out) if size else 0
    if rows:
        _silu_and_mul_kernel[(rows, triton.cdiv(size, BLOCK))](gate_up, out, size, gate_up.stride(0), BLOCK=BLOCK,
                                                               num_warps=4)
    return out
