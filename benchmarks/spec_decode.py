"""Batch-1 tokens/s with and without n-gram speculation on a prompt-lookup workload: the embedded
model (`llmctl/default_model`) is prompted with a passage it has already seen repeated, so its
greedy continuation copies the prompt, which is what prompt lookup drafts from.

    python benchmarks/spec_decode.py [--k 4] [--max-tokens 128] [--repeats 3] [--json]

Prints tok/s of both runs (same engine settings, best of `--repeats`), the speed-up, the acceptance
rate (accepted / drafted tokens) and the mean accepted length (tokens per verify row, the model's own
token included). Checks the two greedy outputs are identical.
"""

from __future__ import annotations

import argparse
import json
import time

from llmctl.engine import LLM, SamplingParams

PASSAGE = ("ROMEO: But, soft! what light through yonder window breaks? It is the east, and Juliet is the sun. "
           "Arise, fair sun, and kill the envious moon, who is already sick and pale with grief.\n")


def run(k: int | None, max_tokens: int, repeats: int) -> dict:
    extra = {} if k is None else {"speculative_config": {"method": "ngram", "num_speculative_tokens": k,
                                                         "prompt_lookup_max": 4, "prompt_lookup_min": 2}}
    llm = LLM(device="cpu", max_model_len=512, **extra)
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    prompt = PASSAGE * 3
    llm.generate([prompt], SamplingParams(temperature=0.0, max_tokens=8))  # warm-up
    best, tokens = float("inf"), []
    for _ in range(repeats):
        start = time.perf_counter()
        (out,) = llm.generate([prompt], params)
        best = min(best, time.perf_counter() - start)
        tokens = out.outputs[0].token_ids
    stats = llm.engine.get_stats()
    drafts, drafted = stats["spec_decode_num_drafts"], stats["spec_decode_num_draft_tokens"]
    accepted = stats["spec_decode_num_accepted_tokens"]
    return {"tok_s": len(tokens) / best, "tokens": tokens,
            "acceptance_rate": accepted / drafted if drafted else 0.0,
            "mean_accepted_length": 1 + accepted / drafts if drafts else 1.0}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--k", type=int, default=4, help="num_speculative_tokens")
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    plain = run(None, args.max_tokens, args.repeats)
    spec = run(args.k, args.max_tokens, args.repeats)
    result = {"no_spec_tok_s": round(plain["tok_s"], 1), "ngram_tok_s": round(spec["tok_s"], 1),
              "speedup": round(spec["tok_s"] / plain["tok_s"], 2),
              "acceptance_rate": round(spec["acceptance_rate"], 3),
              "mean_accepted_length": round(spec["mean_accepted_length"], 2),
              "outputs_identical": plain["tokens"] == spec["tokens"]}
    if args.json:
        print(json.dumps(result))
        return
    print(f"batch 1, {args.max_tokens} tokens, k={args.k}: no speculation {result['no_spec_tok_s']} tok/s, "
          f"n-gram {result['ngram_tok_s']} tok/s ({result['speedup']}x); acceptance {result['acceptance_rate']}, "
          f"mean accepted length {result['mean_accepted_length']}; outputs identical: {result['outputs_identical']}")


if __name__ == "__main__":
    main()
