"""Load curve: the same `llmctl bench serve` rate sweep against `llmctl serve` and llama.cpp's `llama-server`
on the same model, one server at a time (they never share the CPU).

llama-server comes from ../shared/tools/setup-llamacpp.sh (built once into --llamacpp-dir, the model
converted to GGUF beside it); without that script the llama.cpp column is skipped with a message.
Each system's sweep is one `bench serve` call, so each gets one JSON, CSV and load-curve PNG in the
output folder; the table prints every rate side by side and the best point meeting --slo.

    python benchmarks/serve_sweep.py [--model FOLDER] [--rates 1,2,4,inf] [--num-prompts 32]
                                     [--input-len 128] [--output-len 64] [--slo 'p99_ttft_ms<2000']
                                     [--no-llamacpp] [--llamacpp-dir DIR] [--out DIR]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from serve_load import default_model, free_port, wait_healthy  # noqa: E402 - sibling script

ROOT = Path(__file__).resolve().parents[1]
SETUP_LLAMACPP = ROOT.parent / "shared" / "tools" / "setup-llamacpp.sh"
THREADS = "2"


def llmctl_command(model: Path, port: int, args) -> list[str]:
    return [sys.executable, "-m", "llmctl.cli", "serve", "--model", str(model), "--port", str(port),
            "--served-model-name", "bench", "--max-output-tokens", str(max(1024, args.output_len))]


def llamacpp_command(model: Path, port: int, args) -> list[str] | None:
    """llama-server on the model converted to GGUF, or None (with the reason printed) when unavailable."""
    if not SETUP_LLAMACPP.is_file():
        print(f"llama.cpp column skipped: {SETUP_LLAMACPP} is not present")
        return None
    build = Path(args.llamacpp_dir)
    gguf = build / f"{model.name}-bf16.gguf"
    if not gguf.is_file():
        print(f"building llama.cpp into {build} and converting {model} (minutes, once)", flush=True)
        subprocess.run(["bash", str(SETUP_LLAMACPP), str(build), str(model), str(gguf), "bf16"], check=True)
    slots = str(max(16, args.num_prompts))
    context = str(int(slots) * (args.input_len + args.output_len + 16))
    return [str(build / "bin" / "llama-server"), "-m", str(gguf), "--port", str(port), "-t", THREADS,
            "-np", slots, "-c", context, "-cb", "--alias", "bench"]


def sweep(system: str, command: list[str], port: int, model: Path, args) -> dict:
    """Start the server, run the whole sweep as one `bench serve` call, stop the server."""
    out = Path(args.out)
    env_path = {"LD_LIBRARY_PATH": str(Path(command[0]).parent)} if system == "llama.cpp" else {}
    log = open(out / f"{system}-server.log", "w")  # noqa: SIM115 - closed with the process
    proc = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, env={**os.environ, **env_path})
    base = f"http://127.0.0.1:{port}"
    try:
        wait_healthy(proc, base, timeout=600)
        bench = [sys.executable, "-m", "llmctl.cli", "bench", "serve", "--base-url", base, "--json",
                 "--request-rate", args.rates, "--num-prompts", str(args.num_prompts), "--num-warmups", "2",
                 "--random-input-len", str(args.input_len), "--random-output-len", str(args.output_len),
                 "--tokenizer", str(model), "--seed", "0", "--sweep-cooldown", "2", "--slo", args.slo,
                 "--label", system, "--csv", str(out / f"{system}.csv"), "--plot", str(out / f"{system}.png"),
                 "--max-failure-rate", "1"]
        done = subprocess.run(bench, capture_output=True, text=True, timeout=3600)
        if done.returncode not in (0, 1):
            raise RuntimeError(f"{system}: bench serve failed: {done.stderr.strip()}")
        (out / f"{system}.json").write_text(done.stdout)
        return json.loads(done.stdout)
    finally:
        proc.terminate()
        proc.wait(60)
        log.close()


def print_table(results: dict[str, dict]) -> None:
    header = (f"{'rate':>6} {'system':<10} {'ok':>6} {'req/s':>7} {'out tok/s':>10} {'p50 TTFT ms':>12} "
              f"{'p99 TTFT ms':>12} {'mean TPOT ms':>13}")
    print(header)
    print("-" * len(header))
    rates = next(iter(results.values()))["request_rates"]
    for index, rate in enumerate(rates):
        for system, doc in results.items():
            row = doc["sweep"][index]
            print(f"{rate!s:>6} {system:<10} {row['completed']:>3}/{row['completed'] + row['failed']:<2} "
                  f"{row['request_throughput']:>7.2f} {row['output_throughput']:>10.1f} {row['median_ttft_ms']:>12.1f} "
                  f"{row['p99_ttft_ms']:>12.1f} {row['mean_tpot_ms']:>13.2f}")
    for system, doc in results.items():
        best = doc["best_point"]
        verdict = (f"rate {best['request_rate']} ({best['request_throughput']:.2f} req/s)" if best
                   else "no rate met it")
        print(f"{system}: highest load meeting the SLO: {verdict}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", type=Path, default=None, help="HF model folder (default: the embedded model)")
    parser.add_argument("--rates", default="1,2,4,inf", help="comma list; at least two rates make a sweep")
    parser.add_argument("--num-prompts", type=int, default=32)
    parser.add_argument("--input-len", type=int, default=128)
    parser.add_argument("--output-len", type=int, default=64)
    parser.add_argument("--slo", default="p99_ttft_ms<2000", help="the gate whose highest passing rate is reported")
    parser.add_argument("--no-llamacpp", action="store_true", help="run the llmctl column only")
    parser.add_argument("--llamacpp-dir", default=str(Path.home() / ".cache" / "llmctl-llamacpp"))
    parser.add_argument("--out", default=None, help="JSON, CSV, PNG and server logs (default: a new temp folder)")
    args = parser.parse_args()
    if len(args.rates.split(",")) < 2:
        parser.error("--rates needs at least two rates (a sweep)")
    args.out = args.out or tempfile.mkdtemp(prefix="llmctl-serve-sweep-")
    Path(args.out).mkdir(parents=True, exist_ok=True)
    print(f"results in {args.out}", flush=True)
    model = (args.model or default_model()).resolve()
    results = {}
    port = free_port()
    results["llmctl"] = sweep("llmctl", llmctl_command(model, port, args), port, model, args)
    command = None if args.no_llamacpp else llamacpp_command(model, port := free_port(), args)
    if command is not None:
        results["llama.cpp"] = sweep("llama.cpp", command, port, model, args)
    print(f"model {model}, {args.num_prompts} prompts of {args.input_len} tokens -> {args.output_len} tokens, "
          f"{THREADS} threads for llama-server")
    print_table(results)


if __name__ == "__main__":
    main()
