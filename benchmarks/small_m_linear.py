"""bf16 CPU linears per SmolLM-135M shape and row count M: the native AMX kernel (`gemm_amx_bf16`, the
engine's bf16 CPU linear where the CPU has AMX) against oneDNN on its prepacked weight (the engine's method
without AMX) and, at M = 1, the native dpbf16 GEMV (`gemv_bf16`); `--plain-rows`: oneDNN on the plain weight
(F.linear) against its prepacked copy and the AMX kernel at large M.

Times are CPU time of the calling thread (`time.thread_time_ns`), so a shared host's descheduling is not
counted; best of `--repeats` blocks. "cold" rotates through distinct copies of the weight totalling at least
`--cold-mb` MiB (a decode step streams every weight from DRAM; L3 here is large, so keep this above it),
"hot" reuses one. With two threads the calling thread's CPU time is its share of the work plus its waits.

    python benchmarks/small_m_linear.py [--threads 1,2] [--rows 1,2,4,5,8,16,32] [--cold-mb 512] [--json out.json]
    python benchmarks/small_m_linear.py --plain-rows 64,256,2048   # oneDNN plain vs prepacked at large M
"""

from __future__ import annotations

import argparse
import json
import sys
import time

import torch

from llmctl.engine.kernels import load_cpu_kernels

# SmolLM-135M: hidden 576, 9 heads of 64, 3 KV heads, intermediate 1536, vocabulary 49152
SHAPES = {  # name -> (out, in)
    "q/o 576x576": (576, 576),
    "k/v 192x576": (192, 576),
    "qkv 960x576": (960, 576),
    "gate_up 3072x576": (3072, 576),
    "down 576x1536": (576, 1536),
    "lm_head 49152x576": (49152, 576),
}


def best_us(call, copies: list, repeats: int) -> float:
    """Best over `repeats` blocks of the mean thread CPU time of one call, each block a pass over `copies`."""
    for weight in copies[: min(len(copies), 3)]:  # warm-up: oneDNN builds its primitive on first use
        call(weight)
    best = float("inf")
    for _ in range(repeats):
        start = time.thread_time_ns()
        for weight in copies:
            call(weight)
        best = min(best, (time.thread_time_ns() - start) / len(copies) / 1e3)
    return best


def weight_copies(out_features: int, in_features: int, cold_mb: int) -> list[torch.Tensor]:
    """Distinct weights of one shape, together at least `cold_mb` MiB (one when `cold_mb` is 0)."""
    size = out_features * in_features * 2
    count = max(1, -(-cold_mb * 2**20 // size)) if cold_mb else 1
    block = torch.randn(count, out_features, in_features, dtype=torch.bfloat16)
    return list(block.unbind(0))


def fmt(value, spec: float = 9.1) -> str:
    return "-".rjust(int(spec)) if value is None else f"{value:{spec}f}"


def measure_small(kernels, rows: list[int], threads: list[int], cold_mb: int, repeats: int, batch_hint: int):
    results = []
    for name, (out_features, in_features) in SHAPES.items():
        copies = weight_copies(out_features, in_features, cold_mb)
        packed = [torch.ops.mkldnn._reorder_linear_weight(w, batch_hint) for w in copies]
        tiles = [kernels.pack_amx(w) for w in copies]
        for m in rows:
            x = torch.randn(m, in_features, dtype=torch.bfloat16)
            for t in threads:
                torch.set_num_threads(t)
                gemv = best_us(lambda w: kernels.gemv(w, x), copies, repeats) if m == 1 else None
                amx = best_us(lambda p: kernels.gemm_amx(p, x, out_features), tiles, repeats)
                onednn = best_us(lambda p: torch.ops.mkldnn._linear_pointwise(x, p, None, "none", [], ""), packed,
                                 repeats)
                results.append(dict(shape=name, rows=m, threads=t, amx_us=amx, gemv_us=gemv,
                                    onednn_packed_us=onednn, copies=len(copies)))
                print(f"{name:20s} M={m:4d} threads={t}  amx {fmt(amx)}  gemv {fmt(gemv)}  "
                      f"oneDNN packed {fmt(onednn)}  oneDNN/amx {onednn / amx:5.2f}", flush=True)
        del copies, packed, tiles
    return results


def measure_plain(kernels, rows: list[int], threads: list[int], repeats: int, batch_hint: int):
    """oneDNN on the plain [N, K] weight (F.linear) against its prepacked copy and the AMX kernel, at large M
    (hot: compute-bound)."""
    results = []
    for name, (out_features, in_features) in SHAPES.items():
        weight = torch.randn(out_features, in_features, dtype=torch.bfloat16)
        packed = torch.ops.mkldnn._reorder_linear_weight(weight, batch_hint)
        tiles = kernels.pack_amx(weight)
        for m in rows:
            x = torch.randn(m, in_features, dtype=torch.bfloat16)
            for t in threads:
                torch.set_num_threads(t)
                plain = best_us(lambda w: torch.nn.functional.linear(x, w), [weight], repeats)
                onednn = best_us(lambda p: torch.ops.mkldnn._linear_pointwise(x, p, None, "none", [], ""), [packed],
                                 repeats)
                amx = best_us(lambda p: kernels.gemm_amx(p, x, out_features), [tiles], repeats)
                results.append(dict(shape=name, rows=m, threads=t, plain_us=plain, onednn_packed_us=onednn, amx_us=amx))
                print(f"{name:20s} M={m:5d} threads={t}  plain F.linear {plain:10.1f} us  packed {onednn:10.1f} us "
                      f" amx {amx:10.1f} us  plain/packed {plain / onednn:5.2f}  amx/packed "
                      f"{amx / onednn:5.2f}", flush=True)
    return results


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rows", default="1,2,4,5,8,16,32", help="row counts M for the native/oneDNN table")
    parser.add_argument("--plain-rows", default="", help="row counts for oneDNN plain vs prepacked (e.g. 64,256,2048)")
    parser.add_argument("--threads", default="1,2")
    parser.add_argument("--cold-mb", type=int, default=512, help="MiB of distinct weight copies (0: hot)")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--batch-hint", type=int, default=64, help="rows oneDNN packs for (the engine's: 16-64)")
    parser.add_argument("--shapes", default="", help="comma-separated shape names to keep (default: all)")
    parser.add_argument("--json", default="", help="write the results here")
    args = parser.parse_args()
    kernels = load_cpu_kernels()
    if kernels is None or not kernels.has_amx:
        print("the native AMX kernel is not available on this CPU (needs AMX-BF16 and Linux's tile permission)",
              file=sys.stderr)
        return 1
    if args.shapes:
        keep = set(args.shapes.split(","))
        for name in list(SHAPES):
            if not any(part in name for part in keep):
                del SHAPES[name]
    threads = [int(t) for t in args.threads.split(",")]
    torch.manual_seed(0)
    report = {}
    if args.rows:
        report["small"] = measure_small(kernels, [int(m) for m in args.rows.split(",")], threads, args.cold_mb,
                                        args.repeats, args.batch_hint)
    if args.plain_rows:
        report["plain"] = measure_plain(kernels, [int(m) for m in args.plain_rows.split(",")], threads, args.repeats,
                                        args.batch_hint)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(report, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
