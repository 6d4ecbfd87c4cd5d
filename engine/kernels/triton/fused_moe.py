"""The routed experts as two grouped GEMMs (the design of vLLM's fused_moe, our own code).

`moe_align_block_size` sorts the (token, slot) pairs by chosen expert and pads each expert's run to a multiple
of BLOCK_M, so every BLOCK_M rows of the sorted order belong to one expert. `_grouped_gemm_kernel` then runs
one program per (row block, N tile): it gathers its pairs' input rows, multiplies by that expert's weight
(read once per block, and only for experts some token chose) and scatters the rows back to pair order, the
router weight multiplied in at the down projection. Every size is fixed by the shapes (the padded length is
bounded by pairs + experts * (BLOCK_M - 1)) and nothing syncs with the host, so CUDA graphs can capture it.
"""

from __future__ import annotations

import contextlib
from typing import Callable, Optional

import torch
import triton
import triton.language as tl

from llmctl.engine.kernels.triton import interpreter_enabled

BLOCK_N = 64
BLOCK_K = 32


def moe_align_block_size(topk_ids: torch.Tensor, block_m: int,
                         num_experts: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """topk_ids [tokens, k] -> (sorted pair ids [padded] int32: pair = token * k + slot, padding = tokens * k;
    each block's expert [padded / block_m] int32 (num_experts past the end); the padded length used [1] int32).
    An id of `num_experts` (a pair whose expert another expert-parallel rank holds) sorts past the length used,
    so no program runs it."""
    flat = topk_ids.flatten()
    num_pairs, device = flat.numel(), flat.device
    # scatter_add, not bincount: CUDA's bincount reads the largest id back to the host
    counts = torch.zeros(num_experts + 1, dtype=torch.int64, device=device).scatter_add_(0, flat, torch.ones_like(flat))
    padded = (counts + block_m - 1) // block_m * block_m
    padded_end = torch.cumsum(padded, 0)
    order = torch.argsort(flat, stable=True)
    sorted_experts = flat[order]
    rank_in_expert = torch.arange(num_pairs, device=device) - (torch.cumsum(counts, 0) - counts)[sorted_experts]
    max_padded = triton.cdiv(num_pairs + (num_experts + 1) * (block_m - 1), block_m) * block_m
    sorted_ids = torch.full((max_padded,), num_pairs, dtype=torch.int32, device=device)
    sorted_ids[(padded_end - padded)[sorted_experts] + rank_in_expert] = order.to(torch.int32)
    block_starts = torch.arange(0, max_padded, block_m, device=device)
    block_experts = torch.searchsorted(padded_end[:num_experts], block_starts, right=True).to(torch.int32)
    return sorted_ids, block_experts, padded_end[num_experts - 1:num_experts].to(torch.int32)


@triton.jit
def _grouped_gemm_kernel(a_ptr, w_ptr, c_ptr, sorted_ids_ptr, block_experts_ptr, num_padded_ptr, route_ptr,
                         N, K, num_pairs, stride_am, stride_we, stride_wn, stride_wk, stride_cm,
                         PAIRS_PER_ROW: tl.constexpr, MUL_ROUTE: tl.constexpr, PRECISION: tl.constexpr,
                         UPCAST: tl.constexpr,
                         BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    """C[pair] = A[pair // PAIRS_PER_ROW] @ W[expert].T (x the pair's router weight with MUL_ROUTE)."""
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    if pid_m * BLOCK_M >= tl.load(num_padded_ptr):
        return
    pairs = tl.load(sorted_ids_ptr + pid_m * BLOCK_M + tl.arange(0, BLOCK_M))
    valid = pairs < num_pairs
    rows = (pairs // PAIRS_PER_ROW).to(tl.int64)
    expert = tl.load(block_experts_ptr + pid_m).to(tl.int64)
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        ks = k0 + offs_k
        a = tl.load(a_ptr + rows[:, None] * stride_am + ks[None, :], mask=valid[:, None] & (ks[None, :] < K),
                    other=0.0)
        w = tl.load(w_ptr + expert * stride_we + cols[None, :] * stride_wn + ks[:, None] * stride_wk,
                    mask=(ks[:, None] < K) & (cols[None, :] < N), other=0.0)
        if UPCAST:
            a, w = a.to(tl.float32), w.to(tl.float32)
        acc += tl.dot(a, w, input_precision=PRECISION)
    if MUL_ROUTE:
        acc *= tl.load(route_ptr + pairs, mask=valid, other=0.0).to(tl.float32)[:, None]
    out = c_ptr + pairs.to(tl.int64)[:, None] * stride_cm + cols[None, :]
    tl.store(out, acc.to(c_ptr.dtype.element_ty), mask=valid[:, None] & (cols[None, :] < N))


def _grouped_gemm(a: torch.Tensor, weight: torch.Tensor, out: torch.Tensor, alignment, block_m: int,
                  pairs_per_row: int, route: Optional[torch.Tensor]) -> None:
    sorted_ids, block_experts, num_padded = alignment
    n, k = weight.shape[1], weight.shape[2]
    grid = (block_experts.numel(), triton.cdiv(n, BLOCK_N))
    _grouped_gemm_kernel[grid](
        a, weight, out, sorted_ids, block_experts, num_padded, route if route is not None else out,
        n, k, out.shape[0], a.stride(0), weight.stride(0), weight.stride(1), weight.stride(2), out.stride(0),
        PAIRS_PER_ROW=pairs_per_row, MUL_ROUTE=route is not None,
        PRECISION="ieee" if a.dtype == torch.float32 else None,  # fp32 models get fp32 products, not TF32
        UPCAST=interpreter_enabled() and a.dtype != torch.float32,  # the interpreter's 16-bit tl.dot is wrong (3.9)
        BLOCK_M=block_m, BLOCK_N=BLOCK_N, BLOCK_K=BLOCK_K)


def fused_experts_triton(hidden: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, topk_weights: torch.Tensor,
                         topk_ids: torch.Tensor, silu_and_mul: Callable[[torch.Tensor], torch.Tensor]) -> torch.Tensor:
    """`fused_experts_torch`'s contract (engine/layers/fused_moe/torch_impl.py) as two grouped GEMM launches."""
    tokens, top_k = topk_ids.shape
    num_pairs = tokens * top_k
    if tokens == 0:
        return torch.zeros_like(hidden)
    # small blocks while few pairs fall to each expert (decode), so padding wastes little of each weight read
    block_m = 16 if num_pairs <= 16 * w13.shape[0] else 64
    hidden = hidden.contiguous()
    on_device = torch.cuda.device(hidden.device) if hidden.is_cuda else contextlib.nullcontext()
    with on_device:
        alignment = moe_align_block_size(topk_ids, block_m, w13.shape[0])
        gate_up = torch.empty(num_pairs, w13.shape[1], dtype=hidden.dtype, device=hidden.device)
        _grouped_gemm(hidden, w13, gate_up, alignment, block_m, top_k, None)
        activated = silu_and_mul(gate_up).contiguous()
        # zeros: the rows of pairs held by another expert-parallel rank are never written
        down = torch.zeros(num_pairs, w2.shape[1], dtype=hidden.dtype, device=hidden.device)
        _grouped_gemm(activated, w2, down, alignment, block_m, 1, topk_weights.flatten().contiguous())
    return down.view(tokens, top_k, -1).sum(dim=1)
