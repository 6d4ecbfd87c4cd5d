"""flash-attn 2's paged kernels (CUDA only): one varlen call over the whole mixed batch.

The kernel takes every row shape alike (bottom-right aligned causal masks): 1-token decodes, prefill
chunks after a cached prefix and k+1-token verify rows go through the same call. Nothing is kept
between steps; the block tables are still built from the lists each step (not the runner's persistent device
table, which the Triton backend reads).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch

from llmctl.engine.errors import EngineArgsError
from llmctl.engine.layers.attention.common import CommonAttentionMetadata, TokenMajorStateless
from llmctl.engine.layers.attention.paged import write_token_major


@dataclass
class FlashAttentionMetadata:
    slot_mapping: torch.Tensor  # [num_tokens] int64
    cu_seqlens_q: torch.Tensor  # [rows + 1] int32: where each row's queries start
    cu_seqlens_k: torch.Tensor  # [rows + 1] int32: where each row's keys would start, packed
    block_tables: torch.Tensor  # [rows, widest table] int32 (padded with 0)
    max_seqlen_q: int
    max_seqlen_k: int


class FlashAttention(TokenMajorStateless):
    """flash-attn 2 paged kernels on a token-major pool, [num_blocks, block_size, kv_heads, head_dim]."""

    name = "flash-attn"
    preferred_block_size = 256
    supports_full_graphs = False  # its decode metadata follows each step's contexts

    def __init__(self, num_heads: int, num_kv_heads: int, head_dim: int, sliding_window: Optional[int],
                 dtype: torch.dtype, kernels=None, scale: Optional[float] = None, softcap: Optional[float] = None):
        import inspect

        from flash_attn import flash_attn_varlen_func

        if softcap is not None and "softcap" not in inspect.signature(flash_attn_varlen_func).parameters:
            raise EngineArgsError("--attention-backend flash-attn: the installed flash-attn has no attention logit "
                                  "soft-capping (softcap, 2.6+), which this model needs; use triton or torch")
        self._varlen = flash_attn_varlen_func
        self._extra = {} if softcap is None else {"softcap": softcap}
        self.num_kv_heads, self.head_dim = num_kv_heads, head_dim
        self.scale = scale or head_dim ** -0.5
        self.window = sliding_window

    @property
    def label(self) -> str:
        return self.name

    def validate_block_size(self, block_size: int) -> Optional[str]:
        if block_size % 256:
            return f"flash-attn's paged KV cache needs a block size that is a multiple of 256, got {block_size}"
        return None

    def build_metadata(self, batch: CommonAttentionMetadata) -> FlashAttentionMetadata:
        q_lens, k_lens = batch.query_lens, batch.context_lens
        width = max(len(table) for table in batch.block_tables)
        tables = [table + [0] * (width - len(table)) for table in batch.block_tables]
        as_int32 = dict(dtype=torch.int32, device=batch.device)
        return FlashAttentionMetadata(
            slot_mapping=batch.slot_mapping,
            cu_seqlens_q=torch.tensor([0] + q_lens, **as_int32).cumsum(0, dtype=torch.int32),
            cu_seqlens_k=torch.tensor([0] + k_lens, **as_int32).cumsum(0, dtype=torch.int32),
            block_tables=torch.tensor(tables, **as_int32),
            max_seqlen_q=max(q_lens), max_seqlen_k=max(k_lens))

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor,
                v_cache: torch.Tensor, meta: FlashAttentionMetadata, window: Optional[int] = None) -> torch.Tensor:
        """`window`: this layer's sliding window; None: the backend's own (None where the model's layers mix)."""
        window = self.window if window is None else window
        write_token_major(k_cache, v_cache, k, v, meta.slot_mapping)
        return self._varlen(
            q, k_cache, v_cache,
            cu_seqlens_q=meta.cu_seqlens_q, cu_seqlens_k=meta.cu_seqlens_k,
            max_seqlen_q=meta.max_seqlen_q, max_seqlen_k=meta.max_seqlen_k,
            softmax_scale=self.scale, causal=True, window_size=(window - 1, 0) if window else (-1, -1),
            block_table=meta.block_tables, **self._extra,
        )
