"""Every linear of a decode step at batch M, bf16 against the quantised kernels, alternated step by step in one
process: the per-step cost of the weights' kernels under the same machine state, which a shared host's load
swings by 20-40 % between processes.

Shapes: SmolLM-135M's (30 layers of qkv 960x576, o 576x576, gate_up 3072x576, down 576x1536, and the 49152x576
lm_head), seeded random weights. Before each step a 256 MiB sweep stands in for the step's KV-cache reads
(they evict the weights from the caches, as in benchmarks/quantization.py's batched workload). Each scheme
runs the kernel the engine's policy gives M rows (engine/layers/quantization.py `_native_product`): bf16 the
AMX kernel, int8 per channel AMX-INT8 (the GEMV below INT8_TILE_MIN_ROWS), int4-g32 the dequantising AMX GEMM
(the GEMV below AMX_MIN_ROWS). Wall time per step (all threads); the table gives each scheme's median, its
range and the ratio to the first scheme.

    python benchmarks/batched_linears.py [--rows 64] [--threads 2] [--steps 12] [--schemes bf16,int8,int4-g32]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time

import torch

from llmctl.engine.kernels import load_cpu_kernels
from llmctl.engine.kernels.quant import load_quant_kernels
from llmctl.engine.layers.quantization import AMX_MIN_ROWS, INT8_TILE_MIN_ROWS, GroupedIntWeight

SHAPES = [(960, 576), (576, 576), (3072, 576), (576, 1536)] * 30 + [(49152, 576)]
SCHEMES = {"int8": (8, None), "int4-g32": (4, 32)}  # bits, group (None: per channel)


def step_calls(scheme: str, rows: int, cpu, quant) -> list:
    """One callable a linear, in the step's order, each taking that linear's input."""
    torch.manual_seed(0)
    calls = []
    for out_features, in_features in SHAPES:
        weight = torch.randn(out_features, in_features) * 0.05
        if scheme == "bf16":
            tiles = cpu.pack_amx(weight.bfloat16())
            calls.append(lambda x, t=tiles, n=out_features: cpu.gemm_amx(t, x, n))
            continue
        bits, group = SCHEMES[scheme]
        grouped = GroupedIntWeight.quantize(weight, bits, group or in_features, True)
        native = quant.pack(grouped.codes, grouped.scales, grouped.zeros, bits, grouped.group_size)
        if bits == 8 and rows >= INT8_TILE_MIN_ROWS:
            calls.append(lambda x, w=native: quant.gemm_amx_int8(w, x))
        elif rows >= AMX_MIN_ROWS:
            calls.append(lambda x, w=native: quant.gemm_amx(w, x))
        else:
            calls.append(lambda x, w=native: quant.gemv(w, x))
    return calls


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, default=64)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--schemes", default="bf16,int8,int4-g32")
    args = parser.parse_args(argv)
    cpu, quant = load_cpu_kernels(), load_quant_kernels()
    if cpu is None or quant is None or not cpu.has_amx or not quant.has_amx:
        print("batched_linears: needs the native kernels and AMX tiles on this CPU", file=sys.stderr)
        return 1
    torch.set_num_threads(args.threads)
    schemes = args.schemes.split(",")
    unknown = [s for s in schemes if s != "bf16" and s not in SCHEMES]
    if unknown:
        print(f"batched_linears: unknown scheme(s) {', '.join(unknown)}; choose from bf16, {', '.join(SCHEMES)}",
              file=sys.stderr)
        return 2
    steps = {scheme: step_calls(scheme, args.rows, cpu, quant) for scheme in schemes}
    inputs = {k: torch.randn(args.rows, k).bfloat16() for k in {k for _, k in SHAPES}}
    sweep = torch.ones(64 * 2**20)  # 256 MiB
    times: dict[str, list[float]] = {scheme: [] for scheme in schemes}
    for step in range(args.steps + 1):  # the first round warms up
        for scheme in schemes:
            sweep.sum()
            start = time.perf_counter()
            for (_, in_features), call in zip(SHAPES, steps[scheme]):
                call(inputs[in_features])
            if step:
                times[scheme].append(time.perf_counter() - start)
    base = statistics.median(times[schemes[0]])
    print(f"{args.rows} rows, {args.threads} thread(s), {args.steps} alternated steps, ms per step of all {len(SHAPES)} linears")
    print("| scheme | median | min | max | vs " + schemes[0] + " |")
    print("|---|---:|---:|---:|---:|")
    for scheme in schemes:
        values = times[scheme]
        median = statistics.median(values)
        print(f"| {scheme} | {median * 1e3:.1f} | {min(values) * 1e3:.1f} | {max(values) * 1e3:.1f} | {median / base:.2f}x |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
