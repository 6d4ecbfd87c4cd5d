"""Offline throughput: llmctl's engine against transformers `generate` (and optionally vLLM's
CPU engine) on the same random-weight model, in the same run.

Model: SmolLM-135M's shape (hidden 576, 30 layers, 9 heads / 3 KV heads, intermediate 1536,
vocab 49152, tied embeddings) with seeded random weights saved by transformers. Workloads:
`batched` = 64 prompts of 32-256 random tokens with 128 forced output tokens each;
`single` = one 128-token prompt, 128 output tokens. Each system runs in its own process;
the table shows output tokens/s, ratios against transformers and vLLM, and cold start
(process start to first token).

    python benchmarks/offline_throughput.py [--dtypes float32,bfloat16] [--vllm-python VENV/bin/python]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

SMOLLM_135M = dict(hidden_size=576, intermediate_size=1536, num_hidden_layers=30, num_attention_heads=9,
                   num_key_value_heads=3, vocab_size=49152, max_position_embeddings=2048, rms_norm_eps=1e-5,
                   rope_theta=10000.0, tie_word_embeddings=True, bos_token_id=0, eos_token_id=0)
WORKER = Path(__file__).with_name("offline_worker.py")
VLLM_ENV = {"VLLM_CPU_KVCACHE_SPACE": "4", "VLLM_CPU_OMP_THREADS_BIND": "0-1", "VLLM_CPU_NUM_OF_RESERVED_CPU": "0"}


def make_model(folder: Path, dtype: str) -> Path:
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(**SMOLLM_135M))
    model.to(getattr(torch, dtype)).save_pretrained(folder)
    return folder


def run_worker(python: str, system: str, model: Path, dtype: str, args, extra_env: dict[str, str],
               extra_args: tuple[str, ...] = ()) -> dict:
    command = [python, str(WORKER), "--system", system, "--model", str(model), "--dtype", dtype, *extra_args,
               "--vocab", str(SMOLLM_135M["vocab_size"]), "--num-prompts", str(args.num_prompts),
               "--output-len", str(args.output_len), "--workloads", args.workloads, "--repeats", str(args.repeats)]
    if args.threads:
        command += ["--threads", str(args.threads)]
    if system != "vllm":
        command += ["--device", args.device]
    env = {**os.environ, **extra_env}
    started = time.perf_counter()
    proc = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
    cold_start, results = None, []
    for line in proc.stdout:
        if line.startswith("FIRST_TOKEN") and cold_start is None:
            cold_start = time.perf_counter() - started
        elif line.startswith("RESULT "):
            results.append(json.loads(line[len("RESULT "):]))
    stderr = proc.stderr.read()
    if proc.wait() != 0:
        tail = "\n".join(stderr.strip().splitlines()[-15:])
        raise SystemExit(f"{system} ({dtype}) failed with exit code {proc.returncode}:\n{tail}")
    return {"cold_start_s": cold_start, "results": results}


def summarize(runs: dict, workloads: list[str]) -> list[dict]:
    rows = []
    for (system, dtype), run in runs.items():
        for workload in workloads:
            rates = [r["tokens_per_s"] for r in run["results"] if r["workload"] == workload]
            if rates:
                rows.append({"system": system, "dtype": dtype, "workload": workload,
                             "tokens_per_s": statistics.median(rates), "runs": len(rates),
                             "cold_start_s": run["cold_start_s"]})
    return rows


def print_table(rows: list[dict]) -> None:
    def rate(system, dtype, workload):
        return next((r["tokens_per_s"] for r in rows
                     if (r["system"], r["dtype"], r["workload"]) == (system, dtype, workload)), None)

    header = f"{'workload':<9} {'dtype':<9} {'system':<13} {'tok/s':>9} {'vs transformers':>16} {'vs vLLM':>8} {'cold start':>11}"
    print(header)
    print("-" * len(header))
    for r in sorted(rows, key=lambda r: (r["workload"], r["dtype"], r["system"])):
        base = rate("transformers", r["dtype"], r["workload"])
        vllm = rate("vllm", r["dtype"], r["workload"])
        vs_t = f"{r['tokens_per_s'] / base:.2f}x" if base else "-"
        vs_v = f"{r['tokens_per_s'] / vllm:.2f}x" if vllm else "-"
        cold = f"{r['cold_start_s']:.1f} s" if r["cold_start_s"] is not None else "-"
        print(f"{r['workload']:<9} {r['dtype']:<9} {r['system']:<13} {r['tokens_per_s']:>9.1f} {vs_t:>16} {vs_v:>8} {cold:>11}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--dtypes", default="float32,bfloat16")
    parser.add_argument("--systems", default="ours,transformers", help="comma list of ours, transformers")
    parser.add_argument("--vllm-python", help="Python of a venv with vllm-cpu (../shared/tools/setup-vllm-cpu.sh)")
    parser.add_argument("--workloads", default="batched,single")
    parser.add_argument("--num-prompts", type=int, default=64)
    parser.add_argument("--output-len", type=int, default=128)
    parser.add_argument("--repeats", type=int, default=1, help="runs per workload in each process (median shown)")
    parser.add_argument("--threads", type=int, default=None, help="torch threads for ours and transformers")
    parser.add_argument("--device", default="auto", help="auto, cpu or cuda (ours and transformers)")
    parser.add_argument("--json", type=Path, help="also write the rows here")
    args = parser.parse_args()
    systems = [s for s in args.systems.split(",") if s]
    runs = {}
    with tempfile.TemporaryDirectory(prefix="llmctl-bench-") as tmp:
        for dtype in args.dtypes.split(","):
            model = make_model(Path(tmp) / dtype, dtype)
            for system in systems:
                print(f"running {system} {dtype} ...", file=sys.stderr, flush=True)
                runs[(system, dtype)] = run_worker(sys.executable, system, model, dtype, args, {})
            if args.vllm_python:
                print(f"running vllm {dtype} ...", file=sys.stderr, flush=True)
                runs[("vllm", dtype)] = run_worker(args.vllm_python, "vllm", model, dtype, args, VLLM_ENV)
    rows = summarize(runs, args.workloads.split(","))
    print_table(rows)
    if args.json:
        args.json.write_text(json.dumps(rows, indent=2))


if __name__ == "__main__":
    main()
