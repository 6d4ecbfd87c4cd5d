"""Quantised decode on CPU: llmctl bf16 / int8 / int4 beside llama.cpp (the same model converted to GGUF
bf16, Q8_0, Q4_0 and Q4_K_M) and vLLM-CPU bf16, ratios in one run.

Model: SmolLM-135M's shape with seeded random weights (offline_throughput.py's), saved in bfloat16; every
system loads that folder (llama.cpp: its GGUF conversions, made by llama.cpp's own converter and
`llama-quantize`; llmctl's GGUF rows load the same files where llmctl reads GGUF). Workloads:
`single` = one 128-token prompt and 128 output tokens, `batched` = 64 prompts of 32-256 tokens (144 on
average) and 128 output tokens each. Rate = output tokens / wall time of the whole workload (prefill
included) for every system: llama.cpp through `llama-batched-bench` (-npp 128 -npl 1 and -npp 144 -npl 64,
-ntg 128, its B*TG / T). Pairs compared: bf16 - bf16, int8 - Q8_0 (both 8-bit symmetric; Q8_0 has a scale
per 32 weights, ours per row) and int4-g32 - Q4_0 (both symmetric 4-bit in groups of 32). Q4_K_M, the file
type most users download, has no on-the-fly twin: llmctl runs llama.cpp's file (for this shape mostly Q5_0 and
Q8_0, as 576 inputs are not whole 256-value K-quant super-blocks; Q4_K/Q6_K on the 1536-input down_proj).

Bandwidth: the machine's read bandwidth as `llmctl bench --cpu` measures it (a sum over a large buffer, at the
start of every round; the table uses their median), and
the weight bytes each batch-1 token streams (every linear and the lm_head in its stored form) times the
single-stream rate: over the whole run (prefill in the time, a lower bound) and over the decode alone (llmctl's
request metrics, first token to last: a token's weights over the time per output token). llama.cpp's rows (and
llmctl's on its GGUF files) count the file's bytes instead: every matrix a token multiplies (the output matrix, or
the tied embedding), its decode rate llama-batched-bench's S_TG (generation alone). So the goal's fraction, the
decode's weight stream against the read figure, prints for both engines in the same run.

    python benchmarks/quantization.py [--llamacpp DIR [--llamacpp-no-repack]] [--vllm-python VENV/bin/python]
        [--schemes bf16,int8,int4-g32,int4,int8+cache,int4-g32+cache] [--workloads single,batched] [--rounds N]
        [--gguf-types Q8_0,Q4_0,Q4_K_M,IQ4_XS,...] [--json out.json]

`--rounds N` runs every system and scheme N times alternated (llama.cpp's runs among llmctl's, each run its
own process) and reports the median, every run, the ratio of medians and the median of the rounds' own ratios
(the batched goal, int8/int4 not slower than bf16, is a ratio of medians). A shared host's speed can move 2x
within minutes: a single llama.cpp run against llmctl's median compares two moments, not two programs.

`NAME+cache` runs `--quantization NAME --quantization-batch-cache`: batches of 16+ rows on a bf16 copy of
each quantised weight (bf16's batched speed, 2 more bytes per weight); batch 1 is the same as NAME's.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Optional

from offline_throughput import SMOLLM_135M, VLLM_ENV, make_model, run_worker, summarize

# llmctl scheme -> the llama.cpp type it is compared with (a "+cache" scheme: the same, with
# --quantization-batch-cache, whose bf16 copy serves batches of 16+ rows)
PEER_TYPE = {"bf16": "bf16", "int8": "Q8_0", "int4-g32": "Q4_0"}
CACHE_SUFFIX = "+cache"
DEFAULT_MODEL = Path(__file__).resolve().parents[1] / "llmctl" / "default_model"
WORKLOAD_PROMPTS = {"single": 128, "batched": 144}  # prompt tokens (llama-batched-bench): the workloads' mean


def linear_bytes(out_features: int, in_features: int, scheme: str) -> int:
    """One linear weight's bytes (and scales) in llmctl's stored form."""
    weights = out_features * in_features
    if scheme == "bf16":
        return 2 * weights
    if scheme == "int8":  # the native layout: a byte a weight, one float16 scale a row
        return weights + 2 * out_features
    # the native layout: half a byte a weight, a float16 scale (and zero point: -asym) a group
    group = 128 if scheme in ("int4", "int4-asym") else int(re.search(r"g(\d+)", scheme).group(1))
    return weights // 2 + (4 if scheme.endswith("-asym") else 2) * weights // group


def stored_bytes_per_token(scheme: str) -> int:
    """Bytes of every linear weight (and scales) a batch-1 token reads, in llmctl's stored form."""
    c = SMOLLM_135M
    hidden, inter, kv = c["hidden_size"], c["intermediate_size"], c["hidden_size"] * c["num_key_value_heads"] // c["num_attention_heads"]
    shapes = [(hidden + 2 * kv, hidden), (hidden, hidden), (2 * inter, hidden), (hidden, inter)] * c["num_hidden_layers"]
    shapes.append((c["vocab_size"], hidden))  # the (tied) lm_head
    return sum(linear_bytes(out_features, in_features, scheme) for out_features, in_features in shapes)


def read_bandwidth_gbs(warmup_s: float = 0.5, reps: int = 7) -> float:
    """`llmctl bench --cpu`'s memory-read figure: the median GB/s of a sum over 256 MiB or 4x the LLC."""
    import torch

    from llmctl.bench import kernels
    from llmctl.bench.hardware import _cpu_caches

    caches = _cpu_caches()
    llc = caches.get(max(caches)) if caches else 32 << 20
    measured = kernels.memory_read(kernels.Timer(warmup_s, reps), torch.device("cpu"), max(256 << 20, 4 * llc),
                                   peak_key=None)
    return statistics.median(measured.values)


# ---- llama.cpp ---------------------------------------------------------------------------------------------

def convert_to_gguf(llamacpp: Path, folder: Path, out: Path) -> None:
    """llama.cpp's own converter (vendored in its tree) run by this Python, which has torch and transformers.
    The folder carries the embedded model's byte-level BPE tokenizer (the converter pads the vocabulary to
    the model's); its pre-tokenizer is declared GPT-2's (it is byte-level BPE), and the SentencePiece path
    is skipped (no tokenizer.model, and no sentencepiece package here)."""
    tree = llamacpp / "src" / "vendor" / "llama.cpp"
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(DEFAULT_MODEL / name, folder / name)
    script = f"""
import sys
sys.path[:0] = [{str(tree)!r}, {str(tree / 'gguf-py')!r}]
import conversion.base as base
def no_sentencepiece(self):
    raise FileNotFoundError("no tokenizer.model")
for name in dir(base):
    cls = getattr(base, name)
    if isinstance(cls, type) and hasattr(cls, "get_vocab_base_pre"):
        cls.get_vocab_base_pre = lambda self, tokenizer: "gpt-2"
    if isinstance(cls, type) and "_set_vocab_sentencepiece" in vars(cls):
        cls._set_vocab_sentencepiece = no_sentencepiece
import convert_hf_to_gguf as conv
sys.argv = ["convert_hf_to_gguf.py", {str(folder)!r}, "--outfile", {str(out)!r}, "--outtype", "bf16"]
conv.main()
"""
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True)
    if proc.returncode != 0:
        raise SystemExit(f"GGUF conversion failed: {proc.stderr.strip().splitlines()[-3:]}")


def llama_env(llamacpp: Path) -> dict[str, str]:
    return {**os.environ, "LD_LIBRARY_PATH": str(llamacpp / "bin")}


def quantize_gguf(llamacpp: Path, source: Path, kind: str) -> Path:
    out = source.with_name(f"model-{kind}.gguf")
    done = subprocess.run([str(llamacpp / "bin" / "llama-quantize"), str(source), str(out), kind],
                          capture_output=True, text=True, env=llama_env(llamacpp))
    if done.returncode != 0:
        tail = "\n".join((done.stderr or done.stdout).strip().splitlines()[-5:])
        raise SystemExit(f"llama-quantize could not make a {kind} file (a type it knows? --gguf-types):\n{tail}")
    return out


def gguf_bytes_per_token(path: Path, expert_share: float = 1.0) -> int:
    """Bytes of the matrices a batch-1 token multiplies, as the GGUF file stores them: every block's 2-D weights
    and the output matrix (the token embedding where the file ties it; a token reads one row of it otherwise).
    `expert_share`: the share of a mixture-of-experts layer's expert tensors (`*_exps`) a token reads (top-k / E)."""
    from gguf import GGUFReader

    tensors = {t.name: int(t.n_bytes) for t in GGUFReader(path).tensors}
    blocks = sum(int(size * expert_share) if "_exps." in name else size for name, size in tensors.items()
                 if name.startswith("blk.") and name.endswith(".weight") and "norm" not in name)
    return blocks + tensors.get("output.weight", tensors.get("token_embd.weight", 0))


def llama_batched_rate(llamacpp: Path, gguf: Path, workload: str, num_prompts: int, output_len: int, threads: int,
                       no_repack: bool) -> tuple[float, float]:
    """Output tokens / s of `llama-batched-bench` for the workload's shape: B * TG / T (prefill included), and
    its generation rate alone (S_TG).
    `no_repack` (-nr) keeps the weights in their GGUF layout: on hosts that hide AMX's tile state from the
    process (some VMs), llama.cpp's AMX repacked path dies of SIGILL on its first tile instruction."""
    prompt, sequences = WORKLOAD_PROMPTS[workload], 1 if workload == "single" else num_prompts
    command = [str(llamacpp / "bin" / "llama-batched-bench"), "-m", str(gguf), "-c", str(sequences * (prompt + output_len) + 64),
               "-npp", str(prompt), "-ntg", str(output_len), "-npl", str(sequences), "-np", str(sequences),
               "-t", str(threads), "-tb", str(threads), *(["-nr"] if no_repack else [])]
    proc = subprocess.run(command, capture_output=True, text=True, env=llama_env(llamacpp), timeout=3600)
    if proc.returncode != 0:
        raise SystemExit(f"llama-batched-bench failed ({proc.returncode}): {proc.stderr.strip().splitlines()[-3:]}")
    return parse_batched_bench(proc.stdout + proc.stderr)


def parse_batched_bench(text: str) -> tuple[float, float]:
    """B * TG / T and S_TG (generated tokens / s, the prefill excluded) from the table llama-batched-bench prints."""
    header, rows = None, []
    for line in text.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if "S_TG t/s" in cells:
            header = cells
        elif header and len(cells) == len(header) and cells[0].isdigit():
            rows.append(dict(zip(header, cells)))
    if not rows:
        raise SystemExit("llama-batched-bench printed no result table")
    row = rows[-1]
    return int(row["B"]) * int(row["TG"]) / float(row["T s"]), float(row["S_TG t/s"])


# ---- the run -----------------------------------------------------------------------------------------------

def llmctl_reads_gguf() -> bool:
    return importlib.util.find_spec("llmctl.engine.gguf_loader") is not None


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--schemes", default="bf16,int8,int4-g32,int4,int8+cache,int4-g32+cache",
                        help="llmctl: bf16 and --quantization names (NAME+cache: with --quantization-batch-cache)")
    parser.add_argument("--workloads", default="single,batched")
    parser.add_argument("--llamacpp", type=Path, help="llama.cpp peer dir (../shared/tools/setup-llamacpp.sh DIR)")
    parser.add_argument("--llamacpp-no-repack", action="store_true",
                        help="run llama.cpp with -nr (needed where its AMX path dies of SIGILL)")
    parser.add_argument("--vllm-python", help="Python of a venv with vllm-cpu (../shared/tools/setup-vllm-cpu.sh)")
    parser.add_argument("--num-prompts", type=int, default=64)
    parser.add_argument("--output-len", type=int, default=128)
    parser.add_argument("--threads", type=int, default=os.cpu_count())
    parser.add_argument("--rounds", type=int, default=1,
                        help="every system and scheme (llama.cpp's too) runs this many times, alternated (A B C A B C "
                             "...), each run in its own process; the table shows medians, every run and the rounds' "
                             "own ratios (a shared host's load swings a run by 20%% and more)")
    parser.add_argument("--gguf-types", default="Q8_0,Q4_0,Q4_K_M",
                        help="llama-quantize types of the model both llama.cpp and llmctl run (with --llamacpp), e.g. "
                             "Q8_0,Q4_0,Q4_K_M,Q5_K_M,Q6_K,IQ4_XS")
    parser.add_argument("--json", type=Path, help="also write the rows here")
    args = parser.parse_args()
    args.repeats, args.device = 1, "cpu"
    workloads = args.workloads.split(",")
    rows: list[dict] = []
    with tempfile.TemporaryDirectory(prefix="llmctl-quant-bench-") as tmp:
        folder = make_model(Path(tmp) / "model", "bfloat16")
        gguf: dict[str, Path] = {}
        if args.llamacpp:  # converted first, so a failing conversion stops the run before the long part
            gguf["bf16"] = Path(tmp) / "model-bf16.gguf"
            convert_to_gguf(args.llamacpp, folder, gguf["bf16"])
            for kind in args.gguf_types.split(","):
                gguf[kind] = quantize_gguf(args.llamacpp, gguf["bf16"], kind)
        if args.vllm_python:
            print("running vLLM-CPU bf16 ...", file=sys.stderr, flush=True)
            run = run_worker(args.vllm_python, "vllm", folder, "bfloat16", args, VLLM_ENV)
            rows += [dict(r, system="vLLM-CPU", scheme="bf16") for r in summarize({("vllm", "bfloat16"): run}, workloads)]
        measured, bandwidths = run_rounds(folder, gguf, args, workloads)
        for row in measured:  # while the files exist
            row["bytes_per_token"] = token_bytes(row["system"], row["scheme"], gguf)
        rows += measured
    bandwidth = statistics.median(bandwidths)
    print_table(rows, bandwidth, bandwidths)
    if args.json:
        args.json.write_text(json.dumps({"read_bandwidth_gbs": bandwidth, "read_bandwidth_rounds_gbs": bandwidths,
                                         "rows": rows}, indent=2))


def token_bytes(system: str, scheme: str, gguf: dict[str, Path]) -> int:
    """The weight bytes a batch-1 token of this row streams: llmctl's stored form of its scheme, or the GGUF file's."""
    if system == "llama.cpp":
        return gguf_bytes_per_token(gguf[scheme])
    if scheme.startswith("gguf "):
        return gguf_bytes_per_token(gguf[scheme[5:]])
    return stored_bytes_per_token(scheme.removesuffix(CACHE_SUFFIX))


def run_order(schemes: list[str], gguf: dict[str, Path]) -> list[tuple[str, str]]:
    """(system, scheme) in the order a round runs them: each llmctl scheme next to its llama.cpp peer, then
    llmctl on that peer's GGUF file; peers no scheme asked for after the rest."""
    order: list[tuple[str, str]] = []

    def add_peer(kind: Optional[str]) -> None:
        if kind in gguf and ("llama.cpp", kind) not in order:
            order.append(("llama.cpp", kind))
            if kind != "bf16" and llmctl_reads_gguf():
                order.append(("llmctl", f"gguf {kind}"))

    for scheme in schemes:
        order.append(("llmctl", scheme))
        add_peer(PEER_TYPE.get(scheme.removesuffix(CACHE_SUFFIX)))
    for kind in gguf:
        add_peer(kind)
    return order


def run_once(system: str, scheme: str, folder: Path, gguf: dict[str, Path], args,
             workloads: list[str]) -> dict[str, tuple[float, Optional[float]]]:
    """One run of one system and scheme (each in its own process): per workload, tokens/s and the decode's own
    tokens/s without the prefill (llmctl's single workload: first token to last; llama.cpp's: S_TG)."""
    if system == "llama.cpp":
        return {workload: llama_batched_rate(args.llamacpp, gguf[scheme], workload, args.num_prompts, args.output_len,
                                             args.threads, args.llamacpp_no_repack) for workload in workloads}
    if scheme.startswith("gguf "):
        run = run_worker(sys.executable, "ours", gguf[scheme[5:]], "bfloat16", args, {})
    else:
        extra = [] if scheme == "bf16" else ["--quantization", scheme.removesuffix(CACHE_SUFFIX)]
        if scheme.endswith(CACHE_SUFFIX):
            extra.append("--quantization-batch-cache")
        run = run_worker(sys.executable, "ours", folder, "bfloat16", args, {}, tuple(extra))
    decode = {r["workload"]: r["decode_tokens"] / r["decode_seconds"] for r in run["results"] if r.get("decode_seconds")}
    return {row["workload"]: (row["tokens_per_s"], decode.get(row["workload"]))
            for row in summarize({("ours", "bfloat16"): run}, workloads)}


def run_rounds(folder: Path, gguf: dict[str, Path], args, workloads: list[str]) -> tuple[list[dict], list[float]]:
    """Every system and scheme `args.rounds` times, alternated (A B C A B C ...), llama.cpp's runs among
    llmctl's, one process a run: a row per system, scheme and workload with the median rate and every run,
    in round order (so a ratio can also be taken round by round, the two sides minutes apart at most); and
    the read bandwidth measured at each round's start (the host's own figure moves with its load too)."""
    order = run_order(args.schemes.split(","), gguf)
    rates: dict[tuple[str, str, str], list[float]] = {}
    decode_rates: dict[tuple[str, str, str], list[float]] = {}
    failed: set[tuple[str, str]] = set()
    bandwidths: list[float] = []
    for round_index in range(args.rounds):
        bandwidths.append(read_bandwidth_gbs())
        print(f"read bandwidth: {bandwidths[-1]:.1f} GB/s", file=sys.stderr, flush=True)
        for system, scheme in order:
            if (system, scheme) in failed:
                continue
            print(f"running {system} {scheme} (round {round_index + 1}/{args.rounds}) ...", file=sys.stderr, flush=True)
            try:
                measured = run_once(system, scheme, folder, gguf, args, workloads)
            except SystemExit as failure:
                if not scheme.startswith("gguf "):
                    raise
                print(f"llmctl could not run the GGUF {scheme[5:]} file: {failure}", file=sys.stderr, flush=True)
                failed.add((system, scheme))  # the other rows still print
                continue
            for workload, (rate, decode_rate) in measured.items():
                rates.setdefault((system, scheme, workload), []).append(rate)
                if decode_rate is not None:
                    decode_rates.setdefault((system, scheme, workload), []).append(decode_rate)
    rows = [{"system": system, "scheme": scheme, "workload": workload, "tokens_per_s": statistics.median(values),
             "runs": values} for (system, scheme, workload), values in rates.items()]
    for row in rows:
        decode = decode_rates.get((row["system"], row["scheme"], row["workload"]))
        if decode:
            row["decode_tokens_per_s"], row["decode_runs"] = statistics.median(decode), decode
    return rows, bandwidths


def print_table(rows: list[dict], bandwidth: float, bandwidths: list[float]) -> None:
    def find(system: str, scheme: str, workload: str) -> Optional[dict]:
        return next((r for r in rows if (r["system"], r["scheme"], r["workload"]) == (system, scheme, workload)), None)

    def rate(system: str, scheme: str, workload: str) -> Optional[float]:
        row = find(system, scheme, workload)
        return row["tokens_per_s"] if row else None

    header = (f"{'workload':<8} {'system':<10} {'scheme':<15} {'tok/s':>8} {'vs bf16':>8} {'vs llama.cpp':>18} "
              f"{'per round':>10} {'vs vLLM bf16':>13} {'weights GB/s: all, decode':>26}  runs")
    print(f"read bandwidth (llmctl bench --cpu's memory read, median of the rounds'): {bandwidth:.1f} GB/s "
          f"({' '.join(f'{b:.1f}' for b in bandwidths)})")
    print("vs llama.cpp: ratio of the medians; per round: the median of the rounds' own ratios")
    print(header)
    print("-" * len(header))
    decode_shares: list[str] = []
    for r in rows:
        peer = PEER_TYPE.get(r["scheme"].removesuffix(CACHE_SUFFIX)) if r["system"] == "llmctl" else None
        if r["scheme"].startswith("gguf "):
            peer = r["scheme"][5:]
        peer_row = find("llama.cpp", peer, r["workload"]) if peer else None
        vllm = rate("vLLM-CPU", "bf16", r["workload"])
        vs_llama = f"{r['tokens_per_s'] / peer_row['tokens_per_s']:.2f}x ({peer})" if peer_row else "-"
        per_round = "-"
        if peer_row and len(peer_row.get("runs", [])) == len(r.get("runs", [])) > 1:
            per_round = f"{statistics.median(a / b for a, b in zip(r['runs'], peer_row['runs'])):.2f}x"
        vs_vllm = f"{r['tokens_per_s'] / vllm:.2f}x" if vllm and r["system"] == "llmctl" else "-"
        ours_bf16 = rate("llmctl", "bf16", r["workload"])
        vs_bf16 = f"{r['tokens_per_s'] / ours_bf16:.2f}x" if ours_bf16 and r["system"] == "llmctl" else "-"
        runs = " ".join(f"{v:.0f}" for v in r["runs"]) if isinstance(r.get("runs"), list) else ""
        streamed = "-"
        per_token = r.get("bytes_per_token")
        if per_token and r["workload"] == "single":
            gbs = per_token * r["tokens_per_s"] / 1e9
            streamed = f"{gbs:.1f} ({100 * gbs / bandwidth:.0f}%)"
            if r.get("decode_tokens_per_s"):  # the decode alone: a token's weights over the time per output token
                gbs = per_token * r["decode_tokens_per_s"] / 1e9
                streamed += f" {gbs:.1f} ({100 * gbs / bandwidth:.0f}%)"
                if len(r["decode_runs"]) == len(bandwidths) > 1:  # each round's run against that round's read figure
                    shares = sorted(100 * per_token * d / 1e9 / b for d, b in zip(r["decode_runs"], bandwidths))
                    decode_shares.append(f"{r['system']} {r['scheme']} {statistics.median(shares):.0f}% "
                                         f"({' '.join(f'{x:.0f}' for x in shares)})")
        print(f"{r['workload']:<8} {r['system']:<10} {r['scheme']:<15} {r['tokens_per_s']:>8.1f} {vs_bf16:>8} "
              f"{vs_llama:>18} {per_round:>10} {vs_vllm:>13} {streamed:>26}  {runs}")
    if decode_shares:
        print("decode weights stream, each round against its own read figure (median, then every round): "
              + "; ".join(decode_shares))


if __name__ == "__main__":
    main()
