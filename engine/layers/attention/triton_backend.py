"""Paged attention in Triton (CUDA; on CPU tensors under the Triton interpreter, for tests).

One kernel takes every row shape of a step (decodes, prefill chunks on a cached prefix, speculative
verify rows, whole prompts) and reads K/V through the block tables where they lie in the pool: no
kept decode copy, no gathered context, no K/V repeated per query head. Another writes the step's K/V
into the pool. The kernels are engine/kernels/triton/. The block tables come from the runner's persistent device
table (engine/block_table.py), updated by differences: a step sends its rows' row indices, not its tables.
"""

from __future__ import annotations

from dataclasses import dataclass
from itertools import accumulate
from typing import Any, Optional

import torch

from llmctl.engine.block_table import BlockTableRows
from llmctl.engine.layers.attention.common import CommonAttentionMetadata, TokenMajorStateless

# Head dimensions the kernel's register tiles take (padded to a power of two).
MAX_HEAD_DIM = 256


@dataclass
class TritonAttentionMetadata:
    slot_mapping: torch.Tensor  # [num_tokens] int64
    query_starts: torch.Tensor  # [rows + 1] int32: where each row's queries start
    context_lens: torch.Tensor  # [rows] int32: the keys each row attends to, its own included
    block_tables: torch.Tensor  # [rows, blocks of the longest context] int32 (padded with 0)
    plan: Any  # the kernels' LaunchPlan: tile sizes and key splits
    partials: Optional[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]  # the key splits' buffers, or None
    # Full decode graphs' static metadata: query_starts, the rows' persistent-table rows, context_lens and
    # block_tables as one int32 tensor whose parts are refilled per replay
    static_ints: Optional[torch.Tensor] = None


class TritonAttention(TokenMajorStateless):
    """The unified Triton paged attention on a token-major pool, [num_blocks, block_size, kv_heads, head_dim]."""

    name = "triton"
    preferred_block_size = 16
    supports_full_graphs = True
    uses_persistent_block_table = True

    def __init__(self, num_heads: int, num_kv_heads: int, head_dim: int, sliding_window: Optional[int],
                 dtype: torch.dtype, kernels=None, scale: Optional[float] = None, softcap: Optional[float] = None):
        from llmctl.engine.kernels.triton import attention, cache  # here: triton is optional

        self._attention, self._cache = attention, cache
        self.num_heads, self.num_kv_heads, self.head_dim = num_heads, num_kv_heads, head_dim
        self.group = num_heads // num_kv_heads
        self.scale = scale or head_dim ** -0.5
        self.window = sliding_window
        self.softcap = softcap
        self._target_programs: Optional[int] = None  # set on the first step, from the device

    @property
    def label(self) -> str:
        return self.name

    def validate_block_size(self, block_size: int) -> Optional[str]:
        return None

    def build_metadata(self, batch: CommonAttentionMetadata) -> TritonAttentionMetadata:
        """The rows' query starts, context lengths and block tables in one non-blocking host-to-device copy, and
        the step's launch plan. With the runner's persistent table (`batch.table_rows`) the copy carries each row's
        row in it, and one gather on the device takes those rows, as wide as the longest context's blocks; without
        it (a batch built by hand) the copy carries the tables from the lists, each trimmed to its context."""
        rows, device = batch.num_rows, batch.device
        widths = [-(-context // batch.block_size) for context in batch.context_lens]
        width = max(widths)
        packed = list(accumulate(batch.query_lens, initial=0)) + list(batch.context_lens)
        persistent = batch.table_rows
        if persistent is not None:
            _check_width(width, persistent)
            packed += persistent.rows
        else:
            for table, used in zip(batch.block_tables, widths):
                packed += table[:used]
                packed += [0] * (width - used)
        # staged in pinned memory on CUDA (torch's cache keeps it until the copy ran): the host does not wait
        on_cuda = device.type == "cuda"
        ints = torch.tensor(packed, dtype=torch.int32, pin_memory=on_cuda).to(device, non_blocking=on_cuda)
        tail = ints[2 * rows + 1:]
        tables = tail.view(rows, width) if persistent is None else persistent.table[:, :width].index_select(0, tail)
        num_tokens = batch.slot_mapping.shape[0]
        plan = self._attention.launch_plan(self.group, self.num_kv_heads, rows, max(batch.query_lens),
                                           max(batch.context_lens), self._programs_target(device))
        return TritonAttentionMetadata(
            slot_mapping=batch.slot_mapping, query_starts=ints[:rows + 1], context_lens=ints[rows + 1:2 * rows + 1],
            block_tables=tables, plan=plan,
            partials=self._attention.split_buffers(plan, num_tokens, self.num_heads, self.head_dim, device))

    def static_decode_metadata(self, rows: int, max_context_len: int, block_size: int,
                               device: torch.device) -> TritonAttentionMetadata:
        """Metadata for `rows` one-token rows whose tensors stay put (a full decode graph reads them at replay):
        block tables `max_context_len` wide, a launch plan sized for `max_context_len`; every row a pad row
        (no keys, K/V not written) until `fill_decode_metadata`. One int32 tensor holds the query starts, each
        row's persistent-table row, the context lengths and the block tables, in that order."""
        width = -(-max_context_len // block_size)
        ints = torch.zeros(rows + 1 + rows * (2 + width), dtype=torch.int32, device=device)
        ints[:rows + 1] = torch.arange(rows + 1, dtype=torch.int32, device=device)
        plan = self._attention.launch_plan(self.group, self.num_kv_heads, rows, 1, max_context_len,
                                           self._programs_target(device))
        return TritonAttentionMetadata(
            slot_mapping=torch.full((rows,), -1, dtype=torch.long, device=device), query_starts=ints[:rows + 1],
            context_lens=ints[2 * rows + 1:3 * rows + 1], block_tables=ints[3 * rows + 1:].view(rows, width),
            plan=plan, partials=self._attention.split_buffers(plan, rows, self.num_heads, self.head_dim, device),
            static_ints=ints)

    def fill_decode_metadata(self, meta: TritonAttentionMetadata, batch: CommonAttentionMetadata) -> None:
        """Write a decode-only batch into `static_decode_metadata`'s tensors in place: one int32 host-to-device
        copy (from pinned memory on CUDA so the host does not wait for it) and the slot mapping's; rows past the
        batch become pad rows. With the persistent table the copy is the rows' table rows and context lengths,
        and the tables are gathered from it on the device (pad rows read its zero row); without it the copy is
        the context lengths and the lists' tables, zeros past each context."""
        rows, width = meta.block_tables.shape
        real = batch.num_rows
        pads = rows - real
        persistent = batch.table_rows
        if persistent is not None:
            _check_width(width, persistent)
            packed = persistent.rows + [persistent.pad_row] * pads + list(batch.context_lens) + [0] * pads
            region = meta.static_ints[rows + 1:3 * rows + 1]
        else:
            packed = list(batch.context_lens) + [0] * pads
            for table, context in zip(batch.block_tables, batch.context_lens):
                used = -(-context // batch.block_size)
                packed += table[:used]
                packed += [0] * (width - used)
            packed += [0] * (pads * width)
            region = meta.static_ints[2 * rows + 1:]
        # torch's pinned-memory cache keeps the staging block until the copy that reads it has run
        on_cuda = region.is_cuda
        region.copy_(torch.tensor(packed, dtype=torch.int32, pin_memory=on_cuda), non_blocking=on_cuda)
        if persistent is not None:
            torch.index_select(persistent.table[:, :width], 0, region[:rows], out=meta.block_tables)
        meta.slot_mapping[:real].copy_(batch.slot_mapping)
        meta.slot_mapping[real:].fill_(-1)

    def _programs_target(self, device: torch.device) -> int:
        """Programs a step should launch before it pays to split keys: two per multiprocessor on CUDA."""
        if self._target_programs is None:
            self._target_programs = (2 * torch.cuda.get_device_properties(device).multi_processor_count
                                     if device.type == "cuda" else 1)
        return self._target_programs

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor,
                v_cache: torch.Tensor, meta: TritonAttentionMetadata, window: Optional[int] = None) -> torch.Tensor:
        """`window`: this layer's sliding window; None: the backend's own (None where the model's layers mix)."""
        self._cache.write_kv(k, v, k_cache, v_cache, meta.slot_mapping)
        out = q.new_empty(q.shape)
        return self._attention.paged_attention(q, k_cache, v_cache, out, meta.block_tables, meta.query_starts,
                                               meta.context_lens, meta.plan, self.scale,
                                               self.window if window is None else window, meta.partials, self.softcap)


def _check_width(blocks: int, persistent: BlockTableRows) -> None:
    if blocks > persistent.width:
        raise ValueError(f"block tables {blocks} blocks wide are over the persistent block table's {persistent.width}")
