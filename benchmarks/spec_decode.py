"""Tokens/s with and without speculation on the embedded model (`llmctl/default_model`).

n-gram (batch 1): the model is prompted with a passage it has already seen repeated, so its greedy
continuation copies the prompt, which is what prompt lookup drafts from. Draft model (`--draft`):
the shipped `default-draft` proposes for Shakespeare speaker prompts ("ROMEO:\n", ...), greedy and
sampled (temperature 0.8, seeded), at batch 1 and batch 8 (`disable_by_batch_size`'s default).

    python benchmarks/spec_decode.py [--k 4] [--max-tokens 128] [--repeats 3] [--json]
    python benchmarks/spec_decode.py --draft [--draft-k 2] [--max-tokens 96] [--json]

Prints tok/s of both runs (same engine settings, best of `--repeats`), the speed-up, the acceptance
rate (accepted / drafted tokens) and the mean accepted length (tokens per verify row, the model's own
token included). Checks greedy outputs are identical with and without speculation.
"""

from __future__ import annotations

import argparse
import json
import time

from llmctl.engine import LLM, SamplingParams

PASSAGE = ("ROMEO: But, soft! what light through yonder window breaks? It is the east, and Juliet is the sun. "
           "Arise, fair sun, and kill the envious moon, who is already sick and pale with grief.\n")


SPEAKERS = ["ROMEO:\n", "JULIET:\n", "First Citizen:\n", "KING RICHARD III:\n", "MENENIUS:\n", "NURSE:\n",
            "GLOUCESTER:\n", "QUEEN ELIZABETH:\n"]


def ngram_config(k: int) -> dict:
    return {"method": "ngram", "num_speculative_tokens": k, "prompt_lookup_max": 4, "prompt_lookup_min": 2}


def run(speculative: dict | None, prompts: list[str], params: SamplingParams, repeats: int) -> dict:
    """Best-of-`repeats` output tok/s of one engine over `prompts` (all at once), its outputs and its
    spec-decode counters over every repeat."""
    llm = LLM(device="cpu", max_model_len=512, **({"speculative_config": speculative} if speculative else {}))
    llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=8))  # warm-up
    best, tokens = float("inf"), []
    for _ in range(repeats):
        start = time.perf_counter()
        outputs = llm.generate(prompts, params)
        best = min(best, time.perf_counter() - start)
        tokens = [o.outputs[0].token_ids for o in outputs]
    stats = llm.engine.get_stats()
    drafts, drafted = stats["spec_decode_num_drafts"], stats["spec_decode_num_draft_tokens"]
    accepted = stats["spec_decode_num_accepted_tokens"]
    return {"tok_s": sum(map(len, tokens)) / best, "tokens": tokens,
            "acceptance_rate": accepted / drafted if drafted else 0.0,
            "mean_accepted_length": 1 + accepted / drafts if drafts else 1.0}


def compare(speculative: dict, prompts: list[str], params: SamplingParams, repeats: int) -> dict:
    plain, spec = run(None, prompts, params, repeats), run(speculative, prompts, params, repeats)
    return {"no_spec_tok_s": round(plain["tok_s"], 1), "spec_tok_s": round(spec["tok_s"], 1),
            "speedup": round(spec["tok_s"] / plain["tok_s"], 2), "acceptance_rate": round(spec["acceptance_rate"], 3),
            "mean_accepted_length": round(spec["mean_accepted_length"], 2),
            # Sampled outputs differ run to run by design (the same distribution, not the same draws).
            "outputs_identical": plain["tokens"] == spec["tokens"] if params.greedy else None}


def draft_rows(k: int, max_tokens: int, repeats: int) -> list[dict]:
    config = {"model": "default-draft", "num_speculative_tokens": k}
    rows = []
    for batch in (1, len(SPEAKERS)):
        for temperature in (0.0, 0.8):
            params = SamplingParams(temperature=temperature, max_tokens=max_tokens, ignore_eos=True,
                                    seed=None if temperature == 0.0 else 1)
            row = compare(config, SPEAKERS[:batch], params, repeats)
            rows.append({"batch": batch, "temperature": temperature, "k": k, **row})
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--k", type=int, default=4, help="num_speculative_tokens (n-gram)")
    parser.add_argument("--draft", action="store_true", help="the default-draft model on Shakespeare prompts")
    parser.add_argument("--draft-k", type=int, default=2, help="num_speculative_tokens (draft model)")
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    if args.draft:
        rows = draft_rows(args.draft_k, args.max_tokens, args.repeats)
        if args.json:
            print(json.dumps(rows))
            return
        for r in rows:
            print(f"default-draft, batch {r['batch']}, temperature {r['temperature']}, {args.max_tokens} tokens, "
                  f"k={r['k']}: no speculation {r['no_spec_tok_s']} tok/s, draft {r['spec_tok_s']} tok/s "
                  f"({r['speedup']}x); acceptance {r['acceptance_rate']}, mean accepted length "
                  f"{r['mean_accepted_length']}; outputs identical: {r['outputs_identical']}")
        return
    params = SamplingParams(temperature=0.0, max_tokens=args.max_tokens, ignore_eos=True)
    row = compare(ngram_config(args.k), [PASSAGE * 3], params, args.repeats)
    result = {"no_spec_tok_s": row["no_spec_tok_s"], "ngram_tok_s": row["spec_tok_s"],
              **{k: v for k, v in row.items() if k not in ("no_spec_tok_s", "spec_tok_s")}}
    if args.json:
        print(json.dumps(result))
        return
    print(f"batch 1, {args.max_tokens} tokens, k={args.k}: no speculation {result['no_spec_tok_s']} tok/s, "
          f"n-gram {result['ngram_tok_s']} tok/s ({result['speedup']}x); acceptance {result['acceptance_rate']}, "
          f"mean accepted length {result['mean_accepted_length']}; outputs identical: {result['outputs_identical']}")


if __name__ == "__main__":
    main()
