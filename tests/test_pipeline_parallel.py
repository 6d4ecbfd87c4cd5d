"""Pipeline parallelism (issue 43): the decoder layers split over stages, hidden states and residuals passed
between them point to point, each stage's KV pool for its layers only, the logits sent back to the driver."""

from __future__ import annotations

import os
import signal
import time

import pytest

from llmctl.engine import LLM, EngineArgs, SamplingParams
from llmctl.engine.errors import EngineArgsError, RankFailedError
from llmctl.engine.parallel import TensorParallelError, pipeline_layer_ranges


def test_layers_split_evenly_or_as_the_partition_says():
    assert pipeline_layer_ranges(7, 2) == [range(0, 4), range(4, 7)]
    assert pipeline_layer_ranges(6, 3) == [range(0, 2), range(2, 4), range(4, 6)]
    assert pipeline_layer_ranges(6, 2, (1, 5)) == [range(0, 1), range(1, 6)]
    with pytest.raises(TensorParallelError, match="sums to 5, but the model has 6"):
        pipeline_layer_ranges(6, 2, (2, 3))
    with pytest.raises(TensorParallelError, match="cannot fill 3 pipeline stages"):
        pipeline_layer_ranges(2, 3)


def test_pipeline_flags_place_the_ranks():
    placed = EngineArgs(pipeline_parallel_size=2, tensor_parallel_size=2, pp_layer_partition="1,1").parallel_for({})
    assert (placed.world_size, placed.tensor_parallel_size, placed.pipeline_parallel_size) == (4, 2, 2)
    assert placed.layer_partition == (1, 1)
    with pytest.raises(EngineArgsError, match="one positive layer count for each of the 2"):
        EngineArgs(pipeline_parallel_size=2, pp_layer_partition="2")
    with pytest.raises(EngineArgsError, match="comma-separated layer counts"):
        EngineArgs(pipeline_parallel_size=2, pp_layer_partition="a,b")
    torchrun = {"RANK": "1", "WORLD_SIZE": "4", "LOCAL_RANK": "1", "LOCAL_WORLD_SIZE": "4", "GROUP_RANK": "0",
                "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29400"}
    under_torchrun = EngineArgs(pipeline_parallel_size=2).parallel_for(torchrun)  # T = WORLD_SIZE / P
    assert (under_torchrun.tensor_parallel_size, under_torchrun.pipeline_parallel_size) == (2, 2)
    with pytest.raises(EngineArgsError, match=r"\(6\) differs from torchrun's WORLD_SIZE 4"):
        EngineArgs(pipeline_parallel_size=2, tensor_parallel_size=3).parallel_for(torchrun)


def test_speculative_decoding_with_pipeline_stages_is_refused_by_name(tiny_models):
    with pytest.raises(EngineArgsError, match="speculative decoding .* with pipeline_parallel_size > 1"):
        _llm(tiny_models["llama"], pipeline_parallel_size=2,
             speculative_config={"method": "ngram", "num_speculative_tokens": 2})


def _llm(folder, **extra) -> LLM:
    return LLM(model=str(folder), device="cpu", dtype="float32", max_model_len=128, block_size=16,
               skip_tokenizer_init=True, **extra)


def _decode_with_an_abort_in_flight(engine, prompts, params) -> tuple[str, dict]:
    """Run `prompts` on a two-stage engine, aborting a request whose micro-batch is in flight."""
    for i, prompt in enumerate(prompts):
        engine.add_request(str(i), prompt, params)
    engine.step()
    assert [len(out.scheduled) for out, _ in engine._in_flight] == [len(prompts) // 2]  # the second micro-batch
    in_flight = engine._in_flight[0][0].scheduled[0].seq.request_id
    assert engine.abort_request(in_flight).finished
    got = {}
    while engine.has_unfinished_requests():
        for output in engine.step().outputs:
            if output.finished:
                got[output.request_id] = output.outputs[0].token_ids
    assert not engine._in_flight
    return in_flight, got


def test_two_stages_give_one_ranks_greedy_tokens_through_mixed_batches_chunks_and_micro_batches(tiny_models):
    """A 32-token budget chunks the longer prompts while the others decode (mixed batches); the shared prefix
    hits the prefix cache. Then eight decoding sequences run as two micro-batches of four, one in each stage;
    a request aborted while its micro-batch is in flight gets no tokens from it, the others one rank's."""
    shared = [(7 * i) % 500 for i in range(40)]
    prompts = [shared + [1, 2, 3], [9, 8, 7, 9, 8, 7], shared + [4, 5], list(range(60, 110))]
    decodes = [[3 + i, 40 + i, 7] for i in range(8)]
    params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    settings = dict(max_num_batched_tokens=32, num_kv_blocks=24, enable_prefix_caching=True)
    with _llm(tiny_models["llama"], **settings) as one:
        want = [o.outputs[0].token_ids for o in one.generate(prompts, params)]
        want_decodes = [o.outputs[0].token_ids for o in one.generate(decodes, params)]
    with _llm(tiny_models["llama"], pipeline_parallel_size=2, **settings) as pp:
        runner = pp.engine.executor.runner
        assert len(runner.kv_caches) == 1 and runner.stage_layers == range(0, 1)  # stage 0 holds layer 0 only
        assert runner.model.lm_head is None and runner.model.model.norm is None
        got = [o.outputs[0].token_ids for o in pp.generate(prompts, params)]
        aborted, got_decodes = _decode_with_an_abort_in_flight(pp.engine, decodes, params)
    assert got == want
    assert aborted not in got_decodes
    assert got_decodes == {str(i): w for i, w in enumerate(want_decodes) if str(i) != aborted}


def test_each_micro_batch_keeps_its_own_decode_rows_so_steady_decode_gathers_nothing(tiny_models, cpu_kernels_off):
    """The torch decode path keeps each micro-batch's K/V rows in the micro-batch's own workspace: two micro-batches
    alternating through one stage must not evict each other's rows (each step would gather every context from the
    pool again). Stage 0 runs in this process: after each sequence's first decode step, none is gathered."""
    decodes = [[3 + i, 40 + i, 7, 9] for i in range(8)]
    params = SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True)
    with _llm(tiny_models["llama"], **dict(num_kv_blocks=24)) as one:
        want = [o.outputs[0].token_ids for o in one.generate(decodes, params)]
    with _llm(tiny_models["llama"], pipeline_parallel_size=2, num_kv_blocks=24) as pp:
        attention = pp.engine.executor.runner.attention
        assert len(attention.workspaces) == 2
        gathered = []
        for slot, workspace in enumerate(attention.workspaces):
            plan = workspace.plan

            def recording_plan(seq_ids, *args, _plan=plan, _slot=slot, **kwargs):
                made = _plan(seq_ids, *args, **kwargs)
                gathered.append((_slot, frozenset(seq_ids), 0 if made.fill_rows is None else made.fill_rows.numel()))
                return made

            workspace.plan = recording_plan
        got = [o.outputs[0].token_ids for o in pp.generate(decodes, params)]
    assert got == want
    members = {}
    for slot, seq_ids, _ in gathered:
        members.setdefault(slot, seq_ids)
        assert seq_ids == members[slot]  # a slot's micro-batch holds the same sequences each step
    assert members[0].isdisjoint(members[1])
    assert [fills for _, _, fills in gathered[2:]] == [0] * (len(gathered) - 2)  # each slot gathers on its first step


def test_two_stages_of_two_tensor_parallel_ranks_give_one_ranks_tokens_and_a_killed_rank_fails_loudly(tiny_models):
    """Four ranks: each stage's heads split over two ranks, hidden states passed between matching ranks. Then
    a rank of the last stage is killed mid-request: the request fails with the rank named within the
    collective timeout, and no rank process is left (each exits non-zero)."""
    prompts = [[5, 6, 7, 8, 9] * 4, [11, 12, 13], list(range(30, 50))]
    params = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
    settings = dict(max_num_batched_tokens=16, num_kv_blocks=12)
    with _llm(tiny_models["llama"], **settings) as one:
        want = [o.outputs[0].token_ids for o in one.generate(prompts, params)]
    with _llm(tiny_models["llama"], pipeline_parallel_size=2, tensor_parallel_size=2, collective_timeout_s=5.0,
              **settings) as pp:
        assert pp.engine.executor.runner.num_heads == 2  # 4 heads over 2 tensor-parallel ranks
        got = [o.outputs[0].token_ids for o in pp.generate(prompts, params)]
        ranks = pp.engine.executor._processes
        killed = []

        def kill_once(index, output):
            if not killed:
                os.kill(ranks[3].pid, signal.SIGKILL)
                killed.append(time.monotonic())

        with pytest.raises(RankFailedError, match="rank 3"):
            pp.generate([[1, 2, 3]], SamplingParams(max_tokens=50, temperature=0.0, ignore_eos=True),
                        on_output=kill_once)
        assert time.monotonic() - killed[0] < 20
    assert got == want
    assert all(process.exitcode not in (None, 0) for process in ranks.values())
