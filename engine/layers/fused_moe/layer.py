"""`FusedMoE`: every expert's weights as two fused parameters, w13 [E, 2I, H] ([gate | up] rows, as a dense
MLP's gate_up_proj) and w2 [E, H, I], filled from per-expert checkpoint tensors (`ExpertNames` maps
`experts.{e}.{projection}.weight` to a parameter and shard), routed with `router.select_experts` and applied
by the Triton grouped GEMM on CUDA, else by the torch path (engine/layers/fused_moe/torch_impl.py)."""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Callable, Optional

import torch
import torch.nn.functional as F
from torch import nn

from llmctl.engine.errors import ModelLoadError
from llmctl.engine.layers.fused_moe.router import select_experts
from llmctl.engine.layers.fused_moe.torch_impl import fused_experts_torch
from llmctl.engine.layers.linear import ShardId, copy_checked, new_parameter

ExpertsImpl = Callable[..., torch.Tensor]


@dataclass(frozen=True)
class ExpertNames:
    """A checkpoint's names for one MoE block: its module (`mlp`, Mixtral's `block_sparse_moe`) and each expert's
    gate, up and down projections. Ours are `mlp.experts.w13_weight` (shards (e, 0) gate, (e, 1) up),
    `mlp.experts.w2_weight` (shard e) and `mlp.gate.weight` (the router)."""

    module: str
    gate: str
    up: str
    down: str

    def _pattern(self) -> re.Pattern:
        return re.compile(rf"^(.*)\.{re.escape(self.module)}\.(?:experts\.(\d+)\.(\w+)|(gate))\.weight$")

    def target(self, name: str) -> Optional[tuple[str, ShardId]]:
        """(our parameter, shard id) for checkpoint tensor `name`, or None when it is no expert or router tensor."""
        match = self._pattern().match(name)
        if match is None:
            return None
        prefix, expert, projection, router = match.groups()
        if router:
            return f"{prefix}.mlp.gate.weight", None
        shards = {self.gate: ("w13_weight", 0), self.up: ("w13_weight", 1), self.down: ("w2_weight", None)}
        if projection not in shards:
            return None
        param, part = shards[projection]
        return f"{prefix}.mlp.experts.{param}", int(expert) if part is None else (int(expert), part)

    def checkpoint_name(self, target: str, shard: ShardId) -> Optional[str]:
        """The checkpoint tensor that fills shard `shard` of our parameter `target` (the inverse of `target`)."""
        for ours, theirs in ((".mlp.experts.w13_weight", None), (".mlp.experts.w2_weight", self.down)):
            if target.endswith(ours) and shard is not None:
                expert, part = shard if isinstance(shard, tuple) else (shard, None)
                projection = theirs or (self.gate, self.up)[part]
                return f"{target[:-len(ours)]}.{self.module}.experts.{expert}.{projection}.weight"
        if target.endswith(".mlp.gate.weight"):
            return f"{target[:-len('.mlp.gate.weight')]}.{self.module}.gate.weight"
        return None


class ReplicatedGate(nn.Module):
    """A small unquantised [out, in] projection kept whole (the router, Qwen2-MoE's shared-expert gate)."""

    def __init__(self, in_features: int, out_features: int, dtype: torch.dtype):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(out_features, in_features, dtype=dtype), requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight)


def select_experts_impl(device: torch.device) -> ExpertsImpl:
    """The Triton grouped GEMM on CUDA (a CUDA torch build ships triton; a broken one is refused, not run
    unfused through host syncs that CUDA graphs cannot capture); the torch path elsewhere."""
    if device.type != "cuda":
        return fused_experts_torch
    try:
        from llmctl.engine.kernels.triton.fused_moe import fused_experts_triton
    except Exception as exc:  # noqa: BLE001 - a missing or broken triton build
        raise ModelLoadError(f"mixture-of-experts models on CUDA need triton, which does not import: {exc}") from None
    return fused_experts_triton


class FusedMoE(nn.Module):
    """The routed experts of one layer: forward(hidden [tokens, H], router logits [tokens, E]) -> [tokens, H].
    With expert parallelism it holds `experts` only (global ids, a contiguous block): the checkpoint's other
    experts are skipped at loading, and its forward is this rank's partial sum (the caller all-reduces)."""

    def __init__(self, num_experts: int, top_k: int, hidden_size: int, intermediate_size: int, renormalize: bool,
                 dtype: torch.dtype, silu_and_mul: Callable[[torch.Tensor], torch.Tensor],
                 experts: Optional[range] = None):
        super().__init__()
        self.top_k, self.renormalize, self.intermediate_size = top_k, renormalize, intermediate_size
        self.silu_and_mul = silu_and_mul
        self.num_experts = num_experts
        self.experts = experts = range(num_experts) if experts is None else experts
        local = len(experts)
        new_parameter(self, "w13_weight", torch.empty(local, 2 * intermediate_size, hidden_size, dtype=dtype),
                      self._load_w13, shard_ids=tuple((e, part) for e in experts for part in (0, 1)))
        new_parameter(self, "w2_weight", torch.empty(local, hidden_size, intermediate_size, dtype=dtype),
                      self._load_w2, shard_ids=tuple(experts))
        self.impl = select_experts_impl(self.w13_weight.device)

    def _load_w13(self, param: nn.Parameter, loaded: torch.Tensor, shard_id: ShardId) -> None:
        expert, part = shard_id
        if expert in self.experts:  # another rank's expert otherwise
            size = self.intermediate_size
            copy_checked(param.data[expert - self.experts.start, part * size:(part + 1) * size], loaded)

    def _load_w2(self, param: nn.Parameter, loaded: torch.Tensor, shard_id: ShardId) -> None:
        if shard_id in self.experts:
            copy_checked(param.data[shard_id - self.experts.start], loaded)

    def local_expert_ids(self, ids: torch.Tensor) -> torch.Tensor:
        """Global expert ids -> this rank's indices, a pair whose expert another rank holds marked with the
        number of local experts (which the experts' implementations skip); no host sync (CUDA graphs)."""
        if len(self.experts) == self.num_experts:
            return ids
        local = ids - self.experts.start
        return torch.where((local >= 0) & (local < len(self.experts)), local, len(self.experts))

    def forward(self, hidden: torch.Tensor, router_logits: torch.Tensor) -> torch.Tensor:
        weights, ids = select_experts(router_logits, self.top_k, self.renormalize, hidden.dtype)
        return self.impl(hidden, self.w13_weight, self.w2_weight, weights, self.local_expert_ids(ids),
                         self.silu_and_mul)

    def extra_repr(self) -> str:
        _, inter2, hidden = self.w13_weight.shape
        held = f"{self.experts.start}-{self.experts.stop - 1} of {self.num_experts}"
        return f"experts={held}, top_k={self.top_k}, hidden={hidden}, intermediate={inter2 // 2}"
