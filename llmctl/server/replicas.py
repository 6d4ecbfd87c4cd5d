"""Data parallelism: `--data-parallel-size D` engine replicas behind one server, balanced by load.

Owns the replicas' engine settings (each a whole engine with `data_parallel_size` 1: on CPU the torch
threads are split between them, on CUDA each gets a device of its own), their loading, and
`ReplicaBalancer`, which sends each new request to the least-loaded replica. A request is placed once
and stays there until it finishes: in-flight requests never move. A replica that dies is not routed
around: the balancer refuses new requests with the failure and the server stops (a half-capacity
server that looks healthy would hide the loss).
"""

from __future__ import annotations

import dataclasses
from typing import Any, Generic, Optional, Sequence, TypeVar

from llmctl.engine.args import EngineArgs
from llmctl.engine.async_engine import AsyncLLMEngine
from llmctl.engine.errors import EngineArgsError, EngineDeadError
from llmctl.server.routing import load_signal

Target = TypeVar("Target")


def replica_engine_args(args: EngineArgs) -> list[EngineArgs]:
    """One engine's settings per replica: CPU threads split evenly (replicas stepping at once must not
    oversubscribe the cores), on CUDA device N + i for replica i (N: the device named, else 0), and
    engine seed + i (unseeded requests on two replicas must not draw the same random streams)."""
    import torch

    from llmctl.engine.llm_engine import resolve_device

    size = args.data_parallel_size
    device = resolve_device(args.device)
    if device.type == "cuda":
        first = device.index or 0
        if first + size > torch.cuda.device_count():
            raise EngineArgsError(f"data_parallel_size {size} needs one CUDA device per replica from cuda:{first}, "
                                  f"but {torch.cuda.device_count()} are visible")
        return [dataclasses.replace(args, data_parallel_size=1, seed=args.seed + i, device=f"cuda:{first + i}")
                for i in range(size)]
    threads = max(1, (args.num_threads or torch.get_num_threads()) // size)
    return [dataclasses.replace(args, data_parallel_size=1, seed=args.seed + i, num_threads=threads)
            for i in range(size)]


def load_replicas(args: EngineArgs, **options: Any) -> list[AsyncLLMEngine]:
    """The replicas' engines, loaded one after another (each on its own engine thread); a failed load
    shuts down the ones already loaded."""
    engines: list[AsyncLLMEngine] = []
    try:
        for replica_args in replica_engine_args(args):
            engines.append(AsyncLLMEngine.from_engine_args(replica_args, **options))
    except BaseException:
        for engine in engines:
            engine.shutdown()
        raise
    return engines


def replica_failure(engines: Sequence[AsyncLLMEngine]) -> Optional[str]:
    """Why the first failed replica failed (None while all run)."""
    for index, engine in enumerate(engines):
        if engine.dead_error is not None or not engine.is_healthy:
            cause = engine.dead_error or "its engine thread stopped"
            return f"data-parallel replica {index} failed: {cause}"
    return None


class ReplicaBalancer(Generic[Target]):
    """Picks, per new request, the replica (its `Target`: what answers for it) with the lowest load.

    The load is routing.py's signal from the replica's latest snapshot plus this balancer's tally of
    requests sent there since that snapshot, in units of its batch (`max_num_seqs`): a burst that
    arrives between two snapshots spreads instead of piling onto the replica that looked idle. Ties
    rotate, so an idle server alternates.
    """

    def __init__(self, engines: Sequence[AsyncLLMEngine], targets: Sequence[Target]):
        if not engines or len(engines) != len(targets):
            raise ValueError("a balancer needs one target per engine, and at least one")
        self.engines = list(engines)
        self.targets = list(targets)
        self._sent_since_snapshot = [0] * len(engines)
        self._snapshot_seen = [-1] * len(engines)
        self._next = 0

    def load(self, index: int) -> float:
        """Replica `index`'s snapshot load plus the requests sent there since that snapshot."""
        engine = self.engines[index]
        version, stats = engine.stats_version, engine.get_stats()
        if version != self._snapshot_seen[index]:
            self._snapshot_seen[index], self._sent_since_snapshot[index] = version, 0
        batch = max(float(stats.get("max_num_seqs", 0) or 0), 1.0)
        return load_signal(stats, engine.max_waiting_requests) + self._sent_since_snapshot[index] / batch

    def lowest_load(self, unseen: int = 0) -> float:
        """The least-loaded replica's snapshot load signal (what --fallback-at compares: every replica is
        at least this busy), with `unseen` requests routed here that no engine has yet counted on each."""
        return min(load_signal(e.get_stats(), e.max_waiting_requests, unseen) for e in self.engines)

    def pick(self) -> Target:
        """The target for a new request; with replicas, raises `EngineDeadError` once any of them failed
        (a lone engine reports its own death when the request reaches it)."""
        size = len(self.engines)
        failure = replica_failure(self.engines) if size > 1 else None
        if failure is not None:
            raise EngineDeadError(f"{failure}; the server is stopping")
        order = [(self._next + k) % size for k in range(size)]
        loads = {i: self.load(i) for i in order}
        lowest = min(loads.values())
        chosen = next(i for i in order if loads[i] <= lowest + 1e-9)
        self._sent_since_snapshot[chosen] += 1
        self._next = (chosen + 1) % size
        return self.targets[chosen]
