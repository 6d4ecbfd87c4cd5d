"""Piecewise decode graphs: the bookkeeping (buckets, padding, pieces around eager attention, capture at
start-up within a memory allowance) run on CPU with a stand-in capturer that replays by calling the piece;
on CUDA, test_cuda.py replays real graphs."""

from __future__ import annotations

import pytest
import torch

from llmctl.engine import LLM, EngineArgs, SamplingParams
from llmctl.engine.cuda_graphs import DecodeGraphs, batch_buckets, maybe_decode_graphs, resolve_cudagraph_mode
from llmctl.engine.errors import EngineArgsError


class ReplayByCalling:
    """Stands in for a captured CUDA graph: replay() runs the piece again."""

    def __init__(self, piece, counter):
        self.piece, self.counter = piece, counter

    def replay(self):
        self.counter["replays"] += 1
        self.piece()


class CallingCapturer:
    """Stands in for CudaCapturer on CPU: warm-up runs the pieces, a capture returns a ReplayByCalling.
    `fail` makes chosen captures raise."""

    def __init__(self, fail=None):
        self.counter = {"replays": 0, "captures": 0, "warm_ups": 0}
        self.fail = fail or {}  # n-th bucket captured (0: the first) -> the exception its capture raises

    def warm_up(self, pieces):
        self.counter["warm_ups"] += 1
        if self.counter["warm_ups"] - 1 in self.fail:
            raise self.fail[self.counter["warm_ups"] - 1]
        for piece in pieces:
            piece()

    def __call__(self, piece):
        self.counter["captures"] += 1
        return ReplayByCalling(piece, self.counter)


def unmeasured(work):
    work()
    return 0


def recorded_logits(llm: LLM, prompts, max_tokens=12):
    rows = [[] for _ in prompts]
    params = [SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True,
                             logits_processors=[lambda ids, row, rec=rec: rec.append(row.clone()) or row])
              for rec in rows]
    outputs = llm.generate(prompts, params)
    return [o.outputs[0].token_ids for o in outputs], [torch.stack(r) for r in rows]


def test_buckets_cover_every_batch_size_up_to_the_largest():
    assert batch_buckets(1) == [1]
    assert batch_buckets(20) == [1, 2, 4, 8, 16, 20]
    assert batch_buckets(64) == [1, 2, 4, 8, 16, 32, 48, 64]
    assert all(any(b >= n for b in batch_buckets(100)) for n in range(1, 101))


def test_graph_modes_resolve_by_device_ranks_backend_and_enforce_eager():
    from llmctl.engine.layers.attention import TorchAttention, TritonAttention

    cuda, cpu = torch.device("cuda"), torch.device("cpu")
    for mode in ("piecewise", "full_decode_only", "full_and_piecewise"):
        assert resolve_cudagraph_mode(mode, cpu, TritonAttention, False) == "none"
        assert resolve_cudagraph_mode(mode, cuda, TritonAttention, True) == "none"
        assert resolve_cudagraph_mode(mode, cuda, TritonAttention, False, 1, 2) == "none"  # pipeline stages
        assert resolve_cudagraph_mode(mode, cuda, TritonAttention, False) == mode
    # tensor parallelism: full graphs only (NCCL collectives inside them)
    assert resolve_cudagraph_mode("full_and_piecewise", cuda, TritonAttention, False, 2) == "full_decode_only"
    assert resolve_cudagraph_mode("piecewise", cuda, TritonAttention, False, 2) == "none"
    # a backend whose decode metadata follows each step keeps a full mode's mixed part, as vLLM does
    assert resolve_cudagraph_mode("full_and_piecewise", cuda, TorchAttention, False) == "piecewise"
    assert resolve_cudagraph_mode("full_decode_only", cuda, TorchAttention, False) == "none"
    assert resolve_cudagraph_mode("full_and_piecewise", cuda, TorchAttention, False, 2) == "none"
    assert maybe_decode_graphs(None, None, cuda, torch.float32, 8, "none") is None
    assert maybe_decode_graphs(None, None, cuda, torch.float32, 8, "full_decode_only") is None
    assert EngineArgs(enforce_eager=True).enforce_eager and EngineArgs().cudagraph_mode == "piecewise"
    with pytest.raises(EngineArgsError, match="cudagraph_mode"):
        EngineArgs(cudagraph_mode="full")


def test_piecewise_replay_gives_the_eager_logits(tiny_models):
    prompts = [[1, 2, 3], list(range(5, 40)), [7] * 17]  # a batch of 3 pads to the bucket of 4
    kwargs = dict(skip_tokenizer_init=True, dtype="float32", device="cpu", max_model_len=256, max_num_seqs=8)
    eager_tokens, eager_logits = recorded_logits(LLM(str(tiny_models["qwen2"]), **kwargs), prompts)

    llm = LLM(str(tiny_models["qwen2"]), **kwargs)
    runner = llm.engine.executor.runner
    capturer = CallingCapturer()
    runner.graphs = DecodeGraphs(runner.model, runner.attention, 8, runner.device, torch.float32, capturer=capturer)
    runner.graphs.capture_all(None, unmeasured)
    counter = capturer.counter

    layers = len(runner.model.model.layers)
    assert runner.graphs.captured_sizes == [1, 2, 4, 8]
    assert counter["captures"] == (layers + 1) * 4  # one graph per piece and bucket
    tokens, logits = recorded_logits(llm, prompts)
    assert counter["captures"] == (layers + 1) * 4  # nothing captured while serving
    assert counter["replays"] >= (layers + 1) * 5  # decode steps went through the graphs
    assert tokens == eager_tokens
    for ours, expected in zip(logits, eager_logits):
        assert torch.allclose(ours, expected, atol=1e-5)
    assert llm.engine.block_manager.num_free_blocks == llm.engine.block_manager.num_blocks


def test_prefill_steps_stay_eager(tiny_models):
    llm = LLM(str(tiny_models["llama"]), skip_tokenizer_init=True, dtype="float32", device="cpu", max_model_len=128)
    runner = llm.engine.executor.runner
    capturer = CallingCapturer()
    runner.graphs = DecodeGraphs(runner.model, runner.attention, 4, runner.device, torch.float32, capturer=capturer)
    runner.graphs.capture_all(None, unmeasured)
    counter = capturer.counter
    llm.generate([list(range(1, 30))], SamplingParams(max_tokens=1, ignore_eos=True))  # one prefill step only
    assert counter["replays"] == 0
    llm.generate([list(range(1, 30))] * 6, SamplingParams(max_tokens=3, ignore_eos=True))  # 6 rows > bucket 4
    assert counter["replays"] == 0


def per_row_measure(mib_per_row, graphs):
    """A `measure` for capture_all: each capture takes mib_per_row MiB per row of its bucket."""
    def measure(work):
        before = set(graphs.captured_sizes)
        work()
        return sum(mib_per_row * size << 20 for size in set(graphs.captured_sizes) - before)
    return measure


def test_capture_all_stops_before_the_allowance_and_failed_buckets_run_eagerly(tiny_models):
    kwargs = dict(skip_tokenizer_init=True, dtype="float32", device="cpu", max_model_len=256, max_num_seqs=64)
    llm = LLM(str(tiny_models["qwen2"]), **kwargs)
    runner = llm.engine.executor.runner

    def graphs_with(capturer):
        return DecodeGraphs(runner.model, runner.attention, 64, runner.device, torch.float32, capturer=capturer)

    graphs = graphs_with(CallingCapturer())
    assert graphs.buckets == [1, 2, 4, 8, 16, 32, 48, 64]
    # 10 MiB a row: 1..16 take 310 MiB; 32 is expected to take 16's 160 MiB x 2 more, over 315 MiB
    spent = graphs.capture_all(315 << 20, per_row_measure(10, graphs))
    assert graphs.captured_sizes == [1, 2, 4, 8, 16] and spent == 310 << 20
    graphs = graphs_with(CallingCapturer())
    assert graphs.capture_all(0, per_row_measure(10, graphs)) == 0 and graphs.captured_sizes == []
    graphs = graphs_with(CallingCapturer())  # the first capture took more than allowed: dropped, all eager
    assert graphs.capture_all(5 << 20, per_row_measure(10, graphs)) == 0 and graphs.captured_sizes == []
    graphs = graphs_with(CallingCapturer())  # 1 and 2 expected to fit; 2 took 80 MiB, not the 20 expected
    measure = per_row_measure(10, graphs)
    sizes = iter([1, 4])
    assert graphs.capture_all(45 << 20, lambda work: measure(work) * next(sizes)) == 10 << 20
    assert graphs.captured_sizes == [1]

    # bucket 4 (third) fails to capture: 3 rows pad to 8 instead; out of memory at 16 (fifth) stops capturing
    capturer = CallingCapturer(fail={2: RuntimeError("operation not permitted when stream is capturing"),
                                     4: torch.cuda.OutOfMemoryError("CUDA out of memory")})
    runner.graphs = graphs = graphs_with(capturer)
    graphs.capture_all(None, unmeasured)
    assert graphs.captured_sizes == [1, 2, 8]
    prompts = [[1, 2, 3], list(range(5, 40)), [7] * 17]
    tokens, logits = recorded_logits(llm, prompts)
    assert capturer.counter["replays"] > 0  # the 3-row steps replayed bucket 8's graphs
    eager_tokens, eager_logits = recorded_logits(LLM(str(tiny_models["qwen2"]), **kwargs), prompts)
    assert tokens == eager_tokens
    for ours, expected in zip(logits, eager_logits):
        assert torch.allclose(ours, expected, atol=1e-5)
    replays = capturer.counter["replays"]
    recorded_logits(llm, [[1, 2, 3]] * 9, max_tokens=3)  # 9 rows: no captured bucket holds them, eager
    assert capturer.counter["replays"] == replays


def test_tensor_parallel_ranks_take_every_capture_decision_together(tiny_models):
    """`agree` stands in for the ranks' all-reduce: a peer over its allowance at the third bucket stops every rank
    there, and a failed capture fails start-up rather than leave the ranks capturing different buckets."""
    llm = LLM(str(tiny_models["qwen2"]), skip_tokenizer_init=True, dtype="float32", device="cpu", max_model_len=256,
              max_num_seqs=64)
    runner = llm.engine.executor.runner
    votes = []

    def peer_stops_at_third(flag):
        votes.append(flag)
        return flag and len(votes) != 5  # votes per bucket: fits, then kept; the third bucket's first vote is 5th

    graphs = DecodeGraphs(runner.model, runner.attention, 64, runner.device, torch.float32, capturer=CallingCapturer())
    graphs.capture_all(10 << 20, per_row_measure(1, graphs), peer_stops_at_third)
    assert graphs.captured_sizes == [1, 2] and votes == [True] * 5
    failing = CallingCapturer(fail={1: RuntimeError("operation not permitted when stream is capturing")})
    graphs = DecodeGraphs(runner.model, runner.attention, 64, runner.device, torch.float32, capturer=failing)
    with pytest.raises(RuntimeError, match="batch size 2 failed on this tensor-parallel rank"):
        graphs.capture_all(None, unmeasured, lambda flag: flag)


def test_a_batch_with_a_verify_row_runs_eagerly_and_decode_rows_replay(tiny_models):
    """Graphs replay only batches of 1-token rows; a batch mixing them with a 4-token verify row on an existing
    context runs eagerly (the same logits as with no graphs at all)."""
    from llmctl.engine.sequence import Sequence
    from llmctl.engine.step_types import ScheduledSeq

    llm = LLM(str(tiny_models["qwen2"]), skip_tokenizer_init=True, dtype="float32", device="cpu", max_model_len=256,
              max_num_seqs=8, num_kv_blocks=32)
    runner = llm.engine.executor.runner
    capturer = CallingCapturer()
    graphs = DecodeGraphs(runner.model, runner.attention, 8, runner.device, torch.float32, capturer=capturer)
    graphs.capture_all(None, unmeasured)
    seqs = []
    for i, length in enumerate((27, 38, 60)):  # each row below computes its sequence's last tokens: all sample
        seq = Sequence(i, f"r{i}", 0, [(5 * j + i) % 500 for j in range(length)], params=SamplingParams())
        seq.block_table = list(range(8 * i, 8 * i + 8))
        seqs.append(seq)

    def forward(rows, with_graphs):
        """`rows` (sequence, computed, new tokens) from the same pool state: sampled rows' logits, replays."""
        for seq, computed, _ in rows:
            seq.num_computed_tokens = computed
        before = capturer.counter["replays"]
        with torch.inference_mode():
            step = runner.prepare([ScheduledSeq(seq, n) for seq, _, n in rows])
            logits = runner._run(step.inputs, runner.kv_caches, graphs if with_graphs else None).logits
        return logits, capturer.counter["replays"] - before

    mixed = [(seqs[0], 26, 1), (seqs[1], 37, 1), (seqs[2], 56, 4)]  # two decode rows and a 4-token verify row
    forward([(seq, 0, computed) for seq, computed, _ in mixed], False)  # the contexts the rows extend
    eager, _ = forward(mixed, False)
    ours, replays = forward(mixed, True)
    assert ours.shape[0] == 3 and replays == 0 and torch.equal(ours, eager)
    decodes = mixed[:2]
    eager, _ = forward(decodes, False)
    ours, replays = forward(decodes, True)
    assert ours.shape[0] == 2 and replays > 0 and torch.allclose(ours, eager, atol=1e-5)
