"""What every attention backend shares: the batch description the runner hands over, and the protocol.

The runner flattens a scheduled batch into token ids, positions, slot mapping and logits indices, and
describes its rows once (`CommonAttentionMetadata`); each backend's `build_metadata` turns that into
its own metadata (vLLM v1's CommonAttentionMetadata -> AttentionMetadataBuilder split), built once per
step and read by every layer's `forward`.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Optional, Protocol

import torch

if TYPE_CHECKING:
    from llmctl.engine.block_table import BlockTableRows
    from llmctl.engine.kernels import CpuKernels


@dataclass
class CommonAttentionMetadata:
    """One step's batch, rows in batch order (the runner puts rows of one query token first).

    A row is one sequence's query tokens this step: `query_lens[i]` new tokens on top of
    `context_lens[i] - query_lens[i]` already in the pool, so row i attends to `context_lens[i]` keys.
    A row of several query tokens on an existing context (a prefill chunk after a cached prefix, or a
    speculative verify row of k+1 tokens) takes the prefill-with-context path of a backend, except that
    the native CPU attention kernel takes every short row (decodes and verify rows alike); the other
    decode fast paths (kept decode K/V, CUDA graphs) serve only 1-token rows.
    """

    seq_ids: list[int]
    query_lens: list[int]
    context_lens: list[int]  # keys each row attends to: tokens already computed + its query tokens
    block_tables: list[list[int]]  # each row's KV blocks (may hold more blocks than its context needs)
    slot_mapping: torch.Tensor  # [num_tokens] int64: where each new token's K/V goes in the pool
    block_size: int
    micro_batch: int = 0  # pipeline parallelism: the micro-batch slot (state kept per slot)
    # the rows' rows in the runner's persistent device block table, for a backend that reads it (None: use the lists)
    table_rows: Optional[BlockTableRows] = None
    num_single: int = field(init=False)  # the leading rows of one query token

    def __post_init__(self) -> None:
        single = 0
        for length in self.query_lens:
            if length != 1:
                break
            single += 1
        self.num_single = single

    @property
    def num_rows(self) -> int:
        return len(self.query_lens)

    @property
    def device(self) -> torch.device:
        return self.slot_mapping.device

    @property
    def decode_only(self) -> bool:
        """Every row is one query token (what CUDA decode graphs replay)."""
        return 0 < self.num_single == self.num_rows


class AttentionBackend(Protocol):
    """Paged attention behind one interface; the runner never asks which backend it holds.

    Built with `(num_heads, num_kv_heads, head_dim, sliding_window, dtype=..., kernels=..., scale=..., softcap=...)`:
    `kernels` are the native CPU kernels or None; a backend uses what of them fits the model. `sliding_window`
    is the model-wide window (None where the layers mix: each layer then passes its own to `forward`); `scale`
    the score scale (None: head_dim ** -0.5); `softcap` Gemma 2's attention logit cap (a backend that cannot
    apply it refuses the model with an `EngineArgsError`).
    """

    name: str
    preferred_block_size: int
    # Whether a whole decode step, attention included, may be captured as one CUDA graph: the backend then has
    # `static_decode_metadata(rows, max_context_len, block_size, device)` and `fill_decode_metadata(meta, batch)`.
    supports_full_graphs: bool
    # Whether the backend reads its block tables from the runner's persistent device table (`table_rows`); the
    # runner keeps that table only for such a backend, the others build theirs from the lists each step.
    uses_persistent_block_table: bool
    # Kept decode K/V the backend may hold between steps, as a share of the pool's bytes (reserved
    # next to the pool when a device memory budget applies).
    workspace_share: float

    @property
    def label(self) -> str:
        """The backend as the start-up log names it (with the decode path it uses)."""

    def validate_block_size(self, block_size: int) -> Optional[str]:
        """Why this block size cannot work, or None."""

    def native_decode_kernels(self) -> Optional[CpuKernels]:
        """The native CPU kernels whose paged attention runs this backend's short rows on its own pool, or None.
        The runner binds the model's whole few-token step as one native call only when these are its kernels."""

    def kv_cache_shape(self, num_blocks: int, block_size: int) -> tuple[int, ...]:
        """The shape of one layer's K (and of its V) pool: the KV layout."""

    def set_workspace_budget(self, tokens: int, micro_batches: int = 1) -> None:
        """Cap the kept decode K/V at `tokens` tokens (all rows and layers together), shared by `micro_batches`
        pipeline micro-batches that each keep their own."""

    def build_metadata(self, batch: CommonAttentionMetadata) -> Any:
        """This backend's metadata for the step, shared by every layer."""

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor,
                v_cache: torch.Tensor, meta: Any, window: Optional[int] = None) -> torch.Tensor:
        """Write the step's K/V into the pool, then attend: [tokens, heads, head_dim] out. `window`: this layer's
        sliding window (None: the backend's `sliding_window`)."""

    def truncate(self, seq_id: int, num_tokens: int) -> None:
        """Only the first `num_tokens` of the sequence's K/V still hold (rejected tokens rolled back):
        forget whatever the backend kept past them."""

    def release(self) -> None:
        """Drop everything kept between steps (idle engine, a failed or out-of-memory step)."""


class TokenMajorStateless:
    """For a backend on a token-major pool, [num_blocks, block_size, kv_heads, head_dim], that keeps nothing
    between steps (needs `num_kv_heads` and `head_dim` attributes)."""

    workspace_share = 0.0
    uses_persistent_block_table = False
    num_kv_heads: int
    head_dim: int

    def native_decode_kernels(self) -> None:
        """GPU kernels only: no native CPU decode step."""
        return None

    def kv_cache_shape(self, num_blocks: int, block_size: int) -> tuple[int, ...]:
        return (num_blocks, block_size, self.num_kv_heads, self.head_dim)

    def set_workspace_budget(self, tokens: int, micro_batches: int = 1) -> None:
        """Nothing is kept between steps."""

    def truncate(self, seq_id: int, num_tokens: int) -> None:
        """Nothing is kept between steps."""

    def release(self) -> None:
        """Nothing is kept between steps."""
