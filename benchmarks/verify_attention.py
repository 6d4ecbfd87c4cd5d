"""One layer's attention for a speculative verify row: the native paged kernel against the SDPA path.

A verify row is 1 + k query tokens of one sequence on its context (query j sees the first
context - (k + 1) + j + 1 keys). The torch backend runs such rows through the native CPU kernel
(`CpuKernels.paged_attention`, straight from the paged pool, each query computed as a one-token decode)
when they are at most `NATIVE_MAX_QUERY` tokens long; before, they went through SDPA over a context
gathered from the pool (`TorchAttention._prefill`, which longer rows still take). This measures both
per layer call, plus one one-token decode for scale, on the embedded model's heads (8 query / 4 K/V
heads of 32) and SmolLM-135M's (9 / 3 of 64), at a few contexts, and the query length where SDPA
catches up (`--crossover`).

`--prefill` measures instead a prompt's whole prefill row (queries = context, 16 128 512 2048 tokens by
default), native kernel against SDPA: where the kernel runs on AMX tiles (bf16) the torch backend sends
such rows to it too, so that no value depends on how a prompt was chunked.

Times are CPU time of the calling thread (`time.thread_time_ns`) with one torch / OpenMP thread, best of
`--repeats` blocks of `--calls` calls: meaningful on a loaded host, where wall-clock is not (with
`--threads 2`, best wall-clock time).

    python benchmarks/verify_attention.py [--contexts 128 512 2048] [--queries 5] [--dtype bfloat16]
        [--crossover] [--prefill [LENGTH ...]] [--threads 1 2] [--repeats 7] [--calls 50] [--json]
"""

from __future__ import annotations

import argparse
import json
import time

import torch

from llmctl.engine.kernels import load_cpu_kernels
from llmctl.engine.layers.attention.torch_backend import NATIVE_MAX_QUERY, PrefillSpan, TorchAttention

SHAPES = {"embedded (8/4 x 32)": (8, 4, 32), "SmolLM-135M (9/3 x 64)": (9, 3, 64)}
BLOCK_SIZE = 16


def best_us(work, repeats: int, calls: int, clock=time.thread_time_ns) -> float:
    """Best per-call time of `work` in microseconds on `clock` (the calling thread's CPU time by default)."""
    work()
    best = float("inf")
    for _ in range(repeats):
        start = clock()
        for _ in range(calls):
            work()
        best = min(best, (clock() - start) / calls)
    return best / 1e3


def measure(kernels, shape: tuple[int, int, int], context: int, queries: int, dtype: torch.dtype,
            repeats: int, calls: int, clock=time.thread_time_ns) -> dict:
    heads, kv_heads, dim = shape
    generator = torch.Generator().manual_seed(context + queries)
    width = -(-context // BLOCK_SIZE)
    num_blocks = 2 * width + 1
    table = torch.randperm(num_blocks, generator=generator)[:width]  # the pool is paged, not contiguous
    k_pool = torch.randn(kv_heads, num_blocks, BLOCK_SIZE, dim, generator=generator).to(dtype)
    v_pool = torch.randn(kv_heads, num_blocks, BLOCK_SIZE, dim, generator=generator).to(dtype)
    q = torch.randn(queries, heads, dim, generator=generator).to(dtype)
    k, v = (torch.randn(queries, kv_heads, dim, generator=generator).to(dtype) for _ in range(2))
    lens = torch.tensor([context])
    rows = kernels.paged_rows(table.unsqueeze(0), lens, BLOCK_SIZE, torch.tensor([0]), torch.tensor([queries]))
    decode_rows = kernels.paged_rows(table.unsqueeze(0), lens, BLOCK_SIZE)
    scale = dim ** -0.5
    sdpa = TorchAttention(heads, kv_heads, dim, None, dtype)  # no kernels: the SDPA path for the row
    span = PrefillSpan(0, queries, context, table)
    native_us = best_us(lambda: kernels.paged_attention(q, k_pool, v_pool, rows, scale), repeats, calls, clock)
    sdpa_us = best_us(lambda: sdpa._prefill(q, k, v, k_pool, v_pool, span), repeats, calls, clock)
    decode_us = best_us(lambda: kernels.paged_attention(q[:1], k_pool, v_pool, decode_rows, scale), repeats, calls,
                        clock)
    return {"context": context, "queries": queries, "native_us": native_us, "sdpa_us": sdpa_us,
            "decode_us": decode_us, "speedup": sdpa_us / native_us}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--contexts", type=int, nargs="+", default=[128, 512, 2048])
    parser.add_argument("--queries", type=int, default=5, help="query tokens of the verify row (k + 1)")
    parser.add_argument("--dtype", choices=["bfloat16", "float32"], default="bfloat16")
    parser.add_argument("--crossover", action="store_true",
                        help="also rows of 1..64 query tokens at context 512: where SDPA catches up")
    parser.add_argument("--prefill", type=int, nargs="*", metavar="LENGTH",
                        help="instead: prefill rows (a prompt of LENGTH tokens, all its queries in one row; default "
                             "16 128 512 2048), native kernel vs SDPA, with --threads")
    parser.add_argument("--threads", type=int, nargs="+", default=[1],
                        help="with --prefill: torch / OpenMP threads (several: best wall-clock time, since idle "
                             "OpenMP threads spin and the calling thread's CPU time is only its share)")
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--calls", type=int, default=50)
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    kernels = load_cpu_kernels()
    if kernels is None:
        raise SystemExit("error: the native CPU kernels cannot be built here (compiler or AVX-512)")
    dtype = getattr(torch, args.dtype)
    if args.prefill is not None:
        return prefill_table(kernels, args.prefill or [16, 128, 512, 2048], args.threads, dtype, args)
    torch.set_num_threads(1)
    results = []
    for name, shape in SHAPES.items():
        for context in args.contexts:
            results.append({"shape": name, **measure(kernels, shape, context, args.queries, dtype, args.repeats,
                                                     args.calls)})
        if args.crossover:
            for queries in (1, 2, 4, 8, 12, 16, 24, 32, 64):
                results.append({"shape": name, **measure(kernels, shape, 512, queries, dtype, args.repeats,
                                                         args.calls)})
    if args.json:
        print(json.dumps({"dtype": args.dtype, "native_max_query": NATIVE_MAX_QUERY, "results": results}, indent=2))
        return
    print(f"{args.dtype}, thread CPU time per layer call, one thread (native serves rows of <= {NATIVE_MAX_QUERY})")
    print("| heads | context | query tokens | native us | SDPA path us | SDPA / native | one-token decode us |")
    print("|---|---|---|---|---|---|---|")
    for r in results:
        print(f"| {r['shape']} | {r['context']} | {r['queries']} | {r['native_us']:.1f} | {r['sdpa_us']:.1f} "
              f"| {r['speedup']:.2f}x | {r['decode_us']:.1f} |")


def prefill_table(kernels, lengths: list[int], threads: list[int], dtype: torch.dtype, args) -> None:
    """A prompt's prefill row (queries = context): what the torch backend runs on the kernel where it is tiled."""
    results = []
    for count in threads:
        torch.set_num_threads(count)
        clock = time.thread_time_ns if count == 1 else time.perf_counter_ns
        for name, shape in SHAPES.items():
            for length in lengths:
                calls = max(1, min(args.calls, 20000 // length))
                results.append({"shape": name, "threads": count,
                                **measure(kernels, shape, length, length, dtype, args.repeats, calls, clock)})
    if args.json:
        print(json.dumps({"dtype": args.dtype, "prefill": results}, indent=2))
        return
    print(f"{args.dtype}, prefill rows (queries = context), per layer call: 1 thread: the calling thread's CPU time; "
          "more: best wall-clock time")
    print("| heads | threads | prompt tokens | native us | SDPA us | native / SDPA |")
    print("|---|---|---|---|---|---|")
    for r in results:
        print(f"| {r['shape']} | {r['threads']} | {r['context']} | {r['native_us']:.0f} | {r['sdpa_us']:.0f} "
              f"| {r['native_us'] / r['sdpa_us']:.2f} |")


if __name__ == "__main__":
    main()
