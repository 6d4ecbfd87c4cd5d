"""The native paged attention kernel on rows of several query tokens (speculative verify rows, prefill
chunks): each query's output is bitwise that of a one-token decode at its position (what makes greedy
speculation exact in bf16), it agrees with SDPA within tolerance, and the torch backend sends every row
of up to NATIVE_MAX_QUERY tokens to it, longer rows to SDPA, except where the kernel runs on AMX tiles
(bf16): there every row."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st

from llmctl.engine.kernels import load_cpu_kernels
from llmctl.engine.layers.attention import CommonAttentionMetadata, TorchAttention
from llmctl.engine.layers.attention.torch_backend import NATIVE_MAX_QUERY

KERNELS = load_cpu_kernels()
pytestmark = pytest.mark.skipif(KERNELS is None, reason="no C compiler or no AVX-512 here: the torch path runs")


def verify_case(seed, dtype, query_lens, kv_heads, group, dim, block_size, max_len, gap=0):
    """Rows of `query_lens` query tokens on random paged contexts; row r's tokens start `gap` tokens after
    row r-1's end (tokens between belong to no row)."""
    generator = torch.Generator().manual_seed(seed)
    rows = len(query_lens)
    counts = torch.tensor(query_lens)
    lens = torch.maximum(torch.randint(1, max_len + 1, (rows,), generator=generator), counts)
    width = -(-int(lens.max()) // block_size)
    num_blocks = rows * width + 2
    tables = torch.randperm(num_blocks, generator=generator)[: rows * width].view(rows, width)
    k_pool = (torch.randn(kv_heads, num_blocks, block_size, dim, generator=generator) * 2).to(dtype)
    v_pool = torch.randn(kv_heads, num_blocks, block_size, dim, generator=generator).to(dtype)
    starts = torch.cumsum(counts + gap, 0) - counts
    q = torch.randn(int((starts + counts).max()) + gap, kv_heads * group, dim, generator=generator).to(dtype)
    return q, k_pool, v_pool, tables, lens, starts, counts


def run_rows(q, k_pool, v_pool, tables, lens, starts, counts, scale, window=None):
    rows = KERNELS.paged_rows(tables, lens, k_pool.shape[2], starts, counts)
    return KERNELS.paged_attention(q, k_pool, v_pool, rows, scale, window, out=torch.zeros_like(q))


@settings(max_examples=30, deadline=None)
@given(seed=st.integers(0, 2**16), dtype=st.sampled_from([torch.float32, torch.bfloat16]),
       query_lens=st.lists(st.integers(1, 9), min_size=1, max_size=5), kv_heads=st.integers(1, 3),
       group=st.sampled_from([1, 2, 3, 4, 16]), dim=st.sampled_from([16, 32, 48, 64, 128]),
       block_size=st.sampled_from([1, 4, 16]), max_len=st.integers(1, 150), window=st.sampled_from([None, 1, 5, 40]))
def test_each_query_of_a_row_is_bitwise_the_one_token_decode_at_its_position(seed, dtype, query_lens, kv_heads, group,
                                                                            dim, block_size, max_len, window):
    case = verify_case(seed, dtype, query_lens, kv_heads, group, dim, block_size, max_len, gap=1)
    q, k_pool, v_pool, tables, lens, starts, counts = case
    out = run_rows(*case, dim ** -0.5, window)
    for r in range(len(query_lens)):
        for j in range(query_lens[r]):
            token = int(starts[r]) + j
            seen = torch.tensor([int(lens[r]) - query_lens[r] + j + 1])  # keys the decode at this position sees
            decode = KERNELS.paged_decode_attention(q[token: token + 1], k_pool, v_pool, tables[r: r + 1], seen,
                                                    dim ** -0.5, window)
            assert torch.equal(out[token], decode[0]), f"row {r} query {j}"
    covered = torch.zeros(q.shape[0], dtype=torch.bool)
    for start, count in zip(starts.tolist(), query_lens):
        covered[start: start + count] = True
    assert not out[~covered].any()  # tokens of no row are left alone


def sdpa_reference(q, k_pool, v_pool, table, context, count, scale, window):
    """One row through SDPA over its gathered context, with a causal (and window) mask, in float32."""
    positions = torch.arange(context)
    keys = k_pool[:, table[positions // k_pool.shape[2]], positions % k_pool.shape[2]].float()
    values = v_pool[:, table[positions // v_pool.shape[2]], positions % v_pool.shape[2]].float()
    q_pos = torch.arange(context - count, context).unsqueeze(1)
    mask = positions.unsqueeze(0) <= q_pos
    if window is not None:
        mask &= positions.unsqueeze(0) > q_pos - window
    out = F.scaled_dot_product_attention(q.float().transpose(0, 1).unsqueeze(0), keys.unsqueeze(0),
                                         values.unsqueeze(0), attn_mask=mask, scale=scale, enable_gqa=True)
    return out[0].transpose(0, 1)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("window", [None, 6])
def test_rows_agree_with_sdpa_over_the_gathered_context(dtype, window):
    case = verify_case(11, dtype, [5, 1, 3, 16], 3, 3, 64, 16, 90)
    q, k_pool, v_pool, tables, lens, starts, counts = case
    out = run_rows(*case, 0.125, window)
    for r in range(4):
        rows = slice(int(starts[r]), int(starts[r] + counts[r]))
        expected = sdpa_reference(q[rows], k_pool, v_pool, tables[r], int(lens[r]), int(counts[r]), 0.125, window)
        tolerance = 2e-5 if dtype is torch.float32 else 1.6e-2  # bf16: the output's own rounding
        assert (out[rows].float() - expected).abs().max().item() <= tolerance * max(1.0, expected.abs().max().item())


@pytest.mark.parametrize("change, message", [
    (dict(query_starts=torch.tensor([0, 20])), "do not fit"),
    (dict(query_lens=torch.tensor([5, 0])), "query token"),
    (dict(query_starts=torch.tensor([-1, 5])), "query token"),
    (dict(query_lens=torch.tensor([5, 300])), "more query tokens than its context"),
    (dict(query_lens=None), "come together"),
    (dict(query_lens=torch.tensor([5, 1], dtype=torch.int32)), "int64"),
])
def test_bad_query_ranges_are_refused_before_any_pointer_is_used(change, message):
    q, k_pool, v_pool, tables, lens, starts, counts = verify_case(2, torch.float32, [5, 1], 2, 2, 64, 16, 60)
    args = {"query_starts": starts, "query_lens": counts, **change}
    with pytest.raises(ValueError, match=message):
        rows = KERNELS.paged_rows(tables, lens, 16, **args)
        KERNELS.paged_attention(q, k_pool, v_pool, rows, 0.125)


def test_rows_checked_for_one_pool_are_refused_on_another():
    q, k_pool, v_pool, tables, lens, starts, counts = verify_case(3, torch.float32, [2, 3], 2, 2, 64, 16, 60)
    rows = KERNELS.paged_rows(tables, lens, 16, starts, counts)
    with pytest.raises(ValueError, match="outside the pool"):
        KERNELS.paged_attention(q, k_pool[:, :1], v_pool[:, :1], rows, 0.125)
    with pytest.raises(ValueError, match="block size"):
        KERNELS.paged_attention(q, k_pool.view(2, -1, 8, 64), v_pool.view(2, -1, 8, 64), rows, 0.125)
    with pytest.raises(ValueError, match="do not fit"):
        KERNELS.paged_attention(q[:3], k_pool, v_pool, rows, 0.125)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_torch_backend_sends_short_rows_to_the_kernel_and_long_ones_to_sdpa(dtype):
    """Decodes, a verify row and a long prefill chunk in one step: the short rows' outputs are bitwise the
    one-token decodes at their positions, the long row's SDPA's."""
    if KERNELS.tiled_attention(dtype):
        pytest.skip("the kernel runs on AMX tiles here: every row goes to it (the test below)")
    heads, kv_heads, dim, block_size = 6, 2, 32, 16
    backend = TorchAttention(heads, kv_heads, dim, None, dtype, kernels=KERNELS)
    assert backend.decode_kernel is not None
    query_lens, context_lens = [1, 1, 5, NATIVE_MAX_QUERY + 1], [40, 17, 33, 60]
    tables = [[0, 1, 2], [3, 4], [5, 6, 7], [8, 9, 10, 11]]
    generator = torch.Generator().manual_seed(0)
    pools = [(torch.randn(kv_heads, 12, block_size, dim, generator=generator)).to(dtype) for _ in range(2)]
    tokens = sum(query_lens)
    q = torch.randn(tokens, heads, dim, generator=generator).to(dtype)
    k, v = (torch.randn(tokens, kv_heads, dim, generator=generator).to(dtype) for _ in range(2))
    slots = [table[p // block_size] * block_size + p % block_size
             for n, context, table in zip(query_lens, context_lens, tables) for p in range(context - n, context)]
    batch = CommonAttentionMetadata(list(range(4)), query_lens, context_lens, tables, torch.tensor(slots), block_size)
    meta = backend.build_metadata(batch)
    assert [(span.start, span.length) for span in meta.prefills] == [(7, NATIVE_MAX_QUERY + 1)]
    assert meta.native.query_lens.tolist() == [1, 1, 5] and meta.native.query_starts.tolist() == [0, 1, 2]
    out = backend.forward(q, k, v, pools[0], pools[1], meta)
    start = 0
    for n, context, table in zip(query_lens[:3], context_lens, tables):
        for j in range(n):
            one = KERNELS.paged_decode_attention(q[start + j: start + j + 1], *pools, torch.tensor([table]),
                                                 torch.tensor([context - n + j + 1]), backend.scale)
            assert torch.equal(out[start + j], one[0])
        start += n
    expected = sdpa_reference(q[7:], *pools, torch.tensor(tables[3]), 60, NATIVE_MAX_QUERY + 1, backend.scale, None)
    tolerance = 2e-5 if dtype is torch.float32 else 1.6e-2
    assert (out[7:].float() - expected).abs().max().item() <= tolerance * max(1.0, expected.abs().max().item())
    decodes = backend.build_metadata(CommonAttentionMetadata([0, 1], [1, 1], [40, 17], tables[:2],
                                                             torch.tensor(slots[:2]), block_size))
    assert decodes.native.query_lens is None and not decodes.prefills  # a decode-only step: row r is token r


@settings(max_examples=12, deadline=None)
@given(seed=st.integers(0, 2**16), dtype=st.sampled_from([torch.float32, torch.bfloat16]),
       query_lens=st.lists(st.integers(1, 90), min_size=1, max_size=3), group=st.sampled_from([1, 3, 16]),
       dim=st.sampled_from([32, 64]), window=st.sampled_from([None, 7, 50]))
def test_prefill_rows_of_many_tiles_are_bitwise_one_token_decodes(seed, dtype, query_lens, group, dim, window):
    """Rows longer than a work item's tile (48 query heads: 48, 16 or 3 tokens at these groups) spread over
    several items, each scoring only the keys up to its last query: every query is still bitwise the
    one-token decode at its position, so a prompt's outputs do not depend on its chunking."""
    case = verify_case(seed, dtype, query_lens, 2, group, dim, 16, 160)
    q, k_pool, v_pool, tables, lens, starts, counts = case
    out = run_rows(*case, dim ** -0.5, window)
    for r in range(len(query_lens)):
        positions = range(query_lens[r])
        seen = torch.tensor([int(lens[r]) - query_lens[r] + j + 1 for j in positions])
        tokens = [int(starts[r]) + j for j in positions]
        decodes = KERNELS.paged_decode_attention(q[tokens], k_pool, v_pool, tables[r: r + 1].expand(len(tokens), -1),
                                                 seen, dim ** -0.5, window)
        assert torch.equal(out[tokens], decodes), f"row {r}"


def test_where_the_kernel_runs_on_tiles_the_torch_backend_sends_every_row_to_it():
    """bf16 with AMX tiles: a long prefill chunk after a cached prefix runs on the kernel too, bitwise the
    one-token decodes at its positions (float32 keeps SDPA for long rows)."""
    if not KERNELS.tiled_attention(torch.bfloat16):
        pytest.skip("no AMX tiles here: the kernel's vector path takes short rows only")
    assert not KERNELS.tiled_attention(torch.float32)
    heads, kv_heads, dim, block_size = 6, 2, 32, 16
    backend = TorchAttention(heads, kv_heads, dim, None, torch.bfloat16, kernels=KERNELS)
    query_lens, context_lens, tables = [1, 40], [17, 60], [[0, 1], [2, 3, 4, 5]]
    generator = torch.Generator().manual_seed(1)
    pools = [torch.randn(kv_heads, 6, block_size, dim, generator=generator).to(torch.bfloat16) for _ in range(2)]
    q = torch.randn(41, heads, dim, generator=generator).to(torch.bfloat16)
    k, v = (torch.randn(41, kv_heads, dim, generator=generator).to(torch.bfloat16) for _ in range(2))
    slots = [table[p // block_size] * block_size + p % block_size
             for n, context, table in zip(query_lens, context_lens, tables) for p in range(context - n, context)]
    meta = backend.build_metadata(CommonAttentionMetadata([0, 1], query_lens, context_lens, tables,
                                                          torch.tensor(slots), block_size))
    assert not meta.prefills and meta.native.query_lens.tolist() == [1, 40]
    out = backend.forward(q, k, v, pools[0], pools[1], meta)
    seen = torch.tensor([17] + [21 + j for j in range(40)])
    table_rows = torch.tensor([tables[0] + [0, 0]] + [tables[1]] * 40)
    assert torch.equal(out, KERNELS.paged_decode_attention(q, *pools, table_rows, seen, backend.scale))
