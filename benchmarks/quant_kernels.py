"""Quantised GEMV kernels at decode shapes: the native kernels (engine/kernels/quant_*.c) against
torch's `_weight_int8pack_mm` / `_weight_int4pack_mm_for_cpu`, bfloat16 activations.

Times are CPU time of the calling thread (`time.thread_time_ns`), best of `--repeats` blocks, so a shared
host's descheduling is not counted; with `--threads 2` the second OpenMP thread's work is not in the
figure (use one thread to compare kernels). "hot" reuses one weight (it stays in L2/L3); "cold" rotates
through copies totalling `--cold-mib` so every call streams its weight from memory.

    python benchmarks/quant_kernels.py                       # SmolLM-135M shapes, rows 1, 2, 4, 5, 8 (~15 min)
    python benchmarks/quant_kernels.py --quick               # one shape, hot only (a smoke run)
    python benchmarks/quant_kernels.py --cold-mib 1024 --json kernels.json
    python benchmarks/quant_kernels.py --batched --rows 2,5,8,16,32,64,512,2048   # the M >= 2 policy's table

`--batched` compares, per row count, the paths a quantised linear can take for several rows (cold weights):
the native GEMV, the AMX dequantising GEMM (`gemm_amx`, where the CPU has AMX), AMX-INT8 on the codes
(`gemm_amx_int8`, for weights whose x blocks are whole multiples of 32 inputs), the AVX512-BF16 dequantising
GEMM (`gemm_bf16`, CPUs with AVX512-BF16 and no AMX), dequantise + one F.linear, and bf16's own linear on the
dequantised weight (AMX tiles, else oneDNN's packed GEMM: what `--quantization-batch-cache` runs, and what an
unquantised bf16 model runs).
"""

from __future__ import annotations

import argparse
import json
import sys
import time

import torch

from llmctl.engine.kernels import load_cpu_kernels
from llmctl.engine.kernels.quant import load_quant_kernels
from llmctl.engine.layers.quantization.grouped import GroupedIntWeight, tinygemm_scales_and_offsets

SHAPES = {"qkv": (960, 576), "o": (576, 576), "gate_up": (3072, 576), "down": (576, 1536), "lm_head": (49152, 576)}
# name -> (bits, group or None for per row, symmetric)
SCHEMES = {"int8": (8, None, True), "q8_0": (8, 32, True), "int4-g32": (4, 32, True),
           "int4-g32-asym": (4, 32, False), "int4-g128": (4, 128, True)}


def torch_kernel(weight: GroupedIntWeight):
    """torch's CPU kernel for this weight, or None where it has none (grouped int8)."""
    if weight.bits == 8 and weight.num_groups == 1:
        signed = (weight.codes.to(torch.int16) - weight.midpoint).to(torch.int8)
        scales = weight.scales[:, 0].to(torch.bfloat16)
        return lambda x: torch._weight_int8pack_mm(x, signed, scales)
    if weight.bits == 4:
        packed = torch._convert_weight_to_int4pack_for_cpu(weight.codes.to(torch.int32), 1)
        pairs = tinygemm_scales_and_offsets(weight, torch.bfloat16)
        return lambda x: torch._weight_int4pack_mm_for_cpu(x, packed, weight.group_size, pairs)
    return None


def best_us(calls, repeats: int, per_block: int) -> float:
    """Best per-call thread CPU time in µs over `repeats` blocks of `per_block` calls (cycling `calls`)."""
    best = float("inf")
    count = len(calls)
    for call in calls[:2]:
        call()
    for _ in range(repeats):
        start = time.thread_time_ns()
        for i in range(per_block):
            calls[i % count]()
        best = min(best, (time.thread_time_ns() - start) / per_block / 1e3)
    return best


def measure(shape, scheme, rows_list, args, kernels) -> list[dict]:
    out_features, in_features = shape
    bits, group, symmetric = SCHEMES[scheme]
    if group and in_features % group:
        print(f"| {out_features}x{in_features} | {scheme} | - | groups of {group} do not divide {in_features} inputs |")
        return []
    generator = torch.Generator().manual_seed(0)
    dense = torch.randn(out_features, in_features, generator=generator) * 0.05
    weight = GroupedIntWeight.quantize(dense, bits, group or in_features, symmetric)
    weight_bytes = weight.codes.numel() * bits // 8 + weight.scales.numel() * 2 * (1 if weight.zeros is None else 2)
    copies = 1 if args.quick else max(1, int(args.cold_mib * 2**20 // weight_bytes))
    natives = [kernels.pack(weight.codes, weight.scales, weight.zeros, bits, weight.group_size)]
    torch_calls = [torch_kernel(weight)]
    if copies > 1:  # the same weight in distinct memory, so a rotation streams every copy from DRAM
        natives += [type(natives[0])(n.codes.clone(), n.scales.clone(), None if n.zeros is None else n.zeros.clone(),
                                     n.bits, n.group_size, n.in_features, n.out_features)
                    for n in [natives[0]] * (copies - 1)]
        torch_calls = [torch_kernel(weight) for _ in range(copies)] if torch_calls[0] is not None else [None]
    results = []
    for rows in rows_list:
        x = torch.randn(rows, in_features, generator=generator).bfloat16()
        row = {"shape": f"{out_features}x{in_features}", "scheme": scheme, "rows": rows, "bytes": weight_bytes}
        for temperature, count in (("hot", 1), ("cold", copies)):
            if temperature == "cold" and copies == 1:
                continue
            per_block = max(count, 20)
            row[f"native_{temperature}_us"] = best_us([lambda n=n: kernels.gemv(n, x) for n in natives[:count]],
                                                      args.repeats, per_block)
            if torch_calls[0] is not None:
                row[f"torch_{temperature}_us"] = best_us([lambda c=c: c(x) for c in torch_calls[:count]],
                                                         args.repeats, per_block)
        results.append(row)
        print(format_row(row), flush=True)
    return results


def copies_of(native, count: int) -> list:
    """`native` and count - 1 copies of it in distinct memory (a rotation streams each from DRAM)."""
    return [native] + [type(native)(native.codes.clone(), native.scales.clone(),
                                    None if native.zeros is None else native.zeros.clone(), native.bits,
                                    native.group_size, native.in_features, native.out_features)
                       for _ in range(count - 1)]


def measure_batched(shape, scheme, rows_list, args, kernels) -> list[dict]:
    """Per row count: GEMV, AMX dequantising GEMM, AMX-INT8, AVX512-BF16 dequantising GEMM (CPUs without AMX),
    dequantise + F.linear, and bf16's own linear on the dequantised weight (AMX tiles, else oneDNN packed)."""
    out_features, in_features = shape
    bits, group, symmetric = SCHEMES[scheme]
    if group and in_features % group:
        return []
    generator = torch.Generator().manual_seed(0)
    weight = GroupedIntWeight.quantize(torch.randn(out_features, in_features, generator=generator) * 0.05, bits,
                                       group or in_features, symmetric)
    weight_bytes = weight.codes.numel() * bits // 8 + weight.scales.numel() * 2 * (1 if weight.zeros is None else 2)
    native = kernels.pack(weight.codes, weight.scales, weight.zeros, bits, weight.group_size)
    natives = copies_of(native, max(1, int(args.cold_mib * 2**20 // weight_bytes)))
    cpu = load_cpu_kernels()
    bf16_amx = cpu is not None and cpu.has_amx
    dense = kernels.dequantize(native)
    tiles = [cpu.pack_amx(dense)] if bf16_amx else []
    dense_copies = max(1, int(args.cold_mib * 2**20 // dense.numel() // 2))
    tiles += [tiles[0].clone() for _ in range(dense_copies - 1) if bf16_amx]
    packed = [] if bf16_amx or not torch.ops.mkldnn._is_mkldnn_bf16_supported() else \
        [torch.ops.mkldnn._reorder_linear_weight(dense.clone(), 64) for _ in range(dense_copies)]
    results = []
    for rows in rows_list:
        x = torch.randn(rows, in_features, generator=generator).bfloat16()
        # fewer calls per block for the big row counts (each call is already long)
        per_block = max(2, min(len(natives), 20, int(2e6 // (rows * out_features * in_features // 1000 + 1))))
        repeats = args.repeats if rows <= 64 else max(3, args.repeats // 3)
        row = {"shape": f"{out_features}x{in_features}", "scheme": scheme, "rows": rows,
               "gemv_us": best_us([lambda n=n: kernels.gemv(n, x) for n in natives], repeats, per_block),
               "dequant_linear_us": best_us([lambda n=n: torch.nn.functional.linear(x, kernels.dequantize(n))
                                             for n in natives], repeats, per_block)}
        if kernels.has_amx:
            row["amx_us"] = best_us([lambda n=n: kernels.gemm_amx(n, x) for n in natives], repeats, per_block)
            if kernels.int8_tile_depth(native.group_size, native.bits):
                row["amx_int8_us"] = best_us([lambda n=n: kernels.gemm_amx_int8(n, x) for n in natives], repeats,
                                             per_block)
        if kernels.has_bf16_gemm:
            row["bf16_gemm_us"] = best_us([lambda n=n: kernels.gemm_bf16(n, x) for n in natives], repeats, per_block)
        if bf16_amx:
            row["bf16_amx_us"] = best_us([lambda t=t: cpu.gemm_amx(t, x, out_features) for t in tiles], repeats,
                                         per_block)
        elif packed:  # bf16's own linear without AMX: oneDNN's GEMM on its packed weight
            row["bf16_onednn_us"] = best_us([lambda w=w: torch.ops.mkldnn._linear_pointwise(x, w, None, "none", [], "")
                                             for w in packed], repeats, per_block)
        results.append(row)
        cells = [f"{row[key]:.0f}" if key in row else "-" for key in
                 ("gemv_us", "amx_us", "amx_int8_us", "bf16_gemm_us", "dequant_linear_us", "bf16_amx_us",
                  "bf16_onednn_us")]
        print(f"| {row['shape']} | {scheme} | {rows} | " + " | ".join(cells) + " |", flush=True)
    return results


def format_row(row: dict) -> str:
    def cell(key):
        value = row.get(key)
        return "-" if value is None else f"{value:.1f}"

    gbs = row["bytes"] / row.get("native_cold_us", row["native_hot_us"]) / 1e3
    return (f"| {row['shape']} | {row['scheme']} | {row['rows']} | {cell('native_hot_us')} | {cell('torch_hot_us')} | "
            f"{cell('native_cold_us')} | {cell('torch_cold_us')} | {gbs:.1f} |")


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shapes", default="qkv,o,gate_up,down,lm_head")
    parser.add_argument("--schemes", default=",".join(SCHEMES))
    parser.add_argument("--rows", default="1,2,4,5,8")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--repeats", type=int, default=15)
    parser.add_argument("--cold-mib", type=float, default=512.0, help="total size of the rotated weight copies")
    parser.add_argument("--quick", action="store_true", help="qkv shape, int8 and int4-g32, rows 1 and 4, hot only")
    parser.add_argument("--batched", action="store_true",
                        help="several rows: GEMV vs the dequantising GEMMs vs dequantise + GEMM vs bf16's linear (cold)")
    parser.add_argument("--json", help="write the rows here")
    args = parser.parse_args(argv)
    kernels = load_quant_kernels()
    if kernels is None:
        print("the native quant kernels do not build or run on this CPU", file=sys.stderr)
        return 1
    torch.set_num_threads(args.threads)
    shapes = ["qkv"] if args.quick else args.shapes.split(",")
    schemes = ["int8", "int4-g32"] if args.quick else args.schemes.split(",")
    rows_list = [1, 4] if args.quick else [int(r) for r in args.rows.split(",")]
    print(f"native ISA {kernels.isa}, {args.threads} thread(s), thread CPU time, best of {args.repeats}")
    if args.batched:
        print(f"AMX: {kernels.has_amx}; cold (weights rotated over {args.cold_mib:.0f} MiB), µs per call")
        print("| shape | scheme | rows | GEMV | AMX dequantising GEMM | AMX-INT8 on the codes | AVX512-BF16 dequantising "
              "GEMM | dequantise + F.linear | bf16 AMX | bf16 oneDNN |")
        print("|---|---|---:|---:|---:|---:|---:|---:|---:|---:|")
        results = [row for name in shapes for scheme in schemes
                   for row in measure_batched(SHAPES[name], scheme, rows_list, args, kernels)]
        if args.json:
            with open(args.json, "w") as handle:
                json.dump(results, handle, indent=1)
        return 0
    print("| shape | scheme | rows | native hot µs | torch hot µs | native cold µs | torch cold µs | native GB/s |")
    print("|---|---|---:|---:|---:|---:|---:|---:|")
    results = []
    for name in shapes:
        for scheme in schemes:
            results += measure(SHAPES[name], scheme, rows_list, args, kernels)
    if args.json:
        with open(args.json, "w") as handle:
            json.dump(results, handle, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
