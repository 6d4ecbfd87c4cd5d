"""Run a function on N tensor-parallel ranks (gloo on CPU), each a spawned process, and collect results.

`run_ranks(fn, size, *args)` calls `fn(tp, *args)` on every rank with its `TensorParallel` and
returns the results in rank order. A rank that raises fails the call with its traceback; a rank that
hangs fails it after `timeout` seconds (the collectives' own timeout is shorter), and every rank is
stopped either way, so a broken collective never hangs the test suite.
"""

from __future__ import annotations

import datetime
import os
import traceback
from typing import Any, Callable

import torch.multiprocessing as mp

from server_helpers import free_port


def _rank_main(rank: int, size: int, port: int, fn: Callable, args: tuple, results) -> None:
    import torch
    import torch.distributed as dist

    from llmctl.engine.parallel import TensorParallel

    torch.set_num_threads(1)  # the ranks share this machine's cores
    try:
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=size,
                                timeout=datetime.timedelta(seconds=60))
        try:
            results.put((rank, "ok", fn(TensorParallel.from_group(), *args)))
        finally:
            dist.destroy_process_group()
    except BaseException:  # noqa: BLE001 - handed to the parent, which fails the test with it
        results.put((rank, "error", traceback.format_exc()))


def run_ranks(fn: Callable, size: int, *args, timeout: float = 120.0) -> list[Any]:
    context = mp.get_context("spawn")
    results = context.SimpleQueue()
    port = free_port()
    processes = [context.Process(target=_rank_main, args=(rank, size, port, fn, args, results), daemon=True)
                 for rank in range(size)]
    env_threads = os.environ.get("OMP_NUM_THREADS")
    os.environ["OMP_NUM_THREADS"] = "1"
    try:
        for process in processes:
            process.start()
    finally:
        if env_threads is None:
            os.environ.pop("OMP_NUM_THREADS")
        else:
            os.environ["OMP_NUM_THREADS"] = env_threads
    try:
        collected: dict[int, Any] = {}
        deadline = datetime.datetime.now() + datetime.timedelta(seconds=timeout)
        while len(collected) < size:
            if datetime.datetime.now() > deadline:
                raise TimeoutError(f"tensor-parallel ranks {sorted(set(range(size)) - set(collected))} "
                                   f"gave no result within {timeout:.0f} s")
            if results.empty():
                if any(p.exitcode not in (None, 0) for p in processes):
                    dead = [p.exitcode for p in processes]
                    raise RuntimeError(f"a tensor-parallel rank died: exit codes {dead}")
                import time

                time.sleep(0.05)
                continue
            rank, status, value = results.get()
            if status == "error":
                raise RuntimeError(f"rank {rank} failed:\n{value}")
            collected[rank] = value
        return [collected[rank] for rank in range(size)]
    finally:
        for process in processes:
            process.join(timeout=10)
            if process.is_alive():
                process.kill()
                process.join()
