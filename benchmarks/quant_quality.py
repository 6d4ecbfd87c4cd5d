"""Perplexity of the embedded default model (`llmctl/default_model`) on its held-out text, per quantisation:
what `--quantization` costs in quality, measured through the engine itself (prompt log-probabilities).

    python benchmarks/quant_quality.py [--quantizations bf16,int8,int4-g32,...] [--max-tokens N] [--json FILE]

The held-out text is the last 10 % of tiny-shakespeare, split exactly as tools/train_default_model.py
splits it (its `split_corpus`, the same corpus path rule), tokenized without special tokens. Windows of
`--seq-len` tokens (default 512, the model's context) slide by half a window, so every token after the
first is scored once with at least half a window of context, the training script's own evaluation
(`evaluate_perplexity`). bf16 is the model's own dtype; every row runs bfloat16 activations on CPU.
Prints each row's perplexity and its change against bf16, and checks the issue's goals: int8 within 2 %,
int4 with group 32 within 10 %. Exit 1 when a goal is missed.
"""

from __future__ import annotations

import argparse
import functools
import importlib.util
import json
import math
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
DEFAULT_ROWS = ("bf16", "int8", "int4-g32", "int4-g64", "int4-g128", "int4-g32-asym")
GOALS = {"int8": 0.02, "int4-g32": 0.10}  # relative perplexity increase over bf16 (issue 15)


@functools.cache
def training_tool():
    """tools/train_default_model.py as a module: its corpus path rule and split are the reference."""
    spec = importlib.util.spec_from_file_location("train_default_model", REPO / "tools" / "train_default_model.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclasses look their module up
    spec.loader.exec_module(module)
    return module


def held_out_ids(corpus: Path, max_tokens: int | None) -> list[int]:
    from tokenizers import Tokenizer

    _, held_out = training_tool().split_corpus(corpus.read_text(encoding="utf-8"))
    tokenizer = Tokenizer.from_file(str(REPO / "llmctl" / "default_model" / "tokenizer.json"))
    ids = tokenizer.encode(held_out, add_special_tokens=False).ids
    return ids[:max_tokens] if max_tokens else ids


def windows(num_tokens: int, seq_len: int, stride: int) -> list[tuple[int, int, int]]:
    """(begin, end, first scored position within the window): every token after the first scored once."""
    out, prev_end = [], 1
    for begin in range(0, num_tokens - 1, stride):
        end = min(begin + seq_len, num_tokens)
        out.append((begin, end, max(prev_end - begin, 1)))
        prev_end = end
        if end == num_tokens:
            break
    return out


def perplexity(quantization: str, ids: list[int], seq_len: int) -> dict:
    from llmctl.engine import LLM, SamplingParams

    started = time.perf_counter()
    llm = LLM(dtype="bfloat16", device="cpu", max_model_len=seq_len, skip_tokenizer_init=True,
              quantization=None if quantization == "bf16" else quantization, enable_prefix_caching=False)
    plan = windows(len(ids), seq_len, seq_len // 2)
    prompts = [ids[begin:end] for begin, end, _ in plan]
    outputs = llm.generate(prompts, SamplingParams(max_tokens=1, prompt_logprobs=0, temperature=0.0))
    nll, scored = 0.0, 0
    for (begin, end, first), prompt, output in zip(plan, prompts, outputs):
        for position in range(first, end - begin):
            nll -= output.prompt_logprobs[position][prompt[position]]
            scored += 1
    info = llm.engine.model_info
    return {"quantization": quantization, "ppl": math.exp(nll / scored), "nll_per_token": nll / scored,
            "tokens_scored": scored, "weight_bytes": info.weight_bytes, "seconds": time.perf_counter() - started}


def main(argv: list[str] | None = None) -> int:
    tool = training_tool()
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--corpus", type=Path, default=tool.default_corpus_path())
    parser.add_argument("--quantizations", default=",".join(DEFAULT_ROWS))
    parser.add_argument("--seq-len", type=int, default=512)
    parser.add_argument("--max-tokens", type=int, default=None, help="score only the first N held-out tokens")
    parser.add_argument("--json", type=Path, default=None, help="also write the rows to this file")
    args = parser.parse_args(argv)
    if not args.corpus.is_file():
        parser.error(f"corpus {args.corpus} not found (set $LLMCTL_TRAIN_CORPUS or pass --corpus)")
    rows = [q.strip() for q in args.quantizations.split(",") if q.strip()]
    if "bf16" not in rows:
        rows.insert(0, "bf16")
    ids = held_out_ids(args.corpus, args.max_tokens)
    print(f"{'quantization':14} {'perplexity':>10} {'vs bf16':>8} {'weights MiB':>11} {'tokens':>7} {'s':>6}", flush=True)
    results, missed = [], []
    for quantization in sorted(rows, key=lambda q: q != "bf16"):  # bf16 first: the others are relative to it
        r = perplexity(quantization, ids, args.seq_len)
        r["relative_to_bf16"] = r["ppl"] / (results[0]["ppl"] if results else r["ppl"]) - 1
        results.append(r)
        goal = GOALS.get(quantization)
        verdict = "" if goal is None else f"  goal <= +{goal:.0%}: " + ("ok" if r["relative_to_bf16"] <= goal else "MISSED")
        if goal is not None and r["relative_to_bf16"] > goal:
            missed.append(quantization)
        print(f"{quantization:14} {r['ppl']:10.3f} {r['relative_to_bf16']:+8.2%} {r['weight_bytes'] / 2**20:11.2f} "
              f"{r['tokens_scored']:7d} {r['seconds']:6.1f}{verdict}", flush=True)
    if args.json:
        args.json.write_text(json.dumps(results, indent=2) + "\n")
    return 1 if missed else 0


if __name__ == "__main__":
    sys.exit(main())
