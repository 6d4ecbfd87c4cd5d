"""Attention data parallelism with expert parallelism (issue 43; `llmctl serve -dp D --enable-expert-parallel` on a
mixture-of-experts model): the experts are dealt over every replica's ranks, each MoE layer gathers every
replica's tokens and hands each replica back its rows' sums, and the replicas step in lockstep (an idle one
runs idle steps). The rounds and the exchange alone first; then two replicas (and two tensor-parallel replicas,
four expert ranks) answering greedy and seeded requests as one engine does, through chunked prefill,
preemption and prefix hits, while one replica sits idle; a killed rank fails every replica instead of hanging."""

from __future__ import annotations

import asyncio
import threading

import pytest
import torch

from test_moe import moe_models  # noqa: F401 - the tiny Mixtral / Qwen2-MoE / Qwen3-MoE checkpoints

from llmctl.engine import LLM, EngineArgs, SamplingParams
from llmctl.engine.errors import EngineArgsError, EngineDeadError
from llmctl.engine.executor.lockstep import ReplicaLockstep
from llmctl.engine.parallel import ExpertDataParallel, expert_data_parallel
from llmctl.server.replicas import load_replicas, replica_failure
from tests.server_helpers import wait_for

ENGINE = dict(skip_tokenizer_init=True, device="cpu", dtype="float32", max_model_len=96, block_size=16,
              max_num_batched_tokens=32, num_kv_blocks=6, max_num_seqs=3, enable_prefix_caching=True)
SHARED = [(7 * i) % 256 for i in range(40)]
PROMPTS = [SHARED + [1, 2, 3], [9, 8, 7], SHARED + [4, 5], list(range(60, 110)), [200, 17], SHARED + [6]]


def _params(i: int) -> SamplingParams:
    """Greedy and seeded sampling, alternating."""
    if i % 2:
        return SamplingParams(temperature=0.9, seed=100 + i, max_tokens=10, ignore_eos=True)
    return SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)


def test_a_forward_opens_a_round_that_every_other_replica_runs_once():
    lockstep = ReplicaLockstep(2)
    first, second = lockstep.member(0), lockstep.member(1)
    first.join_round()  # opens round 1
    assert (first.behind, second.behind) == (0, 1)
    second.join_round()  # runs round 1 (opens nothing)
    assert (first.behind, second.behind) == (0, 0)
    second.join_round()
    second.join_round()  # two rounds ahead: replica 0 owes both
    assert (first.behind, first.joined, second.joined) == (2, 1, 3)
    first.wait(lambda: False, timeout_s=30)  # returns at once: a round is owed
    woken = threading.Event()
    waiter = threading.Thread(target=lambda: (second.wait(woken.is_set, 30), woken.set()))
    waiter.start()
    first.join_round()
    first.join_round()
    first.join_round()  # opens round 4: the idle replica 1 wakes
    waiter.join(10)
    assert woken.is_set() and second.behind == 1
    first.leave("stopped")
    with pytest.raises(EngineDeadError, match="data-parallel replica 0 stopped; .* replica 1 cannot step"):
        second.join_round()


def test_dispatch_gathers_every_replicas_tokens_and_combine_returns_each_its_rows_summed():
    """Two replicas as threads (as in the server), 3 tokens and none (idle): the counts exchanged once, each
    replica sees both replicas' tokens in replica order and gets back its rows of the sum of both replicas'
    partial outputs; a layer whose tokens do not match the exchanged counts is refused."""
    import torch.distributed as dist

    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    hidden = [torch.randn(3, 4, generator=torch.Generator().manual_seed(1)), torch.empty(0, 4)]
    results: dict[int, tuple] = {}

    def replica(rank: int) -> None:
        experts = expert_data_parallel("127.0.0.1", store.port, rank, 2, 0, torch.device("cpu"), 30.0)
        experts.begin_step(hidden[rank].shape[0])
        tokens = experts.dispatch(hidden[rank])
        partial = tokens * (rank + 1)  # stands for this rank's experts' sums
        results[rank] = tokens, list(experts.step_counts), experts.combine(partial)

    threads = [threading.Thread(target=replica, args=(rank,)) for rank in range(2)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(30)
    for rank in range(2):
        tokens, counts, mine = results[rank]
        assert counts == [3, 0] and torch.equal(tokens, hidden[0])
        torch.testing.assert_close(mine, hidden[rank] * 3)  # 1x + 2x, this replica's rows only
    with pytest.raises(RuntimeError, match="2 tokens do not match this forward's exchanged counts"):
        ExpertDataParallel(0, 2, None, None, [3, 0]).dispatch(torch.empty(2, 4))


def _answers(replicas, prompts) -> list[list[int]]:
    """Each prompt's tokens, sent round-robin to the replicas at once."""
    async def one(index: int, prompt: list[int]) -> list[int]:
        out = None
        async for out in replicas[index % len(replicas)].generate(prompt, _params(index), request_id=f"r{index}"):
            pass
        return out.outputs[0].token_ids

    async def every() -> list[list[int]]:
        return await asyncio.gather(*(one(i, prompt) for i, prompt in enumerate(prompts)))
    return asyncio.run(every())


def _start(replicas) -> None:
    """At once, as the server's lifespan does: warm-ups run in lockstep rounds too."""
    threads = [threading.Thread(target=replica.start) for replica in replicas]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(60)


@pytest.fixture(scope="module")
def expected(moe_models):
    with LLM(str(moe_models["qwen2_moe"]), **ENGINE) as one:
        return [out.outputs[0].token_ids for out in one.generate(PROMPTS, [_params(i) for i in range(len(PROMPTS))])]


def test_two_replicas_hold_half_the_experts_each_and_answer_as_one_engine(moe_models, expected):
    """Qwen2-MoE (8 experts, a shared expert, a dense layer): replica d holds experts 4d..4d+3; a 32-token budget
    chunks the long prompts, 6 blocks per replica force preemptions, the shared prefix hits the cache. A lone
    request on replica 0 still gets one engine's tokens while replica 1 runs an idle step for each of its steps."""
    replicas = load_replicas(EngineArgs(model=str(moe_models["qwen2_moe"]), data_parallel_size=2,
                                        enable_expert_parallel=True, **ENGINE))
    try:
        _start(replicas)
        assert [r.model_info.expert_placement for r in replicas] == [((0, 1, 2, 3), (4, 5, 6, 7))] * 2
        assert _answers(replicas, PROMPTS) == expected
        stats = [r.get_stats() for r in replicas]
        assert sum(s["num_preemptions"] for s in stats) > 0 and max(s["prefix_cache_hit_rate"] for s in stats) > 0
        assert _answers(replicas[:1], PROMPTS[:1]) == expected[:1]
        joined = [r.engine.executor.member.joined for r in replicas]
        assert joined[0] == joined[1] > 0
    finally:
        for replica in replicas:
            replica.shutdown()


def test_two_tensor_parallel_replicas_deal_the_experts_over_four_ranks_and_a_killed_rank_fails_both(moe_models,
                                                                                                    expected):
    """-dp 2 -tp 2: three processes (the server's is rank 0 of both replicas), four expert ranks of two experts
    each. Killing replica 1's worker fails replica 1 by name, and replica 0, whose experts' exchanges now have no
    peer, fails too at its next step instead of hanging."""
    import multiprocessing
    import os
    import signal

    replicas = load_replicas(EngineArgs(model=str(moe_models["qwen2_moe"]), data_parallel_size=2,
                                        tensor_parallel_size=2, enable_expert_parallel=True, **ENGINE))
    ranks = sorted((p for p in multiprocessing.active_children() if p.name.startswith("llmctl-rank-")),
                   key=lambda p: p.name)
    try:
        _start(replicas)
        assert replicas[1].model_info.expert_placement == ((0, 1), (2, 3), (4, 5), (6, 7))
        assert _answers(replicas, PROMPTS[:4]) == expected[:4]
        os.kill(ranks[1].pid, signal.SIGKILL)  # llmctl-rank-2: replica 1's rank 1
        wait_for(lambda: replica_failure(replicas) is not None, 15, "replica 1 to fail")
        assert "data-parallel replica 1 failed: rank 1 (pid" in replica_failure(replicas)
        with pytest.raises(EngineDeadError, match="data-parallel replica 1 failed"):
            _answers(replicas[:1], PROMPTS[:1])
    finally:
        for replica in replicas:
            replica.shutdown()
    wait_for(lambda: all(not p.is_alive() for p in ranks), 15, "every rank to exit")


def test_an_expert_count_the_replicas_ranks_do_not_divide_is_refused_before_anything_starts(moe_models):
    with pytest.raises(EngineArgsError, match="6 experts are not divisible by the expert-parallel size .4"):
        load_replicas(EngineArgs(model=str(moe_models["mixtral"]), data_parallel_size=4, enable_expert_parallel=True,
                                 **ENGINE))
