"""Data-parallel replicas that step together: `llmctl serve -dp D --enable-expert-parallel` on a mixture-of-experts
model deals the experts over every replica's ranks, so each sparse layer of a forward is a collective over the
replicas (engine/parallel.py's `ExpertDataParallel`). A replica's k-th forward must meet every other replica's
k-th: whenever one replica runs a forward, every replica runs one, an idle replica an idle step (its experts run
the others' tokens; it has none of its own).

`ReplicaLockstep` counts those rounds. A replica's forward joins the round it is due in, opening a new one when
it is the first there; a replica with nothing to run waits (`LockstepMember.wait`) and runs an idle step for each
round the others opened. The replicas are engine threads of the server's process, so a condition variable keeps
them in step (vLLM, whose replicas are processes, has a coordinator and "waves" for the same job).
`LockstepExecutor` wraps a replica's executor: each forward joins its round first, and a failed forward leaves
the lockstep, since the other replicas' layers can no longer meet it. Once a replica has left (stopped or failed)
a replica that must step fails: its MoE layers cannot run without the departed replica's experts.
"""

from __future__ import annotations

import threading
from dataclasses import replace
from datetime import timedelta
from typing import Callable, Optional

import torch

from llmctl.engine.errors import EngineDeadError
from llmctl.engine.executor.uniproc_executor import UniProcExecutor
from llmctl.engine.model_runner import RunnerConfig
from llmctl.engine.parallel import TensorParallel, expert_data_parallel
from llmctl.engine.sampler import SamplingRow
from llmctl.engine.step_types import ModelRunnerOutput, ScheduledSeq


class ReplicaLockstep:
    """The rounds of forwards `size` replicas run together; `member(d)` is replica d's side of it. `store`: the
    rendezvous store of the replicas' groups where this process hosts it (kept alive while they step: NCCL
    reads it again when a communicator first runs)."""

    def __init__(self, size: int, store=None):
        self.size, self.store = size, store
        self._changed = threading.Condition()
        self._rounds = 0  # rounds opened so far
        self._joined = [0] * size  # rounds each replica has run its forward in
        self._left: Optional[str] = None  # why a replica left (None: all are in)

    def member(self, replica: int) -> "LockstepMember":
        return LockstepMember(self, replica)

    def join(self, replica: int) -> None:
        with self._changed:
            if self._left is not None:
                raise EngineDeadError(f"{self._left}; the experts it holds are gone, so data-parallel replica "
                                      f"{replica} cannot step")
            if self._joined[replica] == self._rounds:
                self._rounds += 1
                self._changed.notify_all()
            self._joined[replica] += 1

    def behind(self, replica: int) -> int:
        with self._changed:
            return self._rounds - self._joined[replica]

    def joined(self, replica: int) -> int:
        with self._changed:
            return self._joined[replica]

    def wait(self, replica: int, ready: Callable[[], bool], timeout_s: float) -> None:
        """Until `ready()` (re-checked on `wake`), another replica opens a round this one has not run, or
        `timeout_s`."""
        with self._changed:
            self._changed.wait_for(lambda: ready() or self._rounds > self._joined[replica], timeout_s)

    def wake(self) -> None:
        with self._changed:
            self._changed.notify_all()

    def leave(self, why: str) -> None:
        with self._changed:
            if self._left is None:
                self._left = why
            self._changed.notify_all()


class LockstepMember:
    """Replica `replica`'s side of a `ReplicaLockstep` (what its engine thread and executor hold)."""

    def __init__(self, lockstep: ReplicaLockstep, replica: int):
        self.lockstep, self.replica = lockstep, replica

    def join_round(self) -> None:
        """Before each forward: join the round this replica is due in (opening it when first)."""
        self.lockstep.join(self.replica)

    @property
    def behind(self) -> int:
        """Rounds other replicas opened that this one has not run yet."""
        return self.lockstep.behind(self.replica)

    @property
    def joined(self) -> int:
        return self.lockstep.joined(self.replica)

    def wait(self, ready: Callable[[], bool], timeout_s: float) -> None:
        self.lockstep.wait(self.replica, ready, timeout_s)

    def wake(self) -> None:
        """Work arrived for some replica: its waiting engine thread re-checks."""
        self.lockstep.wake()

    def leave(self, why: str) -> None:
        self.lockstep.leave(f"data-parallel replica {self.replica} {why}")


class LockstepExecutor:
    """A replica's executor whose forwards run in the replicas' rounds: `execute` (and `execute_async` where
    the inner executor has it) join the round first; `idle_step` runs the replica's part in a round without
    tokens. Everything else is the inner executor's. `expert_placement`: the experts of every expert-parallel
    rank (replica x tensor-parallel size + rank), which the engine reports."""

    max_concurrent_batches = 1  # pipeline stages do not combine with data-parallel replicas

    def __init__(self, inner, member: LockstepMember, expert_placement: tuple[tuple[int, ...], ...]):
        self.inner, self.member, self.expert_placement = inner, member, expert_placement
        self.num_blocks, self.block_size = inner.num_blocks, inner.block_size
        self.device, self.dtype, self.weight_bytes = inner.device, inner.dtype, inner.weight_bytes
        if hasattr(inner, "execute_async"):
            self.execute_async = self._execute_async

    @property
    def kv_cache_bytes(self) -> int:
        return self.inner.kv_cache_bytes

    def execute(self, scheduled: list[ScheduledSeq], rows: list[Optional[SamplingRow]]) -> ModelRunnerOutput:
        return self._in_round(lambda: self.inner.execute(scheduled, rows))

    def _execute_async(self, scheduled: list[ScheduledSeq], rows: list[Optional[SamplingRow]]):
        return self._in_round(lambda: self.inner.execute_async(scheduled, rows))

    def idle_step(self) -> None:
        self._in_round(self.inner.idle_step)

    def _in_round(self, forward: Callable):
        self.member.join_round()
        try:
            return forward()
        except BaseException as exc:  # noqa: BLE001 - the other replicas' layers can no longer meet this one's
            self.member.leave(f"failed a step ({type(exc).__name__}: {' '.join(str(exc).split())[:200]})")
            if isinstance(exc, EngineDeadError):
                raise
            raise EngineDeadError(f"data-parallel replica {self.member.replica}'s step failed: {type(exc).__name__}: "
                                  f"{exc}; the replicas' expert layers are out of step") from exc

    def make_generator(self, seed: int) -> torch.Generator:
        return self.inner.make_generator(seed)

    def truncate_kept_state(self, seq_id: int, num_tokens: int) -> None:
        self.inner.truncate_kept_state(seq_id, num_tokens)

    def release_kept_state(self) -> None:
        self.inner.release_kept_state()

    def release_after_out_of_memory(self) -> None:
        self.inner.release_after_out_of_memory()

    def check_health(self) -> None:
        self.inner.check_health()

    def shutdown(self) -> None:
        self.member.leave("stopped")
        self.inner.shutdown()


class ExpertReplicas:
    """`llmctl serve -dp D --enable-expert-parallel` with one rank per replica: the store the replicas' expert
    groups meet at (hosted here) and replica d's executor, an in-process runner holding the d-th 1/D of the
    experts, in lockstep. (With -tp T the replicas' executors are multiproc_executor.py's `DataParallelWorld`'s.)"""

    def __init__(self, placement: tuple[tuple[int, ...], ...], timeout_s: float):
        import torch.distributed as dist

        store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False,
                              timeout=timedelta(seconds=timeout_s))
        self.placement, self.timeout_s = placement, timeout_s
        self.lockstep = ReplicaLockstep(len(placement), store)

    def executor_class(self, replica: int) -> Callable[[RunnerConfig], LockstepExecutor]:
        """Replica `replica`'s `executor_class` (every replica's is called at once: their groups form together)."""
        def build(config: RunnerConfig) -> LockstepExecutor:
            experts = expert_data_parallel("127.0.0.1", self.lockstep.store.port, replica, self.lockstep.size, 0,
                                           config.device, self.timeout_s)
            tensor_parallel = TensorParallel(0, 1, None, expert_parallel=True, data_parallel=experts)
            runner = UniProcExecutor(replace(config, tensor_parallel=tensor_parallel))
            return LockstepExecutor(runner, self.lockstep.member(replica), self.placement)
        return build

    def shutdown(self) -> None:
        """A failed load: the replicas already built shut down with their engines; the lockstep is left."""
        self.lockstep.leave("data-parallel replicas failed to load")
