"""What tensor parallelism's communication costs on this host: the median time of the all-reduce a
row-parallel linear ends with ([tokens, hidden] of the model dtype) and of the lm_head's logits all-gather
([rows, vocab / size]), over 2 ranks of gloo (CPU) or NCCL (CUDA, one GPU per rank), through
`TensorParallel`'s own collectives.

    python benchmarks/tp_collectives.py [--backend gloo|nccl] [--size 2] [--iters 200] [--json]

A decoder layer makes two all-reduces per step (after o_proj and after down_proj), the embedding one more
per step, and the logits one all-gather per step: a step's communication is about
(2 x layers + 1) x all-reduce(tokens, hidden) + all-gather(sampled rows, vocab / size).
"""

from __future__ import annotations

import argparse
import datetime
import json
import socket
import statistics
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

# (what, tokens, width): hidden 576 is the embedded default model's scale, 4096 Llama-3-8B's; vocab 128256 Llama 3's.
SHAPES = [("all_reduce", 1, 576), ("all_reduce", 64, 576), ("all_reduce", 1, 4096), ("all_reduce", 64, 4096),
          ("all_reduce", 512, 4096), ("all_gather", 1, 128256), ("all_gather", 64, 128256)]


def _rank(rank: int, size: int, port: int, backend: str, iters: int, results) -> None:
    from llmctl.engine.parallel import TensorParallel

    torch.set_num_threads(1)
    device = torch.device("cuda", rank) if backend == "nccl" else torch.device("cpu")
    if backend == "nccl":
        torch.cuda.set_device(rank)
    dist.init_process_group(backend, init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=size,
                            timeout=datetime.timedelta(seconds=60))
    tp = TensorParallel.from_group()
    rows = []
    for dtype in (torch.bfloat16, torch.float32):
        for what, tokens, width in SHAPES:
            width = width // size if what == "all_gather" else width
            x = torch.randn(tokens, width, dtype=dtype, device=device)
            call = (lambda: tp.all_reduce(x)) if what == "all_reduce" else (lambda: tp.all_gather(x))
            for _ in range(10):
                call()
            times = []
            for _ in range(iters):
                if backend == "nccl":
                    torch.cuda.synchronize()
                start = time.perf_counter()
                call()
                if backend == "nccl":
                    torch.cuda.synchronize()
                times.append(time.perf_counter() - start)
            rows.append(dict(op=what, dtype=str(dtype).removeprefix("torch."), tokens=tokens, width=width,
                             bytes_per_rank=x.numel() * x.element_size(), median_us=statistics.median(times) * 1e6))
    if rank == 0:
        results.put(rows)
    dist.destroy_process_group()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--backend", choices=["gloo", "nccl"], default="gloo")
    parser.add_argument("--size", type=int, default=2)
    parser.add_argument("--iters", type=int, default=200)
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    context = mp.get_context("spawn")
    results = context.SimpleQueue()
    ranks = [context.Process(target=_rank, args=(r, args.size, port, args.backend, args.iters, results))
             for r in range(args.size)]
    for process in ranks:
        process.start()
    for process in ranks:
        process.join()
    if any(process.exitcode for process in ranks):
        raise SystemExit(f"a rank failed: exit codes {[p.exitcode for p in ranks]}")
    rows = results.get()
    if args.json:
        print(json.dumps(rows, indent=2))
        return
    print(f"{args.backend}, {args.size} ranks, median of {args.iters}")
    print(f"{'op':10} {'dtype':9} {'tokens':>6} {'width':>7} {'bytes/rank':>11} {'median':>10}")
    for row in rows:
        print(f"{row['op']:10} {row['dtype']:9} {row['tokens']:>6} {row['width']:>7} {row['bytes_per_rank']:>11,} "
              f"{row['median_us']:>8.0f} µs")


if __name__ == "__main__":
    main()
