"""Data parallelism: `--data-parallel-size D` engine replicas behind one server, balanced by load.

Owns the replicas' engine settings (each a whole engine with `data_parallel_size` 1: on CPU the torch
threads are split between them, on CUDA each gets a device of its own, or T with `-tp T`, whose replicas
share one process group: engine/executor/multiproc_executor.py's `DataParallelWorld`), their loading, and
`ReplicaBalancer`, which sends each new request to the least-loaded replica. With `--enable-expert-parallel`
on a mixture-of-experts model the experts are dealt over every replica's ranks (vLLM's attention-DP + EP) and
the replicas step together (engine/executor/lockstep.py). A request is placed once
and stays there until it finishes: in-flight requests never move. A replica that dies is not routed
around: the balancer refuses new requests with the failure and the server stops (a half-capacity
server that looks healthy would hide the loss).
"""

from __future__ import annotations

import dataclasses
import threading
from typing import Any, Generic, Optional, Sequence, TypeVar

from llmctl.engine.args import EngineArgs
from llmctl.engine.async_engine import AsyncLLMEngine
from llmctl.engine.errors import EngineArgsError, EngineDeadError
from llmctl.engine.executor.lockstep import ExpertReplicas
from llmctl.server.routing import load_signal

Target = TypeVar("Target")


def replica_engine_args(args: EngineArgs) -> list[EngineArgs]:
    """One engine's settings per replica: CPU threads split evenly (replicas stepping at once must not
    oversubscribe the cores), on CUDA device N + i for replica i (N: the device named, else 0; with
    -tp T the replica's ranks take GPUs i T .. i T + T - 1), and engine seed + i (unseeded requests on two
    replicas must not draw the same random streams)."""
    import torch

    from llmctl.engine.llm_engine import resolve_device

    size, ranks = args.data_parallel_size, args.tensor_parallel_size
    device = resolve_device(args.device)
    if device.type == "cuda":
        first = device.index or 0
        if first + size * ranks > torch.cuda.device_count():
            raise EngineArgsError(f"data_parallel_size {size} x tensor_parallel_size {ranks} needs that many CUDA "
                                  f"devices from cuda:{first}, but {torch.cuda.device_count()} are visible")
        if ranks > 1 and first:
            raise EngineArgsError("data_parallel_size with tensor_parallel_size > 1 uses GPUs from cuda:0 "
                                  f"(got --device cuda:{first})")
        return [dataclasses.replace(args, data_parallel_size=1, seed=args.seed + i,
                                    device=f"cuda:{first + i}" if ranks == 1 else args.device) for i in range(size)]
    threads = max(1, (args.num_threads or torch.get_num_threads()) // size)
    return [dataclasses.replace(args, data_parallel_size=1, seed=args.seed + i, num_threads=threads)
            for i in range(size)]


def load_replicas(args: EngineArgs, **options: Any) -> list[AsyncLLMEngine]:
    """The replicas' engines, loaded one after another (each on its own engine thread); a failed load
    shuts down the ones already loaded. Tensor-parallel replicas share one process group
    (`DataParallelWorld`), whose ranks all start first; their engines then load at once, as their
    ranks do (a rank waits in its replica's collectives only for its own driver). Replicas whose experts
    are dealt over all of them load at once too (their groups form together) and step in lockstep."""
    replicas = replica_engine_args(args)
    placement = _experts_over_replicas(replicas)
    world = _tensor_parallel_world(replicas, placement)
    if world is None and not placement:
        return _load_each(replicas, [None] * len(replicas), options)
    if world is None:
        world = ExpertReplicas(placement, replicas[0].collective_timeout_s)
    members = [world.lockstep.member(i) if world.lockstep is not None else None for i in range(len(replicas))]
    try:
        return _load_each(replicas, [world.executor_class(i) for i in range(len(replicas))], options,
                          at_once=True, members=members)
    except BaseException:
        world.shutdown()
        raise


def _experts_over_replicas(replicas: list[EngineArgs]) -> tuple[tuple[int, ...], ...]:
    """Each expert-parallel rank's experts (replica x tensor-parallel size + rank) when --enable-expert-parallel
    deals a mixture-of-experts model's experts over the replicas; () otherwise. An expert count the ranks do not
    divide is refused here, before anything starts."""
    from llmctl.engine.llm_engine import runner_config
    from llmctl.engine.parallel import TensorParallelError, expert_ranges

    first = replicas[0]
    if not first.enable_expert_parallel:
        return ()
    moe = runner_config(first).model_config.moe
    if moe is None:
        return ()
    try:
        ranges = expert_ranges(moe.num_experts, len(replicas) * first.tensor_parallel_size)
    except TensorParallelError as exc:
        raise EngineArgsError(str(exc)) from None
    return tuple(tuple(experts) for experts in ranges)


def _tensor_parallel_world(replicas: list[EngineArgs], placement: tuple[tuple[int, ...], ...]):
    """The shared process group and ranks of tensor-parallel replicas (None with one rank per replica)."""
    if replicas[0].tensor_parallel_size == 1:
        return None
    from llmctl.engine.executor.multiproc_executor import DataParallelWorld
    from llmctl.engine.llm_engine import runner_config

    parallels = [replica.parallel for replica in replicas]
    if parallels[0].torchrun:
        raise EngineArgsError("data_parallel_size > 1 with tensor_parallel_size > 1 under torchrun is not supported "
                              "(llmctl starts the replicas' ranks itself)")
    parallels = [dataclasses.replace(p, data_parallel_size=len(replicas), data_parallel_rank=i,
                                     expert_data_parallel=bool(placement))
                 for i, p in enumerate(parallels)]
    return DataParallelWorld(parallels, [runner_config(replica) for replica in replicas], replicas[0].num_threads,
                             placement)


def _load_each(replicas: list[EngineArgs], executor_classes: list, options: dict[str, Any],
               at_once: bool = False, members: Optional[list] = None) -> list[AsyncLLMEngine]:
    engines: list[Optional[AsyncLLMEngine]] = [None] * len(replicas)
    failures: list[BaseException] = []
    members = members or [None] * len(replicas)

    def load(index: int) -> None:
        try:
            engines[index] = AsyncLLMEngine.from_engine_args(replicas[index], executor_classes[index],
                                                             lockstep=members[index], **options)
        except BaseException as exc:  # noqa: BLE001 - re-raised below, after the others are shut down
            failures.append(exc)

    if at_once:
        threads = [threading.Thread(target=load, args=(i,), name=f"llmctl-load-{i}") for i in range(len(replicas))]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
    else:
        for index in range(len(replicas)):
            load(index)
            if failures:
                break
    if failures:
        for engine in engines:
            if engine is not None:
                engine.shutdown()
        raise failures[0]
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
