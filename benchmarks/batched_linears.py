"""Every linear of a decode step at batch M, bf16 against the quantised kernels, alternated step by step in one
process: the per-step cost of the weights' kernels under the same machine state, which a shared host's load
swings by 20-40 % between processes.

Shapes: SmolLM-135M's (30 layers of qkv 960x576, o 576x576, gate_up 3072x576, down 576x1536, and the 49152x576
lm_head), seeded random weights. Before each step a 256 MiB sweep stands in for the step's KV-cache reads
(they evict the weights from the caches, as in benchmarks/quantization.py's batched workload). Each linear is the
engine's own layer, built as the model runner builds it (bf16: `select_linear_method`, the AMX kernel or oneDNN's
packed GEMM; int8 / int4-g32: `OnTheFlyIntLinearMethod`, the native layout), so M rows run the kernel the engine's
policy gives them on this CPU (engine/layers/quantization/grouped.py `_native_product`). Wall time per step (all
threads); the table gives each scheme's median, its range and the ratio to the first scheme.

    python benchmarks/batched_linears.py [--rows 64] [--threads 2] [--steps 12] [--schemes bf16,int8,int4-g32]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time

import torch

from llmctl.engine.kernels import cpu_kernels_for
from llmctl.engine.kernels.quant import load_quant_kernels
from llmctl.engine.layers.linear import ColumnLinear, select_linear_method
from llmctl.engine.layers.quantization import quantized_linear_method
from llmctl.engine.layers.quantization.on_the_fly import ON_THE_FLY_SCHEMES

SHAPES = [(960, 576), (576, 576), (3072, 576), (576, 1536)] * 30 + [(49152, 576)]
CPU = torch.device("cpu")


def step_layers(scheme: str, rows: int) -> list[ColumnLinear]:
    """The step's linears, in order, each loaded with seeded random weights and prepared as the engine does."""
    torch.manual_seed(0)
    if scheme == "bf16":
        method = select_linear_method(CPU, torch.bfloat16, cpu_kernels_for(CPU, torch.bfloat16), batch_hint=rows)
    else:
        method = quantized_linear_method(scheme, CPU, torch.bfloat16)
    layers = []
    for out_features, in_features in SHAPES:
        layer = ColumnLinear(in_features, out_features, False, method, torch.bfloat16)
        layer.weight.data.copy_(torch.randn(out_features, in_features) * 0.05)
        layer.process_weights_after_loading()
        layers.append(layer)
    return layers


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, default=64)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--schemes", default="bf16,int8,int4-g32")
    args = parser.parse_args(argv)
    if load_quant_kernels() is None:
        print("batched_linears: needs the native quant kernels (a C compiler and AVX2 or AVX-512)", file=sys.stderr)
        return 1
    torch.set_num_threads(args.threads)
    schemes = args.schemes.split(",")
    unknown = [s for s in schemes if s != "bf16" and s not in ON_THE_FLY_SCHEMES]
    if unknown:
        print(f"batched_linears: unknown scheme(s) {', '.join(unknown)}; choose from bf16, "
              f"{', '.join(ON_THE_FLY_SCHEMES)}", file=sys.stderr)
        return 2
    steps = {scheme: step_layers(scheme, args.rows) for scheme in schemes}
    inputs = {k: torch.randn(args.rows, k).bfloat16() for k in {k for _, k in SHAPES}}
    sweep = torch.ones(64 * 2**20)  # 256 MiB
    times: dict[str, list[float]] = {scheme: [] for scheme in schemes}
    for step in range(args.steps + 1):  # the first round warms up
        for scheme in schemes:
            sweep.sum()
            start = time.perf_counter()
            with torch.no_grad():
                for (_, in_features), layer in zip(SHAPES, steps[scheme]):
                    layer(inputs[in_features])
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
