"""Data parallelism (`--data-parallel-size`): two replicas of a tiny model behind one server answer a mix
of greedy and seeded requests token for token as one engine does, the balancer spreads a burst over both
(seen in the per-replica `engine`-labelled series, whose sum is the total), and a replica that dies turns
the whole server unhealthy and refuses new requests instead of quietly serving from the other. With
`-dp 2 -tp 2` two tensor-parallel replicas share one process group and answer as one engine does."""

from __future__ import annotations

import asyncio
import threading
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from types import SimpleNamespace

import httpx
import pytest
import torch
from prometheus_client.parser import text_string_to_metric_families

from llmctl.engine import LLM, EngineArgs, SamplingParams
from llmctl.engine.errors import EngineArgsError, EngineDeadError
from llmctl.server.app import ServerSettings
from llmctl.server import runner
from llmctl.server.replicas import ReplicaBalancer, load_replicas, replica_engine_args, replica_failure
from tests.server_helpers import RunningServer, free_port, wait_for

ENGINE = {"device": "cpu", "dtype": "float32", "num_kv_blocks": 64, "max_num_seqs": 4}
PROMPTS = ["To be, or not to be", "The slings and arrows", "ROMEO: But, soft!", "whether 'tis nobler",
           "a sea of troubles", "Héllo wörld"]


def _requests() -> list[dict]:
    """Greedy and seeded-sampling requests of different lengths."""
    return [{"prompt": prompt, "max_tokens": 3 + i, "temperature": 0.0 if i % 2 == 0 else 0.9,
             **({"seed": 100 + i} if i % 2 else {}), "ignore_eos": True} for i, prompt in enumerate(PROMPTS)]


def _series(base_url: str, name: str) -> dict[tuple[str, str], float]:
    """(model_name, engine) -> value of one family's samples named `name`."""
    text = httpx.get(base_url + "/metrics", timeout=10).text
    return {(s.labels["model_name"], s.labels["engine"]): s.value
            for family in text_string_to_metric_families(text) for s in family.samples if s.name == name}


@pytest.fixture(scope="module")
def dp_server(tiny_chat_model):
    args = EngineArgs(model=str(tiny_chat_model), data_parallel_size=2, **ENGINE)
    server = RunningServer(load_replicas(args), ServerSettings(port=free_port(), served_model_name="m")).start()
    try:
        yield server
    finally:
        server.stop()


def test_two_replicas_answer_a_mix_as_one_engine_does_and_share_the_burst(dp_server, tiny_chat_model):
    requests = _requests()
    with httpx.Client(base_url=dp_server.base_url, timeout=60) as client, ThreadPoolExecutor(len(requests)) as pool:
        answers = list(pool.map(lambda body: client.post("/v1/completions", json=body).json(), requests))
    llm = LLM(str(tiny_chat_model), **ENGINE)
    expected = llm.generate([r["prompt"] for r in requests],
                            [SamplingParams(max_tokens=r["max_tokens"], temperature=r["temperature"],
                                            seed=r.get("seed"), ignore_eos=True) for r in requests])
    assert [a["choices"][0]["text"] for a in answers] == [e.outputs[0].text for e in expected]

    finished = _series(dp_server.base_url, "llmctl:request_success_total")
    per_replica = {engine: value for (_, engine), value in finished.items()}
    assert set(per_replica) == {"0", "1"} and min(per_replica.values()) >= 1, per_replica
    assert sum(per_replica.values()) == len(requests)
    generated = _series(dp_server.base_url, "llmctl:generation_tokens_total")
    assert sum(generated.values()) == sum(r["max_tokens"] for r in requests)
    for gauge in ("llmctl:kv_cache_usage_perc", "llmctl:engine_healthy", "llmctl:load_signal"):
        assert set(_series(dp_server.base_url, gauge)) == {("m", "0"), ("m", "1")}, gauge


def test_a_failed_replica_fails_the_server_loudly(tiny_chat_model):
    args = EngineArgs(model=str(tiny_chat_model), data_parallel_size=2, num_threads=2, **ENGINE)
    replicas = load_replicas(args)
    server = RunningServer(replicas, ServerSettings(port=free_port(), served_model_name="m")).start()
    try:
        # Each engine thread steps with its share of the threads (OpenMP's count is per thread).
        threads = [asyncio.run(r.call_in_engine_thread(lambda _engine: torch.get_num_threads())) for r in replicas]
        assert threads == [1, 1]
        _kill(replicas[1])
        health = httpx.get(server.base_url + "/health", timeout=10)
        assert health.status_code == 503 and "data-parallel replica 1 failed" in health.json()["error"]
        refused = httpx.post(server.base_url + "/v1/completions", json={"prompt": "hi", "max_tokens": 2}, timeout=10)
        assert refused.status_code == 503 and "replica 1 failed" in refused.json()["error"]["message"]
        assert replicas[0].is_healthy  # the other replica runs: it is the server that refuses
        assert _series(server.base_url, "llmctl:engine_healthy") == {("m", "0"): 1.0, ("m", "1"): 0.0}
    finally:
        server.stop()


def _kill(engine) -> None:
    """A fatal step failure (as a CUDA error is) on `engine`, and wait until it has died."""
    def fatal_step(*_args) -> None:
        raise RuntimeError("CUDA error: an illegal memory access was encountered")

    engine.engine.executor.runner.execute = fatal_step

    async def run_one() -> None:
        stream = await engine.add_request("kill-replica", "x", SamplingParams(max_tokens=2))
        with pytest.raises(EngineDeadError):
            async for _ in stream:
                pass

    asyncio.run(run_one())
    wait_for(lambda: not engine.is_healthy, what="the replica to die")


@dataclass
class _FakeReplica:
    """An engine as the balancer sees it: a snapshot, its version and health."""
    stats: dict = field(default_factory=lambda: {"max_num_seqs": 4, "num_running_requests": 0})
    stats_version: int = 0
    max_waiting_requests: int | None = None
    dead_error: Exception | None = None
    is_healthy: bool = True

    def get_stats(self) -> dict:
        return dict(self.stats)


def test_the_balancer_picks_the_least_loaded_and_spreads_a_burst_between_snapshots():
    idle, busy = _FakeReplica(), _FakeReplica(stats={"max_num_seqs": 4, "num_running_requests": 3})
    balancer = ReplicaBalancer([busy, idle], ["busy", "idle"])
    assert [balancer.pick() for _ in range(3)] == ["idle", "idle", "idle"]  # tally 3/4 reaches busy's 3/4
    assert balancer.pick() == "busy"  # a tie now: it rotates
    idle.stats_version += 1  # a new snapshot (still idle) restarts idle's tally
    assert balancer.pick() == "idle"
    even = ReplicaBalancer([_FakeReplica(), _FakeReplica()], ["a", "b"])
    assert [even.pick() for _ in range(4)] == ["a", "b", "a", "b"]
    busy.dead_error = EngineDeadError("lost")
    with pytest.raises(EngineDeadError, match="replica 0 failed: lost"):
        balancer.pick()


def check_two_tensor_parallel_replicas(folder, engine: dict) -> None:
    """-dp 2 -tp 2: three processes, the server's being rank 0 of both replicas (one process group for all),
    each replica's other rank its own process; the replicas' greedy and seeded answers are one engine's.
    Killing replica 1's rank fails replica 1 by name (replica 0 stays up; the server would stop), and
    stopping the server stops every rank and releases the process group."""
    import multiprocessing
    import os
    import signal

    import torch.distributed as dist

    replicas = load_replicas(EngineArgs(model=str(folder), data_parallel_size=2, tensor_parallel_size=2, **engine))
    ranks = sorted((p for p in multiprocessing.active_children() if p.name.startswith("llmctl-rank-")),
                   key=lambda p: p.name)
    assert [p.name for p in ranks] == ["llmctl-rank-1", "llmctl-rank-2"]
    assert [e.engine.executor.runner.num_heads for e in replicas] == [2, 2]  # 4 heads over 2 ranks each
    requests = _requests()[:4]
    server = RunningServer(replicas, ServerSettings(port=free_port(), served_model_name="m")).start()
    try:
        with httpx.Client(base_url=server.base_url, timeout=60) as client, ThreadPoolExecutor(4) as pool:
            answers = list(pool.map(lambda body: client.post("/v1/completions", json=body).json(), requests))
        per_replica = {engine: v for (_, engine), v in _series(server.base_url, "llmctl:request_success_total").items()}
        os.kill(ranks[1].pid, signal.SIGKILL)  # llmctl-rank-2: replica 1's rank 1
        wait_for(lambda: replica_failure(replicas) is not None, 15, "replica 1 to fail")
        assert "data-parallel replica 1 failed: rank 1 (pid" in replica_failure(replicas)
        assert replicas[0].is_healthy
    finally:
        server.stop()
        for replica in replicas:
            replica.shutdown()
    assert not dist.is_initialized() and all(not p.is_alive() for p in ranks)
    assert set(per_replica) == {"0", "1"} and min(per_replica.values()) >= 1, per_replica
    llm = LLM(str(folder), **engine)
    expected = llm.generate([r["prompt"] for r in requests],
                            [SamplingParams(max_tokens=r["max_tokens"], temperature=r["temperature"],
                                            seed=r.get("seed"), ignore_eos=True) for r in requests])
    assert [a["choices"][0]["text"] for a in answers] == [e.outputs[0].text for e in expected]


def test_two_tensor_parallel_replicas_answer_as_one_engine_and_a_killed_rank_fails_its_replica(tiny_chat_model):
    check_two_tensor_parallel_replicas(tiny_chat_model, ENGINE)


def test_replica_settings_split_the_threads_and_refuse_what_is_not_supported():
    replicas = replica_engine_args(EngineArgs(device="cpu", data_parallel_size=2, num_threads=4, seed=7))
    assert [(r.num_threads, r.data_parallel_size, r.seed) for r in replicas] == [(2, 1, 7), (2, 1, 8)]
    with pytest.raises(EngineArgsError, match="data_parallel_size > 1 with pipeline_parallel_size > 1 or nnodes"):
        EngineArgs(data_parallel_size=2, pipeline_parallel_size=2)
    with pytest.raises(EngineArgsError, match="an LLMEngine is one replica"):
        LLM(device="cpu", data_parallel_size=2)


def test_the_runner_stops_the_server_with_exit_1_once_a_replica_died(monkeypatch):
    monkeypatch.setattr(runner, "RANK_FAILURE_GRACE_S", 0.0)
    server, failed = SimpleNamespace(should_exit=False), threading.Event()
    replicas = [_FakeReplica(), _FakeReplica(dead_error=EngineDeadError("step failed"))]
    runner._stop_after_rank_failure(server, replicas[:1], failed, replicas)
    assert server.should_exit and failed.is_set()
