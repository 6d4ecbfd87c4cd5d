"""The experts in torch: tokens grouped by expert, one GEMM pair per expert that any token chose, so only the
chosen experts' weights are read (the reference, and the CPU path at every batch size). `group_by_expert` is
the grouping, shared with the per-expert quantised linears (engine/layers/fused_moe/layer.py)."""

from __future__ import annotations

from typing import Callable, Iterator

import torch
import torch.nn.functional as F


def group_by_expert(topk_weights: torch.Tensor, topk_ids: torch.Tensor,
                    num_experts: int) -> Iterator[tuple[int, torch.Tensor, torch.Tensor]]:
    """(expert, its tokens' rows, their routing weights) for every expert that at least one token chose. An id
    of `num_experts` marks a pair whose expert another expert-parallel rank holds: it is skipped (it sorts last)."""
    top_k = topk_ids.shape[1]
    flat_ids = topk_ids.flatten()
    order = torch.argsort(flat_ids, stable=True)  # (token, slot) pairs grouped by expert
    counts = torch.bincount(flat_ids, minlength=num_experts + 1).tolist()[:num_experts]
    flat_weights = topk_weights.flatten()
    start = 0
    for expert, count in enumerate(counts):
        if count == 0:
            continue
        pairs = order[start:start + count]
        start += count
        yield expert, pairs // top_k, flat_weights[pairs]


def fused_experts_torch(hidden: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, topk_weights: torch.Tensor,
                        topk_ids: torch.Tensor, silu_and_mul: Callable[[torch.Tensor], torch.Tensor]) -> torch.Tensor:
    """hidden [tokens, H], w13 [E, 2I, H] ([gate | up] rows), w2 [E, H, I], top-k weights and ids [tokens, k]
    -> sum over each token's k experts of weight * w2 @ silu_and_mul(w13 @ x), [tokens, H]. An id of E (the
    number of experts here) is a pair whose expert another expert-parallel rank holds: it adds nothing here."""
    out = torch.zeros_like(hidden)
    for expert, tokens, weights in group_by_expert(topk_weights, topk_ids, w13.shape[0]):
        expert_out = F.linear(silu_and_mul(F.linear(hidden[tokens], w13[expert])), w2[expert])
        out.index_add_(0, tokens, expert_out * weights[:, None])
    return out
