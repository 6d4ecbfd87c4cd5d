"""Gemma 2 and Gemma 3 (text-only): llama.py's tree with a norm after attention and around the MLP, as their
checkpoints name them (input_layernorm, post_attention_layernorm, pre_feedforward_layernorm,
post_feedforward_layernorm), each applied before its residual add. The rest is `ModelConfig` flags that llama.py
and the attention backends read: (1 + weight) norms, embeddings scaled by sqrt(hidden), GeGLU, the score scale
query_pre_attn_scalar ** -0.5, per-layer sliding windows, Gemma 2's attention soft-cap (in the backend) and
Gemma 3's q/k norms and sliding layers' own RoPE base; the final logit soft-cap is applied here."""

from __future__ import annotations

from typing import Optional

import torch
from torch import nn

from llmctl.engine.layers.fused_ops import LayerOps
from llmctl.engine.layers.linear import LinearFactory
from llmctl.engine.model_config import ModelConfig
from llmctl.engine.models.llama import MLP, DecoderLayer, LlamaForCausalLM, model_norm


class GemmaDecoderLayer(DecoderLayer):
    """`h + norm(f(norm(h)))` for attention and the MLP alike; takes the step's (global, local) RoPE tables and
    rotates with the local ones where the layer slides."""

    def __init__(self, config: ModelConfig, linears: LinearFactory, ops: LayerOps, mlp: nn.Module, index: int):
        super().__init__(config, linears, ops, mlp, index)
        self.pre_feedforward_layernorm = model_norm(config, config.hidden_size, linears.dtype, ops)
        self.post_feedforward_layernorm = model_norm(config, config.hidden_size, linears.dtype, ops)

    def pre_attention(self, rope, hidden: torch.Tensor, residual: Optional[torch.Tensor]):
        return super().pre_attention(rope[self.self_attn.window is not None], hidden, residual)

    def post_attention(self, attended: torch.Tensor, residual: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        attended = self.post_attention_layernorm(self.self_attn.output(attended))
        hidden, residual = self.pre_feedforward_layernorm(attended, residual)
        return self.post_feedforward_layernorm(self.mlp(hidden)), residual


class Gemma2ForCausalLM(LlamaForCausalLM):
    def build_layer(self, index: int, config: ModelConfig, linears: LinearFactory, ops: LayerOps) -> nn.Module:
        return GemmaDecoderLayer(config, linears, ops, MLP(config, linears, ops), index)

    def rope_tables(self, positions: torch.Tensor, dtype: torch.dtype):
        """(full layers' tables, sliding layers' tables): the same ones unless the model has a local RoPE base."""
        full = self.model.rotary.tables(positions, dtype)
        local = self.model.local_rotary
        return full, full if local is None else local.tables(positions, dtype)

    def logits(self, hidden: torch.Tensor, residual: torch.Tensor) -> torch.Tensor:
        logits = super().logits(hidden, residual)
        cap = self.config.final_logit_softcapping
        return logits if cap is None else torch.tanh(logits / cap) * cap

    def native_decode_step(self, kernels, kv_caches: list[torch.Tensor]):
        """None: the native decode stack has neither the extra norms nor GeGLU, so every step runs `forward`."""
        return None


class Gemma3ForCausalLM(Gemma2ForCausalLM):
    """Gemma 3's differences (q/k norms, the local RoPE base, no soft-caps) are all `ModelConfig` flags."""
