"""`MultiprocExecutor`: the `Executor` over several ranks (tensor and pipeline parallelism), on torch.distributed.

Rank 0 lives in the engine's process: the scheduler, block manager and sampler stay there, and so do
the `SamplingRow`s (generators, logits-processor closures never cross a process boundary). The other
ranks only run the model: node 0 starts its ranks 1..n-1 with torch.multiprocessing (spawn), a node
k > 0 (`run_worker_node`) starts all of its own, and under torchrun every process already is a rank.

Each step the driver flattens the batch once (`ModelRunner.prepare` -> `StepInputs`), sends it to
every rank as one fixed `HEADER_LEN`-integer header and one int64 payload (ids, positions, slots, logits rows,
the rows' lengths and block tables, the kept-state truncations queued since the last step, and the
placeholder rows), and every rank runs `ModelRunner.forward` on it; the sharded model's collectives run
between ranks on the model group; the driver samples from its (gathered) logits.

Async scheduling (`execute_async`, tensor parallelism): the driver launches a step before the host has
the ids the step in flight samples. Those inputs are placeholders: the driver fills its own from the
sampled ids on the device (`ModelRunner.fill_placeholders`) and broadcasts them on the model group (an
NCCL device tensor on CUDA: no host round trip), and each worker scatters them into the rows the step
message names (`ModelRunner.scatter_placeholders`). Only the driver samples (the requests' generators
never leave its process), so the ranks cannot diverge; its one device sync per step is the sampled ids'
copy to the host (`AsyncModelRunnerOutput.get_output`). The step message is packed from the driver's host
copy of the vectors, never from device tensors (whose copy would wait for the step in flight).

With pipeline stages (global rank = stage x T + tensor-parallel rank) stage 0 runs on the driver, each later
stage receives its input from the one before, and the last stage's first rank sends the logits to the
driver; the engine keeps one micro-batch per stage in flight (`submit`, then `collect` in order): that is
their overlap, and async scheduling is refused with stages (`EngineArgs.async_scheduling_blocker`).

The process groups, because their waits differ:
- the default group (gloo): start-up only (agreeing on the KV pool size), waiting up to
  `LOAD_TIMEOUT_S` for the slowest rank's weights;
- the control group (gloo, CPU tensors on every device): the step messages. The timeout is local to
  each process: on the driver it is the collective timeout (a rank that stopped reading fails the
  step), on a worker it is `IDLE_TIMEOUT_S`, because a worker waits there for as long as the server
  sits idle;
- the model groups (gloo on CPU, NCCL on CUDA), one per pipeline stage: the model's all-reduces and
  gathers, with the collective timeout on every rank;
- the pipe group (every rank, same backend, the collective timeout; with pipeline stages only): the
  hidden states between stages and the last stage's logits.
With `llmctl serve -dp D -tp T` (`DataParallelWorld`) the D replicas share one process group, the server's
process being rank 0 of each: every replica has its own control, model and start-up groups. With the experts
dealt over the replicas (`--enable-expert-parallel` on a mixture-of-experts model) each rank also joins a
group with the same tensor-parallel rank of the other replicas (engine/parallel.py's `stateless_group`, as the
drivers share one process), and an IDLE step message runs a replica's MoE exchanges without tokens.

Faults: a rank that exits closes its connections, so the driver's next (or current) collective fails
at once; a rank that hangs fails it after the collective timeout (30 s by default). Either way the
executor is failed from then on (a multi-rank step that broke half-way leaves the ranks out of step,
so nothing retries) and raises `RankFailedError`, an `EngineDeadError`. Between steps a thread
watches node 0's worker processes, and `check_health` reports a dead one (the server polls it).
Workers ignore SIGINT (a terminal's Ctrl-C reaches the whole process group; the driver drains first,
then stops them), and the kernel kills them when their parent dies (PR_SET_PDEATHSIG), so no rank
outlives the engine. SIGTERM stops a worker (so systemd units want KillMode=mixed: SIGTERM to the
server, which drains and stops its ranks).
"""

from __future__ import annotations

import atexit
import ctypes
import logging
import multiprocessing.connection
import os
import signal
import threading
import time
from dataclasses import dataclass, replace
from datetime import timedelta
from typing import Callable, NamedTuple, Optional, Sequence

import torch

from llmctl.engine.args import ParallelConfig
from llmctl.engine.cuda_profiler import ProfilerSteps, step_bracket
from llmctl.engine.errors import EngineError, RankFailedError
from llmctl.engine.executor.lockstep import LockstepExecutor, ReplicaLockstep
from llmctl.engine.host import tune_cpu_allocator
from llmctl.engine.model_runner import (AsyncModelRunnerOutput, ModelRunner, PreparedStep, RunnerConfig, StepInputs,
                                       StepLogits)
from llmctl.engine.parallel import (ExpertDataParallel, PipelineParallel, TensorParallel, expert_data_parallel,
                                    pipeline_layer_ranges)
from llmctl.engine.sampler import SamplingRow
from llmctl.engine.step_types import ModelRunnerOutput, ScheduledSeq

logger = logging.getLogger(__name__)

JOIN_TIMEOUT_S = 300.0  # ranks on other machines may be started by hand after node 0
LOAD_TIMEOUT_S = 1800.0  # the slowest rank's weight load
IDLE_TIMEOUT_S = 30 * 24 * 3600.0  # a worker waits this long for the next step (the server may be idle)
STOP_TIMEOUT_S = 10.0  # after the stop message, before a worker is killed

EXECUTE, STOP, IDLE = 1, 2, 3  # IDLE: a data-parallel replica's MoE exchanges without tokens (`idle_step`)
# command, payload length, tokens, logits rows, rows, block-table width, truncations, release, micro-batch slot,
# placeholders
HEADER_LEN = 10


def _joined_key(rank: int) -> str:
    """The rendezvous-store key a rank sets once its process runs (before the process groups form)."""
    return f"llmctl/joined/{rank}"


@dataclass(frozen=True)
class _Groups:
    control: object
    model: object  # this rank's pipeline stage's tensor-parallel ranks
    pipe: object  # every rank: the pipeline's point-to-point sends (hidden states, the last stage's logits)
    startup: object  # agreeing on the KV pool: the default group, or with data-parallel replicas each one's own


# ---- the step message -----------------------------------------------------------------------------
class StepMessage(NamedTuple):
    """One step as a rank other than the driver receives it."""

    inputs: StepInputs
    truncations: list[tuple[int, int]]  # kept-state truncations (seq id, tokens kept) to apply before it
    release: bool  # drop the kept state before it
    placeholder_rows: torch.Tensor  # async scheduling: input rows whose ids the driver sends on the model group


def _host_vectors(inputs: StepInputs) -> list[torch.Tensor]:
    """The step's four vectors on the host without waiting for the device: its tensors on CPU, else the driver's
    lists they were staged from (a GPU tensor's copy would wait for the step in flight)."""
    vectors = (inputs.input_ids, inputs.positions, inputs.slot_mapping, inputs.logits_indices)
    if inputs.host is None or inputs.input_ids.device.type == "cpu":
        return [v.cpu() for v in vectors]
    return [torch.tensor(values, dtype=torch.long) for values in inputs.host]


def pack_step(inputs: StepInputs, truncations: list[tuple[int, int]], release: bool,
              placeholder_rows: Sequence[int] = ()) -> tuple[torch.Tensor, torch.Tensor]:
    """The header and payload (int64, CPU) that carry one step to the other ranks."""
    width = max((len(t) for t in inputs.block_tables), default=0)
    tables = torch.full((len(inputs.block_tables), width), -1, dtype=torch.long)
    for i, table in enumerate(inputs.block_tables):
        tables[i, : len(table)] = torch.tensor(table, dtype=torch.long)
    rows = torch.tensor([inputs.seq_ids, inputs.query_lens, inputs.context_lens], dtype=torch.long).reshape(-1)
    flat_truncations = torch.tensor(truncations, dtype=torch.long).reshape(-1)
    payload = torch.cat([*_host_vectors(inputs), rows, tables.reshape(-1), flat_truncations,
                         torch.tensor(placeholder_rows, dtype=torch.long)])
    header = torch.tensor([EXECUTE, payload.numel(), inputs.input_ids.numel(), inputs.logits_indices.numel(),
                           len(inputs.seq_ids), width, len(truncations), int(release), inputs.micro_batch,
                           len(placeholder_rows)], dtype=torch.long)
    return header, payload


def unpack_step(header: torch.Tensor, payload: torch.Tensor, device: torch.device) -> StepMessage:
    _, _, tokens, logits, rows, width, truncations, release, micro_batch, placeholders = header.tolist()
    parts = payload.split([tokens, tokens, tokens, logits, 3 * rows, rows * width, 2 * truncations, placeholders])
    ids, positions, slots, logits_indices = (p.to(device) for p in parts[:4])
    seq_ids, query_lens, context_lens = parts[4].reshape(3, rows).tolist() if rows else ([], [], [])
    tables = [[b for b in row if b >= 0] for row in parts[5].reshape(rows, width).tolist()]
    inputs = StepInputs(ids, positions, slots, logits_indices, seq_ids, query_lens, context_lens, tables,
                        micro_batch=micro_batch)
    return StepMessage(inputs, [tuple(t) for t in parts[6].reshape(-1, 2).tolist()], bool(release),
                       parts[7].to(device))


# ---- process set-up ---------------------------------------------------------------------------------
def _die_with_parent() -> None:
    """Linux: the kernel sends this process SIGKILL when its parent exits (however it exits)."""
    try:
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except OSError:
        pass
    if os.getppid() == 1:  # the parent died before prctl: nobody is left to stop us
        os._exit(1)


def _threads_per_rank(parallel: ParallelConfig, num_threads: Optional[int]) -> int:
    """CPU: the node's threads (--num-threads, else every core) divided between its ranks."""
    total = num_threads or os.cpu_count() or 1
    return max(1, total // parallel.ranks_per_node)


def _rank_device(device: torch.device, parallel: ParallelConfig, rank: int) -> torch.device:
    """CUDA: one GPU per rank, the rank's index on its node; CPU: the CPU."""
    if device.type != "cuda":
        return device
    local = rank - parallel.node_ranks.start + parallel.data_parallel_rank * parallel.world_size
    if local >= torch.cuda.device_count():
        raise EngineError(f"rank {rank} needs GPU {local} on its node, which has {torch.cuda.device_count()}")
    torch.cuda.set_device(local)
    return torch.device("cuda", local)


def _store(parallel: ParallelConfig, rank: int):
    import torch.distributed as dist

    return dist.TCPStore(parallel.master_addr, parallel.master_port, parallel.process_group_size, is_master=rank == 0,
                         timeout=timedelta(seconds=JOIN_TIMEOUT_S), wait_for_workers=False)


def _connect(parallel: ParallelConfig, rank: int, device: torch.device, store,
             control_timeout_s: float) -> list[_Groups]:
    """Join the process group as `parallel`'s rank `rank`; every replica's groups (one without data parallelism),
    this process's own for its replica (the server's process is rank 0 of each)."""
    import torch.distributed as dist

    world, global_rank = parallel.process_group_size, parallel.global_rank(rank)
    if store is None:  # torchrun: its agent hosts the store at MASTER_ADDR:MASTER_PORT
        dist.init_process_group("gloo", init_method="env://", rank=global_rank, world_size=world,
                                timeout=timedelta(seconds=LOAD_TIMEOUT_S))
    else:
        dist.init_process_group("gloo", store=store, rank=global_rank, world_size=world,
                                timeout=timedelta(seconds=LOAD_TIMEOUT_S))
    # every process creates every group, in the same order (new_group is collective over the default group)
    return [_replica_groups(replace(parallel, data_parallel_rank=replica),
                            rank if replica == parallel.data_parallel_rank else 0, device, control_timeout_s)
            for replica in range(parallel.data_parallel_size)]


def _replica_groups(parallel: ParallelConfig, rank: int, device: torch.device, control_timeout_s: float) -> _Groups:
    import torch.distributed as dist

    ranks = [parallel.global_rank(r) for r in range(parallel.world_size)]
    control = dist.new_group(ranks, timeout=timedelta(seconds=control_timeout_s), backend="gloo")
    model_backend = "nccl" if device.type == "cuda" else "gloo"
    timeout = timedelta(seconds=parallel.collective_timeout_s)
    tp = parallel.tensor_parallel_size
    stage_groups = [dist.new_group(ranks[stage * tp:(stage + 1) * tp], timeout=timeout, backend=model_backend)
                    for stage in range(parallel.pipeline_parallel_size)]
    pipe = dist.new_group(ranks, timeout=timeout, backend=model_backend) if parallel.pipeline_parallel_size > 1 else None
    startup = (dist.new_group(ranks, timeout=timedelta(seconds=LOAD_TIMEOUT_S), backend="gloo")
               if parallel.data_parallel_size > 1 else None)
    return _Groups(control, stage_groups[rank // tp], pipe, startup)


def _agree_num_blocks(num_blocks: int, group) -> int:
    """Every rank's pool has the same block count on CPU; on CUDA free memory may differ per GPU, so the
    engine uses the smallest (a rank's blocks past it are never addressed)."""
    import torch.distributed as dist

    value = torch.tensor([num_blocks], dtype=torch.long)
    dist.all_reduce(value, op=dist.ReduceOp.MIN, group=group)
    return int(value.item())


def _experts_over_replicas(parallel: ParallelConfig, rank: int, device: torch.device) -> Optional[ExpertDataParallel]:
    """With experts dealt over data-parallel replicas: this rank's groups with its peers in the other replicas."""
    if not parallel.expert_data_parallel:
        return None
    return expert_data_parallel(parallel.master_addr, parallel.master_port, parallel.data_parallel_rank,
                                parallel.data_parallel_size, rank % parallel.tensor_parallel_size, device,
                                parallel.collective_timeout_s)


def _rank_config(config: RunnerConfig, parallel: ParallelConfig, rank: int, groups: _Groups) -> RunnerConfig:
    """Global rank = stage x tensor_parallel_size + tensor-parallel rank (vLLM's layout): a stage's
    tensor-parallel ranks are neighbours, and each sends to the same tensor-parallel rank of the next stage."""
    tp, stages = parallel.tensor_parallel_size, parallel.pipeline_parallel_size
    stage = rank // tp
    layers = pipeline_layer_ranges(config.model_config.num_layers, stages, parallel.layer_partition)[stage]
    pipeline = PipelineParallel(stage, stages, layers, groups.pipe,
                                parallel.global_rank(rank - tp) if stage > 0 else None,
                                parallel.global_rank(rank + tp) if stage < stages - 1 else None)
    return replace(config, device=_rank_device(config.device, parallel, rank),
                   tensor_parallel=TensorParallel(rank % tp, tp, groups.model, parallel.enable_expert_parallel,
                                                  _experts_over_replicas(parallel, rank, config.device)),
                   pipeline_parallel=pipeline)


def _sends_logits(parallel: ParallelConfig, rank: int) -> bool:
    """The last stage's first tensor-parallel rank hands the step's logits to the driver (rank 0)."""
    return parallel.pipeline_parallel_size > 1 and rank == parallel.world_size - parallel.tensor_parallel_size


# ---- a rank that only runs the model ----------------------------------------------------------------
class _Worker:
    def __init__(self, rank: int, runner: ModelRunner, groups: _Groups, sends_logits: bool):
        self.rank = rank
        self.runner = runner
        self.groups = groups
        self.sends_logits = sends_logits
        self.profiler = ProfilerSteps.for_device(runner.config.cuda_profiler_steps, runner.device)

    def serve(self) -> None:
        """Run steps until the driver says stop (returns) or goes away (raises)."""
        import torch.distributed as dist

        header = torch.empty(HEADER_LEN, dtype=torch.long)
        logits_sent = None  # the last stage's previous send to the driver, until it completes
        while True:
            dist.broadcast(header, 0, group=self.groups.control)
            if header[0].item() == STOP:
                return
            if header[0].item() == IDLE:
                self.runner.idle_step()
                continue
            payload = torch.empty(int(header[1].item()), dtype=torch.long)
            dist.broadcast(payload, 0, group=self.groups.control)
            message = unpack_step(header, payload, self.runner.device)
            inputs = message.inputs
            if message.release:
                self.runner.release_kept_state()
            for seq_id, num_tokens in message.truncations:
                self.runner.truncate_kept_state(seq_id, num_tokens)
            if message.placeholder_rows.numel():
                self._receive_placeholders(inputs, message.placeholder_rows)
            with step_bracket(self.profiler) as ran_a_batch:
                out = self.runner.forward(inputs)
                ran_a_batch(True)
            if self.sends_logits and inputs.logits_indices.numel():
                if logits_sent is not None:
                    logits_sent.wait()
                logits_sent = dist.isend(out.logits.contiguous(), 0, group=self.groups.pipe)

    def _receive_placeholders(self, inputs: StepInputs, rows: torch.Tensor) -> None:
        """Async scheduling: the ids the driver sampled in the step before, for the input rows `rows`, arrive on
        the model group (device to device with NCCL: they never were on the host)."""
        import torch.distributed as dist

        ids = torch.empty(rows.numel(), dtype=torch.long, device=self.runner.device)
        dist.broadcast(ids, 0, group=self.groups.model)
        self.runner.scatter_placeholders(inputs, rows, ids)


def _worker_main(rank: int, parallel: ParallelConfig, config: RunnerConfig, num_threads: int) -> None:
    """A worker rank's process: join, load its shard, agree on the pool, serve steps. Exits 0 when the
    driver stopped it, 1 when the driver went away or this rank failed (the reason logged)."""
    _die_with_parent()
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # a terminal's Ctrl-C reaches the group: rank 0 drains, then stops us
    logging.basicConfig(format=f"%(asctime)s rank {rank} %(levelname)s %(name)s: %(message)s")
    if config.device.type == "cpu":
        torch.set_num_threads(num_threads)
        tune_cpu_allocator()  # as the driver's engine does: each step's activations would page-fault again
    try:
        store = None if parallel.torchrun else _store(parallel, rank)
        if store is not None:
            store.set(_joined_key(parallel.global_rank(rank)), str(os.getpid()))
        groups = _connect(parallel, rank, config.device, store, IDLE_TIMEOUT_S)[parallel.data_parallel_rank]
        runner = ModelRunner(_rank_config(config, parallel, rank, groups))
        _agree_num_blocks(runner.num_blocks, groups.startup)
        _Worker(rank, runner, groups, _sends_logits(parallel, rank)).serve()
    except BaseException as exc:  # noqa: BLE001 - a worker's failure is its exit code and its log line
        logger.error("rank %d stops: %s: %s", rank, type(exc).__name__, " ".join(str(exc).split())[:500])
        os._exit(1)
    _destroy_process_group()
    os._exit(0)


def _destroy_process_group() -> None:
    import torch.distributed as dist

    if dist.is_initialized():
        try:
            dist.destroy_process_group()
        except Exception:  # noqa: BLE001 - the peers may already be gone
            pass


def _spawn(ranks: range, parallel: ParallelConfig, config: RunnerConfig, num_threads: int) -> dict[int, object]:
    context = torch.multiprocessing.get_context("spawn")
    processes = {}
    for rank in ranks:
        process = context.Process(target=_worker_main, args=(rank, parallel, config, num_threads),
                                  name=f"llmctl-rank-{parallel.global_rank(rank)}", daemon=True)
        process.start()
        processes[rank] = process
    return processes


def _stop(processes: dict[int, object], timeout_s: float) -> None:
    """Wait for the processes to exit, then terminate, then kill what is left."""
    deadline = time.monotonic() + timeout_s
    for process in processes.values():
        process.join(max(0.0, deadline - time.monotonic()))
    for process in processes.values():
        if process.is_alive():
            process.terminate()
            process.join(2.0)
        if process.is_alive():
            process.kill()
            process.join(2.0)


def _wait_for_ranks(store, parallel: ParallelConfig, raise_for_dead: Callable[[], None]) -> None:
    """Until every rank has joined the store: node 0's workers (`raise_for_dead` fails at once for a dead one)
    and the other nodes' (logged every 30 s while missing, given up after JOIN_TIMEOUT_S)."""
    missing = set(range(1, parallel.process_group_size))
    start = last_note = time.monotonic()
    while missing:
        raise_for_dead()
        missing = {r for r in missing if not store.check([_joined_key(r)])}
        now = time.monotonic()
        if missing and now - start > JOIN_TIMEOUT_S:
            raise RankFailedError(f"rank(s) {sorted(missing)} did not join {parallel.master_addr}:"
                                  f"{parallel.master_port} within {JOIN_TIMEOUT_S:g} s (is every node's "
                                  "command running with the same --nnodes and --master-addr/--master-port?)")
        if missing and now - last_note > 30:
            logger.warning("waiting for rank(s) %s to join at %s:%d", sorted(missing), parallel.master_addr,
                           parallel.master_port)
            last_note = now
        time.sleep(0.05)


# ---- the driver (rank 0, in the engine's process) -----------------------------------------------------
@dataclass
class PendingStep:
    """A micro-batch in the pipeline: its prepared step, sampling rows and step-message broadcasts."""

    step: PreparedStep
    rows: list[Optional[SamplingRow]]
    messages: list
    slot: int = 0  # its micro-batch slot, free again once collected


class MultiprocExecutor:
    """The `Executor` of a tensor- or pipeline-parallel engine; rank 0 runs here."""

    def __init__(self, config: RunnerConfig, parallel: ParallelConfig, num_threads: Optional[int] = None,
                 world: Optional["DataParallelWorld"] = None):
        """`world`: the process group and ranks of `llmctl serve -dp D -tp T`, which this replica
        (`parallel.data_parallel_rank`) takes instead of starting its own."""
        if not parallel.runs_engine:
            raise EngineError("only rank 0 (node 0) runs the engine; other nodes run run_worker_node")
        import torch.distributed as dist

        self.world = world
        if world is None and dist.is_initialized():  # the default process group is per process
            raise EngineError("a parallel engine already runs in this process (one per process): call "
                              "shutdown() on the first LLM (or build it in a `with LLM(...) as llm:` block)")
        self.parallel = parallel
        self.fault: Optional[RankFailedError] = None
        self._closed = False
        self._serving = False  # start-up done: every rank reads step messages
        self._truncations: list[tuple[int, int]] = []
        self._release = False
        # micro-batch slots not in flight, the one freed last at the end: the batch scheduled after collecting a
        # micro-batch holds its sequences again, so it takes its slot (and the state the ranks keep for it)
        self._free_slots = list(reversed(range(parallel.pipeline_parallel_size)))
        self._processes: dict[int, object] = {}
        threads = _threads_per_rank(parallel, num_threads)
        if config.device.type == "cpu":
            torch.set_num_threads(threads)
        try:
            self._start(config, threads)
        except BaseException:
            self.shutdown()
            raise
        atexit.register(self.shutdown)  # an offline LLM's ranks stop with the interpreter
        self._watcher = threading.Thread(target=self._watch, name="llmctl-rank-watch", daemon=True)
        self._watcher.start()
        logger.info("tensor parallel: %d ranks on %d node(s), %s", parallel.world_size, parallel.nnodes,
                    "NCCL" if self.device.type == "cuda" else f"gloo, {threads} thread(s) per rank")

    def _start(self, config: RunnerConfig, threads: int) -> None:
        store = None
        if self.world is not None:
            self._processes = self.world.processes[self.parallel.data_parallel_rank]
        elif not self.parallel.torchrun:
            store = _store(self.parallel, 0)
            self.parallel = replace(self.parallel, master_port=store.port)  # port 0: the one it picked
            local = range(1, self.parallel.ranks_per_node)
            self._processes = _spawn(local, self.parallel, config, threads)
            _wait_for_ranks(store, self.parallel, lambda: self._raise_for_dead_process("start-up"))
        try:
            self.groups = (self.world.groups[self.parallel.data_parallel_rank] if self.world is not None else
                           _connect(self.parallel, 0, config.device, store, self.parallel.collective_timeout_s)[0])
            self.runner = ModelRunner(_rank_config(config, self.parallel, 0, self.groups))
            self.num_blocks = _agree_num_blocks(self.runner.num_blocks, self.groups.startup)
            self._serving = True
        except EngineError:
            raise
        except RuntimeError as exc:  # gloo/NCCL: a rank went away during start-up
            raise self._failure("start-up", exc) from None
        self.block_size = self.runner.block_size
        self.device = self.runner.device
        self.dtype = config.dtype
        self.weight_bytes = self.runner.weight_bytes  # rank 0's share, as kv_cache_bytes is its pool

    # ---- faults -------------------------------------------------------------------------------------
    def _raise_for_dead_process(self, when: str) -> None:
        dead = self._exited_ranks(timeout=0)
        if dead:
            raise RankFailedError(f"multi-rank {when} failed: {'; '.join(dead)} (its log says why)")

    def _failure(self, when: str, exc: BaseException) -> RankFailedError:
        # A failed collective almost always means a peer died: give its exit a moment to show, so it is named.
        dead = self._exited_ranks(timeout=2.0)
        cause = "; ".join(dead) if dead else f"{type(exc).__name__}: {' '.join(str(exc).split())[:300]}"
        return RankFailedError(f"multi-rank {when} failed: {cause}; the ranks are out of step, the engine "
                               "stops")

    def _exited_ranks(self, timeout: float) -> list[str]:
        """The ranks whose process has exited, waiting up to `timeout` for a first one. A closed sentinel is
        the proof: the exit code may still be unknown here while the watcher thread reaps the process."""
        sentinels = {p.sentinel: rank for rank, p in self._processes.items()}
        ready = set(multiprocessing.connection.wait(list(sentinels), timeout=timeout)) if sentinels else set()
        exited = []
        for sentinel in ready:
            rank = sentinels[sentinel]
            process = self._processes[rank]
            deadline = time.monotonic() + 1.0
            while process.exitcode is None and time.monotonic() < deadline:
                time.sleep(0.01)
            code = "an unknown code" if process.exitcode is None else f"code {process.exitcode}"
            exited.append((rank, f"rank {rank} (pid {process.pid}) exited with {code}"))
        return [text for _, text in sorted(exited)]

    def _watch(self) -> None:
        """Between steps: the first worker process that exits fails the executor."""
        sentinels = {p.sentinel: rank for rank, p in self._processes.items()}
        if not sentinels:
            return
        ready = multiprocessing.connection.wait(list(sentinels))
        rank = sentinels[ready[0]]
        process = self._processes[rank]
        process.join(1.0)  # the sentinel closes as the process exits, a moment before its exit code is known
        if not self._closed and self.fault is None:
            self.fault = RankFailedError(f"rank {rank} (pid {process.pid}) exited with code "
                                         f"{process.exitcode}")
            logger.critical("%s", self.fault)

    def check_health(self) -> None:
        """Raise the executor's fault (a rank died, or a step's collective failed)."""
        if self.fault is not None:
            raise self.fault

    # ---- the Executor methods -------------------------------------------------------------------------
    @property
    def kv_cache_bytes(self) -> int:
        """Rank 0's pool (every rank holds one of the same size, its KV heads' share)."""
        return self.num_blocks * self.runner.bytes_per_block

    @property
    def max_concurrent_batches(self) -> int:
        """Micro-batches the engine keeps in flight: one per pipeline stage."""
        return self.parallel.pipeline_parallel_size

    def execute(self, scheduled: list[ScheduledSeq], rows: list[Optional[SamplingRow]]) -> ModelRunnerOutput:
        if self.parallel.pipeline_parallel_size > 1:
            return self.collect(self.submit(scheduled, rows))
        self.check_health()
        step = self.runner.prepare(scheduled)
        return self.runner.sample(step, self._forward_on_every_rank(step), rows)

    def execute_async(self, scheduled: list[ScheduledSeq],
                      rows: list[Optional[SamplingRow]]) -> AsyncModelRunnerOutput:
        """Async scheduling with tensor parallelism (pipeline stages keep submit/collect): launch the step without
        waiting for the one in flight, whose sampled ids fill this step's placeholders on every rank on the
        device; the host reads this step's ids from the returned output."""
        self.check_health()
        step = self.runner.prepare(scheduled)
        return self.runner.sample_async(step, self._forward_on_every_rank(step), rows)

    def _forward_on_every_rank(self, step: PreparedStep) -> StepLogits:
        """Send the step to the other ranks and run this rank's forward. Inputs the step in flight samples are
        filled here from its ids on the device and broadcast to the other ranks on the model group (NCCL on
        CUDA: no host round trip), which scatter them into the same rows."""
        import torch.distributed as dist

        try:
            for work in self._send(step.inputs, [row for row, _ in step.placeholders]):
                work.wait()
            with torch.inference_mode():  # the ids in flight are inference tensors
                sampled = self.runner.fill_placeholders(step)
                if sampled is not None:
                    dist.broadcast(sampled, 0, group=self.groups.model)
            return self.runner.forward(step.inputs)
        except BaseException as exc:  # noqa: BLE001 - any failure here leaves the ranks out of step
            self.fault = self._failure("step", exc)
            raise self.fault from None

    def submit(self, scheduled: list[ScheduledSeq], rows: list[Optional[SamplingRow]]) -> PendingStep:
        """Pipeline parallelism: start a micro-batch (its step message and the first stage, here) and return
        while the later stages run it; `collect` samples it. Micro-batches are collected in submission order."""
        self.check_health()
        step = self.runner.prepare(scheduled)
        slot = step.inputs.micro_batch = self._free_slots.pop()
        try:
            messages = self._send(step.inputs)
            self.runner.forward(step.inputs)  # stage 0: hands its output to stage 1 and returns
        except BaseException as exc:  # noqa: BLE001 - any failure here leaves the ranks out of step
            self.fault = self._failure("step", exc)
            raise self.fault from None
        return PendingStep(step, rows, messages, slot)

    def collect(self, pending: PendingStep) -> ModelRunnerOutput:
        self.check_health()
        try:
            for work in pending.messages:
                work.wait()
            out = self._receive_logits(pending.step.inputs)
        except BaseException as exc:  # noqa: BLE001 - any failure here leaves the ranks out of step
            self.fault = self._failure("step", exc)
            raise self.fault from None
        self._free_slots.append(pending.slot)
        return self.runner.sample(pending.step, out, pending.rows)

    def idle_step(self) -> None:
        """A data-parallel replica's share of the others' step (experts dealt over the replicas): every rank
        runs its MoE layers' exchanges without tokens."""
        import torch.distributed as dist

        self.check_health()
        try:
            dist.broadcast(torch.tensor([IDLE] + [0] * (HEADER_LEN - 1), dtype=torch.long), 0,
                           group=self.groups.control)
            self.runner.idle_step()
        except BaseException as exc:  # noqa: BLE001 - any failure here leaves the ranks out of step
            self.fault = self._failure("step", exc)
            raise self.fault from None

    def _receive_logits(self, inputs: StepInputs) -> StepLogits:
        """The last pipeline stage's logits of the step's sampled and prompt-scored rows."""
        import torch.distributed as dist

        logits = torch.empty((inputs.logits_indices.numel(), self.runner.config.model_config.vocab_size),
                             dtype=torch.float32, device=self.device)
        if logits.numel():
            last_stage = self.parallel.world_size - self.parallel.tensor_parallel_size
            dist.recv(logits, self.parallel.global_rank(last_stage), group=self.groups.pipe)
        return StepLogits(logits)

    def _send(self, inputs: StepInputs, placeholder_rows: Sequence[int] = ()) -> list:
        """Start broadcasting the step message; returns the broadcasts' works (the caller waits on them)."""
        import torch.distributed as dist

        header, payload = pack_step(inputs, self._truncations, self._release, placeholder_rows)
        works = [dist.broadcast(tensor, 0, group=self.groups.control, async_op=True) for tensor in (header, payload)]
        self._truncations, self._release = [], False
        return works

    def make_generator(self, seed: int) -> torch.Generator:
        return self.runner.make_generator(seed)

    def truncate_kept_state(self, seq_id: int, num_tokens: int) -> None:
        """Here at once, on the other ranks with the next step (nothing runs on them in between)."""
        self.runner.truncate_kept_state(seq_id, num_tokens)
        self._truncations.append((seq_id, num_tokens))

    def release_kept_state(self) -> None:
        self.runner.release_kept_state()
        self._truncations, self._release = [], True

    def release_after_out_of_memory(self) -> None:
        # Unreachable in practice: an out-of-memory inside a multi-rank forward is a fault (see execute);
        # one in the driver's sampling leaves the workers waiting for the next step, which is in step.
        self.release_kept_state()
        if self.device.type == "cuda":
            torch.cuda.empty_cache()

    def shutdown(self) -> None:
        """Tell every rank to stop, wait for node 0's workers (killing those that do not exit), close the
        groups. Idempotent."""
        if self._closed:
            return
        self._closed = True
        atexit.unregister(self.shutdown)
        # Before start-up finished the workers are not reading step messages: they are stopped, not told.
        told = self._serving and self.fault is None
        if told:
            import torch.distributed as dist

            try:
                dist.broadcast(torch.tensor([STOP] + [0] * (HEADER_LEN - 1), dtype=torch.long), 0,
                               group=self.groups.control)
            except RuntimeError as exc:
                told = False
                logger.warning("could not tell every rank to stop: %s", " ".join(str(exc).split())[:200])
        _stop(self._processes, STOP_TIMEOUT_S if told else 0.0)  # after a fault, nobody waits for a hung rank
        if self.world is not None:
            self.world.release()
        else:
            _destroy_process_group()


def multiproc_executor_for(parallel: ParallelConfig, num_threads: Optional[int]):
    """The `executor_class` LLMEngine takes: builds a MultiprocExecutor for `parallel`."""
    def build(config: RunnerConfig) -> MultiprocExecutor:
        return MultiprocExecutor(config, parallel, num_threads)
    return build


# ---- data-parallel replicas of tensor-parallel engines ------------------------------------------------
class DataParallelWorld:
    """`llmctl serve -dp D -tp T` on one node: D tensor-parallel engines in the server's process. torch allows
    one process group per process, so the replicas share it: the server's process is rank 0 of every replica
    (each replica's driver runs on its own engine thread) and replica d's ranks 1..T-1 are processes of their
    own, global ranks 1 + d (T - 1) ... All of them are started here at once, every replica's groups are
    made, and each replica's `MultiprocExecutor` (`executor_class(d)`) takes its groups and processes. The
    process group is released when the last replica's executor shuts down."""

    def __init__(self, parallels: list[ParallelConfig], configs: list[RunnerConfig], num_threads: Optional[int],
                 expert_placement: tuple[tuple[int, ...], ...] = ()):
        """`expert_placement`: each expert-parallel rank's experts when they are dealt over the replicas (whose
        executors then step in lockstep); () otherwise."""
        import torch.distributed as dist

        if dist.is_initialized():
            raise EngineError("a parallel engine already runs in this process (one process group per process)")
        store = _store(parallels[0], 0)
        self.parallels = [replace(p, master_port=store.port) for p in parallels]
        self.num_threads = num_threads
        self.expert_placement = expert_placement
        self.lockstep = ReplicaLockstep(len(parallels)) if expert_placement else None
        self.processes: list[dict[int, object]] = []
        self._open = len(parallels)
        self._lock = threading.Lock()
        threads = _threads_per_rank(parallels[0], num_threads)
        try:
            for parallel, config in zip(self.parallels, configs):
                self.processes.append(_spawn(range(1, parallel.world_size), parallel, config, threads))
            _wait_for_ranks(store, self.parallels[0], self._raise_for_dead_process)
            self.groups = _connect(self.parallels[0], 0, configs[0].device, store, parallels[0].collective_timeout_s)
        except BaseException:
            self._open = 0
            self._stop_all()
            raise

    def _raise_for_dead_process(self) -> None:
        for replica, processes in enumerate(self.processes):
            for rank, process in processes.items():
                if process.exitcode is not None:
                    raise RankFailedError(f"data-parallel replica {replica}'s rank {rank} (pid {process.pid}) "
                                          f"exited with code {process.exitcode} during start-up (its log says why)")

    def executor_class(self, replica: int) -> Callable[[RunnerConfig], "MultiprocExecutor | LockstepExecutor"]:
        """The `executor_class` of replica `replica`'s LLMEngine."""
        def build(config: RunnerConfig):
            executor = MultiprocExecutor(config, self.parallels[replica], self.num_threads, world=self)
            if self.lockstep is None:
                return executor
            return LockstepExecutor(executor, self.lockstep.member(replica), self.expert_placement)
        return build

    def release(self) -> None:
        """A replica's executor shut down; after the last, the process group goes."""
        with self._lock:
            self._open -= 1
            last = self._open == 0
        if last:
            _destroy_process_group()

    def shutdown(self) -> None:
        """Stop every rank and release the process group (a failed load: replicas that never got an executor)."""
        if self.lockstep is not None:
            self.lockstep.leave("data-parallel replicas failed to load")
        with self._lock:
            self._open = 0
        self._stop_all()

    def _stop_all(self) -> None:
        for processes in self.processes:
            _stop(processes, 0.0)
        _destroy_process_group()


# ---- a node k > 0 -----------------------------------------------------------------------------------
def run_worker_node(config: RunnerConfig, parallel: ParallelConfig, num_threads: Optional[int]) -> int:
    """Node k > 0 (or a torchrun rank > 0): run this machine's ranks until rank 0 stops them. Returns the
    exit code: 0 when every rank was stopped by rank 0, 1 when one failed or rank 0 went away. SIGTERM or
    SIGINT here stops this node's ranks (which fails the engine on node 0)."""
    threads = _threads_per_rank(parallel, num_threads)
    if parallel.torchrun:
        _worker_main(parallel.rank, parallel, config, threads)  # exits the process
    processes = _spawn(parallel.node_ranks, parallel, config, threads)
    stopping = threading.Event()

    def on_signal(sig, frame):
        logger.warning("received %s: stopping this node's ranks", signal.Signals(sig).name)
        stopping.set()

    previous = {sig: signal.signal(sig, on_signal) for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
        remaining = {p.sentinel: p for p in processes.values()}
        while remaining and not stopping.is_set():
            for sentinel in multiprocessing.connection.wait(list(remaining), timeout=0.5):
                remaining.pop(sentinel)
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
        _stop(processes, 0.0 if stopping.is_set() else STOP_TIMEOUT_S)
    codes = {rank: p.exitcode for rank, p in processes.items()}
    logger.info("node %d: ranks exited %s", parallel.node_rank, codes)
    return 0 if not stopping.is_set() and all(code == 0 for code in codes.values()) else 1
