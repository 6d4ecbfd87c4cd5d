"""Run a function on N tensor-parallel ranks, each a spawned process, and collect results; run a greedy
workload on one rank's engine.

`run_ranks(fn, size, *args)` calls `fn(tp, *args)` on every rank with its `TensorParallel` (gloo on CPU;
`backend="nccl"`: rank r on cuda:r) and returns the results in rank order. A rank that raises fails the
call with its traceback; a rank that hangs fails it after `timeout` seconds (the collectives' own timeout
is shorter), and every rank is stopped either way, so a broken collective never hangs the test suite.

`greedy_run(folder, tp, prompts, new_tokens, **engine_args)`: one engine per rank, each with the whole
scheduler. With greedy sampling and the same requests every rank makes the same scheduling decisions, so
their collectives line up step by step (the multi-rank executor, which schedules on rank 0 only, is the
product's way; this isolates the sharded model and KV pool).
"""

from __future__ import annotations

import dataclasses
import datetime
import os
import time
import traceback
from typing import Any, Callable

import torch.multiprocessing as mp

from server_helpers import free_port


def _rank_main(rank: int, size: int, port: int, backend: str, fn: Callable, args: tuple, results) -> None:
    import torch
    import torch.distributed as dist

    from llmctl.engine.parallel import TensorParallel

    torch.set_num_threads(1)  # the ranks share this machine's cores
    try:
        if backend == "nccl":
            torch.cuda.set_device(rank)
        dist.init_process_group(backend, init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=size,
                                timeout=datetime.timedelta(seconds=60))
        try:
            results.put((rank, "ok", fn(TensorParallel.from_group(), *args)))
        finally:
            dist.destroy_process_group()
    except BaseException:  # noqa: BLE001 - handed to the parent, which fails the test with it
        results.put((rank, "error", traceback.format_exc()))


def run_ranks(fn: Callable, size: int, *args, timeout: float = 120.0, backend: str = "gloo") -> list[Any]:
    context = mp.get_context("spawn")
    results = context.SimpleQueue()
    port = free_port()
    processes = [context.Process(target=_rank_main, args=(rank, size, port, backend, fn, args, results), daemon=True)
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


def greedy_run(folder: str, tp, prompts: list[list[int]], new_tokens: int, **engine_args) -> dict[str, Any]:
    """Greedy tokens and the logits of every sampled position (numpy, so they cross the process boundary
    by pickle) of `prompts` on this rank's engine, with what the test checks about the run."""
    import torch

    from llmctl.engine import SamplingParams
    from llmctl.engine.args import EngineArgs
    from llmctl.engine.executor.uniproc_executor import UniProcExecutor
    from llmctl.engine.llm_engine import LLMEngine

    engine = LLMEngine(EngineArgs.from_dict({"model": folder, **engine_args}),
                       executor_class=lambda config: UniProcExecutor(dataclasses.replace(config, tensor_parallel=tp)))
    recorded: list[list[torch.Tensor]] = [[] for _ in prompts]

    def recorder(rows: list):
        def record(output_ids, logits):
            rows.append(logits.detach().float().cpu().clone())
            return logits
        return record

    for i, prompt in enumerate(prompts):
        engine.add_request(str(i), prompt, SamplingParams(temperature=0.0, max_tokens=new_tokens, ignore_eos=True,
                                                          logits_processors=[recorder(recorded[i])]))
    tokens: dict[str, list[int]] = {}
    while engine.has_unfinished_requests():
        for output in engine.step().outputs:
            if output.finished:
                tokens[output.request_id] = list(output.outputs[0].token_ids)
    stats = engine.get_stats()
    runner = engine.executor.runner
    return dict(tokens=[tokens[str(i)] for i in range(len(prompts))],
                logits=[torch.stack(rows).numpy() for rows in recorded],
                preemptions=stats["num_preemptions"], prefix_hits=stats["prefix_cache_hit_rate"],
                heads=(runner.num_heads, runner.num_kv_heads), kv_bytes_per_block=runner.bytes_per_block,
                free_blocks=engine.block_manager.num_free_blocks == engine.block_manager.num_blocks)
