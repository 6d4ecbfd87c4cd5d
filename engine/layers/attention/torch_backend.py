"""Paged attention in plain torch (CPU, and the CUDA fallback): head-major pool, kept decode K/V.

Where the native CPU attention kernel serves the model, every row of at most `NATIVE_MAX_QUERY` query
tokens (decodes, speculative verify rows of k+1 tokens, short prefill chunks) runs in one call of it: it
reads each row's K/V where it lies in the pool and computes each query exactly as a one-token decode at
its position, so a verify row's outputs are bitwise those of decoding its tokens one by one. Where the
kernel runs on AMX tiles (bf16), longer rows run on it too, at about SDPA's cost: no value then depends
on how a prompt was chunked or batched, which keeps greedy speculation exact in bf16 mixed batches (the
scheduler chunks prompts differently when verify rows take part of its token budget). Without the kernel,
rows of one query token run batched over the kept decode K/V of `DecodeWorkspace`. Every other row (a
longer prefill chunk, with or without a cached prefix; without the kernel, a verify row too) runs
through SDPA on its own, its context gathered from the pool.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Optional

import torch
import torch.nn.functional as F

from llmctl.engine.layers.attention.common import CommonAttentionMetadata
from llmctl.engine.layers.attention.decode_workspace import WORKSPACE_SHARE, DecodeWorkspace, WorkspacePlan
from llmctl.engine.layers.attention.paged import gather_head_major, write_head_major

# The longest row the native kernel's vector path takes (float32, or bf16 without AMX tiles): it computes
# each query as its own decode, SDPA batches a row's queries into GEMMs and catches up at 12-16 query tokens
# (benchmarks/verify_attention.py --crossover): 8 keeps every verify row of k <= 7 drafts native (exact).
# On AMX tiles a whole prompt's row costs about SDPA's (--prefill), so there every row goes native.
NATIVE_MAX_QUERY = 8


@dataclass
class PrefillSpan:
    """A row of several query tokens: rows [start, start+length) of the batch, attending to `context_len` keys."""

    start: int
    length: int
    context_len: int
    block_table: torch.Tensor  # [num_blocks] int64


@dataclass
class TorchAttentionMetadata:
    slot_mapping: torch.Tensor  # [num_tokens] int64
    num_rows: int
    num_single: int  # the first rows are single-token queries
    prefills: list[PrefillSpan]  # the rows SDPA runs
    native: Any = None  # the native kernel's rows (`PagedRows`), None without the kernel
    # Without the kernel, the leading 1-token rows over the kept decode K/V:
    single_block_tables: Optional[torch.Tensor] = None  # [num_single, blocks of the longest context] int64
    single_context_lens: Optional[torch.Tensor] = None  # [num_single] int64
    single_bias: Optional[torch.Tensor] = None  # [1, num_single, 1, padded context] float32: 0 or -inf
    workspace: Optional[WorkspacePlan] = None
    kept: Optional[DecodeWorkspace] = None  # the micro-batch's kept decode K/V the plan is for
    # the 1-token rows' bias for the windows of layers whose window is not the backend's own, built once a step
    window_biases: dict[Optional[int], torch.Tensor] = field(default_factory=dict)


class TorchAttention:
    """Grouped-query attention in plain torch (softmax in float32). With `softcap` (Gemma 2) the scores are
    capped as cap * tanh(scores / cap) before the mask: every row then runs the explicit score path (SDPA and
    the native CPU kernel have no cap).

    The pool is head-major, [kv_heads, num_blocks, block_size, head_dim], so gathering a batch's
    blocks with one `index_select` yields [kv_heads, batch, context, head_dim], a layout the batched
    matmuls read without another copy (a token-major gather needs a transposing copy that costs
    several times the gather itself on CPU).
    """

    name = "torch"
    preferred_block_size = 16
    supports_full_graphs = False  # its decode metadata follows each step's contexts
    # its CPU paths (the native kernel's int64 tables, per-row spans) build from the lists: no device table to keep
    uses_persistent_block_table = False
    workspace_share = WORKSPACE_SHARE

    def __init__(self, num_heads: int, num_kv_heads: int, head_dim: int, sliding_window: Optional[int],
                 dtype: torch.dtype, kernels=None, scale: Optional[float] = None, softcap: Optional[float] = None):
        self.num_heads, self.num_kv_heads, self.head_dim = num_heads, num_kv_heads, head_dim
        self.group = num_heads // num_kv_heads
        self.scale = scale or head_dim ** -0.5
        self.window = sliding_window
        self.softcap = softcap
        # one kept decode K/V per pipeline micro-batch: each holds only its own sequences' rows
        self.workspaces = [DecodeWorkspace(num_kv_heads, head_dim)]
        # The native CPU kernels, where their decode attention serves this model.
        fits = kernels is not None and softcap is None and kernels.supports_decode(dtype, num_heads, num_kv_heads,
                                                                                   head_dim)
        self.decode_kernel = kernels if fits else None
        # The longest row the kernel takes; None: every row (the tiled path costs about SDPA's time on a prefill chunk).
        tiled = self.decode_kernel is not None and self.decode_kernel.tiled_attention(dtype)
        self.native_max_query: Optional[int] = None if tiled else NATIVE_MAX_QUERY
        # GQA prefill that SDPA's flash kernel cannot take (a mask, or float32) with one K/V head per query
        # head: None = on CUDA.
        self.expand_masked_gqa: Optional[bool] = None

    @property
    def label(self) -> str:
        if self.decode_kernel is None:
            return "torch"
        return "torch (native CPU decode kernel)" if self.native_max_query else "torch (native CPU kernel, every row)"

    def validate_block_size(self, block_size: int) -> Optional[str]:
        return None

    def native_decode_kernels(self):
        """The kernels passed in, where their decode attention fits this model (see `__init__`)."""
        return self.decode_kernel

    def kv_cache_shape(self, num_blocks: int, block_size: int) -> tuple[int, ...]:
        return (self.num_kv_heads, num_blocks, block_size, self.head_dim)

    def set_workspace_budget(self, tokens: int, micro_batches: int = 1) -> None:
        self.workspaces = [DecodeWorkspace(self.num_kv_heads, self.head_dim) for _ in range(micro_batches)]
        for workspace in self.workspaces:
            workspace.budget_tokens = tokens // micro_batches

    def truncate(self, seq_id: int, num_tokens: int) -> None:
        for workspace in self.workspaces:
            workspace.truncate(seq_id, num_tokens)

    def release(self) -> None:
        """Drop the kept decode K/V (the engine calls this when it goes idle)."""
        for workspace in self.workspaces:
            workspace.release()

    @property
    def kept_layers(self) -> int:
        return max(workspace.kept_layers for workspace in self.workspaces)

    # ---- per step ---------------------------------------------------------------------------------
    def build_metadata(self, batch: CommonAttentionMetadata) -> TorchAttentionMetadata:
        """Shared by all layers: the rows the native kernel or the kept decode K/V serve, and one span per
        other row."""
        if self.decode_kernel is not None:
            return self._native_metadata(batch)
        device, n = batch.device, batch.num_single
        spans, row = [], n
        for length, context, table in zip(batch.query_lens[n:], batch.context_lens[n:], batch.block_tables[n:]):
            spans.append(PrefillSpan(row, length, context, torch.tensor(table, dtype=torch.long, device=device)))
            row += length
        lens = batch.context_lens[:n]
        num_blocks = -(-max(lens, default=0) // batch.block_size)
        tables = [table[:num_blocks] + [0] * (num_blocks - len(table[:num_blocks])) for table in batch.block_tables[:n]]
        meta = TorchAttentionMetadata(
            slot_mapping=batch.slot_mapping, num_rows=batch.num_rows, num_single=n, prefills=spans,
            single_block_tables=torch.tensor(tables, dtype=torch.long, device=device).view(n, num_blocks),
            single_context_lens=torch.tensor(lens, dtype=torch.long, device=device))
        if n:
            meta.kept = self.workspaces[batch.micro_batch]
            meta.workspace = meta.kept.plan(batch.seq_ids[:n], lens, meta.single_context_lens,
                                            meta.single_block_tables, batch.block_size)
            meta.single_bias = self._decode_bias(meta.single_context_lens, meta.workspace, self.window)
        return meta

    def _native_metadata(self, batch: CommonAttentionMetadata) -> TorchAttentionMetadata:
        """Rows of up to `native_max_query` tokens (all where it is None) for the native kernel (tables trimmed
        to their longest context), a span for each longer one."""
        device = batch.device
        spans, starts, native = [], [], []
        start = 0
        for i, (length, context, table) in enumerate(zip(batch.query_lens, batch.context_lens, batch.block_tables)):
            if self.native_max_query is None or length <= self.native_max_query:
                native.append(i)
                starts.append(start)
            else:
                spans.append(PrefillSpan(start, length, context, torch.tensor(table, dtype=torch.long, device=device)))
            start += length
        meta = TorchAttentionMetadata(slot_mapping=batch.slot_mapping, num_rows=batch.num_rows,
                                      num_single=batch.num_single, prefills=spans)
        if not native:
            return meta
        lens = [batch.context_lens[i] for i in native]
        num_blocks = -(-max(lens) // batch.block_size)
        tables = [batch.block_tables[i][:num_blocks] for i in native]
        tables = [table + [0] * (num_blocks - len(table)) for table in tables]
        counts = [batch.query_lens[i] for i in native]
        ranges = (None, None)  # a decode-only step: row r is token r
        if batch.num_single != len(native) or len(native) != batch.num_rows:
            ranges = (torch.tensor(starts, dtype=torch.long, device=device),
                      torch.tensor(counts, dtype=torch.long, device=device))
        meta.native = self.decode_kernel.paged_rows(
            torch.tensor(tables, dtype=torch.long, device=device).view(len(native), num_blocks),
            torch.tensor(lens, dtype=torch.long, device=device), batch.block_size, *ranges)
        return meta

    def _decode_bias(self, lens: torch.Tensor, plan: WorkspacePlan, window: Optional[int]) -> torch.Tensor:
        """0 where a 1-token row may attend, -inf elsewhere (past its context, outside the window)."""
        if plan.mode == "slots":  # rows without a sequence this step see one (masked-in) slot
            row_lens = torch.ones(plan.used_rows, dtype=torch.long, device=lens.device)
            row_lens[plan.rows] = lens
        else:
            row_lens = lens
        positions = torch.arange(plan.capacity, device=lens.device)
        hidden = positions >= row_lens.unsqueeze(1)
        if window is not None:
            hidden |= positions <= row_lens.unsqueeze(1) - 1 - window
        bias = torch.zeros(hidden.shape, dtype=torch.float32, device=hidden.device).masked_fill_(hidden, float("-inf"))
        # an add is several times cheaper than masked_fill here; scores are [rows, Hkv, G, L] in
        # "slots" mode and [Hkv, rows, G, L] in "none" mode
        return bias[:, None, None, :] if plan.mode == "slots" else bias[None, :, None, :]

    # ---- per layer --------------------------------------------------------------------------------
    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor,
                v_cache: torch.Tensor, meta: TorchAttentionMetadata, window: Optional[int] = None) -> torch.Tensor:
        """`window`: this layer's sliding window; None: the backend's own (None where the model's layers mix)."""
        window = self.window if window is None else window
        if self.decode_kernel is not None:
            self.decode_kernel.write_kv(k, v, k_cache, v_cache, meta.slot_mapping)
            return self._native(q, k, v, k_cache, v_cache, meta, window)
        write_head_major(k_cache, k, meta.slot_mapping)
        write_head_major(v_cache, v, meta.slot_mapping)
        if not meta.prefills:
            return self._single(q, k, v, k_cache, v_cache, meta, window)
        out = torch.empty_like(q)
        if meta.num_single:
            single = slice(0, meta.num_single)
            out[single] = self._single(q[single], k[single], v[single], k_cache, v_cache, meta, window)
        for span in meta.prefills:
            rows = slice(span.start, span.start + span.length)
            out[rows] = self._prefill(q[rows], k[rows], v[rows], k_cache, v_cache, span, window)
        return out

    def _native(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor,
                v_cache: torch.Tensor, meta: TorchAttentionMetadata, window: Optional[int]) -> torch.Tensor:
        """The native kernel's rows in one call, written in place among the SDPA rows' outputs."""
        out = q.new_empty(q.shape) if meta.prefills or meta.native is None else None
        if meta.native is not None:
            out = self.decode_kernel.paged_attention(q, k_cache, v_cache, meta.native, self.scale, window, out)
        for span in meta.prefills:
            rows = slice(span.start, span.start + span.length)
            out[rows] = self._prefill(q[rows], k[rows], v[rows], k_cache, v_cache, span, window)
        return out

    def _single_bias(self, meta: TorchAttentionMetadata, window: Optional[int]) -> torch.Tensor:
        if window == self.window:
            return meta.single_bias
        if window not in meta.window_biases:
            meta.window_biases[window] = self._decode_bias(meta.single_context_lens, meta.workspace, window)
        return meta.window_biases[window]

    def _single(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor,
                v_cache: torch.Tensor, meta: TorchAttentionMetadata, window: Optional[int]) -> torch.Tensor:
        batch = q.shape[0]
        plan = meta.workspace
        keys, values = meta.kept.keys_and_values(k, v, k_cache, v_cache, plan)
        qg = (q * self.scale).view(batch, self.num_kv_heads, self.group, self.head_dim)
        if plan.mode == "slots":  # place each query at its sequence's workspace row: [rows, Hkv, G, D]
            placed = qg.new_zeros(plan.used_rows, self.num_kv_heads, self.group, self.head_dim)
            qg = placed.index_copy_(0, plan.rows, qg)
        else:  # [Hkv, rows, G, D], the layout of a gather from the head-major pool
            qg = qg.transpose(0, 1).contiguous()
        scores = self._capped(torch.matmul(qg, keys.transpose(-1, -2))) + self._single_bias(meta, window)  # float32
        probs = torch.softmax(scores, dim=-1).to(values.dtype)
        out = torch.matmul(probs, values)
        out = out.index_select(0, plan.rows) if plan.mode == "slots" else out.transpose(0, 1)
        return out.reshape(batch, self.num_heads, self.head_dim)

    def _capped(self, scores: torch.Tensor) -> torch.Tensor:
        return scores if self.softcap is None else torch.tanh(scores / self.softcap) * self.softcap

    def _prefill(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor,
                 v_cache: torch.Tensor, span: PrefillSpan, window: Optional[int]) -> torch.Tensor:
        cached = span.context_len - span.length
        if cached:
            table = span.block_table[: -(-span.context_len // k_cache.shape[2])].unsqueeze(0)
            k = gather_head_major(k_cache, table)[:, 0, : span.context_len]  # [Hkv, L, D]
            v = gather_head_major(v_cache, table)[:, 0, : span.context_len]
        else:
            k, v = k.transpose(0, 1), v.transpose(0, 1)
        mask = None
        if cached or window is not None or self.softcap is not None:
            q_pos = torch.arange(cached, span.context_len, device=q.device).unsqueeze(1)
            k_pos = torch.arange(span.context_len, device=q.device).unsqueeze(0)
            mask = k_pos <= q_pos
            if window is not None:
                mask &= k_pos > q_pos - window
        if self.softcap is not None:
            return self._capped_prefill(q, k, v, mask)
        gqa = self.group > 1
        expand = self.expand_masked_gqa if self.expand_masked_gqa is not None else q.device.type == "cuda"
        if gqa and expand and (mask is not None or q.dtype == torch.float32):
            # On CUDA only SDPA's flash kernel takes enable_gqa, and it takes neither a mask nor float32; the
            # memory-efficient kernel takes both but not enable_gqa. Such a GQA call would fall back to the math
            # kernel, which materialises the [heads, queries, keys] scores in float32 (8 GiB for 32 heads x 2k
            # queries x 32k keys). Query head h reads K/V head h // group: repeat_interleave gives each its own.
            k, v = k.repeat_interleave(self.group, dim=0), v.repeat_interleave(self.group, dim=0)
            gqa = False
        # A batch dimension of one: SDPA's fused kernels (CUDA flash/efficient/cuDNN, the CPU flash kernel)
        # take 4-D inputs only; 3-D ones fall back to the math kernel, which materialises the full
        # [heads, queries, keys] score matrix in float32 and is several times slower.
        out = F.scaled_dot_product_attention(
            q.transpose(0, 1).unsqueeze(0), k.unsqueeze(0), v.unsqueeze(0), attn_mask=mask, is_causal=mask is None,
            scale=self.scale, enable_gqa=gqa,
        )
        return out[0].transpose(0, 1)

    def _capped_prefill(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        """q [queries, heads, D] over k, v [Hkv, keys, D] with capped scores in float32 (SDPA has no cap)."""
        scores = torch.matmul((q * self.scale).transpose(0, 1).unflatten(0, (self.num_kv_heads, self.group)),
                              k.unsqueeze(1).transpose(-1, -2)).float()  # [Hkv, G, queries, keys]
        scores = self._capped(scores).masked_fill_(~mask, float("-inf"))
        out = torch.matmul(torch.softmax(scores, dim=-1).to(v.dtype), v.unsqueeze(1))  # [Hkv, G, queries, D]
        return out.flatten(0, 1).transpose(0, 1)
