"""The persistent batch's block tables: one device table whose rows outlive a step (vLLM v1's input batch idea).

`PersistentBlockTable` holds `[max_rows, blocks_per_seq]` int32 on the device, a row per sequence, assigned by
seq id and kept while the sequence keeps being scheduled. Each step it compares every scheduled sequence's block
list with what its row holds and writes only the entries that differ (a new sequence's row, blocks appended
since its last step, a rolled-back or recomputed tail, a reclaimed row's leftovers), staged in pinned memory and
sent in one non-blocking copy that a scatter applies on the device; a decode step that crosses no block boundary
writes nothing. The step then reads its rows through a per-step row index (`BlockTableRows`).

Exactness needs no notice of preemption, aborts, prefix-cache hits or speculative rollbacks: the scheduler's
list is the truth and the row is diffed against it every step. A row whose sequence stopped being scheduled
stays assigned until a new sequence needs a row (least recently scheduled first) or `release` frees them all.
The host record of each row is a Python list: comparing it with the scheduler's list runs at C speed.
"""

from __future__ import annotations

import heapq
from collections import OrderedDict
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class BlockTableRows:
    """One step's view of the persistent table: batch row i reads `table[rows[i]]`; `pad_row` is all zeros."""

    table: torch.Tensor  # [max_rows + 1, width] int32 on the device
    rows: list[int]
    pad_row: int

    @property
    def width(self) -> int:
        return self.table.shape[1]


class PersistentBlockTable:
    """Rows of block ids on the device, one per sequence, updated by differences each step."""

    def __init__(self, max_rows: int, width: int, device: torch.device):
        if max_rows < 1 or width < 1:
            raise ValueError(f"a persistent block table needs rows and width >= 1, got {max_rows} x {width}")
        self.width, self.pad_row = width, max_rows
        self.table = torch.zeros(max_rows + 1, width, dtype=torch.int32, device=device)  # the last row: pad rows
        self._held: list[list[int]] = [[] for _ in range(max_rows)]  # each row's entries; zeros past them
        self._row_of: OrderedDict[int, int] = OrderedDict()  # seq id -> row, least recently scheduled first
        self._free = list(range(max_rows))  # a heap: the lowest free row first
        self.entries_written = 0  # table entries written since start-up (what the diffs cost)

    @property
    def max_rows(self) -> int:
        return self.pad_row

    def update(self, seq_ids: list[int], block_tables: list[list[int]]) -> BlockTableRows:
        """Bring the rows of this step's sequences up to their block lists (each cut to `width` blocks, all a
        context of at most width * block_size keys reads) and return where they are."""
        rows = self._assign(seq_ids)
        positions: list[int] = []
        values: list[int] = []
        for row, blocks in zip(rows, block_tables):
            wanted = blocks if len(blocks) <= self.width else blocks[:self.width]
            held = self._held[row]
            if wanted == held:
                continue
            base = row * self.width
            for position, value in _changed_entries(held, wanted):
                positions.append(base + position)
                values.append(value)
            self._held[row] = list(wanted)
        if positions:
            self._write(positions, values)
        return BlockTableRows(self.table, rows, self.pad_row)

    def release(self) -> None:
        """Free every row (idle engine, a failed step): the device table is zeroed, as a failed step may have
        left a write half done."""
        self.table.zero_()
        self._held = [[] for _ in range(self.max_rows)]
        self._row_of.clear()
        self._free = list(range(self.max_rows))

    def _assign(self, seq_ids: list[int]) -> list[int]:
        """Each sequence's row: its own, else a free one, else the least recently scheduled row of a sequence
        not in this step."""
        if len(seq_ids) > self.max_rows:
            raise ValueError(f"a step of {len(seq_ids)} sequences is over the persistent block table's "
                             f"{self.max_rows} rows")
        for seq_id in seq_ids:  # first mark the step's known rows as the most recent: never reclaimed below
            if seq_id in self._row_of:
                self._row_of.move_to_end(seq_id)
        rows = []
        for seq_id in seq_ids:
            row = self._row_of.get(seq_id)
            if row is None:
                row = heapq.heappop(self._free) if self._free else self._row_of.popitem(last=False)[1]
                self._row_of[seq_id] = row
            rows.append(row)
        return rows

    def _write(self, positions: list[int], values: list[int]) -> None:
        """The changed entries in one host-to-device copy (pinned on CUDA: the host does not wait for it; torch's
        pinned-memory cache keeps the block until the copy ran), scattered into the table on the device."""
        count = len(positions)
        on_cuda = self.table.is_cuda
        staged = torch.tensor(positions + values, dtype=torch.int32, pin_memory=on_cuda)
        sent = staged.to(self.table.device, non_blocking=on_cuda)
        self.table.view(-1)[sent[:count]] = sent[count:]
        self.entries_written += count


def _changed_entries(held: list[int], wanted: list[int]) -> list[tuple[int, int]]:
    """(position, value) of each entry where `wanted` differs from `held`, both read as padded with zeros."""
    if len(wanted) >= len(held) and wanted[:len(held)] == held:  # grown: the common case
        start = len(held)
    else:
        start = next((i for i, (a, b) in enumerate(zip(held, wanted)) if a != b), min(len(held), len(wanted)))
    size = max(len(held), len(wanted)) - start
    old = held[start:] + [0] * (size - (len(held) - start))
    new = wanted[start:] + [0] * (size - (len(wanted) - start))
    return [(start + i, b) for i, (a, b) in enumerate(zip(old, new)) if a != b]
