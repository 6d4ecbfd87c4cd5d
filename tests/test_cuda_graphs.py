"""Piecewise decode graphs: the bookkeeping (buckets, padding, pieces around eager attention) run on
CPU with a stand-in capture that replays by calling the piece; on CUDA, test_cuda.py replays real
graphs."""

from __future__ import annotations

import torch

from llmctl.engine import LLM, EngineArgs, SamplingParams
from llmctl.engine.cuda_graphs import DecodeGraphs, batch_buckets, maybe_decode_graphs


class ReplayByCalling:
    """Stands in for a captured CUDA graph: replay() runs the piece again."""

    def __init__(self, piece, counter):
        self.piece, self.counter = piece, counter

    def replay(self):
        self.counter["replays"] += 1
        self.piece()


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


def test_graphs_only_on_cuda_and_not_with_enforce_eager():
    assert maybe_decode_graphs(None, None, torch.device("cpu"), torch.float32, 8, False) is None
    assert maybe_decode_graphs(None, None, torch.device("cuda"), torch.float32, 8, True) is None
    assert EngineArgs(enforce_eager=True).enforce_eager


def test_piecewise_replay_gives_the_eager_logits(tiny_models):
    prompts = [[1, 2, 3], list(range(5, 40)), [7] * 17]  # a batch of 3 pads to the bucket of 4
    kwargs = dict(skip_tokenizer_init=True, dtype="float32", device="cpu", max_model_len=256, max_num_seqs=8)
    eager_tokens, eager_logits = recorded_logits(LLM(str(tiny_models["qwen2"]), **kwargs), prompts)

    llm = LLM(str(tiny_models["qwen2"]), **kwargs)
    runner = llm.engine.runner
    counter = {"replays": 0, "captures": 0}

    def capture(piece, pool):
        counter["captures"] += 1
        return ReplayByCalling(piece, counter)

    runner.graphs = DecodeGraphs(runner.model, runner.attention, 8, runner.device, torch.float32,
                                 capture=capture, new_pool=lambda: None)
    tokens, logits = recorded_logits(llm, prompts)

    layers = len(runner.model.model.layers)
    assert counter["captures"] > 0 and counter["captures"] % (layers + 1) == 0  # one graph per piece
    assert counter["replays"] >= (layers + 1) * 5  # decode steps went through the graphs
    assert runner.graphs.num_captured >= 1 and set(runner.graphs._captured) <= {1, 2, 4}
    assert tokens == eager_tokens
    for ours, expected in zip(logits, eager_logits):
        assert torch.allclose(ours, expected, atol=1e-5)
    assert llm.engine.block_manager.num_free_blocks == llm.engine.block_manager.num_blocks


def test_prefill_steps_stay_eager(tiny_models):
    llm = LLM(str(tiny_models["llama"]), skip_tokenizer_init=True, dtype="float32", device="cpu", max_model_len=128)
    runner = llm.engine.runner
    counter = {"replays": 0}
    runner.graphs = DecodeGraphs(runner.model, runner.attention, 4, runner.device, torch.float32,
                                 capture=lambda piece, pool: ReplayByCalling(piece, counter), new_pool=lambda: None)
    llm.generate([list(range(1, 30))], SamplingParams(max_tokens=1, ignore_eos=True))  # one prefill step only
    assert counter["replays"] == 0 and runner.graphs.num_captured == 0
    llm.generate([list(range(1, 30))] * 6, SamplingParams(max_tokens=3, ignore_eos=True))  # 6 rows > bucket 4
    assert runner.graphs.num_captured == 0
