"""Async scheduling (--async-scheduling): the engine launches step N+1 before it applies step N, feeding N's
sampled ids into N+1's inputs on the device. On CPU the same machinery runs on CPU tensors, so these tests hold
the overlap engine to the serial engine's outputs: the same tokens and log-probs under greedy and seeded
sampling, stops that end a request one step late (its extra row discarded, its blocks freed), preemption,
prefix caching, aborts, n > 1, chunked prefill and mixed prefill + decode batches."""

from __future__ import annotations

from typing import Callable, Optional

import pytest
import torch

from llmctl.engine import EngineArgs, SamplingParams
from llmctl.engine.errors import EngineArgsError
from llmctl.engine.llm_engine import LLMEngine

Workload = list[tuple[str, list[int], SamplingParams]]


@pytest.fixture(autouse=True)
def _restore_torch_threads():
    """The engines here run on one thread (--num-threads 1 sets torch's process-wide count): put it back."""
    threads = torch.get_num_threads()
    yield
    torch.set_num_threads(threads)


def engine_for(folder, overlap: bool, **args) -> LLMEngine:
    settings = dict(model=str(folder), device="cpu", dtype="float32", skip_tokenizer_init=True, block_size=4,
                    max_num_batched_tokens=24, max_num_seqs=6, num_kv_blocks=96, max_model_len=64,
                    num_threads=1)
    return LLMEngine(EngineArgs(**{**settings, **args, "async_scheduling": overlap}))


def run(engine: LLMEngine, workload: Workload, arrivals: Optional[dict[str, int]] = None,
        on_step: Optional[Callable[[LLMEngine, int], None]] = None) -> dict[str, tuple]:
    """Run the workload to the end (request r added at step arrivals[r], default 0); each request's final
    (token ids, log-probs, finish reason) per sample. Checks that no KV block is left held."""
    arrivals = arrivals or {}
    pending = list(workload)
    finals: dict[str, tuple] = {}
    step = 0
    while pending or engine.has_unfinished_requests():
        for item in [w for w in pending if arrivals.get(w[0], 0) <= step]:
            engine.add_request(*item)
            pending.remove(item)
        if on_step is not None:
            on_step(engine, step)
        for output in engine.step().outputs:
            if output.finished:
                finals[output.request_id] = tuple((tuple(c.token_ids), c.logprobs, c.finish_reason)
                                                  for c in output.outputs)
        step += 1
        assert step < 500
    blocks = engine.block_manager
    blocks.check_invariants([])
    assert blocks.num_free_blocks == blocks.num_blocks
    assert engine._launched is None
    return finals


def both(folder, workload: Workload, arrivals=None, **args) -> tuple[dict, dict, LLMEngine]:
    serial = run(engine_for(folder, False, **args), workload, arrivals)
    overlap_engine = engine_for(folder, True, **args)
    return serial, run(overlap_engine, workload, arrivals), overlap_engine


def assert_same_outputs(overlap: dict, serial: dict) -> None:
    """The same requests, tokens and finish reasons; the same log-prob entries, their values equal up to float32
    rounding (a sequence's rows may share a step with other rows than in the serial engine: n > 1 siblings start
    one step later, a finished row's seat frees one step later)."""
    assert overlap.keys() == serial.keys()
    for request_id, samples in serial.items():
        assert [s[0::2] for s in overlap[request_id]] == [s[0::2] for s in samples], request_id
        for (_, got, _), (_, want, _) in zip(overlap[request_id], samples):
            assert (got is None) == (want is None)
            for got_entry, want_entry in zip(got or [], want or []):
                assert got_entry.keys() == want_entry.keys()
                assert list(got_entry.values()) == pytest.approx(list(want_entry.values()), rel=1e-5, abs=1e-5)


def prompts(count: int, length: int, start: int = 3) -> list[list[int]]:
    return [[(start + 7 * i + 13 * j) % 500 + 2 for j in range(length + 3 * i)] for i in range(count)]


def test_greedy_seeded_and_logprobs_match_the_serial_engine_with_chunked_prefill(tiny_models):
    long_prompts = prompts(5, 17)
    params = [SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True, logprobs=2),
              SamplingParams(temperature=0.9, top_k=20, seed=7, max_tokens=9, ignore_eos=True),
              SamplingParams(temperature=0.7, top_p=0.9, seed=3, max_tokens=14, ignore_eos=True, logprobs=1),
              SamplingParams(temperature=0.0, max_tokens=5, ignore_eos=True, min_tokens=3),
              SamplingParams(temperature=1.0, seed=11, n=3, max_tokens=6, ignore_eos=True)]
    workload = [(f"r{i}", p, sp) for i, (p, sp) in enumerate(zip(long_prompts, params))]
    serial, overlap, _ = both(tiny_models["llama"], workload, arrivals={"r2": 3, "r3": 5, "r4": 6})
    assert_same_outputs(overlap, serial)
    assert overlap["r0"] == serial["r0"]  # alone in its batches until r2 arrives: bitwise the same log-probs
    assert all(len(serial[request_id][0][0]) == sp.max_tokens for request_id, _, sp in workload)


def test_token_stops_and_length_end_a_request_one_step_late_without_leaking_blocks(tiny_models):
    folder = tiny_models["qwen2"]
    free_run = run(engine_for(folder, False), [("probe", prompts(1, 9)[0],
                                                 SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True))])
    tokens = free_run["probe"][0][0]
    workload = [("stop-token", prompts(1, 9)[0], SamplingParams(temperature=0.0, max_tokens=8,
                                                                 stop_token_ids=[tokens[3]])),
                ("length", prompts(2, 6)[1], SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)),
                ("one", prompts(3, 5)[2], SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True))]
    serial, overlap, _ = both(folder, workload)
    assert_same_outputs(overlap, serial)
    assert serial["stop-token"][0][2] == "stop" and serial["stop-token"][0][0][-1] == tokens[3]


def test_max_model_len_ends_a_sequence_at_the_same_token(tiny_models):
    workload = [("long", prompts(1, 20)[0], SamplingParams(temperature=0.0, ignore_eos=True))]
    serial, overlap, _ = both(tiny_models["llama"], workload, max_model_len=28)
    assert_same_outputs(overlap, serial)
    assert len(serial["long"][0][0]) == 8


def test_preemption_under_a_small_kv_pool_gives_the_serial_tokens(tiny_models):
    workload = [(f"r{i}", p, SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True))
                for i, p in enumerate(prompts(4, 10))]
    serial, overlap, engine = both(tiny_models["llama"], workload, num_kv_blocks=16, max_num_batched_tokens=32)
    assert engine.scheduler.num_preemptions > 0
    assert_same_outputs(overlap, serial)


def test_prefix_cache_hits_and_n_siblings_match_the_serial_engine(tiny_models):
    shared = prompts(1, 16)[0]
    workload = [("first", shared + [5, 6], SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)),
                ("second", shared + [9], SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)),
                ("siblings", shared, SamplingParams(temperature=0.8, seed=5, n=2, max_tokens=5, ignore_eos=True))]
    serial, overlap, engine = both(tiny_models["llama"], workload, arrivals={"second": 6, "siblings": 8})
    assert engine.block_manager.prefix_hits > 0
    assert_same_outputs(overlap, serial)


def test_an_abort_mid_stream_leaves_the_others_as_in_the_serial_engine(tiny_models):
    workload = [(f"r{i}", p, SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True))
                for i, p in enumerate(prompts(3, 7))]

    def abort_r1(engine: LLMEngine, step: int) -> None:
        if step == 4:
            engine.abort_request("r1")

    folder = tiny_models["llama"]
    serial = run(engine_for(folder, False), workload, on_step=abort_r1)
    overlap = run(engine_for(folder, True), workload, on_step=abort_r1)
    assert {k: v for k, v in overlap.items() if k != "r1"} == {k: v for k, v in serial.items() if k != "r1"}
    assert "r1" not in overlap and "r1" not in serial  # an abort returns its output from abort_request


def test_penalties_wait_for_the_step_before_and_match_the_serial_engine(tiny_models):
    workload = [("penalised", prompts(1, 8)[0], SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True,
                                                              repetition_penalty=1.3, presence_penalty=0.5)),
                ("plain", prompts(2, 8)[1], SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True))]
    serial, overlap, _ = both(tiny_models["llama"], workload)
    assert_same_outputs(overlap, serial)


def test_inputs_come_from_the_device_ids_of_the_step_in_flight(tiny_models):
    """Each decode row after the first is launched before its input token reached the host."""
    engine = engine_for(tiny_models["llama"], True)
    runner = engine.executor.runner
    filled = []
    fill = runner.fill_placeholders
    runner.fill_placeholders = lambda step: (filled.append(len(step.placeholders)), fill(step))[1]
    run(engine, [("r", prompts(1, 5)[0], SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True))])
    assert filled == [0, 1, 1, 1, 1, 1]


def test_the_default_is_on_for_cuda_only_and_blocked_features_are_named():
    assert EngineArgs().with_device_defaults("cuda").async_scheduling is True
    assert EngineArgs().with_device_defaults("cpu").async_scheduling is False
    assert EngineArgs(async_scheduling=True).with_device_defaults("cpu").async_scheduling is True
    assert EngineArgs(tensor_parallel_size=2).with_device_defaults("cuda").async_scheduling is True
    assert EngineArgs(tensor_parallel_size=2).with_device_defaults("cpu").async_scheduling is False
    spec = '{"method": "ngram", "num_speculative_tokens": 2}'
    assert EngineArgs(speculative_config=spec).with_device_defaults("cuda").async_scheduling is False
    assert EngineArgs(pipeline_parallel_size=2).with_device_defaults("cuda").async_scheduling is False
    for blocked, name in ((dict(speculative_config=spec), "speculative decoding"),
                          (dict(pipeline_parallel_size=2), "pipeline parallelism"),
                          (dict(tensor_parallel_size=2, pipeline_parallel_size=2), "pipeline parallelism"),
                          (dict(tensor_parallel_size=2, speculative_config=spec), "speculative decoding")):
        with pytest.raises(EngineArgsError, match=name):
            EngineArgs(async_scheduling=True, **blocked)


def test_a_step_that_runs_out_of_memory_with_a_step_in_flight_is_retried_smaller(tiny_models):
    from test_oom_recovery import InjectedOOM

    workload = [(f"r{i}", p, SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True))
                for i, p in enumerate(prompts(4, 9))]
    arrivals = {"r2": 3, "r3": 4}
    folder = tiny_models["llama"]
    serial = run(engine_for(folder, False), workload, arrivals)
    engine = engine_for(folder, True)
    oom = InjectedOOM(engine.executor.runner, max_tokens=12)
    overlap = run(engine, workload, arrivals)
    assert oom.events and engine.num_oom_retries == len(oom.events)
    assert_same_outputs(overlap, serial)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_on_cuda_the_overlap_engine_gives_the_serial_engines_tokens(tiny_models):
    workload = [(f"r{i}", p, SamplingParams(temperature=0.0 if i % 2 else 0.8, seed=i, max_tokens=10,
                                            ignore_eos=True, logprobs=1))
                for i, p in enumerate(prompts(4, 9))]
    serial, overlap, engine = both(tiny_models["llama"], workload, {"r3": 2}, device="cuda")
    assert engine.async_scheduling
    assert_same_outputs(overlap, serial)


def stop_string_for(folder, prompt: list[int], **args) -> str:
    """Two characters from the middle of the serial engine's greedy text of `prompt` (12 tokens)."""
    probe = engine_for(folder, False, skip_tokenizer_init=False, **args)
    probe.add_request("probe", prompt, SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True))
    while probe.has_unfinished_requests():
        text = next((o.outputs[0].text for o in probe.step().outputs if o.finished), None)
    return text[len(text) // 2:len(text) // 2 + 2]


def test_a_stop_string_ends_the_request_at_the_serial_engines_token(tiny_chat_model):
    prompt = prompts(1, 6)[0]
    stop = stop_string_for(tiny_chat_model, prompt)
    workload = [("stopped", prompt, SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True, stop=[stop])),
                ("bystander", prompts(2, 6)[1], SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True))]
    serial, overlap, _ = both(tiny_chat_model, workload, skip_tokenizer_init=False)
    assert_same_outputs(overlap, serial)
    assert serial["stopped"][0][2] == "stop" and len(serial["stopped"][0][0]) < 12
