"""Mixture-of-experts members of the Llama family (Mixtral, Qwen2-MoE, Qwen3-MoE): llama.py's attention and
decoder structure with the MLP of each sparse layer (`MoEConfig.sparse_layers`) a `SparseMoeBlock`: the router,
the fused experts (engine/layers/fused_moe/) and Qwen2-MoE's shared expert scaled by its sigmoid gate.
Dense layers (Qwen's `mlp_only_layers`, `decoder_sparse_step`) keep llama.py's MLP. With tensor parallelism
attention, dense MLPs and the shared expert are sharded as in llama.py; the experts split their intermediate size
over the ranks, or with expert parallelism (`TensorParallel.expert_parallel`) each rank holds whole experts
(`expert_range`); the experts' partial sums are all-reduced once. With experts dealt over data-parallel replicas
too (`TensorParallel.data_parallel`) each sparse layer first gathers every replica's tokens and hands each one
back its rows' sums (`ExpertDataParallel`), and a replica with nothing to run still runs those exchanges
(`idle_step`). The native CPU decode step does not cover experts, so every step runs `forward`."""

from __future__ import annotations

import dataclasses
from typing import Optional

import torch
from torch import nn

from llmctl.engine.layers.fused_moe import CHECKPOINT_EXPERT_NAMES, FusedMoE, ReplicatedGate
from llmctl.engine.layers.fused_ops import LayerOps
from llmctl.engine.layers.linear import LinearFactory
from llmctl.engine.model_config import ModelConfig
from llmctl.engine.models.llama import MLP, LlamaForCausalLM


class SparseMoeBlock(nn.Module):
    def __init__(self, config: ModelConfig, linears: LinearFactory, ops: LayerOps):
        super().__init__()
        moe = config.moe
        self.tp = linears.tp
        self.gate = ReplicatedGate(config.hidden_size, moe.num_experts, linears.dtype)
        self.experts = FusedMoE(moe.num_experts, moe.top_k, config.hidden_size, moe.intermediate_size,
                                moe.renormalize, linears, ops.silu_and_mul)
        self.shared_expert: Optional[MLP] = None
        if moe.shared_expert_intermediate_size:
            self.shared_expert = MLP(config, linears, ops, size=moe.shared_expert_intermediate_size)
            self.shared_expert_gate = ReplicatedGate(config.hidden_size, 1, linears.dtype)

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        out = self.tp.all_reduce(self.routed(hidden))  # each rank: its experts' pairs
        if self.shared_expert is not None:
            out = out + torch.sigmoid(self.shared_expert_gate(hidden)) * self.shared_expert(hidden)
        return out


    def routed(self, hidden: torch.Tensor) -> torch.Tensor:
        """This rank's experts' partial sums for `hidden`'s tokens; across data-parallel replicas they also run
        the other replicas' tokens, and the replicas' sums of these rows come back."""
        dp = self.tp.data_parallel
        if dp is None:
            return self.experts(hidden, self.gate(hidden))
        tokens = dp.dispatch(hidden)
        return dp.combine(self.experts(tokens, self.gate(tokens)))

    def idle(self) -> None:
        """A replica with no tokens in this step: its experts still run the other replicas' tokens."""
        self.routed(self.gate.weight.new_empty((0, self.gate.weight.shape[1])))


class MoEForCausalLM(LlamaForCausalLM):
    """`LlamaForCausalLM` whose sparse layers' MLP is a `SparseMoeBlock`; `expert_names` tells the loader where
    each per-expert checkpoint tensor lands (in the fused or the per-expert form, as the experts were built).
    `eager_reason`: why decode steps cannot be captured in CUDA graphs (None: they can)."""

    expert_names = CHECKPOINT_EXPERT_NAMES["Qwen2MoeForCausalLM"]

    def __init__(self, config: ModelConfig, max_positions: int, **kwargs):
        super().__init__(config, max_positions, **kwargs)
        per_expert = any(isinstance(m, FusedMoE) and m.per_expert for m in self.modules())
        self.expert_names = dataclasses.replace(type(self).expert_names, per_expert=per_expert)
        # grouping tokens by expert on the host syncs with the device, which graph capture forbids
        on_cuda = next(self.parameters()).device.type == "cuda"
        self.eager_reason = ("quantised experts group tokens on the host" if per_expert and on_cuda else
                             "experts across data-parallel replicas exchange token counts on the host"
                             if self.tp.data_parallel is not None and on_cuda else None)

    def forward(self, input_ids: torch.Tensor, *args, **kwargs):
        if self.tp.data_parallel is not None:  # the replicas' token counts, once for every sparse layer
            self.tp.data_parallel.begin_step(input_ids.shape[0])
        return super().forward(input_ids, *args, **kwargs)

    def idle_step(self) -> None:
        """One step without tokens: this stage's sparse layers' exchanges with the data-parallel replicas that
        have tokens (nothing else of the model talks to other replicas)."""
        self.tp.data_parallel.begin_step(0)
        for layer in self.model.stage_layers:
            if isinstance(layer.mlp, SparseMoeBlock):
                layer.mlp.idle()

    def build_mlp(self, index: int, config: ModelConfig, linears: LinearFactory, ops: LayerOps) -> nn.Module:
        if index in config.moe.sparse_layers:
            return SparseMoeBlock(config, linears, ops)
        return MLP(config, linears, ops)

    def native_decode_step(self, kernels, kv_caches: list[torch.Tensor]):
        """None: the native decode stack has no expert kernels, so batch-1 decode runs `forward` (which reads
        only the chosen experts' weights)."""
        return None


class MixtralForCausalLM(MoEForCausalLM):
    expert_names = CHECKPOINT_EXPERT_NAMES["MixtralForCausalLM"]

