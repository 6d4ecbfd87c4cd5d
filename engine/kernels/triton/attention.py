"""Unified paged attention in Triton: one kernel for every row shape, reading K/V where it lies in the pool.

A batch is rows of query tokens (a decode: 1; a speculative verify row or a prefill chunk after a cached
prefix: several on top of `context_len - query_len` keys; a whole prompt: all of them), flattened
token-major as q [tokens, heads, head_dim]. A program takes one (query tile of a row, KV head[, split]):
the tile packs BLOCK_Q consecutive query tokens x the GROUP query heads that share the KV head, so one
K/V tile read from the pool feeds every query head of its group (GQA). Query i of a row sits at position
`context_len - query_len + i` and sees keys up to it (and, with a sliding window, more than `position -
window`); with a soft-cap (Gemma 2) each score becomes cap * tanh(score / cap); the softmax runs online
in float32 over tiles of TILE_N keys found through the row's block table. Rows of a single query tile
(decodes, short verify rows) may split their keys over NUM_SPLITS programs (flash-decoding) whose partial
results a second kernel merges: few rows on long contexts would otherwise leave most of the GPU idle. A full
decode CUDA graph launches with a plan fixed per batch size (splits sized for max_model_len): each row divides
its own keys over the splits, a split left without keys runs no tile, and a pad row of no keys comes out as
zeros, so the grid never depends on the step's data.

The pool layout is [num_blocks, block_size, kv_heads, head_dim] (head_dim contiguous).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch
import triton
import triton.language as tl

from llmctl.engine.kernels.triton import interpreter_enabled

LOG2E = 1.4426950408889634
TILE_N = 32  # keys per step of the online softmax
MAX_SPLITS = 32
MIN_KEYS_PER_SPLIT = 256  # a split shorter than this costs more in its merge than it saves
PREFILL_BLOCK_M = 64  # query rows (tokens x heads) of a tile once rows are prefill-sized


@dataclass(frozen=True)
class LaunchPlan:
    """How one step's rows map onto programs (the same for every layer of the step)."""

    block_m: int  # query rows of a tile: block_q tokens x the query heads of one KV head
    block_q: int
    num_splits: int  # programs per query tile, each over its share of the keys (1: no merge)

    def num_tiles(self, num_tokens: int, num_rows: int) -> int:
        """Grid tiles enough for every row (row r's start at query_starts[r] // block_q + r); extra ones exit."""
        return num_tokens // self.block_q + num_rows


def launch_plan(group: int, num_kv_heads: int, num_rows: int, max_query_len: int, max_context_len: int,
                target_programs: int) -> LaunchPlan:
    """Tile sizes for a step; key splits where rows of one tile each leave programs under `target_programs`."""
    block_m = max(16, triton.next_power_of_2(group))  # tl.dot takes 16 rows at least
    if max_query_len * group >= PREFILL_BLOCK_M:  # prefill-sized rows: each K/V tile feeds more queries
        block_m = max(block_m, PREFILL_BLOCK_M)
    block_q = block_m // group
    splits = 1
    if max_query_len <= block_q:
        programs = num_rows * num_kv_heads  # one query tile a row
        while (splits < MAX_SPLITS and programs * splits * 2 <= target_programs
               and max_context_len >= splits * 2 * MIN_KEYS_PER_SPLIT):
            splits *= 2
    return LaunchPlan(block_m=block_m, block_q=block_q, num_splits=splits)


def split_buffers(plan: LaunchPlan, num_tokens: int, num_heads: int, head_dim: int,
                  device: torch.device) -> Optional[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
    """The split programs' partial outputs, running maxima and sums (float32), shared by a step's layers."""
    if plan.num_splits == 1:
        return None
    parts = (num_tokens, num_heads, plan.num_splits)
    return (torch.empty(*parts, _padded_head_dim(head_dim), dtype=torch.float32, device=device),
            torch.empty(parts, dtype=torch.float32, device=device),
            torch.empty(parts, dtype=torch.float32, device=device))


def _padded_head_dim(head_dim: int) -> int:
    return max(16, triton.next_power_of_2(head_dim))


@triton.jit
def _row_of_tile(query_starts_ptr, tile, num_rows, BLOCK_Q: tl.constexpr):
    """The row grid tile `tile` belongs to: the last row whose first tile (start // BLOCK_Q + row) is <= tile."""
    lo: tl.int32 = 0
    hi = num_rows
    while lo < hi:
        mid = (lo + hi) // 2
        first = tl.load(query_starts_ptr + mid) // BLOCK_Q + mid
        if first <= tile:
            lo = mid + 1
        else:
            hi = mid
    return lo - 1


@triton.jit
def _dot(a, b, IEEE: tl.constexpr, UPCAST: tl.constexpr):
    """a @ b accumulated in float32. IEEE: full float32 products (else TF32 for float32 inputs on CUDA).
    UPCAST: 16-bit operands as float32 first, the same exact products (the Triton interpreter's dot multiplies
    bfloat16 as raw integers)."""
    if UPCAST:
        product = tl.dot(a.to(tl.float32), b.to(tl.float32), input_precision="ieee")
    elif IEEE:
        product = tl.dot(a, b, input_precision="ieee")
    else:
        product = tl.dot(a, b)
    return product


@triton.jit
def _key_tiles(cached, first_query, last_query, split, WINDOW: tl.constexpr, TILE_N: tl.constexpr,
               NUM_SPLITS: tl.constexpr):
    """The key tiles [lo, hi) this program reads: from the first query's window start to the last query."""
    key_end = cached + last_query + 1
    key_start = 0
    if WINDOW > 0:
        key_start = tl.maximum(cached + first_query - WINDOW + 1, 0)
    lo = key_start // TILE_N
    hi = tl.cdiv(key_end, TILE_N)
    if NUM_SPLITS > 1:
        per_split = tl.cdiv(hi - lo, NUM_SPLITS)
        lo = lo + split * per_split
        hi = tl.minimum(hi, lo + per_split)
    return lo, hi, key_end


@triton.jit(do_not_specialize=["num_rows"])  # a value of 1 would make it a constant the row search reassigns
def _paged_attention_kernel(
    out_ptr, q_ptr, k_cache_ptr, v_cache_ptr, block_tables_ptr, query_starts_ptr, context_lens_ptr,
    partial_out_ptr, partial_max_ptr, partial_sum_ptr,
    num_rows, scale_log2, softcap_log2,
    q_stride_token, q_stride_head, out_stride_token, out_stride_head,
    cache_stride_block, cache_stride_slot, cache_stride_head, table_stride,
    NUM_HEADS: tl.constexpr, GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, HEAD_DIM_PADDED: tl.constexpr,
    BLOCK_SIZE: tl.constexpr, TILE_N: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_Q: tl.constexpr,
    WINDOW: tl.constexpr, SOFTCAP: tl.constexpr, NUM_SPLITS: tl.constexpr, IEEE: tl.constexpr,
    UPCAST: tl.constexpr,
):
    tile, kv_head, split = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    row = _row_of_tile(query_starts_ptr, tile, num_rows, BLOCK_Q)
    row_start = tl.load(query_starts_ptr + row)
    query_len = tl.load(query_starts_ptr + row + 1) - row_start
    first_query = (tile - (row_start // BLOCK_Q + row)) * BLOCK_Q  # within the row
    if first_query >= query_len:  # a spare grid tile past its row's queries
        return
    cached = tl.load(context_lens_ptr + row) - query_len  # keys in the pool before the row's first query

    offs_m = tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, HEAD_DIM_PADDED)
    query = first_query + offs_m // GROUP
    head = kv_head * GROUP + offs_m % GROUP
    query_valid = (offs_m < BLOCK_Q * GROUP) & (query < query_len)
    dim_valid = offs_d < HEAD_DIM
    token = (row_start + query).to(tl.int64)
    q = tl.load(q_ptr + token[:, None] * q_stride_token + head[:, None] * q_stride_head + offs_d[None, :],
                mask=query_valid[:, None] & dim_valid[None, :], other=0.0)
    position = cached + query

    lo, hi, key_end = _key_tiles(cached, first_query, tl.minimum(first_query + BLOCK_Q, query_len) - 1, split,
                                 WINDOW, TILE_N, NUM_SPLITS)
    running_max = tl.full([BLOCK_M], float("-inf"), tl.float32)
    running_sum = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_DIM_PADDED], tl.float32)
    table = block_tables_ptr + row.to(tl.int64) * table_stride
    offs_n = tl.arange(0, TILE_N)
    for key_tile in range(lo, hi):
        key = key_tile * TILE_N + offs_n
        key_valid = key < key_end  # never past the pool's written keys: an unwritten slot may hold NaN
        block = tl.load(table + key // BLOCK_SIZE, mask=key_valid, other=0).to(tl.int64)
        slot = block * cache_stride_block + (key % BLOCK_SIZE) * cache_stride_slot + kv_head * cache_stride_head
        k = tl.load(k_cache_ptr + slot[None, :] + offs_d[:, None], mask=key_valid[None, :] & dim_valid[:, None],
                    other=0.0)
        v = tl.load(v_cache_ptr + slot[:, None] + offs_d[None, :], mask=key_valid[:, None] & dim_valid[None, :],
                    other=0.0)
        scores = _dot(q, k, IEEE, UPCAST) * scale_log2
        if SOFTCAP:  # in the exp2 domain the cap scales by log2(e) too; tanh(x) = 2 sigmoid(2x) - 1
            scores = softcap_log2 * (2.0 * tl.sigmoid(2.0 * scores / softcap_log2) - 1.0)
        seen = query_valid[:, None] & (key[None, :] <= position[:, None])
        if WINDOW > 0:
            seen = seen & (key[None, :] > position[:, None] - WINDOW)
        scores = tl.where(seen, scores, float("-inf"))
        new_max = tl.maximum(running_max, tl.max(scores, axis=1))
        shift = tl.where(new_max == float("-inf"), 0.0, new_max)  # a query that has seen no key yet
        probs = tl.exp2(scores - shift[:, None])
        rescale = tl.exp2(running_max - shift)
        running_sum = running_sum * rescale + tl.sum(probs, axis=1)
        acc = acc * rescale[:, None] + _dot(probs.to(v.dtype), v, IEEE, UPCAST)
        running_max = new_max

    if NUM_SPLITS == 1:
        out = acc / tl.where(running_sum == 0.0, 1.0, running_sum)[:, None]
        tl.store(out_ptr + token[:, None] * out_stride_token + head[:, None] * out_stride_head + offs_d[None, :],
                 out.to(out_ptr.dtype.element_ty), mask=query_valid[:, None] & dim_valid[None, :])
    else:
        part = (token * NUM_HEADS + head) * NUM_SPLITS + split
        tl.store(partial_out_ptr + part[:, None] * HEAD_DIM_PADDED + offs_d[None, :], acc,
                 mask=query_valid[:, None])
        tl.store(partial_max_ptr + part, running_max, mask=query_valid)
        tl.store(partial_sum_ptr + part, running_sum, mask=query_valid)


@triton.jit
def _merge_splits_kernel(
    out_ptr, partial_out_ptr, partial_max_ptr, partial_sum_ptr, out_stride_token, out_stride_head,
    NUM_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr, HEAD_DIM_PADDED: tl.constexpr, NUM_SPLITS: tl.constexpr,
):
    """One (token, query head): its splits' partial sums rescaled to the overall maximum and normalised."""
    token, head = tl.program_id(0).to(tl.int64), tl.program_id(1)
    part = (token * NUM_HEADS + head) * NUM_SPLITS + tl.arange(0, NUM_SPLITS)
    maxima = tl.load(partial_max_ptr + part)
    overall = tl.max(maxima, axis=0)  # finite unless the row has no keys (a decode graph's pad row)
    overall = tl.where(overall == float("-inf"), 0.0, overall)
    weight = tl.exp2(maxima - overall)  # 0 for a split that saw no key of this query
    total = tl.sum(tl.load(partial_sum_ptr + part) * weight, axis=0)
    offs_d = tl.arange(0, HEAD_DIM_PADDED)
    acc = tl.load(partial_out_ptr + part[:, None] * HEAD_DIM_PADDED + offs_d[None, :])
    out = tl.sum(acc * weight[:, None], axis=0) / tl.where(total == 0.0, 1.0, total)  # a keyless row: zeros
    tl.store(out_ptr + token * out_stride_token + head * out_stride_head + offs_d, out.to(out_ptr.dtype.element_ty),
             mask=offs_d < HEAD_DIM)


def paged_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, out: torch.Tensor,
                    block_tables: torch.Tensor, query_starts: torch.Tensor, context_lens: torch.Tensor,
                    plan: LaunchPlan, scale: float, window: Optional[int],
                    partials: Optional[tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = None,
                    softcap: Optional[float] = None) -> torch.Tensor:
    """Causal attention of every row's queries q [tokens, heads, head_dim] over its keys in the pool, into `out`.

    `block_tables` [rows, width] int32 (width >= each row's blocks), `query_starts` [rows + 1] int32 (row r's
    tokens are [query_starts[r], query_starts[r+1])), `context_lens` [rows] int32 (keys row r attends to, its
    own tokens included, already written to the pool); `partials` from `split_buffers` when plan splits;
    `softcap`: scores capped as softcap * tanh(scores / softcap) (None: not capped).
    """
    num_tokens, num_heads, head_dim = q.shape
    num_kv_heads = k_cache.shape[2]
    if q.stride(2) != 1 or out.stride(2) != 1 or k_cache.stride(3) != 1 or k_cache.stride() != v_cache.stride():
        raise ValueError("paged_attention needs head_dim contiguous and K and V pools of one layout")
    if (plan.num_splits > 1) != (partials is not None):
        raise ValueError("paged_attention needs split buffers exactly when the plan splits keys")
    num_rows = context_lens.shape[0]
    grid = (plan.num_tiles(num_tokens, num_rows), num_kv_heads, plan.num_splits)
    partial_out, partial_max, partial_sum = partials if partials is not None else (out, out, out)
    padded = _padded_head_dim(head_dim)
    _paged_attention_kernel[grid](
        out, q, k_cache, v_cache, block_tables, query_starts, context_lens, partial_out, partial_max, partial_sum,
        num_rows, scale * LOG2E, (softcap or 1.0) * LOG2E, q.stride(0), q.stride(1), out.stride(0), out.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2), block_tables.stride(0),
        NUM_HEADS=num_heads, GROUP=num_heads // num_kv_heads, HEAD_DIM=head_dim, HEAD_DIM_PADDED=padded,
        BLOCK_SIZE=k_cache.shape[1], TILE_N=TILE_N, BLOCK_M=plan.block_m, BLOCK_Q=plan.block_q,
        WINDOW=window or 0, SOFTCAP=softcap is not None, NUM_SPLITS=plan.num_splits, IEEE=q.dtype == torch.float32,
        UPCAST=q.dtype == torch.bfloat16 and interpreter_enabled(),
        num_warps=8 if plan.block_m * padded >= 64 * 128 else 4,
    )
    if plan.num_splits > 1:
        _merge_splits_kernel[(num_tokens, num_heads)](
            out, partial_out, partial_max, partial_sum, out.stride(0), out.stride(1),
            NUM_HEADS=num_heads, HEAD_DIM=head_dim, HEAD_DIM_PADDED=padded, NUM_SPLITS=plan.num_splits,
        )
    return out
