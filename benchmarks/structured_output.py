"""Structured outputs (xgrammar) on the embedded model (`llmctl/default_model`, vocabulary 2048): cost, compile
time and validity.

  * overhead: 64 requests at once, each with a JSON schema of its own (random, tests/json_schemas.py), against
    the same 64 prompts unconstrained, in one run, passes alternated over `--rounds`. A grammar ends outputs at
    different lengths, so the comparison is per decode step: the median wall time of the steps that ran all 64
    sequences, constrained / unconstrained (the grammar's cost: a bitmask per row, one masking pass, a
    matcher advance per token). Output tokens/s of each whole pass are printed beside it.
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
    """One batch to the end, step by step: the wall time of each step that ran all the sequences, tokens/s."""
    engine = llm.engine
    for i, (prompt, p) in enumerate(zip(prompts, params)):
        engine.add_request(f"bench-{time.monotonic_ns()}-{i}", prompt, p)
    full_steps, tokens, start = [], 0, time.perf_counter()
    while engine.has_unfinished_requests():
        running = len(engine.scheduler.running)
        step_start = time.perf_counter()
        info = engine.step()
        if running == len(prompts) and info.num_batched_tokens == len(prompts):  # a decode step of the whole batch
            full_steps.append(time.perf_counter() - step_start)
        tokens += sum(len(c.token_ids) for o in info.outputs if o.finished for c in o.outputs)
    wall = time.perf_counter() - start
    return {"full_step_ms": 1000 * median(full_steps) if full_steps else float("nan"),
            "full_steps": len(full_steps), "tokens_per_s": tokens / wall}


def overhead(llm: LLM, rounds: int, max_tokens: int) -> dict:
    schemas = random_schemas(BATCH)
    prompts = [f"Record {i}: " for i in range(BATCH)]
    plain = [SamplingParams(max_tokens=max_tokens, temperature=1.0, seed=i, ignore_eos=True) for i in range(BATCH)]
    constrained = [SamplingParams(max_tokens=max_tokens, temperature=1.0, seed=i,
                                  structured_outputs=StructuredOutputsParams(json=s)) for i, s in enumerate(schemas)]
    for schema in schemas:  # compiles are measured apart; here only the per-step cost
        llm.engine.structured_output.compile(StructuredOutputsParams(json=schema))
    timed_pass(llm, prompts[:8], plain[:8])  # warm-up
    runs: dict[str, list[dict]] = {"unconstrained": [], "json_schema": []}
    for _ in range(rounds):
        runs["unconstrained"].append(timed_pass(llm, prompts, plain))
        runs["json_schema"].append(timed_pass(llm, prompts, constrained))
    summary = {name: {"full_step_ms": median(r["full_step_ms"] for r in passes),
                      "tokens_per_s": median(r["tokens_per_s"] for r in passes),
                      "full_steps": [r["full_steps"] for r in passes]} for name, passes in runs.items()}
    summary["step_ratio"] = summary["json_schema"]["full_step_ms"] / summary["unconstrained"]["full_step_ms"]
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
        print(f"batch {BATCH} {name:>13}: {o[name]['full_step_ms']:.2f} ms per full-batch step "
              f"(steps {o[name]['full_steps']}), {o[name]['tokens_per_s']:.0f} output tokens/s")
    print(f"json_schema / unconstrained step time: {o['step_ratio']:.3f}")
    if args.validity:
        v = report["validity"]
        print(f"validity: {v['valid']}/{v['schemas']} valid, {v['ran_into_max_tokens']} ran into max_tokens, "
              f"{len(v['invalid'])} invalid")
        for bad in v["invalid"][:5]:
            print("  INVALID", json.dumps(bad)[:400])


if __name__ == "__main__":
    main()
