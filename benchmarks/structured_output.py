"""Structured outputs (xgrammar) on the embedded model (`llmctl/default_model`, vocabulary 2048): cost, compile
time and validity.

  * overhead: 64 requests at once, each with a JSON schema of its own (random, tests/json_schemas.py), against
    the same 64 prompts unconstrained, in one run, passes alternated over `--rounds`. A grammar ends outputs at
    different lengths, so each unconstrained pass gives every request the length its constrained output had
    (max_tokens, ignore_eos): the same batch sizes step for step, and the time ratio is the grammar's cost
    (a batch bitmask fill, one masking pass, a matcher advance per token). Which pass runs first alternates by
    round; both the wall time and this process's CPU time are reported, the median ratio over rounds of each
    (on a shared host other tenants' load lands in the wall time, far less in the CPU time).
  * compile: p50 / p99 of the compile time of `--schemas` distinct random schemas (one compile each, cached by spec).
  * validity (`--validity N`): N random schemas, sampled, batched; every output must parse and validate under
    jsonschema (an output that ran into max_tokens is counted apart: that is the model's length, not the grammar).

    python benchmarks/structured_output.py [--rounds 4] [--max-tokens 48] [--schemas 200] [--validity 200] [--json]
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from statistics import median, quantiles

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))  # the random-schema strategy

from json_schemas import random_schemas  # noqa: E402
from llmctl.engine import LLM, SamplingParams  # noqa: E402
from llmctl.engine.sampling_params import StructuredOutputsParams  # noqa: E402

BATCH = 64


def timed_pass(llm: LLM, prompts: list[str], params: list[SamplingParams]) -> dict:
    """One batch to the end: wall and CPU seconds, output tokens, each request's output length."""
    start, cpu_start = time.perf_counter(), time.process_time()
    outputs = llm.generate(prompts, params)
    wall, cpu = time.perf_counter() - start, time.process_time() - cpu_start
    lengths = [len(o.outputs[0].token_ids) for o in outputs]
    return {"wall_s": wall, "cpu_s": cpu, "tokens": sum(lengths), "lengths": lengths}


def overhead(llm: LLM, rounds: int, max_tokens: int) -> dict:
    """Constrained, and unconstrained with each request's max_tokens set to the length its constrained output
    had (ignore_eos): both passes run the same batch sizes step for step, so their times compare directly."""
    schemas = random_schemas(BATCH)
    prompts = [f"Record {i}: " for i in range(BATCH)]
    constrained = [SamplingParams(max_tokens=max_tokens, temperature=1.0, seed=i,
                                  structured_outputs=StructuredOutputsParams(json=s)) for i, s in enumerate(schemas)]
    for schema in schemas:  # compiles are measured apart; here only the per-step cost
        llm.engine.structured_output.compile(StructuredOutputsParams(json=schema))
    timed_pass(llm, prompts[:8], constrained[:8])  # warm-up
    runs: dict[str, list[dict]] = {"json_schema": [timed_pass(llm, prompts, constrained)], "unconstrained": []}
    lengths = runs["json_schema"][0]["lengths"]  # seeded: every constrained pass gives these
    plain = [SamplingParams(max_tokens=n, temperature=1.0, seed=i, ignore_eos=True) for i, n in enumerate(lengths)]
    runs["unconstrained"].append(timed_pass(llm, prompts, plain))
    for _ in range(rounds - 1):  # the first round ran the constrained pass first: the next one runs it second
        order = [("unconstrained", plain), ("json_schema", constrained)]
        for name, params in order if len(runs["json_schema"]) % 2 else order[::-1]:
            runs[name].append(timed_pass(llm, prompts, params))
        assert runs["json_schema"][-1]["lengths"] == lengths, "seeded constrained passes must repeat"
    summary = {name: {"wall_s": [round(r["wall_s"], 3) for r in passes], "cpu_s": [round(r["cpu_s"], 3) for r in passes],
                      "tokens_per_s": median(r["tokens"] / r["wall_s"] for r in passes)} for name, passes in runs.items()}
    for clock in ("wall_s", "cpu_s"):
        summary[f"slowdown_{clock[:-2]}"] = median(
            c[clock] / u[clock] for c, u in zip(runs["json_schema"], runs["unconstrained"]))
    return summary


def compile_times(llm: LLM, count: int) -> dict:
    manager = llm.engine.structured_output
    before = len(manager.compile_seconds)
    for schema in random_schemas(count):
        manager.compile(StructuredOutputsParams(json=schema))
    seconds = manager.compile_seconds[before:]
    cuts = quantiles(seconds, n=100, method="inclusive")
    return {"schemas": len(seconds), "p50_ms": 1000 * cuts[49], "p99_ms": 1000 * cuts[98], "max_ms": 1000 * max(seconds)}


def validity(llm: LLM, count: int, max_tokens: int) -> dict:
    import jsonschema

    schemas = random_schemas(count)
    params = [SamplingParams(max_tokens=max_tokens, temperature=1.0, seed=i,
                             structured_outputs=StructuredOutputsParams(json=s)) for i, s in enumerate(schemas)]
    outputs = llm.generate([f"Answer {i}: " for i in range(count)], params)
    valid, length, invalid = 0, 0, []
    for schema, out in zip(schemas, outputs):
        completion = out.outputs[0]
        if completion.finish_reason == "length":
            length += 1
            continue
        try:
            jsonschema.validate(json.loads(completion.text), schema)
            valid += 1
        except (ValueError, jsonschema.ValidationError) as exc:
            invalid.append({"schema": schema, "text": completion.text, "error": str(exc)[:200]})
    return {"schemas": count, "valid": valid, "ran_into_max_tokens": length, "invalid": invalid}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("--max-tokens", type=int, default=48)
    parser.add_argument("--schemas", type=int, default=200, help="random schemas whose compile time is measured")
    parser.add_argument("--validity", type=int, default=0, help="random schemas to generate and validate (0: skip)")
    parser.add_argument("--num-threads", type=int, default=None)
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    llm = LLM(device="cpu", max_num_seqs=max(BATCH, args.validity), max_model_len=512, num_threads=args.num_threads)
    report = {"compile": compile_times(llm, args.schemas), "overhead": overhead(llm, args.rounds, args.max_tokens)}
    if args.validity:
        report["validity"] = validity(llm, args.validity, max_tokens=400)
    if args.json:
        print(json.dumps(report, indent=2))
        return
    c, o = report["compile"], report["overhead"]
    print(f"compile ({c['schemas']} schemas, vocab {llm.engine.vocab_size}): p50 {c['p50_ms']:.2f} ms, "
          f"p99 {c['p99_ms']:.2f} ms, max {c['max_ms']:.2f} ms")
    for name in ("unconstrained", "json_schema"):
        print(f"batch {BATCH} {name:>13}: passes {o[name]['wall_s']} s wall, {o[name]['cpu_s']} s CPU, "
              f"{o[name]['tokens_per_s']:.1f} output tokens/s")
    print(f"json_schema / unconstrained (same output lengths), median over rounds: wall time {o['slowdown_wall']:.3f}, "
          f"CPU time {o['slowdown_cpu']:.3f}")
    if args.validity:
        v = report["validity"]
        print(f"validity: {v['valid']}/{v['schemas']} valid, {v['ran_into_max_tokens']} ran into max_tokens, "
              f"{len(v['invalid'])} invalid")
        for bad in v["invalid"][:5]:
            print("  INVALID", json.dumps(bad)[:400])


if __name__ == "__main__":
    main()
