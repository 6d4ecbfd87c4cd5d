"""Structured outputs (xgrammar) on the embedded model (`llmctl/default_model`, vocabulary 2048): cost, compile
time and validity.

  * overhead: 64 requests at once, each with a JSON schema of its own (random, tests/json_schemas.py), against
    the same 64 prompts unconstrained, in one run, passes alternated over `--rounds`. A grammar ends outputs at
    different lengths, so each unconstrained pass gives every request the length its constrained output had
    (max_tokens, ignore_eos): the same batch sizes step for step, and the wall-time ratio is the grammar's cost
    (a bitmask per row, one masking pass, a matcher advance per token).
  * compile: p50 / p99 of the compile time of `--schemas` distinct random schemas (one compile each, cached by spec).
  * validity (`--validity N`): N random schemas, sampled, batched; every output must parse and validate under
    jsonschema (an output that ran into max_tokens is counted apart: that is the model's length, not the grammar).

    python benchmarks/structured_output.py [--rounds 3] [--max-tokens 48] [--schemas 200] [--validity 200] [--json]
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from statistics import median, quantiles

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))  # the random-schema strategy

from hypothesis import HealthCheck, Phase, given, settings  # noqa: E402

from json_schemas import json_schemas  # noqa: E402
from llmctl.engine import LLM, SamplingParams  # noqa: E402
from llmctl.engine.sampling_params import StructuredOutputsParams  # noqa: E402

BATCH = 64


def random_schemas(count: int) -> list[dict]:
    """The first `count` distinct schemas of one derandomized hypothesis stream (the same in every run)."""
    drawn: dict[str, dict] = {}

    @settings(max_examples=4 * count, database=None, derandomize=True, deadline=None, phases=[Phase.generate],
              suppress_health_check=list(HealthCheck))
    @given(json_schemas())
    def draw(schema: dict) -> None:
        if len(drawn) < count:
            drawn.setdefault(json.dumps(schema, sort_keys=True), schema)

    draw()
    return list(drawn.values())


def timed_pass(llm: LLM, prompts: list[str], params: list[SamplingParams]) -> dict:
    """One batch to the end: wall seconds, output tokens, each request's output length."""
    start = time.perf_counter()
    outputs = llm.generate(prompts, params)
    wall = time.perf_counter() - start
    lengths = [len(o.outputs[0].token_ids) for o in outputs]
    return {"wall_s": wall, "tokens": sum(lengths), "lengths": lengths}


def overhead(llm: LLM, rounds: int, max_tokens: int) -> dict:
    """Constrained, then unconstrained with each request's max_tokens set to the length its constrained output
    had (ignore_eos): both passes run the same batch sizes step for step, so their wall times compare directly."""
    schemas = random_schemas(BATCH)
    prompts = [f"Record {i}: " for i in range(BATCH)]
    constrained = [SamplingParams(max_tokens=max_tokens, temperature=1.0, seed=i,
                                  structured_outputs=StructuredOutputsParams(json=s)) for i, s in enumerate(schemas)]
    for schema in schemas:  # compiles are measured apart; here only the per-step cost
        llm.engine.structured_output.compile(StructuredOutputsParams(json=schema))
    timed_pass(llm, prompts[:8], constrained[:8])  # warm-up
    runs: dict[str, list[dict]] = {"json_schema": [], "unconstrained": []}
    for _ in range(rounds):
        runs["json_schema"].append(timed_pass(llm, prompts, constrained))
        lengths = runs["json_schema"][-1]["lengths"]
        plain = [SamplingParams(max_tokens=n, temperature=1.0, seed=i, ignore_eos=True) for i, n in enumerate(lengths)]
        runs["unconstrained"].append(timed_pass(llm, prompts, plain))
    summary = {name: {"wall_s": [round(r["wall_s"], 3) for r in passes],
                      "tokens_per_s": median(r["tokens"] / r["wall_s"] for r in passes)} for name, passes in runs.items()}
    summary["slowdown"] = median(c["wall_s"] / u["wall_s"] for c, u in zip(runs["json_schema"], runs["unconstrained"]))
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
    parser.add_argument("--rounds", type=int, default=3)
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
        print(f"batch {BATCH} {name:>13}: passes {o[name]['wall_s']} s, {o[name]['tokens_per_s']:.1f} output tokens/s")
    print(f"json_schema / unconstrained wall time (same output lengths): {o['slowdown']:.3f}")
    if args.validity:
        v = report["validity"]
        print(f"validity: {v['valid']}/{v['schemas']} valid, {v['ran_into_max_tokens']} ran into max_tokens, "
              f"{len(v['invalid'])} invalid")
        for bad in v["invalid"][:5]:
            print("  INVALID", json.dumps(bad)[:400])


if __name__ == "__main__":
    main()
