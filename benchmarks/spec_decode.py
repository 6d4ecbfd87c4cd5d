"""Tokens/s with and without speculation on the embedded model (`llmctl/default_model`).

n-gram (default, batch 1), two prompt-lookup workloads:
  * `rewrite`: answers that copy the prompt. For each Shakespeare speaker line ("ROMEO:\n", ...) the
    passage is the model's own greedy continuation of it (`--passage-tokens`); the prompt is the line,
    the passage, then the line again, so the model's answer repeats text the prompt holds (the model
    writes what it wrote after that line before). The 4-layer model does not copy an arbitrary passage
    (see `repeat`), but it does reproduce its own.
  * `repeat`: a fixed Shakespeare passage repeated three times, which the model mostly does not copy
    (it drafts once its own text repeats itself): the workload before `rewrite`, kept for comparison.
Draft model (`--draft`): the shipped `default-draft` proposes for the speaker lines, greedy and sampled
(temperature 0.8, unseeded: the cost gate does not decide for a seeded request), at batch 1 and batch 8
(`disable_by_batch_size`'s default), with its per-step cost gate (`disable_by_cost`, the default for a
draft model) and without it (`"disable_by_cost": false`, every step drafts).
Batched (`--batched`): 64 `rewrite` prompts at once: no speculation, n-gram with the default
`disable_by_batch_size` (8: drafting off while more run), n-gram forced on (`disable_by_batch_size` 64:
verify rows in a compute-bound batch) and the `default-draft` model at the default threshold, each in a
process of its own, alternated over `--rounds`: median and spread per configuration, ratio of medians.

    python benchmarks/spec_decode.py [--k 4] [--max-tokens 128] [--repeats 3] [--num-threads N] [--json]
    python benchmarks/spec_decode.py --draft [--draft-k 2] [--max-tokens 96] [--json]
    python benchmarks/spec_decode.py --batched [--k 4] [--max-tokens 64] [--rounds 7] [--configs none,ngram,...] [--json]
    python benchmarks/spec_decode.py --quick [--draft | --batched]   # a small run that checks it all works

The batch-1 and draft modes build their engines once and interleave their passes (A B A B ...), best
of `--repeats` each, so a load change on a shared host hits every side alike. It prints wall-clock tokens/s and
tokens per CPU second (process time: on a shared host a pass waits for the cores far longer than it
computes; with `--num-threads 1` CPU seconds are a load-independent measure), both speed-ups, the
acceptance rate (accepted / drafted tokens), the mean accepted length (tokens per verify row, the
model's own token included), the share of output tokens that came from accepted drafts, and whether
greedy outputs are identical with and without speculation. Acceptance does not depend on the host's
load; the rates do, so compare them on an idle host.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from statistics import median
from typing import Optional

from llmctl.engine import LLM, SamplingParams

PASSAGE = ("ROMEO: But, soft! what light through yonder window breaks? It is the east, and Juliet is the sun. "
           "Arise, fair sun, and kill the envious moon, who is already sick and pale with grief.\n")
SPEAKERS = ["ROMEO:\n", "JULIET:\n", "First Citizen:\n", "KING RICHARD III:\n", "MENENIUS:\n", "NURSE:\n",
            "GLOUCESTER:\n", "QUEEN ELIZABETH:\n"]
MAX_MODEL_LEN = 512


def ngram_config(k: int, **extra) -> dict:
    return {"method": "ngram", "num_speculative_tokens": k, "prompt_lookup_max": 4, "prompt_lookup_min": 2, **extra}


def make_engine(speculative: Optional[dict], num_threads: Optional[int], max_num_seqs: int = 256) -> LLM:
    return LLM(device="cpu", max_model_len=MAX_MODEL_LEN, max_num_seqs=max_num_seqs, num_threads=num_threads,
               **({"speculative_config": speculative} if speculative else {}))


def rewrite_prompts(num_threads: Optional[int], count: int, passage_tokens: int) -> list[list[int]]:
    """`count` prompts (speaker lines cycled): the line, the model's greedy continuation of it, the line
    again (token ids, so the passage is exactly the tokens the model wrote). Written by an engine of its own:
    in a measured engine its prefix cache would then hold the passage's K/V from one-token decodes, which
    differ in bf16 from the other engine's prefill of the same tokens, and the outputs compared would not
    start from the same state."""
    llm = make_engine(None, num_threads)
    lines = [llm.engine.tokenizer.encode(s) for s in SPEAKERS[:count]]
    greedy = SamplingParams(temperature=0.0, max_tokens=passage_tokens, ignore_eos=True)
    passages = [o.outputs[0].token_ids for o in llm.generate(lines, greedy)]
    prompts = [line + passage + line for line, passage in zip(lines, passages)]
    return [prompts[i % len(prompts)] for i in range(count)]


def measure(engines: dict[str, LLM], prompts: list, params: SamplingParams, repeats: int) -> dict[str, dict]:
    """Per engine: best-of-`repeats` wall and CPU seconds over `prompts` (all at once), passes
    interleaved; output token count, outputs, and the spec-decode counters of the timed passes."""
    for llm in engines.values():
        llm.generate(prompts[:4], SamplingParams(temperature=0.0, max_tokens=8))  # warm-up
    before = {name: llm.engine.get_stats() for name, llm in engines.items()}
    result = {name: {"wall": float("inf"), "cpu": float("inf")} for name in engines}
    for _ in range(repeats):
        for name, llm in engines.items():
            start, cpu_start = time.perf_counter(), time.process_time()
            outputs = llm.generate(prompts, params)
            wall, cpu = time.perf_counter() - start, time.process_time() - cpu_start
            r = result[name]
            r["wall"], r["cpu"] = min(r["wall"], wall), min(r["cpu"], cpu)
            r["tokens"] = [o.outputs[0].token_ids for o in outputs]
    for name, llm in engines.items():
        stats = llm.engine.get_stats()
        result[name].update({key: stats[key] - before[name][key] for key in (
            "spec_decode_num_drafts", "spec_decode_num_draft_tokens", "spec_decode_num_accepted_tokens")})
    return result


def summary(result: dict[str, dict], name: str, base: str, greedy: bool, repeats: int) -> dict:
    """One engine's row against the `base` engine's: both rates, speed-ups and acceptance."""
    r, b = result[name], result[base]
    tokens, base_tokens = sum(map(len, r["tokens"])), sum(map(len, b["tokens"]))
    drafts, drafted = r["spec_decode_num_drafts"], r["spec_decode_num_draft_tokens"]
    accepted = r["spec_decode_num_accepted_tokens"]
    tok_s, cpu_tok_s = tokens / r["wall"], tokens / r["cpu"]
    base_tok_s, base_cpu_tok_s = base_tokens / b["wall"], base_tokens / b["cpu"]
    return {"run": name, "no_spec_tok_s": round(base_tok_s, 1), "no_spec_tok_per_cpu_s": round(base_cpu_tok_s, 1),
            "tok_s": round(tok_s, 1), "speedup": round(tok_s / base_tok_s, 3),
            "tok_per_cpu_s": round(cpu_tok_s, 1), "cpu_speedup": round(cpu_tok_s / base_cpu_tok_s, 3),
            "num_drafts": drafts // repeats,
            "acceptance_rate": round(accepted / drafted, 3) if drafted else None,
            "mean_accepted_length": round(1 + accepted / drafts, 2) if drafts else None,
            # Of the output tokens, the share that accepted drafts supplied (the rest: one per step).
            "drafted_share": round(accepted / (tokens * repeats), 3),
            # Sampled outputs differ run to run by design (the same distribution, not the same draws).
            "outputs_identical": r["tokens"] == b["tokens"] if greedy else None}


def ngram_rows(args) -> list[dict]:
    engines = {"no speculation": make_engine(None, args.num_threads),
               "n-gram": make_engine(ngram_config(args.k), args.num_threads),
               "n-gram, disable_by_cost": make_engine(ngram_config(args.k, disable_by_cost=True), args.num_threads)}
    params = SamplingParams(temperature=0.0, max_tokens=args.max_tokens, ignore_eos=True)
    workloads = {"rewrite": rewrite_prompts(args.num_threads, args.prompts, args.passage_tokens),
                 "repeat": [PASSAGE * 3]}
    rows = []
    for workload, prompts in workloads.items():
        # Batch 1: one prompt at a time, each timed as its own pass.
        per_prompt = [measure(engines, [prompt], params, args.repeats) for prompt in prompts]
        merged = {name: {key: (sum(p[name][key] for p in per_prompt) if key != "tokens"
                               else [t for p in per_prompt for t in p[name]["tokens"]])
                         for key in per_prompt[0][name]} for name in engines}
        rows += [{"workload": workload, "batch": 1, "prompts": len(prompts), "k": args.k,
                  **summary(merged, name, "no speculation", True, args.repeats)} for name in list(engines)[1:]]
    return rows


def draft_rows(args) -> list[dict]:
    config = {"model": "default-draft", "num_speculative_tokens": args.draft_k}
    engines = {"no speculation": make_engine(None, args.num_threads),
               "draft model": make_engine(config, args.num_threads),  # the cost gate on: the default
               "draft model, disable_by_cost false": make_engine({**config, "disable_by_cost": False},
                                                                 args.num_threads)}
    rows = []
    for batch in sorted({1, args.prompts}):
        for temperature in (0.0, 0.8):
            params = SamplingParams(temperature=temperature, max_tokens=args.max_tokens, ignore_eos=True)
            result = measure(engines, SPEAKERS[:batch], params, args.repeats)
            rows += [{"batch": batch, "temperature": temperature, "k": args.draft_k,
                      **summary(result, name, "no speculation", params.greedy, args.repeats)}
                     for name in list(engines)[1:]]
    return rows


BATCHED_CONFIGS = ("none", "ngram", "ngram-forced", "ngram-gated", "draft")
DEFAULT_BATCHED = "none,ngram,ngram-forced,draft"


def batched_configs(args) -> dict[str, tuple[str, Optional[dict]]]:
    """--batched's configurations by short name: (label, speculative_config)."""
    table = {"none": ("no speculation", None),
             "ngram": ("n-gram, disable_by_batch_size 8 (default)", ngram_config(args.k)),
             "ngram-forced": (f"n-gram forced on (disable_by_batch_size {args.batch}, disable_by_cost false)",
                              ngram_config(args.k, disable_by_batch_size=args.batch, disable_by_cost=False)),
             "ngram-gated": (f"n-gram, disable_by_batch_size {args.batch}, disable_by_cost true",
                             ngram_config(args.k, disable_by_batch_size=args.batch, disable_by_cost=True)),
             "draft": (f"draft model default-draft, k={args.draft_k}, disable_by_batch_size 8 (default)",
                       {"model": "default-draft", "num_speculative_tokens": args.draft_k})}
    return {name: table[name] for name in args.configs}


def batched_worker(args) -> None:
    """One configuration's timed pass in a process of its own (--batched runs one per configuration and
    round): the engine built, a warm-up on the speaker lines alone (their prompts' passages stay out of the
    prefix cache, so every pass prefills alike), then all prompts at once. Prints one JSON line."""
    speculative = json.loads(args.worker_config)
    prompts = json.loads(Path(args.prompts_file).read_text())
    llm = make_engine(speculative, args.num_threads, max_num_seqs=args.batch)
    lines = [llm.engine.tokenizer.encode(s) for s in SPEAKERS]
    llm.generate(lines, SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True))
    before = llm.engine.get_stats()
    params = SamplingParams(temperature=0.0, max_tokens=args.max_tokens, ignore_eos=True)
    start, cpu_start = time.perf_counter(), time.process_time()
    outputs = llm.generate(prompts, params)
    wall, cpu = time.perf_counter() - start, time.process_time() - cpu_start
    stats = llm.engine.get_stats()
    print(json.dumps({"wall": wall, "cpu": cpu, "tokens": [o.outputs[0].token_ids for o in outputs],
                      **{key: stats[key] - before[key] for key in (
                          "spec_decode_num_drafts", "spec_decode_num_draft_tokens",
                          "spec_decode_num_accepted_tokens")}}))


def run_worker(args, speculative: Optional[dict], prompts_file: Path) -> dict:
    command = [sys.executable, __file__, "--batched-worker", "--worker-config", json.dumps(speculative),
               "--prompts-file", str(prompts_file), "--max-tokens", str(args.max_tokens), "--batch", str(args.batch)]
    if args.num_threads is not None:
        command += ["--num-threads", str(args.num_threads)]
    done = subprocess.run(command, capture_output=True, text=True)
    if done.returncode != 0:
        raise SystemExit(f"the worker for {json.dumps(speculative)} failed:\n{done.stderr[-3000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def batched_rows(args) -> list[dict]:
    """Each configuration in a process of its own, alternated over rounds (A B C D A B C D ...) on the
    same prompts: three engines in one process differed by 3 % even when identical, which hid a 5 % goal.
    Per configuration the median and spread of its rounds' rates and the ratio of medians."""
    configs = batched_configs(args)
    prompts = rewrite_prompts(args.num_threads, args.batch, args.passage_tokens)
    passes: dict[str, list[dict]] = {name: [] for name in configs}
    with tempfile.TemporaryDirectory() as folder:
        prompts_file = Path(folder) / "prompts.json"
        prompts_file.write_text(json.dumps(prompts))
        for round_index in range(args.rounds):
            for name, (_, speculative) in configs.items():
                passes[name].append(run_worker(args, speculative, prompts_file))
                if not args.json:
                    r = passes[name][-1]
                    print(f"round {round_index + 1}/{args.rounds} {name}: "
                          f"{sum(map(len, r['tokens'])) / r['wall']:.1f} tok/s", file=sys.stderr, flush=True)
    reference = passes[next(iter(configs))]
    base = _rates(reference)
    rows = []
    for name, (label, _) in configs.items():
        rates, drafts = _rates(passes[name]), passes[name]
        drafted = sum(p["spec_decode_num_draft_tokens"] for p in drafts)
        accepted = sum(p["spec_decode_num_accepted_tokens"] for p in drafts)
        verify_rows = sum(p["spec_decode_num_drafts"] for p in drafts)
        tokens = sum(len(t) for p in drafts for t in p["tokens"])
        rows.append({"batch": len(prompts), "run": label, "config": name, "rounds": args.rounds,
                     "tok_s_median": round(median(rates["wall"]), 1),
                     "tok_s_min": round(min(rates["wall"]), 1), "tok_s_max": round(max(rates["wall"]), 1),
                     "tok_s_spread": round((max(rates["wall"]) - min(rates["wall"])) / median(rates["wall"]), 3),
                     "tok_per_cpu_s_median": round(median(rates["cpu"]), 1),
                     "speedup": round(median(rates["wall"]) / median(base["wall"]), 3),
                     "cpu_speedup": round(median(rates["cpu"]) / median(base["cpu"]), 3),
                     "verify_rows_per_pass": verify_rows / args.rounds,
                     "acceptance_rate": round(accepted / drafted, 3) if drafted else None,
                     "mean_accepted_length": round(1 + accepted / verify_rows, 2) if verify_rows else None,
                     "drafted_share": round(accepted / tokens, 3),
                     "outputs_identical": all(p["tokens"] == reference[0]["tokens"] for p in drafts)})
    return rows


def _rates(passes: list[dict]) -> dict[str, list[float]]:
    tokens = [sum(map(len, p["tokens"])) for p in passes]
    return {"wall": [t / p["wall"] for t, p in zip(tokens, passes)],
            "cpu": [t / p["cpu"] for t, p in zip(tokens, passes)]}


def print_batched(rows: list[dict], args) -> None:
    for r in rows:
        print(f"batch {r['batch']}, {args.max_tokens} tokens, {r['rounds']} rounds, {r['run']}: median "
              f"{r['tok_s_median']} tok/s (min {r['tok_s_min']}, max {r['tok_s_max']}, spread {r['tok_s_spread']}), "
              f"{r['tok_per_cpu_s_median']} tok per CPU s; ratio of medians {r['speedup']}x wall, "
              f"{r['cpu_speedup']}x CPU; verify rows per pass {r['verify_rows_per_pass']}, acceptance "
              f"{r['acceptance_rate']}, mean accepted length {r['mean_accepted_length']}, drafted share "
              f"{r['drafted_share']}; outputs identical to the first config's: {r['outputs_identical']}")


def print_rows(rows: list[dict], args) -> None:
    for r in rows:
        where = (f"{r['workload']}, batch 1 ({r['prompts']} prompts)" if "workload" in r
                 else f"batch {r['batch']}" + (f", temperature {r['temperature']}" if "temperature" in r else ""))
        print(f"{where}, {args.max_tokens} tokens, k={r['k']}, {r['run']}: {r['tok_s']} tok/s against "
              f"{r['no_spec_tok_s']} ({r['speedup']}x), {r['tok_per_cpu_s']} tok per CPU s against "
              f"{r['no_spec_tok_per_cpu_s']} ({r['cpu_speedup']}x); verify rows per pass {r['num_drafts']}, "
              f"acceptance {r['acceptance_rate']}, mean accepted length {r['mean_accepted_length']}, "
              f"drafted share {r['drafted_share']}; outputs identical: {r['outputs_identical']}")


def parse_args(argv: Optional[list[str]] = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--k", type=int, default=4, help="num_speculative_tokens (n-gram)")
    parser.add_argument("--draft", action="store_true", help="the default-draft model on Shakespeare speaker lines")
    parser.add_argument("--draft-k", type=int, default=2, help="num_speculative_tokens (draft model)")
    parser.add_argument("--batched", action="store_true", help="64 sequences: n-gram off by batch size, and forced on")
    parser.add_argument("--num-threads", type=int, default=None,
                        help="torch threads (1 makes CPU seconds a load-independent measure)")
    parser.add_argument("--max-tokens", type=int, default=None, help="output tokens per prompt (default 128; "
                        "--draft 96, --batched 64)")
    parser.add_argument("--passage-tokens", type=int, default=128, help="the rewrite workload's passage length")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--rounds", type=int, default=7, help="--batched: rounds, each running every "
                        "configuration once in a process of its own (median and spread over them)")
    parser.add_argument("--configs", default=DEFAULT_BATCHED,
                        help=f"--batched: which configurations, comma-separated, the first the reference "
                        f"(default {DEFAULT_BATCHED}; also ngram-gated: the threshold lifted, the cost gate on)")
    parser.add_argument("--batch", type=int, default=64, help="--batched: sequences at once")
    parser.add_argument("--batched-worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--worker-config", help=argparse.SUPPRESS)
    parser.add_argument("--prompts-file", help=argparse.SUPPRESS)
    parser.add_argument("--quick", action="store_true",
                        help="small settings (a minute or two on a busy 2-core host): checks the script runs end to end")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args(argv)
    default_tokens = 64 if args.batched else 96 if args.draft else 128
    args.prompts = len(SPEAKERS)
    args.configs = [name.strip() for name in args.configs.split(",") if name.strip()]
    unknown = sorted(set(args.configs) - set(BATCHED_CONFIGS))
    if unknown or not args.configs:
        parser.error(f"--configs: unknown {', '.join(unknown) or 'empty list'} (known: {', '.join(BATCHED_CONFIGS)})")
    if args.rounds < 1 or args.batch < 1:
        parser.error("--rounds and --batch must be at least 1")
    if args.quick:
        args.max_tokens, args.passage_tokens, args.repeats = args.max_tokens or 16, 32, 1
        args.prompts, args.batch, args.rounds = 2, 12, 2  # batched: above disable_by_batch_size 8, so its gate is exercised
    args.max_tokens = args.max_tokens or default_tokens
    return args


def main(argv: Optional[list[str]] = None) -> None:
    args = parse_args(argv)
    if args.batched_worker:
        batched_worker(args)
        return
    rows = batched_rows(args) if args.batched else draft_rows(args) if args.draft else ngram_rows(args)
    if args.json:
        print(json.dumps(rows))
    else:
        (print_batched if args.batched else print_rows)(rows, args)


if __name__ == "__main__":
    main()
