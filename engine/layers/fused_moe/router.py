"""Top-k expert selection from router logits: softmax over every expert in float32, the k largest, and
(`renormalize`: Mixtral, Qwen `norm_topk_prob`) those k rescaled to sum to 1 (= a softmax over the top-k logits)."""

from __future__ import annotations

import torch


def select_experts(router_logits: torch.Tensor, top_k: int, renormalize: bool,
                   dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """[tokens, experts] logits -> (weights [tokens, top_k] of `dtype`, expert ids [tokens, top_k] int64)."""
    probabilities = torch.softmax(router_logits, dim=-1, dtype=torch.float32)
    weights, ids = torch.topk(probabilities, top_k, dim=-1)
    if renormalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return weights.to(dtype), ids
