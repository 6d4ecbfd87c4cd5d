"""Paged attention over a flattened batch: write new K/V into the block pool, then attend.

The batch holds single-token queries first (decodes, and any 1-token prefill chunk) and then
prefill chunks. `TorchAttention` runs anywhere (CPU and the CUDA fallback); `FlashAttention`
uses flash-attn's paged kernels on CUDA when the package imports.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch
import torch.nn.functional as F


@dataclass
class PrefillSpan:
    """One prefill chunk: rows [start, start+length) of the batch, attending to `context_len` keys."""

    start: int
    length: int
    context_len: int
    block_table: torch.Tensor  # [num_blocks] int64


@dataclass
class AttentionMetadata:
    slot_mapping: torch.Tensor  # [num_tokens] int64: where each new token's K/V goes in the pool
    num_single: int  # the first rows are single-token queries
    single_block_tables: torch.Tensor  # [num_single, max_blocks] int64 (padded with 0)
    single_context_lens: torch.Tensor  # [num_single] int64
    single_max_context: int
    prefills: list[PrefillSpan]
    single_seq_ids: tuple[int, ...] = ()  # which sequences the single-token rows belong to
    # Set once per step by the backend's `prepare` (shared by every layer): torch backend
    single_bias: Optional[torch.Tensor] = None  # [1, num_single, 1, padded context] float32: 0 or -inf
    workspace: Optional["WorkspacePlan"] = None
    # flash-attn (CUDA) views of the same batch; None on the torch backend
    cu_seqlens_q: Optional[torch.Tensor] = None
    cu_seqlens_k: Optional[torch.Tensor] = None
    block_tables: Optional[torch.Tensor] = None
    max_seqlen_q: int = 0
    max_seqlen_k: int = 0


def write_kv_token_major(k_cache: torch.Tensor, v_cache: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                         slot_mapping: torch.Tensor) -> None:
    """Scatter the step's keys/values into a [num_blocks, block_size, kv_heads, head_dim] pool."""
    heads, dim = k_cache.shape[-2:]
    k_cache.view(-1, heads, dim).index_copy_(0, slot_mapping, k)
    v_cache.view(-1, heads, dim).index_copy_(0, slot_mapping, v)


@dataclass
class WorkspacePlan:
    """How this step's decode rows get their K/V.

    `slots`: every running sequence keeps a row of a per-layer workspace [kv_heads, rows, capacity,
    head_dim] across steps. Rows of sequences new to the workspace (or out of step with it) are
    gathered from the pool (`fill_*`), then every row's newest token is appended; attention runs
    over rows [0, used_rows). `none`: the batch is over the workspace budget, so each layer
    gathers the batch's blocks and drops them after use.
    """

    mode: str
    capacity: int
    rows: Optional[torch.Tensor] = None  # [num_single] workspace row of each decode row
    used_rows: int = 0
    fill_rows: Optional[torch.Tensor] = None  # rows to (re)gather from the pool
    fill_tables: Optional[torch.Tensor] = None  # [len(fill_rows), capacity // block_size] block ids
    append_index: Optional[torch.Tensor] = None  # flat (row, position) of each decode row's new token
    regrow: Optional[tuple[int, int]] = None  # (rows, capacity) the kept workspaces had before this step


class TorchAttention:
    """Grouped-query attention in plain torch (softmax in float32).

    The pool is head-major, [kv_heads, num_blocks, block_size, head_dim], so gathering a batch's
    blocks with one `index_select` yields [kv_heads, batch, context, head_dim], a layout the batched
    matmuls read without another copy (a token-major gather needs a transposing copy that costs
    several times the gather itself on CPU).

    Decode rows keep their K/V between steps in a per-layer workspace [rows, kv_heads, capacity,
    head_dim]: each running sequence owns a row, so a step appends one token per row, and only
    sequences new to the batch (or out of step with their row) are gathered from the pool. A
    finished sequence just frees its row; capacity grows two blocks at a time. The gather costs
    about as much as the attention matmuls, so this keeps it off the steady path even while
    requests come and go. `workspace_budget_tokens` (set by the runner) caps the workspace; over
    it, each layer gathers the batch's blocks and drops them after use.

    With `decode_kernel` set (the native CPU kernels, see `llmctl.engine.kernels`), decode rows
    skip all of that: the kernel reads each sequence's K/V where it lies in the pool.
    """

    name = "torch"
    preferred_block_size = 16

    def __init__(self, num_heads: int, num_kv_heads: int, head_dim: int, sliding_window: Optional[int]):
        self.num_heads, self.num_kv_heads, self.head_dim = num_heads, num_kv_heads, head_dim
        self.group = num_heads // num_kv_heads
        self.scale = head_dim ** -0.5
        self.window = sliding_window
        self.workspace_budget_tokens = 0
        self._workspaces: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}  # pool data_ptr -> (K, V)
        self._scratch: dict[str, torch.Tensor] = {}  # flat storage for "none" mode gathers, reused
        self._slots: dict[int, int] = {}  # seq id -> workspace row
        self._kept_lens: dict[int, int] = {}  # seq id -> tokens its row holds
        self._shape = (0, 0)  # (rows, capacity) of the kept workspaces
        self.decode_kernel = None  # CpuKernels, set by the runner where it supports this model
        # GQA prefill that SDPA's flash kernel cannot take (a mask, or float32) with one K/V head per query
        # head: None = on CUDA.
        self.expand_masked_gqa: Optional[bool] = None

    def validate_block_size(self, block_size: int) -> Optional[str]:
        return None

    def kv_cache_shape(self, num_blocks: int, block_size: int) -> tuple[int, ...]:
        return (self.num_kv_heads, num_blocks, block_size, self.head_dim)

    def prepare(self, meta: AttentionMetadata, block_size: int) -> None:
        """Per-step work shared by all layers: trim block tables, plan the workspace, build the mask."""
        if not meta.num_single:
            return
        num_blocks = -(-meta.single_max_context // block_size)
        meta.single_block_tables = meta.single_block_tables[:, :num_blocks].contiguous()
        if self.decode_kernel is not None:
            return
        lens = meta.single_context_lens.tolist()
        meta.workspace = self._plan_workspace(meta, lens, num_blocks, block_size)
        row_lens = meta.single_context_lens
        if meta.workspace.mode == "slots":  # rows without a sequence this step see one (masked-in) slot
            row_lens = torch.ones(meta.workspace.used_rows, dtype=torch.long, device=row_lens.device)
            row_lens[meta.workspace.rows] = meta.single_context_lens
        positions = torch.arange(meta.workspace.capacity, device=row_lens.device)
        hidden = positions >= row_lens.unsqueeze(1)
        if self.window is not None:
            hidden |= positions <= row_lens.unsqueeze(1) - 1 - self.window
        bias = torch.zeros(hidden.shape, dtype=torch.float32, device=hidden.device).masked_fill_(hidden, float("-inf"))
        # an add is several times cheaper than masked_fill here; scores are [rows, Hkv, G, L] in
        # "slots" mode and [Hkv, rows, G, L] in "none" mode
        meta.single_bias = bias[:, None, None, :] if meta.workspace.mode == "slots" else bias[None, :, None, :]

    @property
    def kept_layers(self) -> int:
        """How many layers currently keep decode K/V."""
        return len(self._workspaces)

    def release(self) -> None:
        """Drop the kept decode K/V (the engine calls this when it goes idle)."""
        self._workspaces.clear()
        self._scratch.clear()
        self._slots.clear()
        self._kept_lens.clear()
        self._shape = (0, 0)

    # ---- the decode workspace ---------------------------------------------------------------------
    def _plan_workspace(self, meta: AttentionMetadata, lens: list[int], num_blocks: int,
                        block_size: int) -> WorkspacePlan:
        ids = meta.single_seq_ids
        for seq_id in set(self._slots) - set(ids):  # finished, preempted or not scheduled: free the row
            del self._slots[seq_id], self._kept_lens[seq_id]
        free = sorted(set(range(len(ids) + len(self._slots))) - set(self._slots.values()))
        for seq_id in ids:
            if seq_id not in self._slots:
                self._slots[seq_id] = free.pop(0)
        rows_needed = max(self._slots.values()) + 1
        old_rows, old_capacity = self._shape
        # Grow by two blocks at a time: a regrow copies the workspace, a larger one is read every step.
        capacity = old_capacity if num_blocks * block_size <= old_capacity else (num_blocks + 1) * block_size
        rows = max(rows_needed, old_rows)
        if rows * capacity > self.workspace_budget_tokens:
            self.release()
            return WorkspacePlan("none", num_blocks * block_size)
        device = meta.single_context_lens.device
        row_of = [self._slots[seq_id] for seq_id in ids]
        stale = [i for i, (seq_id, n) in enumerate(zip(ids, lens)) if self._kept_lens.get(seq_id) != n - 1]
        for seq_id, n in zip(ids, lens):
            self._kept_lens[seq_id] = n
        plan = WorkspacePlan("slots", capacity, used_rows=rows_needed,
                             rows=torch.tensor(row_of, dtype=torch.long, device=device),
                             regrow=(old_rows, old_capacity) if (rows, capacity) != self._shape else None)
        heads = torch.arange(self.num_kv_heads, device=device)
        plan.append_index = (((plan.rows * self.num_kv_heads).unsqueeze(1) + heads) * capacity
                             + (meta.single_context_lens - 1).unsqueeze(1)).reshape(-1)
        if stale:
            tables = meta.single_block_tables[stale]
            pad = capacity // block_size - tables.shape[1]  # padding blocks are masked out by the bias
            plan.fill_tables = F.pad(tables, (0, pad)) if pad > 0 else tables[:, : capacity // block_size]
            plan.fill_rows = plan.rows[stale]
        self._shape = (rows, capacity)
        if plan.regrow is not None and plan.regrow != (0, 0) and not self._workspaces:
            plan.regrow = None
        return plan

    def _kept(self, layer: int, like: torch.Tensor, plan: WorkspacePlan) -> tuple[torch.Tensor, torch.Tensor]:
        """This layer's workspace K/V, re-laid out when the row count or capacity grew."""
        rows, capacity = self._shape
        kept = self._workspaces.get(layer)
        if kept is not None and plan.regrow is None:
            return kept
        shape = (rows, self.num_kv_heads, capacity, self.head_dim)
        grown = (torch.zeros(shape, dtype=like.dtype, device=like.device),
                 torch.zeros(shape, dtype=like.dtype, device=like.device))
        if kept is not None:
            old_rows, old_capacity = kept[0].shape[0], kept[0].shape[2]
            for new, old in zip(grown, kept):
                new[:old_rows, :, :old_capacity].copy_(old)
        self._workspaces[layer] = grown
        return grown

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor,
                v_cache: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        if self.decode_kernel is not None:
            self.decode_kernel.write_kv(k, v, k_cache, v_cache, meta.slot_mapping)
        else:
            self._write(k_cache, k, meta.slot_mapping)
            self._write(v_cache, v, meta.slot_mapping)
        if not meta.prefills:
            return self._single(q, k, v, k_cache, v_cache, meta)
        out = torch.empty_like(q)
        if meta.num_single:
            single = slice(0, meta.num_single)
            out[single] = self._single(q[single], k[single], v[single], k_cache, v_cache, meta)
        for span in meta.prefills:
            rows = slice(span.start, span.start + span.length)
            out[rows] = self._prefill(q[rows], k[rows], v[rows], k_cache, v_cache, span)
        return out

    def _write(self, cache: torch.Tensor, new: torch.Tensor, slot_mapping: torch.Tensor) -> None:
        cache.view(self.num_kv_heads, -1, self.head_dim).index_copy_(1, slot_mapping, new.transpose(0, 1))

    def _gather(self, cache: torch.Tensor, tables: torch.Tensor, out: Optional[torch.Tensor] = None) -> torch.Tensor:
        """[kv_heads, rows of tables, blocks x block_size, head_dim] from the blocks in `tables`,
        written into `out` (flat, reused storage) when given.
        Not trimmed to the context length: a trimmed view would make matmul copy it again."""
        heads, blocks, block_size, dim = cache.shape
        # One index_select over (head, block) rows of a 2-D view: about 4x faster on CPU than
        # selecting along the middle dimension of the 3-D pool, which copies element-wise.
        rows = ((torch.arange(heads, device=tables.device) * blocks).unsqueeze(1) + tables.reshape(1, -1)).reshape(-1)
        source = cache.view(heads * blocks, block_size * dim)
        if out is None:
            picked = source.index_select(0, rows)
        else:
            picked = torch.index_select(source, 0, rows, out=out.view(rows.numel(), block_size * dim))
        return picked.view(heads, tables.shape[0], -1, dim)

    def _scratch_buffer(self, key: str, numel: int, like: torch.Tensor) -> torch.Tensor:
        """Flat storage kept across steps: fresh multi-MB tensors every step cost page faults."""
        buffer = self._scratch.get(key)
        if buffer is None or buffer.numel() < numel:
            buffer = torch.empty(numel, dtype=like.dtype, device=like.device)
            self._scratch[key] = buffer
        return buffer[:numel]

    def _decode_kv(self, k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                   meta: AttentionMetadata) -> tuple[torch.Tensor, torch.Tensor]:
        """This layer's [Hkv, rows, L, D] keys and values for the single-token rows."""
        plan = meta.workspace
        if plan.mode == "none":
            numel = self.num_kv_heads * meta.single_block_tables.numel() * k_cache.shape[2] * self.head_dim
            return (self._gather(k_cache, meta.single_block_tables, self._scratch_buffer("k", numel, k_cache)),
                    self._gather(v_cache, meta.single_block_tables, self._scratch_buffer("v", numel, v_cache)))
        keys, values = self._kept(k_cache.data_ptr(), k_cache, plan)
        for kept, cache, new in ((keys, k_cache, k), (values, v_cache, v)):
            if plan.fill_rows is not None:
                kept.index_copy_(0, plan.fill_rows, self._gather(cache, plan.fill_tables).transpose(0, 1))
            kept.view(-1, self.head_dim).index_copy_(0, plan.append_index, new.reshape(-1, self.head_dim))
        used = plan.used_rows  # rows first, so the first `used` rows are one contiguous block
        return keys[:used], values[:used]

    def _single(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor,
                v_cache: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        if self.decode_kernel is not None:
            return self.decode_kernel.paged_decode_attention(q, k_cache, v_cache, meta.single_block_tables,
                                                             meta.single_context_lens, self.scale, self.window)
        batch = q.shape[0]
        keys, values = self._decode_kv(k, v, k_cache, v_cache, meta)
        qg = (q * self.scale).view(batch, self.num_kv_heads, self.group, self.head_dim)
        plan = meta.workspace
        if plan.mode == "slots":  # place each query at its sequence's workspace row: [rows, Hkv, G, D]
            placed = qg.new_zeros(plan.used_rows, self.num_kv_heads, self.group, self.head_dim)
            qg = placed.index_copy_(0, plan.rows, qg)
        else:  # [Hkv, rows, G, D], the layout of a gather from the head-major pool
            qg = qg.transpose(0, 1).contiguous()
        scores = torch.matmul(qg, keys.transpose(-1, -2)) + meta.single_bias  # float32
        probs = torch.softmax(scores, dim=-1).to(values.dtype)
        out = torch.matmul(probs, values)
        out = out.index_select(0, plan.rows) if plan.mode == "slots" else out.transpose(0, 1)
        return out.reshape(batch, self.num_heads, self.head_dim)

    def _prefill(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor,
                 v_cache: torch.Tensor, span: PrefillSpan) -> torch.Tensor:
        cached = span.context_len - span.length
        if cached:
            table = span.block_table[: -(-span.context_len // k_cache.shape[2])].unsqueeze(0)
            k = self._gather(k_cache, table)[:, 0, : span.context_len]  # [Hkv, L, D]
            v = self._gather(v_cache, table)[:, 0, : span.context_len]
        else:
            k, v = k.transpose(0, 1), v.transpose(0, 1)
        mask = None
        if cached or self.window is not None:
            q_pos = torch.arange(cached, span.context_len, device=q.device).unsqueeze(1)
            k_pos = torch.arange(span.context_len, device=q.device).unsqueeze(0)
            mask = k_pos <= q_pos
            if self.window is not None:
                mask &= k_pos > q_pos - self.window
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


class FlashAttention:
    """flash-attn 2 paged kernels (CUDA only): one varlen call over the whole mixed batch."""

    name = "flash-attn"
    preferred_block_size = 256

    def __init__(self, num_heads: int, num_kv_heads: int, head_dim: int, sliding_window: Optional[int]):
        from flash_attn import flash_attn_varlen_func

        self._varlen = flash_attn_varlen_func
        self.num_kv_heads, self.head_dim = num_kv_heads, head_dim
        self.scale = head_dim ** -0.5
        self.window = (sliding_window - 1, 0) if sliding_window else (-1, -1)

    def kv_cache_shape(self, num_blocks: int, block_size: int) -> tuple[int, ...]:
        return (num_blocks, block_size, self.num_kv_heads, self.head_dim)

    def prepare(self, meta: AttentionMetadata, block_size: int) -> None:
        """Nothing to share across layers: the kernel reads cu_seqlens and block tables as they are."""

    def release(self) -> None:
        """Nothing is kept between steps."""

    def validate_block_size(self, block_size: int) -> Optional[str]:
        if block_size % 256:
            return f"flash-attn's paged KV cache needs a block size that is a multiple of 256, got {block_size}"
        return None

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor,
                v_cache: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        write_kv_token_major(k_cache, v_cache, k, v, meta.slot_mapping)
        return self._varlen(
            q, k_cache, v_cache,
            cu_seqlens_q=meta.cu_seqlens_q, cu_seqlens_k=meta.cu_seqlens_k,
            max_seqlen_q=meta.max_seqlen_q, max_seqlen_k=meta.max_seqlen_k,
            softmax_scale=self.scale, causal=True, window_size=self.window, block_table=meta.block_tables,
        )


def select_backend(device: torch.device, dtype: torch.dtype, head_dim: Optional[int] = None):
    """flash-attn on CUDA for 16-bit dtypes when its kernels can run this model, else the torch path."""
    if device.type != "cuda" or dtype not in (torch.float16, torch.bfloat16):
        return TorchAttention
    if torch.cuda.get_device_capability(device) < (8, 0):  # flash-attn 2 has Ampere+ kernels only
        return TorchAttention
    # Over 256 (its largest head dimension) flash-attn has no kernel; below that, a head dimension that is not a
    # multiple of 8 is padded inside flash_attn_varlen_func, i.e. the whole paged K/V pool is copied every call.
    if head_dim is not None and (head_dim > 256 or head_dim % 8):
        return TorchAttention
    try:
        import inspect

        from flash_attn import flash_attn_varlen_func
    except Exception:  # noqa: BLE001 - a broken build (undefined symbol, missing CUDA lib) means "not available"
        return TorchAttention
    # The varlen kernel took a paged KV cache (block_table) only from flash-attn 2.5.x (2024); older builds
    # import fine and would fail at the first forward.
    if "block_table" not in inspect.signature(flash_attn_varlen_func).parameters:
        return TorchAttention
    return FlashAttention
