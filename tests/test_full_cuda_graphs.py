"""Full decode graphs (`--cudagraph-mode full_decode_only|full_and_piecewise`) on the Triton backend, run on CPU
under the Triton interpreter (tests/conftest.py sets TRITON_INTERPRET=1) with a stand-in capturer whose replay
calls the captured step again, so what replay reads is the bucket's static tensors and nothing else.

The backend's static decode metadata (rows padded to a bucket, block tables to max_model_len's blocks, a key-split
plan fixed per bucket) gives the exact metadata's attention output and KV writes bitwise, pad rows zeros and
nothing written; the engine replaying full graphs gives the eager engine's greedy tokens; the runner captures them
after the KV pool, on that pool, and a step replays full graphs first, then piecewise ones.
"""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from test_cuda_graphs import CallingCapturer, per_row_measure, recorded_logits, unmeasured


@pytest.fixture(scope="module")
def triton_cpu():
    pytest.importorskip("triton")
    from llmctl.engine.kernels.triton import interpreter_enabled

    if not interpreter_enabled():
        pytest.skip("triton was imported before TRITON_INTERPRET=1 could be set")
    from llmctl.engine.kernels.triton import attention

    return attention


@st.composite
def decode_batches(draw):
    contexts = draw(st.lists(st.integers(1, 70), min_size=1, max_size=4))
    return dict(contexts=contexts, pad=draw(st.integers(0, 3)), kv_heads=draw(st.sampled_from([1, 2])),
                group=draw(st.sampled_from([1, 2, 4])), head_dim=draw(st.sampled_from([32, 64])),
                dtype=draw(st.sampled_from([torch.float32, torch.bfloat16])), block_size=draw(st.sampled_from([8, 16])),
                window=draw(st.sampled_from([None, 5])), splits=draw(st.sampled_from([1, 2, 4])),
                seed=draw(st.integers(0, 2**16)))


def decode_step(batch: dict):
    """A NaN pool holding each row's context but its last token (this step's), shuffled block tables with a spare
    block each, and the step's q/k/v; returns (backend, CommonAttentionMetadata, q, k, v, k_cache, v_cache)."""
    from llmctl.engine.layers.attention import CommonAttentionMetadata, TritonAttention

    generator = torch.Generator().manual_seed(batch["seed"])
    kv_heads, dim, dtype, bs = batch["kv_heads"], batch["head_dim"], batch["dtype"], batch["block_size"]
    heads = kv_heads * batch["group"]
    needed = [-(-context // bs) + 1 for context in batch["contexts"]]
    order = torch.randperm(sum(needed) + 1, generator=generator).tolist()
    tables = [order[sum(needed[:i]):sum(needed[:i + 1])] for i in range(len(needed))]
    k_cache = torch.full((len(order), bs, kv_heads, dim), float("nan"), dtype=dtype)
    v_cache = torch.full_like(k_cache, float("nan"))
    for table, context in zip(tables, batch["contexts"]):
        for position in range(context - 1):
            block, offset = table[position // bs], position % bs
            k_cache[block, offset] = torch.randn(kv_heads, dim, generator=generator).to(dtype)
            v_cache[block, offset] = torch.randn(kv_heads, dim, generator=generator).to(dtype)
    slots = torch.tensor([table[(c - 1) // bs] * bs + (c - 1) % bs for table, c in zip(tables, batch["contexts"])])
    rows = len(tables)
    common = CommonAttentionMetadata(list(range(rows)), [1] * rows, batch["contexts"], tables, slots, bs)
    q, k, v = (torch.randn(rows + batch["pad"], n, dim, generator=generator).to(dtype) for n in (heads, kv_heads,
                                                                                                  kv_heads))
    backend = TritonAttention(heads, kv_heads, dim, batch["window"], dtype=dtype)
    return backend, common, q, k, v, k_cache, v_cache


def with_splits(attention, meta, splits: int, backend):
    return replace(meta, plan=attention.LaunchPlan(meta.plan.block_m, meta.plan.block_q, splits),
                   partials=attention.split_buffers(attention.LaunchPlan(1, 1, splits), meta.block_tables.shape[0],
                                                    backend.num_heads, backend.head_dim, torch.device("cpu")))


@settings(max_examples=10, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture,
                                                                 HealthCheck.too_slow])
@given(batch=decode_batches())
def test_static_padded_metadata_gives_the_exact_metadatas_output_and_writes(triton_cpu, batch):
    """The same kernels on the bucket's static metadata (pad rows, tables 80 keys wide) and on the step's exact
    metadata: the real rows' outputs and the pool bitwise equal (same key-split plan), pad rows zeros, nothing
    written for them; a split plan against no split agrees to rounding."""
    backend, common, q, k, v, k_cache, v_cache = decode_step(batch)
    rows, bucket = common.num_rows, common.num_rows + batch["pad"]
    exact = with_splits(triton_cpu, backend.build_metadata(common), batch["splits"], backend)
    static = backend.static_decode_metadata(bucket, 80, common.block_size, torch.device("cpu"))
    assert static.block_tables.shape == (bucket, -(-80 // common.block_size))
    backend.fill_decode_metadata(static, common)
    static = with_splits(triton_cpu, static, batch["splits"], backend)
    pools = [(k_cache.clone(), v_cache.clone()) for _ in range(2)]
    expected = backend.forward(q[:rows], k[:rows], v[:rows], *pools[0], exact)
    ours = backend.forward(q, k, v, *pools[1], static)
    assert torch.equal(ours[:rows], expected)
    assert torch.equal(ours[rows:], torch.zeros_like(ours[rows:]))
    for theirs, mine in zip(pools[0], pools[1]):
        torch.testing.assert_close(mine, theirs, rtol=0, atol=0, equal_nan=True)
    unsplit = backend.forward(q[:rows], k[:rows], v[:rows], *pools[0], with_splits(triton_cpu, exact, 1, backend))
    tolerance = 1e-5 if batch["dtype"] == torch.float32 else 2e-2
    torch.testing.assert_close(ours[:rows].float(), unsplit.float(), rtol=0, atol=tolerance)


def test_refilling_static_metadata_keeps_its_tensors_and_resets_pad_rows(triton_cpu):
    """A replay reads the same tensors every step: a refill writes in place, and rows the new batch leaves become
    pad rows again (no keys, slot -1, zero tables)."""
    from llmctl.engine.layers.attention import CommonAttentionMetadata, TritonAttention

    backend = TritonAttention(4, 2, 32, None, dtype=torch.float32)
    static = backend.static_decode_metadata(4, 64, 16, torch.device("cpu"))
    assert static.query_starts.tolist() == [0, 1, 2, 3, 4] and static.slot_mapping.tolist() == [-1] * 4
    addresses = [t.data_ptr() for t in (static.slot_mapping, static.context_lens, static.block_tables)]
    backend.fill_decode_metadata(static, CommonAttentionMetadata(
        [1, 2, 3], [1, 1, 1], [17, 40, 3], [[3, 9, 4], [7, 1, 2, 8], [5, 6]], torch.tensor([57, 39, 82]), 16))
    assert static.context_lens.tolist() == [17, 40, 3, 0]
    assert static.block_tables.tolist() == [[3, 9, 0, 0], [7, 1, 2, 0], [5, 0, 0, 0], [0, 0, 0, 0]]
    backend.fill_decode_metadata(static, CommonAttentionMetadata([2], [1], [33], [[7, 1, 2]], torch.tensor([32]), 16))
    assert static.context_lens.tolist() == [33, 0, 0, 0] and static.slot_mapping.tolist() == [32, -1, -1, -1]
    assert static.block_tables.tolist() == [[7, 1, 2, 0]] + [[0] * 4] * 3
    assert addresses == [t.data_ptr() for t in (static.slot_mapping, static.context_lens, static.block_tables)]


def triton_llm(folder, **engine):
    from llmctl.engine import LLM

    return LLM(str(folder), skip_tokenizer_init=True, dtype="float32", device="cpu", attention_backend="triton",
               max_model_len=128, max_num_seqs=4, num_kv_blocks=48, enable_prefix_caching=False, **engine)


def full_graphs(runner, capturer, max_batch=4):
    from llmctl.engine.cuda_graphs import FullDecodeGraphs

    return FullDecodeGraphs(runner.model, runner.attention, runner.kv_caches, max_batch, runner.config.max_model_len,
                            runner.block_size, runner.device, capturer=capturer)


PROMPTS = [[1, 2, 3], list(range(5, 30)), [7] * 17]  # three rows: decode steps pad to the bucket of 4


def test_engine_replaying_full_graphs_gives_the_eager_greedy_tokens(triton_cpu, tiny_models):
    llm = triton_llm(tiny_models["llama"])
    runner = llm.engine.executor.runner
    eager_tokens, eager_logits = recorded_logits(llm, PROMPTS, max_tokens=4)
    capturer = CallingCapturer()
    runner.graphs = graphs = full_graphs(runner, capturer)
    graphs.capture_all(None, unmeasured)
    assert graphs.captured_sizes == [1, 2, 4] and capturer.counter["captures"] == 3  # one graph a bucket
    tokens, logits = recorded_logits(llm, PROMPTS, max_tokens=4)
    assert capturer.counter["captures"] == 3 and capturer.counter["replays"] >= 3  # every decode step replayed
    assert tokens == eager_tokens
    for ours, expected in zip(logits, eager_logits):
        torch.testing.assert_close(ours, expected, rtol=0, atol=1e-5)
    bucket = graphs._captured[4]
    assert bucket.logits.shape[0] == 4  # the graph computes the pad row's logits; the step took the first rows
    assert llm.engine.block_manager.num_free_blocks == llm.engine.block_manager.num_blocks


def test_full_graphs_replay_only_decode_batches_on_their_own_pool(triton_cpu, tiny_models):
    """A prefill step, a batch over the largest bucket and a forward on another pool (the memory profile's scratch)
    run eagerly; a bucket left uncaptured falls to the piecewise graphs behind them in the dispatch."""
    from llmctl.engine.cuda_graphs import DecodeGraphs, GraphDispatch
    from llmctl.engine.layers.attention import CommonAttentionMetadata

    llm = triton_llm(tiny_models["llama"])
    runner = llm.engine.executor.runner
    eager_tokens, _ = recorded_logits(llm, PROMPTS, max_tokens=4)
    capturer = CallingCapturer()
    graphs = full_graphs(runner, capturer)
    graphs.capture_all(3 << 20, per_row_measure(1, graphs))  # 1 MiB a row: buckets 1 and 2 fit, 4 does not
    assert graphs.captured_sizes == [1, 2]
    batch = CommonAttentionMetadata([0, 1], [1, 1], [5, 9], [[0], [1]], torch.tensor([4, 24]), runner.block_size)
    assert graphs.can_run(batch, runner.kv_caches)
    assert not graphs.can_run(batch, [cache.clone() for cache in runner.kv_caches])
    prefill = CommonAttentionMetadata([0, 1], [1, 4], [5, 9], [[0], [1]], torch.arange(5), runner.block_size)
    assert not graphs.can_run(prefill, runner.kv_caches)

    piecewise_capturer = CallingCapturer()
    piecewise = DecodeGraphs(runner.model, runner.attention, 4, runner.device, torch.float32,
                             capturer=piecewise_capturer)
    piecewise.capture_all(None, unmeasured)
    runner.graphs = GraphDispatch(graphs, piecewise)
    tokens, _ = recorded_logits(llm, PROMPTS, max_tokens=4)
    assert tokens == eager_tokens
    assert piecewise_capturer.counter["replays"] > 0  # the 3-row steps: bucket 4 only piecewise
    full_replays = capturer.counter["replays"]
    recorded_logits(llm, [[3, 4]], max_tokens=3)  # one row: the full graphs
    assert capturer.counter["replays"] > full_replays


def test_runner_captures_full_graphs_after_the_pool_on_it(triton_cpu, tiny_models, monkeypatch):
    """The runner's start-up with full_and_piecewise (forced on the CPU): piecewise graphs before the pool, full
    graphs after it on its tensors, full ones first in the dispatch."""
    from llmctl.engine import cuda_graphs
    from llmctl.engine.cuda_graphs import GraphDispatch

    made = {}

    def fake(name, make):
        def build(*args):
            made[name] = CallingCapturer()
            graphs = make(*args, capturer=made[name])
            if graphs is None:
                del made[name]
            return graphs
        monkeypatch.setattr(f"llmctl.engine.model_runner.{make.__name__}", build)

    monkeypatch.setattr("llmctl.engine.model_runner.resolve_cudagraph_mode", lambda mode, *_: mode)
    fake("piecewise", cuda_graphs.maybe_decode_graphs)
    fake("full", cuda_graphs.maybe_full_decode_graphs)
    llm = triton_llm(tiny_models["llama"], cudagraph_mode="full_and_piecewise")
    runner = llm.engine.executor.runner
    assert isinstance(runner.graphs, GraphDispatch)
    full, piecewise = runner.graphs.graph_sets
    assert full.kind == "full decode graphs" and full.kv_caches is runner.kv_caches
    assert full.captured_sizes == piecewise.captured_sizes == [1, 2, 4]
    recorded_logits(llm, PROMPTS, max_tokens=3)
    assert made["full"].counter["replays"] > 0 and made["piecewise"].counter["replays"] == 0

    made.clear()
    llm = triton_llm(tiny_models["llama"], cudagraph_mode="full_decode_only")
    assert isinstance(llm.engine.executor.runner.graphs, GraphDispatch) and list(made) == ["full"]
