"""Serving load: `llmctl serve` (and optionally vLLM's OpenAI server) under `llmctl bench serve`
at several request rates, in the same run, on the same model and the same prompts.

Each server runs alone (one after the other) so they never share the CPU. For each request rate the
table shows request and output-token throughput, p50/p99 time to first token, mean time per output
token, and our output throughput as a ratio of vLLM's.

    python benchmarks/serve_load.py [--model FOLDER] [--rates 1,4,16,inf] [--num-prompts 64]
                                    [--vllm-python VENV/bin/python]
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

VLLM_ENV = {"VLLM_CPU_KVCACHE_SPACE": "4", "VLLM_CPU_OMP_THREADS_BIND": "0-1", "VLLM_CPU_NUM_OF_RESERVED_CPU": "0"}


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def default_model() -> Path:
    from llmctl.engine.llm_engine import default_model_path

    return default_model_path()


def smollm_shaped_model(folder: Path, dtype: str) -> Path:
    """Random weights of SmolLM-135M's shape (as in offline_throughput.py) with the embedded
    model's tokenizer: its ids all fall inside the larger vocabulary, so both servers can
    tokenize and detokenize."""
    import shutil

    sys.path.insert(0, str(Path(__file__).parent))
    from offline_throughput import make_model

    if not (folder / "config.json").exists():
        make_model(folder, dtype)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(default_model() / name, folder / name)
    return folder


def start_server(system: str, model: Path, port: int, args) -> subprocess.Popen:
    if system == "llmctl":
        command = [sys.executable, "-m", "llmctl.cli", "serve", "--model", str(model), "--port", str(port),
                   "--served-model-name", "bench", "--max-output-tokens", str(max(1024, args.output_len)),
                   "--no-enable-prefix-caching"]
        env = dict(os.environ)
    else:
        command = [args.vllm_python, "-m", "vllm.entrypoints.openai.api_server", "--model", str(model),
                   "--port", str(port), "--served-model-name", "bench", "--no-enable-prefix-caching",
                   "--dtype", "auto"]
        env = {**os.environ, **VLLM_ENV}
    log = open(Path(args.log_dir) / f"{system}-server.log", "w")  # noqa: SIM115 - closed with the process
    return subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, env=env)


def wait_healthy(proc: subprocess.Popen, base: str, timeout: float) -> float:
    started = time.monotonic()
    while time.monotonic() - started < timeout:
        if proc.poll() is not None:
            raise RuntimeError(f"server exited with {proc.returncode}; see the log")
        try:
            if httpx.get(base + "/health", timeout=1).status_code == 200:
                return time.monotonic() - started
        except httpx.HTTPError:
            pass
        time.sleep(0.2)
    raise RuntimeError("server did not become healthy in time")


def bench(base: str, rate: str, model: Path, args) -> dict:
    command = [sys.executable, "-m", "llmctl.cli", "bench", "serve", "--base-url", base, "--json",
               "--request-rate", rate, "--num-prompts", str(args.num_prompts), "--num-warmups", "4",
               "--random-input-len", str(args.input_len), "--random-output-len", str(args.output_len),
               "--tokenizer", str(model), "--seed", "0", "--percentiles", "50,99"]
    proc = subprocess.run(command, capture_output=True, text=True, timeout=1800)
    if proc.returncode not in (0, 1):
        raise RuntimeError(f"bench serve failed: {proc.stderr.strip()}")
    return json.loads(proc.stdout)


def run_system(system: str, model: Path, args) -> tuple[float, dict[str, dict]]:
    port = free_port()
    base = f"http://127.0.0.1:{port}"
    proc = start_server(system, model, port, args)
    try:
        startup = wait_healthy(proc, base, timeout=600)
        return startup, {rate: bench(base, rate, model, args) for rate in args.rates.split(",")}
    finally:
        proc.terminate()
        proc.wait(60)


def print_table(results: dict[str, tuple[float, dict[str, dict]]], rates: list[str]) -> None:
    header = f"{'rate':>5} {'system':<7} {'ok':>6} {'req/s':>7} {'out tok/s':>10} {'p50 TTFT ms':>12} " \
             f"{'p99 TTFT ms':>12} {'mean TPOT ms':>13} {'vs vLLM':>8}"
    print(header)
    print("-" * len(header))
    for rate in rates:
        peer = results.get("vllm", (0, {}))[1].get(rate)
        for system, (_, runs) in results.items():
            r = runs[rate]
            ratio = f"{r['output_throughput'] / peer['output_throughput']:.2f}x" if peer and system != "vllm" else ""
            print(f"{rate:>5} {system:<7} {r['completed']:>3}/{r['completed'] + r['failed']:<2} "
                  f"{r['request_throughput']:>7.2f} {r['output_throughput']:>10.1f} {r['p50_ttft_ms']:>12.1f} "
                  f"{r['p99_ttft_ms']:>12.1f} {r['mean_tpot_ms']:>13.2f} {ratio:>8}")
    for system, (startup, _) in results.items():
        print(f"{system}: process start to healthy {startup:.1f} s")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", type=Path, default=None, help="HF model folder (default: the embedded model)")
    parser.add_argument("--smollm-shape", metavar="DTYPE", default=None,
                        help="serve random weights of SmolLM-135M's shape in DTYPE (float32 or bfloat16)")
    parser.add_argument("--rates", default="1,4,16,inf")
    parser.add_argument("--num-prompts", type=int, default=64)
    parser.add_argument("--input-len", type=int, default=128)
    parser.add_argument("--output-len", type=int, default=64)
    parser.add_argument("--vllm-python", default=None, help="python of a venv with vLLM (CPU) installed")
    parser.add_argument("--log-dir", default=None,
                        help="where the servers' logs (and a --smollm-shape model) go; default: a new temp folder")
    args = parser.parse_args()
    # never the working directory: a SmolLM-shaped model is 270 MB and lands beside the logs
    args.log_dir = args.log_dir or tempfile.mkdtemp(prefix="llmctl-serve-load-")
    print(f"logs in {args.log_dir}", flush=True)
    model = args.model or default_model()
    if args.smollm_shape:
        model = smollm_shaped_model(Path(args.log_dir) / f"smollm-135m-{args.smollm_shape}", args.smollm_shape)
    results = {"llmctl": run_system("llmctl", model, args)}
    if args.vllm_python:
        results["vllm"] = run_system("vllm", model, args)
    print(f"model {model}, {args.num_prompts} prompts of {args.input_len} tokens -> {args.output_len} tokens each")
    print_table(results, args.rates.split(","))


if __name__ == "__main__":
    main()
