"""`llmctl bench --gpu` on several GPUs: an all-reduce sweep over the local GPUs through
torch.distributed (NCCL; gloo on CPU processes for the tests), reported as nccl-tests does.

nccl-tests' figures: algbw = bytes / time; busbw = algbw x 2(n-1)/n for all-reduce (each rank
sends and receives 2(n-1)/n of the buffer in a ring, so busbw compares with link bandwidth whatever
n is). The time of an iteration is the slowest rank's. Every iteration's result is also checked: each
rank contributes rank + 1, so every element must equal n(n+1)/2.
"""

from __future__ import annotations

import socket
import time
from dataclasses import dataclass
from typing import Any

MIB = 1 << 20


def allreduce_busbw_factor(world: int) -> float:
    """nccl-tests' bus-bandwidth factor of all-reduce: 2(n-1)/n."""
    if world < 1:
        raise ValueError(f"world size must be >= 1, got {world}")
    return 2.0 * (world - 1) / world


def bandwidths(nbytes: int, seconds: float, world: int) -> tuple[float, float]:
    """(algbw, busbw) in GB/s for one all-reduce of nbytes per rank that took seconds."""
    algbw = nbytes / seconds / 1e9
    return algbw, algbw * allreduce_busbw_factor(world)


@dataclass(frozen=True)
class SweepRow:
    nbytes: int
    seconds: list[float]  # per iteration, the slowest rank's
    wrong_elements: int  # summed over ranks and iterations


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _worker(rank: int, world: int, backend: str, port: int, sizes: list[int], reps: int, warmup: int,
            queue: Any) -> None:
    import torch
    import torch.distributed as dist

    dist.init_process_group(backend, init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    device = torch.device("cuda", rank) if backend == "nccl" else torch.device("cpu")
    if device.type == "cuda":
        torch.cuda.set_device(device)
    try:
        rows = [_sweep_one(dist, device, rank, world, nbytes, reps, warmup) for nbytes in sizes]
    finally:
        dist.destroy_process_group()
    if rank == 0:
        queue.put(rows)


def _sweep_one(dist: Any, device: Any, rank: int, world: int, nbytes: int, reps: int, warmup: int) -> SweepRow:
    import torch

    buffer = torch.empty(nbytes // 4, dtype=torch.float32, device=device)
    expected = world * (world + 1) / 2
    sync = (lambda: torch.cuda.synchronize(device)) if device.type == "cuda" else (lambda: None)
    seconds, wrong = [], 0
    for i in range(warmup + reps):
        buffer.fill_(rank + 1)
        sync()
        dist.barrier()
        start = time.perf_counter()
        dist.all_reduce(buffer)
        sync()
        elapsed = time.perf_counter() - start
        wrong += int((buffer != expected).sum())
        if i >= warmup:
            seconds.append(elapsed)
    slowest = torch.tensor(seconds, dtype=torch.float64, device=device)
    dist.all_reduce(slowest, op=dist.ReduceOp.MAX)
    errors = torch.tensor([wrong], dtype=torch.int64, device=device)
    dist.all_reduce(errors)
    return SweepRow(nbytes, slowest.tolist(), int(errors.item()))


def allreduce_sweep(world: int, sizes: list[int], backend: str = "nccl", reps: int = 5,
                    warmup: int = 2) -> list[SweepRow]:
    """Run the sweep in `world` spawned processes (rank r on cuda:r with NCCL); rows in size order."""
    import torch.multiprocessing as mp

    context = mp.get_context("spawn")
    queue = context.SimpleQueue()
    mp.start_processes(_worker, args=(world, backend, _free_port(), sizes, reps, warmup, queue), nprocs=world,
                       join=True, start_method="spawn")
    if queue.empty():
        raise RuntimeError(f"all-reduce sweep over {world} {backend} ranks returned no result")
    return queue.get()


def to_measured(row: SweepRow, world: int, backend: str) -> Any:
    """A kernels.Measured of the busbw per iteration; algbw's median and the error count in params."""
    import statistics

    from llmctl.bench.kernels import Measured
    from llmctl.output import format_bytes

    pairs = [bandwidths(row.nbytes, s, world) for s in row.seconds]
    return Measured("allreduce_busbw", f"all-reduce busbw {format_bytes(row.nbytes)} x{world} {backend}", "GB/s",
                    [bus for _, bus in pairs],
                    {"bytes": row.nbytes, "world_size": world, "backend": backend,
                     "algbw_median_gbs": float(f"{statistics.median(alg for alg, _ in pairs):.5g}"),
                     "busbw_factor": allreduce_busbw_factor(world), "wrong_elements": row.wrong_elements})
