"""Mixture-of-experts decode on CPU: llmctl bf16 / int8 / int4-g32 beside llama.cpp bf16 / Q8_0 / Q4_0 (and llmctl on
llama.cpp's own GGUF files) in one run, batch 1, with each engine's weight stream against the measured read bandwidth.

Model: a Qwen3-MoE shape scaled to this machine (hidden 1024, 8 layers, 64 experts of 512, top 8, 16/4 heads of 64,
vocabulary 49152: ~0.93 B weights, ~0.17 B a token), random weights written by transformers in bfloat16; llama.cpp
runs its conversion by llama.cpp's own converter and `llama-quantize` (quantization.py's helpers). Workload: one
128-token prompt, `--output-len` tokens; the rate compared is the decode alone (llmctl: first token to last;
llama.cpp: `llama-batched-bench`'s S_TG). Each engine and scheme runs `--rounds` times, alternated, one process a run.

A token streams only its experts: the bytes counted for it are the attention, norms' matrices, router and the
top-k experts' share of the expert tensors, plus the output matrix, in the form each engine stores them.

    python benchmarks/moe_decode.py --llamacpp DIR [--schemes bf16,int8,int4-g32] [--gguf Q8_0,Q4_0]
        [--rounds 2] [--output-len 64] [--threads N] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
from pathlib import Path

from offline_throughput import SMOLLM_135M, run_worker
from quantization import (PEER_TYPE, convert_to_gguf, gguf_bytes_per_token, linear_bytes, llama_batched_rate,
                          quantize_gguf, read_bandwidth_gbs)

QWEN3_MOE = dict(hidden_size=1024, intermediate_size=3072, moe_intermediate_size=512, num_experts=64,
                 num_experts_per_tok=8, num_hidden_layers=8, num_attention_heads=16, num_key_value_heads=4,
                 head_dim=64, vocab_size=SMOLLM_135M["vocab_size"], norm_topk_prob=True, decoder_sparse_step=1,
                 mlp_only_layers=[], tie_word_embeddings=False, max_position_embeddings=2048)
EXPERT_SHARE = QWEN3_MOE["num_experts_per_tok"] / QWEN3_MOE["num_experts"]  # of the expert tensors a token reads


def make_moe_model(folder: Path) -> Path:
    import torch
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    torch.manual_seed(0)
    model = Qwen3MoeForCausalLM(Qwen3MoeConfig(**QWEN3_MOE))
    model.to(torch.bfloat16).save_pretrained(folder)
    return folder


def llmctl_bytes_per_token(scheme: str) -> int:
    """The weights a batch-1 token reads in llmctl: attention, router (bf16), its top-k experts and the lm_head."""
    c = QWEN3_MOE
    hidden, heads, kv, dim = c["hidden_size"], c["num_attention_heads"], c["num_key_value_heads"], c["head_dim"]
    attention = linear_bytes((heads + 2 * kv) * dim, hidden, scheme) + linear_bytes(hidden, heads * dim, scheme)
    expert = linear_bytes(2 * c["moe_intermediate_size"], hidden, scheme) + \
        linear_bytes(hidden, c["moe_intermediate_size"], scheme)
    router = 2 * c["num_experts"] * hidden
    layer = attention + router + c["num_experts_per_tok"] * expert
    return c["num_hidden_layers"] * layer + linear_bytes(c["vocab_size"], hidden, scheme)


def run_llmctl(folder: Path, scheme: str, args) -> float:
    """Decode tokens / s of one single-prompt run, in its own process."""
    extra = () if scheme == "bf16" or scheme.startswith("gguf ") else ("--quantization", scheme)
    run = run_worker(sys.executable, "ours", folder, "bfloat16", args, {}, extra)
    decode = [r for r in run["results"] if r["workload"] == "single" and r.get("decode_seconds")]
    return decode[0]["decode_tokens"] / decode[0]["decode_seconds"]


def run_order(schemes: list[str], gguf_kinds: list[str]) -> list[tuple[str, str]]:
    order = []
    for scheme in schemes:
        order += [("llmctl", scheme), ("llama.cpp", PEER_TYPE[scheme])]
    return order + [("llmctl", f"gguf {kind}") for kind in gguf_kinds]


def measure(order: list[tuple[str, str]], folder: Path, gguf: dict[str, Path], args) -> tuple[dict, list[float]]:
    rates: dict[tuple[str, str], list[float]] = {}
    bandwidths = []
    for round_index in range(args.rounds):
        bandwidths.append(read_bandwidth_gbs())
        for system, scheme in order:
            print(f"round {round_index + 1}: {system} {scheme} ...", file=sys.stderr, flush=True)
            if system == "llama.cpp":
                rate = llama_batched_rate(args.llamacpp, gguf[scheme], "single", 1, args.output_len, args.threads,
                                          args.llamacpp_no_repack)[1]
            else:
                rate = run_llmctl(gguf[scheme[5:]] if scheme.startswith("gguf ") else folder, scheme, args)
            rates.setdefault((system, scheme), []).append(rate)
            print(f"  {rate:.2f} decode tok/s", file=sys.stderr, flush=True)
    return rates, bandwidths


def streamed_bytes(order: list[tuple[str, str]], gguf: dict[str, Path]) -> dict[tuple[str, str], int]:
    """Each row's bytes a token streams: llama.cpp's and llmctl's GGUF rows from the file, llmctl's own from its layout."""
    return {(system, scheme): gguf_bytes_per_token(gguf[scheme.removeprefix("gguf ")], EXPERT_SHARE)
            if system == "llama.cpp" or scheme.startswith("gguf ") else llmctl_bytes_per_token(scheme)
            for system, scheme in order}


def table(rates: dict, bandwidth: float, streamed_by_row: dict[tuple[str, str], int]) -> list[dict]:
    rows = []
    for (system, scheme), values in rates.items():
        rate, streamed = statistics.median(values), streamed_by_row[(system, scheme)]
        peer = rates.get(("llama.cpp", PEER_TYPE.get(scheme, scheme.removeprefix("gguf "))))
        rows.append({"system": system, "scheme": scheme, "decode_tok_s": round(rate, 2), "runs": values,
                     "mb_per_token": round(streamed / 1e6, 1), "stream_gbs": round(rate * streamed / 1e9, 2),
                     "stream_share": round(rate * streamed / 1e9 / bandwidth, 3),
                     "vs_llama_cpp": round(rate / statistics.median(peer), 2) if peer and system == "llmctl" else None})
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--llamacpp", type=Path, required=True, help="llama.cpp's install (setup-llamacpp.sh)")
    parser.add_argument("--llamacpp-no-repack", action="store_true")
    parser.add_argument("--schemes", default="bf16,int8,int4-g32")
    parser.add_argument("--gguf", default="Q8_0,Q4_0", help="llama.cpp types llmctl also runs from the GGUF file")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--output-len", type=int, default=64)
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args()
    args.threads = args.threads or len(os.sched_getaffinity(0))
    args.num_prompts, args.workloads, args.repeats, args.device = 1, "single", 1, "cpu"
    schemes = args.schemes.split(",")
    with tempfile.TemporaryDirectory() as root:
        folder = make_moe_model(Path(root) / "qwen3-moe")
        gguf = {"bf16": Path(root) / "model-bf16.gguf"}
        convert_to_gguf(args.llamacpp, folder, gguf["bf16"])
        gguf_kinds = [kind for kind in args.gguf.split(",") if kind]
        for kind in sorted({PEER_TYPE[s] for s in schemes} | set(gguf_kinds)):
            if kind != "bf16":
                gguf[kind] = quantize_gguf(args.llamacpp, gguf["bf16"], kind)
        order = run_order(schemes, gguf_kinds)
        streamed = streamed_bytes(order, gguf)
        rates, bandwidths = measure(order, folder, gguf, args)
    bandwidth = statistics.median(bandwidths)
    rows = table(rates, bandwidth, streamed)
    print(f"read bandwidth {bandwidth:.1f} GB/s (median of {[round(b, 1) for b in bandwidths]}), "
          f"{args.threads} threads, {args.output_len} output tokens after a 128-token prompt")
    print(f"{'system':10s} {'scheme':10s} {'decode tok/s':>12s} {'MB/token':>9s} {'GB/s':>6s} {'share':>6s} {'vs llama.cpp':>12s}")
    for row in rows:
        ratio = "" if row["vs_llama_cpp"] is None else f"{row['vs_llama_cpp']:.2f}x"
        print(f"{row['system']:10s} {row['scheme']:10s} {row['decode_tok_s']:12.1f} {row['mb_per_token']:9.1f} "
              f"{row['stream_gbs']:6.2f} {row['stream_share']:6.1%} {ratio:>12s}")
    if args.json:
        args.json.write_text(json.dumps({"bandwidth_gbs": bandwidths, "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
