"""Batch-1 decode with the weights and KV pool in 4 KiB pages against 2 MiB ones (engine/weight_pages.py).

Two engines on offline_throughput.py's SmolLM-135M shape (random bf16 weights) in one process, built with
LLMCTL_HUGE_PAGES=0 and =1, their decode passes (one 128-token prompt, `--steps` greedy steps, wall clock,
the median step of each pass) alternated in ABBA order, with a read-bandwidth measurement each round: the
host's state (a shared machine's memory bandwidth moves between runs) is then the same for both, and the
paired ratio of each round's steps is the figure.

    python benchmarks/huge_pages.py [--quantization int4-g32,int8,bf16] [--rounds 12] [--steps 64] [--threads 2]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))


def build(folder: str, quantization, threads: int, huge: bool):
    from llmctl.engine import EngineArgs, LLMEngine

    os.environ["LLMCTL_HUGE_PAGES"] = "1" if huge else "0"
    return LLMEngine(EngineArgs.from_dict(dict(model=folder, dtype="bfloat16", skip_tokenizer_init=True,
                                               enable_prefix_caching=False, max_model_len=1024, num_threads=threads,
                                               quantization=quantization, kv_cache_memory=512 << 20)))


def compare(folder: str, quantization, args) -> dict:
    import torch
    from decode_overhead import decode_steps, median, weight_bytes_per_token
    from quantization import read_bandwidth_gbs

    engines = {"4K": build(folder, quantization, args.threads, False), "2M": build(folder, quantization, args.threads, True)}
    torch.manual_seed(0)
    prompt = torch.randint(0, engines["4K"].executor.runner.config.model_config.vocab_size, (128,)).tolist()
    for engine in engines.values():
        decode_steps(engine, prompt, 8)  # warm-up
    steps = {name: [] for name in engines}
    bandwidths = []
    for round_ in range(args.rounds):
        for name in (engines if round_ % 2 == 0 else reversed(list(engines))):
            steps[name].append(median(decode_steps(engines[name], prompt, args.steps, clock=time.perf_counter_ns)) / 1e6)
        bandwidths.append(read_bandwidth_gbs(warmup_s=0.1, reps=3))
    ratios = [small / huge for small, huge in zip(steps["4K"], steps["2M"])]
    weights = weight_bytes_per_token(engines["4K"].executor.runner)
    quartiles = statistics.quantiles(ratios, n=4)
    return {"quantization": quantization or "bf16", "weight_bytes_per_token": weights,
            "step_ms_4k": round(statistics.median(steps["4K"]), 3), "step_ms_2m": round(statistics.median(steps["2M"]), 3),
            "speedup_median": round(statistics.median(ratios), 3), "speedup_quartiles": [round(q, 3) for q in quartiles],
            "read_gbs_median": round(statistics.median(bandwidths), 1), "rounds": args.rounds}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quantization", default="int4-g32,int8,bf16", help="comma-separated; bf16: none")
    parser.add_argument("--rounds", type=int, default=12)
    parser.add_argument("--steps", type=int, default=64)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()

    from offline_throughput import make_model

    from llmctl.engine.weight_pages import huge_pages_available

    os.environ.pop("LLMCTL_HUGE_PAGES", None)
    if not huge_pages_available():
        sys.exit("huge_pages.py: this host has no transparent huge pages (Linux, THP always or madvise)")
    with tempfile.TemporaryDirectory(prefix="huge-pages-") as scratch:
        folder = str(make_model(Path(scratch), "bfloat16"))
        rows = [compare(folder, None if q == "bf16" else q, args) for q in args.quantization.split(",")]
    if args.json:
        print(json.dumps(rows))
        return
    print(f"batch-1 decode, {args.threads} thread(s), {args.rounds} rounds of {args.steps} steps, ABBA")
    print(f"{'weights':10} {'MB/token':>9} {'4 KiB ms':>9} {'2 MiB ms':>9} {'speed-up':>9} {'quartiles':>15} {'read GB/s':>10}")
    for r in rows:
        q1, _, q3 = r["speedup_quartiles"]
        print(f"{r['quantization']:10} {r['weight_bytes_per_token'] / 1e6:9.1f} {r['step_ms_4k']:9.3f} {r['step_ms_2m']:9.3f} "
              f"{r['speedup_median']:9.3f} {f'{q1:.3f}-{q3:.3f}':>15} {r['read_gbs_median']:10.1f}")


if __name__ == "__main__":
    main()
