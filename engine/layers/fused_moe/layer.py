"""`FusedMoE`: one layer's routed experts, routed with `router.select_experts`, in one of two forms chosen by the
model's linear method:
- full precision: every expert's weights as two fused parameters, w13 [E, 2I, H] ([gate | up] rows, as a dense
  MLP's gate_up_proj) and w2 [E, H, I], applied by the Triton grouped GEMM on CUDA, else by the torch path
  (engine/layers/fused_moe/torch_impl.py);
- quantised (`LinearMethod.quantized`: --quantization int8/int4, GGUF): one merged gate/up linear and one down
  linear per expert, built, loaded and run by that method like a dense MLP's, so each expert's codes stay packed
  on their own and a step runs (and reads) only the experts its tokens chose.
`ExpertNames` maps a checkpoint's `experts.{e}.{projection}` tensors to either form's parameter and shard.
With tensor parallelism each rank keeps its share of every expert's intermediate size (vLLM's layout without
expert parallelism); with expert parallelism it keeps whole experts, a contiguous block of them (the checkpoint's
other experts are skipped at loading). Either way the forward is this rank's partial sum: the caller all-reduces."""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Callable, Optional

import torch
import torch.nn.functional as F
from torch import nn

from llmctl.engine.errors import ModelLoadError
from llmctl.engine.layers.fused_moe.router import select_experts
from llmctl.engine.layers.fused_moe.torch_impl import fused_experts_torch, group_by_expert
from llmctl.engine.layers.linear import (CheckpointSlice, LinearFactory, ShardId, WeightShapeError, copy_checked,
                                        new_parameter)

ExpertsImpl = Callable[..., torch.Tensor]
# the tensor suffixes a per-expert linear loads (GGUF's raw blocks and their type as well as plain weights)
PER_EXPERT_SUFFIXES = ("weight", "qweight", "qweight_type")


@dataclass(frozen=True)
class ExpertNames:
    """A checkpoint's names for one MoE block: its module (`mlp`, Mixtral's `block_sparse_moe`) and each expert's
    gate, up and down projections. Ours: `mlp.gate.weight` (the router) and, fused, `mlp.experts.w13_weight`
    (shards (e, 0) gate, (e, 1) up) and `mlp.experts.w2_weight` (shard e); per expert (`per_expert`),
    `mlp.experts.w13.{e}.<suffix>` (shards 0 gate, 1 up) and `mlp.experts.w2.{e}.<suffix>`."""

    module: str
    gate: str
    up: str
    down: str
    per_expert: bool = False

    def target(self, name: str) -> Optional[tuple[str, ShardId]]:
        """(our parameter, shard id) for checkpoint tensor `name`, or None when it is no expert or router tensor."""
        match = re.match(rf"^(.*)\.{re.escape(self.module)}\.(?:experts\.(\d+)\.(\w+)\.(\w+)|gate\.weight)$", name)
        if match is None:
            return None
        prefix, expert, projection, suffix = match.groups()
        if expert is None:
            return f"{prefix}.mlp.gate.weight", None
        shards = {self.gate: ("w13", 0), self.up: ("w13", 1), self.down: ("w2", None)}
        if projection not in shards or suffix not in (PER_EXPERT_SUFFIXES if self.per_expert else ("weight",)):
            return None
        param, part = shards[projection]
        if self.per_expert:
            return f"{prefix}.mlp.experts.{param}.{expert}.{suffix}", part
        return f"{prefix}.mlp.experts.{param}_weight", int(expert) if part is None else (int(expert), part)

    def checkpoint_name(self, target: str, shard: ShardId) -> Optional[str]:
        """The checkpoint tensor that fills shard `shard` of our parameter `target` (the inverse of `target`)."""
        match = re.match(r"^(.*)\.mlp\.(?:experts\.(w13|w2)(?:_weight|\.(\d+)\.(\w+))|gate\.weight)$", target)
        if match is None:
            return None
        prefix, param, expert, suffix = match.groups()
        if param is None:
            return f"{prefix}.{self.module}.gate.weight"
        if expert is None:  # fused: the shard names the expert
            if shard is None:
                return None
            expert, part = shard if isinstance(shard, tuple) else (shard, None)
            suffix = "weight"
        else:
            part = shard
        projection = self.down if param == "w2" else (self.gate, self.up)[part]
        return f"{prefix}.{self.module}.experts.{expert}.{projection}.{suffix}"


QWEN_EXPERT_NAMES = ExpertNames("mlp", "gate_proj", "up_proj", "down_proj")
# each mixture-of-experts architecture's checkpoint names (the models' and the GGUF loader's one source)
CHECKPOINT_EXPERT_NAMES = {"MixtralForCausalLM": ExpertNames("block_sparse_moe", "w1", "w3", "w2"),
                           "Qwen2MoeForCausalLM": QWEN_EXPERT_NAMES, "Qwen3MoeForCausalLM": QWEN_EXPERT_NAMES}


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
    """The routed experts of one layer: forward(hidden [tokens, H], router logits [tokens, E]) -> [tokens, H],
    this rank's partial sum."""

    def __init__(self, num_experts: int, top_k: int, hidden_size: int, intermediate_size: int, renormalize: bool,
                 linears: LinearFactory, silu_and_mul: Callable[[torch.Tensor], torch.Tensor]):
        super().__init__()
        self.num_experts, self.top_k, self.renormalize = num_experts, top_k, renormalize
        self.hidden_size, self.silu_and_mul = hidden_size, silu_and_mul
        self.experts = experts = linears.tp.expert_range(num_experts)  # global ids this rank holds
        start, local = ((0, intermediate_size) if linears.tp.expert_parallel
                        else linears.tp.partition(intermediate_size, "the experts' intermediate size"))
        self.expert_part = CheckpointSlice(intermediate_size, start, local)  # this rank's share of each expert
        self.per_expert = linears.method.quantized
        if self.per_expert:
            if linears.tp.expert_parallel_size > 1:
                raise ModelLoadError("quantised experts (--quantization or a quantised checkpoint) with "
                                     "--enable-expert-parallel are not supported yet; drop one of them")
            self.w13 = nn.ModuleList(linears.merged(hidden_size, [intermediate_size] * 2, False)
                                     for _ in range(num_experts))
            self.w2 = nn.ModuleList(linears.row(intermediate_size, hidden_size, False, reduce_results=False)
                                    for _ in range(num_experts))
            return
        dtype = linears.dtype
        new_parameter(self, "w13_weight", torch.empty(len(experts), 2 * local, hidden_size, dtype=dtype),
                      self._load_w13, shard_ids=tuple((e, part) for e in experts for part in (0, 1)))
        new_parameter(self, "w2_weight", torch.empty(len(experts), hidden_size, local, dtype=dtype),
                      self._load_w2, shard_ids=tuple(experts))
        self.impl = select_experts_impl(self.w13_weight.device)

    def _rank_part(self, loaded: torch.Tensor, dim: int) -> torch.Tensor:
        """This rank's part of one expert's checkpoint tensor, its intermediate dimension `dim` (checked whole)."""
        expected = [self.hidden_size, self.hidden_size]
        expected[dim] = self.expert_part.full
        if tuple(loaded.shape) != tuple(expected):
            raise WeightShapeError(tuple(loaded.shape), tuple(expected))
        return self.expert_part.take(loaded, dim)

    def _load_w13(self, param: nn.Parameter, loaded: torch.Tensor, shard_id: ShardId) -> None:
        expert, part = shard_id
        if expert in self.experts:  # another expert-parallel rank's expert otherwise
            size = self.expert_part.size
            copy_checked(param.data[expert - self.experts.start, part * size:(part + 1) * size],
                         self._rank_part(loaded, 0))

    def _load_w2(self, param: nn.Parameter, loaded: torch.Tensor, shard_id: ShardId) -> None:
        if shard_id in self.experts:
            copy_checked(param.data[shard_id - self.experts.start], self._rank_part(loaded, 1))

    def local_expert_ids(self, ids: torch.Tensor) -> torch.Tensor:
        """Global expert ids -> this rank's indices, a pair whose expert another rank holds marked with the
        number of local experts (which the experts' implementations skip); no host sync (CUDA graphs)."""
        if len(self.experts) == self.num_experts:
            return ids
        local = ids - self.experts.start
        return torch.where((local >= 0) & (local < len(self.experts)), local, len(self.experts))

    def forward(self, hidden: torch.Tensor, router_logits: torch.Tensor) -> torch.Tensor:
        weights, ids = select_experts(router_logits, self.top_k, self.renormalize, hidden.dtype)
        if self.per_expert:
            return self._apply_per_expert(hidden, weights, ids)
        return self.impl(hidden, self.w13_weight, self.w2_weight, weights, self.local_expert_ids(ids),
                         self.silu_and_mul)

    def _apply_per_expert(self, hidden: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        """Each chosen expert's linears on its tokens only (the other experts' weights are not read)."""
        out = torch.zeros_like(hidden)
        for expert, tokens, token_weights in group_by_expert(weights, ids, self.num_experts):
            expert_out = self.w2[expert](self.silu_and_mul(self.w13[expert](hidden[tokens])))
            out.index_add_(0, tokens, expert_out * token_weights[:, None])
        return out

    def extra_repr(self) -> str:
        form = "per-expert linears" if self.per_expert else "fused"
        held = f"{self.experts.start}-{self.experts.stop - 1} of {self.num_experts}"
        return (f"experts={held}, top_k={self.top_k}, hidden={self.hidden_size}, "
                f"intermediate={self.expert_part.size} of {self.expert_part.full}, {form}")
