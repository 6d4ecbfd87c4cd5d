"""The torch backend's kept decode K/V: one workspace row per running sequence, across steps.

Gathering a batch's blocks out of the pool costs about as much as the decode attention matmuls on CPU,
so 1-token rows keep their K/V between steps in a per-layer workspace [rows, kv_heads, capacity,
head_dim]: each sequence owns a row, a step appends its newest token, and only sequences new to the
workspace (or out of step with their row) are gathered from the pool. A sequence missing from a step's
1-token rows (finished, preempted, unscheduled, or in a row of several query tokens) frees its row;
capacity grows two blocks at a time. Over the budget, each layer gathers the batch's blocks into reused
scratch storage and drops them after use.

A row is keyed by sequence id and the number of tokens it holds: it is appended to only when the step's
row is exactly one token longer, so a sequence whose `num_computed_tokens` went down between steps (a
rejected speculative suffix) is gathered again; `truncate` says so explicitly and keeps the valid prefix.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch
import torch.nn.functional as F

from llmctl.engine.layers.attention.paged import gather_head_major

# The kept decode K/V may reach this share of the pool's bytes.
WORKSPACE_SHARE = 0.5


@dataclass
class WorkspacePlan:
    """How this step's 1-token rows get their K/V.

    `slots`: rows of sequences new to the workspace (or out of step with it) are gathered from the pool
    (`fill_*`), then every row's newest token is appended; attention runs over workspace rows
    [0, used_rows). `none`: the batch is over the workspace budget, so each layer gathers the batch's
    blocks (`tables`) and drops them after use.
    """

    mode: str
    capacity: int
    tables: Optional[torch.Tensor] = None  # "none": [rows, capacity // block_size] block ids
    rows: Optional[torch.Tensor] = None  # [num_single] workspace row of each decode row
    used_rows: int = 0
    fill_rows: Optional[torch.Tensor] = None  # rows to (re)gather from the pool
    fill_tables: Optional[torch.Tensor] = None  # [len(fill_rows), capacity // block_size] block ids
    append_index: Optional[torch.Tensor] = None  # flat (row, position) of each decode row's new token
    regrow: Optional[tuple[int, int]] = None  # (rows, capacity) the kept workspaces had before this step


class DecodeWorkspace:
    """Kept decode K/V for every layer (keyed by the layer's pool), planned once per step."""

    def __init__(self, num_kv_heads: int, head_dim: int):
        self.num_kv_heads, self.head_dim = num_kv_heads, head_dim
        self.budget_tokens = 0
        self._workspaces: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}  # pool data_ptr -> (K, V)
        self._scratch: dict[str, torch.Tensor] = {}  # flat storage for "none" mode gathers, reused
        self._slots: dict[int, int] = {}  # seq id -> workspace row
        self._kept_lens: dict[int, int] = {}  # seq id -> tokens its row holds
        self._shape = (0, 0)  # (rows, capacity) of the kept workspaces

    @property
    def kept_layers(self) -> int:
        """How many layers currently keep decode K/V."""
        return len(self._workspaces)

    @property
    def kept_bytes(self) -> int:
        return sum(t.numel() * t.element_size() for pair in self._workspaces.values() for t in pair)

    def kept_tokens(self, seq_id: int) -> Optional[int]:
        """How many tokens the sequence's row holds (None: no row)."""
        return self._kept_lens.get(seq_id)

    def truncate(self, seq_id: int, num_tokens: int) -> None:
        """Only the sequence's first `num_tokens` K/V are still valid: its row keeps at most those (the
        positions past them are masked out until appended again)."""
        kept = self._kept_lens.get(seq_id)
        if kept is not None and kept > num_tokens:
            self._kept_lens[seq_id] = num_tokens

    def release(self) -> None:
        self._workspaces.clear()
        self._scratch.clear()
        self._slots.clear()
        self._kept_lens.clear()
        self._shape = (0, 0)

    def plan(self, seq_ids: list[int], lens: list[int], lens_tensor: torch.Tensor, tables: torch.Tensor,
             block_size: int) -> WorkspacePlan:
        """Plan the step for 1-token rows of `seq_ids` with `lens` keys each ([rows, blocks] `tables`)."""
        num_blocks = tables.shape[1]
        for seq_id in set(self._slots) - set(seq_ids):  # finished, preempted, not a 1-token row: free the row
            del self._slots[seq_id], self._kept_lens[seq_id]
        free = sorted(set(range(len(seq_ids) + len(self._slots))) - set(self._slots.values()))
        for seq_id in seq_ids:
            if seq_id not in self._slots:
                self._slots[seq_id] = free.pop(0)
        rows_needed = max(self._slots.values()) + 1
        old_rows, old_capacity = self._shape
        # Grow by two blocks at a time: a regrow copies the workspace, a larger one is read every step.
        capacity = old_capacity if num_blocks * block_size <= old_capacity else (num_blocks + 1) * block_size
        rows = max(rows_needed, old_rows)
        if rows * capacity > self.budget_tokens:
            self.release()
            return WorkspacePlan("none", num_blocks * block_size, tables=tables)
        device = lens_tensor.device
        row_of = [self._slots[seq_id] for seq_id in seq_ids]
        stale = [i for i, (seq_id, n) in enumerate(zip(seq_ids, lens)) if self._kept_lens.get(seq_id) != n - 1]
        for seq_id, n in zip(seq_ids, lens):
            self._kept_lens[seq_id] = n
        plan = WorkspacePlan("slots", capacity, used_rows=rows_needed,
                             rows=torch.tensor(row_of, dtype=torch.long, device=device),
                             regrow=(old_rows, old_capacity) if (rows, capacity) != self._shape else None)
        heads = torch.arange(self.num_kv_heads, device=device)
        plan.append_index = (((plan.rows * self.num_kv_heads).unsqueeze(1) + heads) * capacity
                             + (lens_tensor - 1).unsqueeze(1)).reshape(-1)
        if stale:
            stale_tables = tables[stale]
            pad = capacity // block_size - num_blocks  # padding blocks are masked out by the bias
            plan.fill_tables = F.pad(stale_tables, (0, pad)) if pad > 0 else stale_tables[:, : capacity // block_size]
            plan.fill_rows = plan.rows[stale]
        self._shape = (rows, capacity)
        if plan.regrow is not None and plan.regrow != (0, 0) and not self._workspaces:
            plan.regrow = None
        return plan

    def keys_and_values(self, k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                        plan: WorkspacePlan) -> tuple[torch.Tensor, torch.Tensor]:
        """This layer's keys and values for the 1-token rows: [used_rows, Hkv, capacity, D] ("slots") or
        [Hkv, rows, capacity, D] ("none")."""
        if plan.mode == "none":
            numel = self.num_kv_heads * plan.tables.numel() * k_cache.shape[2] * self.head_dim
            return (gather_head_major(k_cache, plan.tables, self._scratch_buffer("k", numel, k_cache)),
                    gather_head_major(v_cache, plan.tables, self._scratch_buffer("v", numel, v_cache)))
        keys, values = self._kept(k_cache.data_ptr(), k_cache, plan)
        for kept, cache, new in ((keys, k_cache, k), (values, v_cache, v)):
            if plan.fill_rows is not None:
                kept.index_copy_(0, plan.fill_rows, gather_head_major(cache, plan.fill_tables).transpose(0, 1))
            kept.view(-1, self.head_dim).index_copy_(0, plan.append_index, new.reshape(-1, self.head_dim))
        used = plan.used_rows  # rows first, so the first `used` rows are one contiguous block
        return keys[:used], values[:used]

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

    def _scratch_buffer(self, key: str, numel: int, like: torch.Tensor) -> torch.Tensor:
        """Flat storage kept across steps: fresh multi-MB tensors every step cost page faults."""
        buffer = self._scratch.get(key)
        if buffer is None or buffer.numel() < numel:
            buffer = torch.empty(numel, dtype=like.dtype, device=like.device)
            self._scratch[key] = buffer
        return buffer[:numel]
