"""The multi-rank executor (issue 17): the step message, where ranks run (flags and torchrun's
environment), an engine on two gloo ranks giving TP=1's greedy tokens through chunked prefill,
preemption, prefix-cache hits and speculative verify rows, and a hung rank failing the engine within
the collective timeout (never a silent hang); with async scheduling, two ranks giving the serial engine's
tokens and log-probs, rank 1's placeholder inputs being the ids rank 0 sampled on the step before."""

from __future__ import annotations

import os
import signal
import time

import pytest
import torch

from llmctl.engine import LLM, EngineArgs, SamplingParams
from llmctl.engine.errors import EngineArgsError, RankFailedError
from llmctl.engine.model_runner import HostVectors, StepInputs
from llmctl.engine.executor.multiproc_executor import HEADER_LEN, pack_step, unpack_step
from test_async_scheduling import Workload, assert_same_outputs, engine_for, run, stop_string_for
from test_async_scheduling import prompts as async_prompts

TORCHRUN = {"RANK": "3", "WORLD_SIZE": "4", "LOCAL_RANK": "1", "LOCAL_WORLD_SIZE": "2", "GROUP_RANK": "1",
            "MASTER_ADDR": "10.0.0.1", "MASTER_PORT": "29400"}


def test_a_step_message_carries_every_forward_input_and_the_kept_state_changes():
    inputs = StepInputs(torch.tensor([5, 6, 7, 8]), torch.tensor([9, 0, 1, 2]), torch.tensor([41, 16, 17, 18]),
                        torch.tensor([0, 3]), seq_ids=[4, 2], query_lens=[1, 3], context_lens=[10, 3],
                        block_tables=[[0, 2, 7], [1]], micro_batch=1)
    header, payload = pack_step(inputs, [(4, 9), (11, 2)], release=True, placeholder_rows=[0, 3])
    assert header.shape == (HEADER_LEN,) and payload.dtype == torch.long
    got, truncations, release, placeholder_rows = unpack_step(header, payload, torch.device("cpu"))
    for name in ("input_ids", "positions", "slot_mapping", "logits_indices"):
        assert torch.equal(getattr(got, name), getattr(inputs, name))
    assert (got.seq_ids, got.query_lens, got.context_lens, got.block_tables, got.micro_batch) == (
        [4, 2], [1, 3], [10, 3], [[0, 2, 7], [1]], 1)
    assert truncations == [(4, 9), (11, 2)] and release and placeholder_rows.tolist() == [0, 3]
    empty, none, kept, no_rows = unpack_step(*pack_step(StepInputs(*(torch.tensor([], dtype=torch.long),) * 4,
                                                                   [], [], [], []), [], False), torch.device("cpu"))
    assert empty.seq_ids == [] and empty.block_tables == [] and none == [] and not kept and not no_rows.numel()


def test_a_driver_on_a_gpu_packs_the_host_lists_it_staged_the_step_from():
    """The step's tensors may be on the device with a step in flight: packing reads the host copy, never them."""
    on_device = torch.empty(3, dtype=torch.long, device="meta")  # any read of these would fail
    inputs = StepInputs(on_device, on_device, on_device, on_device[:1], seq_ids=[7], query_lens=[3],
                        context_lens=[3], block_tables=[[2]], host=HostVectors([5, 0, 6], [0, 1, 2], [32, 33, 34], [2]))
    header, payload = pack_step(inputs, [], False, placeholder_rows=[1])
    got = unpack_step(header, payload, torch.device("cpu"))
    assert got.inputs.input_ids.tolist() == [5, 0, 6] and got.inputs.slot_mapping.tolist() == [32, 33, 34]
    assert got.inputs.logits_indices.tolist() == [2] and got.placeholder_rows.tolist() == [1]


def test_ranks_are_placed_from_the_flags():
    one = EngineArgs().parallel_for({})
    assert (one.world_size, one.master_port, one.runs_engine) == (1, 0, True)  # port 0: a free one
    node1 = EngineArgs(tensor_parallel_size=4, nnodes=2, node_rank=1, master_addr="10.0.0.1").parallel_for({})
    assert list(node1.node_ranks) == [2, 3] and not node1.runs_engine and node1.master_port == 29500
    assert list(EngineArgs(tensor_parallel_size=4, nnodes=2).parallel_for({}).node_ranks) == [0, 1]


def test_torchrun_environment_places_this_process_as_one_rank():
    placed = EngineArgs().parallel_for(TORCHRUN)
    assert placed.torchrun and (placed.rank, placed.world_size, placed.nnodes, placed.node_rank) == (3, 4, 2, 1)
    assert (placed.master_addr, placed.master_port, placed.runs_engine) == ("10.0.0.1", 29400, False)
    assert EngineArgs(tensor_parallel_size=4).parallel_for({**TORCHRUN, "RANK": "0"}).runs_engine
    with pytest.raises(EngineArgsError, match="differs from torchrun's WORLD_SIZE 4"):
        EngineArgs(tensor_parallel_size=2).parallel_for(TORCHRUN)


@pytest.mark.parametrize("flags, message", [
    (dict(tensor_parallel_size=3, nnodes=2), "must be a multiple of nnodes"),
    (dict(tensor_parallel_size=2, nnodes=2, node_rank=2), "node_rank must be in 0..1"),
    (dict(tensor_parallel_size=2, nnodes=2, master_port=0), "works on one node only"),
    (dict(master_port=70000), "master_port must be in 0..65535"),
    (dict(tensor_parallel_size=0), "tensor_parallel_size must be a positive integer"),
])
def test_bad_placements_are_refused_naming_the_flag(flags, message):
    with pytest.raises(EngineArgsError, match=message):
        EngineArgs(**flags)


def test_a_node_above_zero_cannot_run_the_engine(tiny_models):
    with pytest.raises(EngineArgsError, match="node_rank 1 runs model ranks only"):
        LLM(model=str(tiny_models["llama"]), device="cpu", tensor_parallel_size=2, nnodes=2, node_rank=1,
            master_port=29999, skip_tokenizer_init=True)


def _llm(folder, **extra) -> LLM:
    return LLM(model=str(folder), device="cpu", dtype="float32", max_model_len=128, block_size=16,
               skip_tokenizer_init=True, **extra)


def _mixed_workload():
    shared = [(7 * i) % 500 for i in range(40)]  # a 2-block prefix the later prompts find cached
    prompts = [shared + [1, 2, 3], [9, 8, 7, 9, 8, 7, 9, 8, 7, 9, 8], shared + [4, 5], list(range(60, 120))]
    return prompts, SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)


def test_two_ranks_give_the_greedy_tokens_of_one_through_chunks_preemption_prefix_hits_and_verify_rows(tiny_models):
    """A small token budget chunks the prefills, 10 blocks cannot hold the four sequences (preemption),
    the shared prefix hits the prefix cache, n-gram drafts make verify rows whose rejections truncate the
    kept decode K/V on every rank."""
    prompts, params = _mixed_workload()
    settings = dict(max_num_batched_tokens=32, num_kv_blocks=10, enable_prefix_caching=True,
                    speculative_config={"method": "ngram", "num_speculative_tokens": 3})
    want = [o.outputs[0].token_ids for o in _llm(tiny_models["llama"], **settings).generate(prompts, params)]
    tp = _llm(tiny_models["llama"], tensor_parallel_size=2, **settings)
    try:
        got = [o.outputs[0].token_ids for o in tp.generate(prompts, params)]
        preemptions = tp.engine.scheduler.num_preemptions
        drafts = tp.engine.get_stats()
    finally:
        tp.engine.shutdown()
    assert got == want
    assert preemptions > 0
    # drafts were verified, and some rejected (the truncations the other rank applies with the next step)
    assert 0 < drafts["spec_decode_num_accepted_tokens"] < drafts["spec_decode_num_draft_tokens"]


def async_workload(folder, **engine_args) -> tuple[Workload, dict[str, int]]:
    """Greedy and seeded rows with log-probs, n = 2 siblings arriving late, max_tokens 1, chunked prompts, and a stop
    string picked from one rank's greedy text of its prompt (TP=2 gives TP=1's greedy tokens)."""
    prompt = async_prompts(1, 6)[0]
    long_prompts = async_prompts(5, 17)
    return [("greedy", long_prompts[0], SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True, logprobs=2)),
            ("seeded", long_prompts[1], SamplingParams(temperature=0.9, top_k=20, seed=7, max_tokens=8,
                                                       ignore_eos=True, logprobs=1)),
            ("siblings", long_prompts[2], SamplingParams(temperature=1.0, seed=11, n=2, max_tokens=6, ignore_eos=True)),
            ("aborted", long_prompts[3], SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True)),
            ("one", long_prompts[4], SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True)),
            ("stopped", prompt, SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True,
                                               stop=[stop_string_for(folder, prompt, **engine_args)]))], {"siblings": 3}


def _abort_at_step_4(engine, step: int) -> None:
    if step == 4:
        engine.abort_request("aborted")


def tp2_run(folder, overlap: bool, workload: Workload, arrivals: dict[str, int],
            **engine_args) -> tuple[dict, list[int], bool]:
    """The workload's finals on a TP=2 engine, the placeholders of each step's fill on rank 0, and whether the
    engine resolved async scheduling on."""
    engine = engine_for(folder, overlap, skip_tokenizer_init=False, tensor_parallel_size=2, **engine_args)
    filled: list[int] = []
    fill = engine.executor.runner.fill_placeholders
    engine.executor.runner.fill_placeholders = lambda step: (filled.append(len(step.placeholders)), fill(step))[1]
    try:
        return run(engine, workload, arrivals, on_step=_abort_at_step_4), filled, engine.async_scheduling
    finally:
        engine.shutdown()


def test_two_ranks_with_async_scheduling_give_the_serial_engines_tokens_and_logprobs(tiny_chat_model):
    """Rank 0 samples and sends each step's ids to rank 1 on the model group: the decode rows' inputs there are
    the ids rank 0 sampled (were they not, rank 1's half of every all-reduce would be another token's)."""
    check_tp2_async_scheduling(tiny_chat_model)


def check_tp2_async_scheduling(folder, **engine_args) -> None:
    workload, arrivals = async_workload(folder, **engine_args)
    serial, serial_filled, serial_async = tp2_run(folder, False, workload, arrivals, **engine_args)
    overlap, filled, resolved_async = tp2_run(folder, True, workload, arrivals, **engine_args)
    assert not serial_async and resolved_async
    assert not any(serial_filled) and sum(filled) > 20  # decode rows after the first take the ids in flight
    assert_same_outputs(overlap, serial)
    assert "aborted" not in serial and "aborted" not in overlap  # an abort returns its output from abort_request
    assert serial["stopped"][0][2] == "stop" and len(serial["stopped"][0][0]) < 12
    assert [len(s[0]) for s in serial["siblings"]] == [6, 6] and len(serial["one"][0][0]) == 1


def test_a_hung_rank_fails_the_step_within_the_collective_timeout(tiny_models):
    tp = _llm(tiny_models["llama"], tensor_parallel_size=2, num_kv_blocks=32, collective_timeout_s=3.0)
    executor = tp.engine.executor
    (worker,) = executor._processes.values()
    params = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
    try:
        assert tp.generate([[1, 2, 3]], params)[0].outputs[0].token_ids
        os.kill(worker.pid, signal.SIGSTOP)
        start = time.monotonic()
        with pytest.raises(RankFailedError, match="multi-rank step failed"):
            tp.generate([[4, 5, 6]], params)
        assert time.monotonic() - start < 30
        with pytest.raises(RankFailedError):  # failed for good: the ranks are out of step
            tp.engine.check_health()
    finally:
        tp.engine.shutdown()
    assert not worker.is_alive()  # shutdown killed the stopped rank



def test_a_start_up_error_is_raised_as_itself_and_leaves_no_rank(tiny_models):
    """Every rank finds the pool too small for one sequence: the engine raises that error (not a lost-rank
    one), and no rank process is left."""
    import multiprocessing

    with pytest.raises(EngineArgsError, match="the KV cache holds 1 blocks"):
        _llm(tiny_models["llama"], tensor_parallel_size=2, num_kv_blocks=1)
    assert not [p for p in multiprocessing.active_children() if p.name.startswith("llmctl-rank-")]
