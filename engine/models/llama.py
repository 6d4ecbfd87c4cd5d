"""The Llama family (Llama, Mistral, Qwen2, Qwen3, Gemma 1) as one module tree driven by `ModelConfig` flags.

Parameter names mirror Hugging Face's except for two fused projections: `qkv_proj` (q, k, v)
and `gate_up_proj` (gate, up); `LlamaForCausalLM.stacked_params` tells the loader which shard of
them each HF tensor fills. Layers are built with their implementation: the linears through a
`LinearFactory` (its `LinearMethod` decides storage, loading, packing and forward), the fused
elementwise ops with one `LayerOps` (engine/layers/fused_ops.py: native CPU kernels, Triton or torch).
With a `TensorParallel` of several ranks the tree holds this rank's shard (engine/parallel.py): its
attention heads and KV heads, its part of the MLP's intermediate size and of the vocabulary; o_proj,
down_proj and the embedding all-reduce, and the logits are gathered from every rank's part of the vocabulary.
"""

from __future__ import annotations

from typing import Iterator, Optional

import torch
from torch import nn

from llmctl.engine.layers.attention import AttentionBackend
from llmctl.engine.layers.embedding import VocabParallelEmbedding
from llmctl.engine.layers.fused_ops import LayerOps, TorchLayerOps
from llmctl.engine.layers.linear import LinearFactory, LinearMethod
from llmctl.engine.layers.rotary import RotaryEmbedding
from llmctl.engine.model_config import ModelConfig
from llmctl.engine.parallel import PipelineParallel, TensorParallel


class RMSNorm(nn.Module):
    """RMSNorm; with `residual`, first adds x into the residual stream and normalises the sum,
    returning (normed, residual) (the residual passed in is consumed: `ops` may update it in place)."""

    def __init__(self, size: int, eps: float, dtype: torch.dtype, ops: LayerOps, offset: float = 0.0):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(size, dtype=dtype), requires_grad=False)
        self.eps = eps
        self.ops = ops
        self.offset = offset  # Gemma scales by (1 + weight)

    @torch.no_grad()
    def process_weights_after_loading(self) -> None:
        """Fold the offset into the weight once (in float32), so every `LayerOps` norm kernel serves it."""
        if self.offset:
            self.weight.copy_((self.weight.float() + self.offset).to(self.weight.dtype))
            self.offset = 0.0

    def forward(self, x: torch.Tensor, residual: Optional[torch.Tensor] = None):
        if residual is None:
            return self.ops.rms_norm(x, self.weight, self.eps)
        return self.ops.add_rms_norm(x, residual, self.weight, self.eps)


def model_norm(config: ModelConfig, size: int, dtype: torch.dtype, ops: LayerOps) -> RMSNorm:
    """An RMSNorm as the model's config defines them (eps, Gemma's weight offset)."""
    return RMSNorm(size, config.rms_norm_eps, dtype, ops, config.norm_weight_offset)


class Attention(nn.Module):
    def __init__(self, config: ModelConfig, linears: LinearFactory, ops: LayerOps, window: Optional[int] = None):
        """`window`: this layer's sliding window (None: full attention)."""
        super().__init__()
        self.window = window
        # this rank's heads (all of them with one rank)
        self.num_heads, self.num_kv_heads = linears.tp.attention_heads(config.num_heads, config.num_kv_heads)
        self.head_dim = config.head_dim
        self.q_size = self.num_heads * self.head_dim
        self.kv_size = self.num_kv_heads * self.head_dim
        self.qkv_proj = linears.qkv(config.hidden_size, config.num_heads * self.head_dim,
                                    config.num_kv_heads * self.head_dim, bias=config.qkv_bias, head_dim=self.head_dim)
        self.o_proj = linears.row(config.num_heads * self.head_dim, config.hidden_size, bias=config.o_bias)
        if config.qk_norm:
            self.q_norm = model_norm(config, self.head_dim, linears.dtype, ops)
            self.k_norm = model_norm(config, self.head_dim, linears.dtype, ops)
        self.qk_norm = config.qk_norm
        self.ops = ops

    def project(self, rope, hidden: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """hidden -> rotated q [tokens, heads, dim], k and v [tokens, kv_heads, dim] (views where possible)."""
        tokens = hidden.shape[0]
        qkv = self.qkv_proj(hidden)
        v = qkv[:, self.q_size + self.kv_size:].view(tokens, self.num_kv_heads, self.head_dim)
        if self.qk_norm:  # Qwen3, Gemma 3: each head normalised, then rotated
            q, k, _ = qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1)
            q = self.q_norm(q.view(tokens, self.num_heads, self.head_dim))
            k = self.k_norm(k.view(tokens, self.num_kv_heads, self.head_dim))
            q = self.ops.rotary(q.view(tokens, self.q_size), self.num_heads, self.head_dim, *rope)
            k = self.ops.rotary(k.view(tokens, self.kv_size), self.num_kv_heads, self.head_dim, *rope)
        else:  # q and k sit side by side in the qkv output: rotate them as one tensor
            qk = self.ops.rotary(qkv, self.num_heads + self.num_kv_heads, self.head_dim, *rope)
            q, k = qk.split([self.num_heads, self.num_kv_heads], dim=1)
        return q, k, v

    def output(self, attended: torch.Tensor) -> torch.Tensor:
        return self.o_proj(attended.reshape(attended.shape[0], self.q_size))


class MLP(nn.Module):
    def __init__(self, config: ModelConfig, linears: LinearFactory, ops: LayerOps, size: Optional[int] = None):
        """`size`: the intermediate size (default config.intermediate_size; a MoE model's shared expert has its own)."""
        super().__init__()
        size = size or config.intermediate_size
        self.gate_up_proj = linears.merged(config.hidden_size, [size, size], bias=config.mlp_bias)
        self.down_proj = linears.row(size, config.hidden_size, bias=config.mlp_bias)
        self.size = self.gate_up_proj.out_features // 2  # this rank's part of the intermediate size
        self.act_and_mul = ops.gelu_tanh_and_mul if config.hidden_act == "gelu_pytorch_tanh" else ops.silu_and_mul

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.act_and_mul(self.gate_up_proj(x)))


class DecoderLayer(nn.Module):
    def __init__(self, config: ModelConfig, linears: LinearFactory, ops: LayerOps, mlp: nn.Module, index: int):
        """`index`: the layer's number in the model (its sliding window where the layers' windows differ)."""
        super().__init__()
        self.input_layernorm = model_norm(config, config.hidden_size, linears.dtype, ops)
        self.self_attn = Attention(config, linears, ops, config.window_of(index))
        self.post_attention_layernorm = model_norm(config, config.hidden_size, linears.dtype, ops)
        self.mlp = mlp

    # The layer is split at attention, the one op whose shapes depend on each sequence's context:
    # CUDA graphs capture the halves around it (see engine/cuda_graphs.py) and attention runs eagerly.
    def pre_attention(self, rope, hidden: torch.Tensor, residual: Optional[torch.Tensor]):
        """`hidden` is the previous layer's MLP output and `residual` the stream before it (None at the
        first layer, whose `hidden` is the embeddings). Returns q, k, v and the residual stream; the
        adds are those of `h + f(norm(h))`, arranged so that each fuses with the norm after it."""
        if residual is None:
            residual, hidden = hidden, self.input_layernorm(hidden)
        else:
            hidden, residual = self.input_layernorm(hidden, residual)
        return (*self.self_attn.project(rope, hidden), residual)

    def post_attention(self, attended: torch.Tensor, residual: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        hidden, residual = self.post_attention_layernorm(self.self_attn.output(attended), residual)
        return self.mlp(hidden), residual


class LlamaModel(nn.Module):
    """With pipeline stages, this stage's part: its decoder layers (the others are placeholders, so parameter
    names keep the checkpoint's layer numbers), the embedding on the first stage (and on the last when the
    lm_head is tied to it), the final norm on the last. `build_layer(index, config, linears, ops)`: a decoder
    layer. Gemma 3's sliding layers rotate with their own RoPE base (`local_rotary`)."""

    def __init__(self, config: ModelConfig, max_positions: int, linears: LinearFactory, ops: LayerOps, build_layer,
                 pp: PipelineParallel = PipelineParallel()):
        super().__init__()
        has_embedding = pp.is_first or (pp.is_last and config.tie_word_embeddings)
        self.embed_tokens = VocabParallelEmbedding(config.vocab_size, config.hidden_size, linears.dtype,
                                                   linears.tp) if has_embedding else None
        stage_layers = pp.layer_range(config.num_layers)
        self.layers = nn.ModuleList(build_layer(i, config, linears, ops) if i in stage_layers else nn.Identity()
                                    for i in range(config.num_layers))
        self.stage_layers = [self.layers[i] for i in stage_layers]
        self.norm = model_norm(config, config.hidden_size, linears.dtype, ops) if pp.is_last else None
        self.rotary = RotaryEmbedding(config.head_dim, max_positions, config.rope_theta, config.rope_scaling)
        self.local_rotary = None if config.local_rope_theta is None else \
            RotaryEmbedding(config.head_dim, max_positions, config.local_rope_theta, None)


class LlamaForCausalLM(nn.Module):
    """Forward over a flattened batch; logits only for the rows that will be sampled. Built on the current
    device (`with torch.device(...)`) with parameters of `dtype`, uninitialised until loaded."""

    # HF name fragment -> (our fused parameter fragment, shard id in that layer)
    stacked_params = {
        "q_proj": ("qkv_proj", "q"),
        "k_proj": ("qkv_proj", "k"),
        "v_proj": ("qkv_proj", "v"),
        "gate_proj": ("gate_up_proj", 0),
        "up_proj": ("gate_up_proj", 1),
    }

    def __init__(self, config: ModelConfig, max_positions: int, *, dtype: torch.dtype, linear_method: LinearMethod,
                 ops: Optional[LayerOps] = None, lm_head_method: Optional[LinearMethod] = None,
                 tp: TensorParallel = TensorParallel.single(), pp: PipelineParallel = PipelineParallel()):
        """`ops`: the layers' elementwise ops (`select_layer_ops`; None: torch's). `lm_head_method`: the output
        projection's own method (a checkpoint that quantised only the decoder layers); None: `linear_method`."""
        super().__init__()
        self.config = config
        self.tp = tp
        self.pp = pp
        self.ops = ops or TorchLayerOps()
        linears = LinearFactory(linear_method, dtype, tp)
        self.model = LlamaModel(config, max_positions, linears, self.ops, self.build_layer, pp)
        heads = LinearFactory(lm_head_method or linear_method, dtype, tp)
        if not pp.is_last:
            self.lm_head = None
        elif config.tie_word_embeddings:
            self.lm_head = heads.tied(self.model.embed_tokens.weight)
        else:
            self.lm_head = heads.vocab_column(config.hidden_size, config.vocab_size)

    def build_layer(self, index: int, config: ModelConfig, linears: LinearFactory, ops: LayerOps) -> nn.Module:
        """Decoder layer `index` (Gemma 2/3's subclass returns its layer with more norms)."""
        return DecoderLayer(config, linears, ops, self.build_mlp(index, config, linears, ops), index)

    def build_mlp(self, index: int, config: ModelConfig, linears: LinearFactory, ops: LayerOps) -> nn.Module:
        """Decoder layer `index`'s MLP (a mixture-of-experts model's subclass returns its MoE block)."""
        return MLP(config, linears, ops)

    def checkpoint_tensors(self, name: str, tensor: torch.Tensor) -> Iterator[tuple[str, torch.Tensor]]:
        """The checkpoint's tensor as the (HF name, tensor) pairs the loader maps (an architecture whose
        checkpoints fuse projections splits them)."""
        yield name, tensor

    def embed(self, input_ids: torch.Tensor, positions: torch.Tensor):
        """Token embeddings and this step's RoPE cos/sin rows."""
        hidden = self.model.embed_tokens(input_ids)
        if self.config.embedding_multiplier is not None:  # Gemma: the multiplier rounded to the model dtype first
            hidden = hidden * torch.tensor(self.config.embedding_multiplier, dtype=hidden.dtype)
        return hidden, self.rope_tables(positions, hidden.dtype)

    def rope_tables(self, positions: torch.Tensor, dtype: torch.dtype):
        """This step's RoPE cos/sin rows, as the decoder layers take them."""
        return self.model.rotary.tables(positions, dtype)

    def final_hidden(self, hidden: torch.Tensor, residual: torch.Tensor) -> torch.Tensor:
        """The last layer's output after the final norm (what the lm_head reads, and what embeddings pool)."""
        return self.model.norm(hidden, residual)[0]

    def logits(self, hidden: torch.Tensor, residual: torch.Tensor) -> torch.Tensor:
        logits = self.lm_head(self.final_hidden(hidden, residual))
        if not self.tp.is_single:  # every rank's vocabulary part, less the padding (vocab / size x dtype per row)
            logits = self.tp.all_gather(logits, dim=-1)[:, : self.config.vocab_size]
        return logits.float()

    def native_decode_step(self, kernels, kv_caches: list[torch.Tensor]):
        """This model's batch-1 decode step (one sequence, one new token) as one native call on its
        operands (`CpuKernels.decode_stack`; logits bitwise `forward`'s), where every op of that step
        already runs a native CPU kernel here: bfloat16, one rank, every linear's one-row forward a native kernel
        (the bf16 GEMV, the AMX kernel or the quantised GEMV, mixed as the layers have them), the native decode
        attention, no q/k norm (Qwen3), one sliding window (or none) for every layer. None elsewhere (`forward` runs)."""
        config, layers = self.config, self.model.layers
        if kernels is None or self.ops.kernels is not kernels or not self.tp.is_single or not self.pp.is_single \
                or config.qk_norm or config.hidden_act == "gelu_pytorch_tanh" \
                or config.embedding_multiplier is not None or config.layer_windows \
                or config.attention_scale is not None \
                or self.model.embed_tokens.weight.dtype != torch.bfloat16 \
                or not kernels.supports_decode(torch.bfloat16, config.num_heads, config.num_kv_heads, config.head_dim):
            return None
        norms = [self.model.norm] + [n for layer in layers for n in (layer.input_layernorm, layer.post_attention_layernorm)]
        if any(n.eps != config.rms_norm_eps for n in norms):
            return None
        linears = [self.lm_head] + [linear for layer in layers for linear in
                                    (layer.self_attn.qkv_proj, layer.self_attn.o_proj, layer.mlp.gate_up_proj,
                                     layer.mlp.down_proj)]
        operands = {id(linear): linear.method.native_row_operands(linear) for linear in linears}
        if any(found is None for found in operands.values()):
            return None
        lm_head_kind, lm_head, lm_head_bias = operands.pop(id(self.lm_head))
        if lm_head_bias is not None:
            return None
        stack = []
        for layer, kv_cache in zip(layers, kv_caches):
            parts = {"input_norm": layer.input_layernorm.weight, "post_norm": layer.post_attention_layernorm.weight,
                     "k_pool": kv_cache[0], "v_pool": kv_cache[1]}
            for name, linear in (("qkv", layer.self_attn.qkv_proj), ("o", layer.self_attn.o_proj),
                                 ("gate_up", layer.mlp.gate_up_proj), ("down", layer.mlp.down_proj)):
                kind, operand, parts[f"{name}_bias"] = operands[id(linear)]
                parts[name] = (kind, operand)
            stack.append(parts)
        rotary = self.model.rotary  # bf16 tables: the rows `RotaryEmbedding.tables` converts each step
        return kernels.decode_stack(stack, self.model.embed_tokens.weight, self.model.norm.weight,
                                    (lm_head_kind, lm_head), rotary.cos.to(torch.bfloat16),
                                    rotary.sin.to(torch.bfloat16), num_heads=config.num_heads,
                                    num_kv_heads=config.num_kv_heads, intermediate=layers[0].mlp.size,
                                    eps=config.rms_norm_eps, scale=config.head_dim ** -0.5,
                                    window=config.sliding_window)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, kv_caches: list[torch.Tensor],
                meta, backend: AttentionBackend, logits_indices: torch.Tensor,
                intermediate: Optional[tuple[torch.Tensor, torch.Tensor]] = None,
                pooling_indices: Optional[torch.Tensor] = None):
        """The logits of `logits_indices`' rows; a pipeline stage before the last returns its (hidden, residual)
        instead, and a stage after the first starts from the `intermediate` (hidden, residual) it received.
        `kv_caches`: this stage's layers' pools. With `pooling_indices`: (logits, the float32 final hidden
        states of those rows)."""
        if intermediate is None:
            hidden, rope = self.embed(input_ids, positions)
            residual = None
        else:
            hidden, residual = intermediate
            rope = self.rope_tables(positions, hidden.dtype)
        for layer, kv_cache in zip(self.model.stage_layers, kv_caches):
            q, k, v, residual = layer.pre_attention(rope, hidden, residual)
            attended = backend.forward(q, k, v, kv_cache[0], kv_cache[1], meta, layer.self_attn.window)
            hidden, residual = layer.post_attention(attended, residual)
        if not self.pp.is_last:
            return hidden, residual
        logits = self.logits(hidden[logits_indices], residual[logits_indices])
        if pooling_indices is None:
            return logits
        return logits, self.final_hidden(hidden[pooling_indices], residual[pooling_indices]).float()
