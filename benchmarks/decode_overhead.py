"""Where a batch-1 decode step's CPU time goes, outside the weight streaming.

Runs the engine on offline_throughput.py's SmolLM-135M shape (random weights; `--model` takes another
folder or a GGUF file; `--quantization` quantises it on the fly), one 128-token prompt, greedy, one torch thread, and times decode steps in CPU time of the
calling thread (`time.thread_time_ns`: descheduling on a shared host is not counted), best of
`--repeats` passes. Two kinds of pass:

- plain: `LLMEngine.step()` alone, nothing instrumented (the real per-step cost);
- split: the same steps with timers around the engine's parts (schedule, prepare, the native step or the forward, in it
  the linears, attention, the rest of the model; sample; update_from_output + detokenize + outputs).
  The timers cost ~0.5 us each (~170 per step on the Python forward).

Both for the native step (`ModelRunner.native_decode`: the whole forward in one C call) and for the
model's Python forward, interleaved; beside them the linears alone (the step's weight streaming).

`--streaming` measures instead what issue 15's goal asks for: the rate at which a batch-1 token's weights
stream. Wall-clock time of native decode steps (the whole engine step, sampling and scheduling included),
the bytes of every linear's operands as stored (bf16 weights; codes, scales and zero points), and the
machine's read bandwidth as `llmctl bench --cpu` measures it, taken between the passes so both see the same
moment of a shared host; the figure is each pass's bytes / median step time over the read bandwidth measured
right after it, the median of the passes'.

    python benchmarks/decode_overhead.py [--steps 64] [--repeats 5] [--quantization int4-g32] [--json]
    python benchmarks/decode_overhead.py --streaming --threads 2 [--quantization int8|int4-g32] [--repeats 7]
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from collections import defaultdict
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))


class Timers:
    """Thread CPU time per named part; nested parts are subtracted from their parent's own time."""

    def __init__(self):
        self.total = defaultdict(int)
        self.stack: list[list] = []

    def wrap(self, owner, name: str, part: str) -> None:
        original = getattr(owner, name)
        timers = self

        def timed(*args, **kwargs):
            frame = [part, 0]  # [part, time of nested parts]
            timers.stack.append(frame)
            start = time.thread_time_ns()
            try:
                return original(*args, **kwargs)
            finally:
                spent = time.thread_time_ns() - start
                timers.stack.pop()
                timers.total[part] += spent - frame[1]
                if timers.stack:
                    timers.stack[-1][1] += spent

        setattr(owner, name, timed)


def instrument(engine) -> Timers:
    from llmctl.engine.layers.linear import LinearBase

    timers = Timers()
    runner = engine.executor.runner
    timers.wrap(engine.scheduler, "schedule", "schedule")
    timers.wrap(engine.scheduler, "update_from_output", "update_from_output")
    timers.wrap(engine, "_detokenize", "detokenize")
    timers.wrap(engine, "_output", "outputs")
    timers.wrap(runner, "prepare", "prepare")
    timers.wrap(runner, "_run", "forward (rest)")  # execute's own calls (forward and sample are the driver's)
    timers.wrap(runner, "_native_step", "native step")
    timers.wrap(runner, "_sample", "sample")
    timers.wrap(runner.attention, "build_metadata", "attention metadata")
    timers.wrap(runner.attention, "forward", "attention")
    for module in runner.model.modules():
        if isinstance(module, LinearBase):
            timers.wrap(module, "forward", "lm_head" if module is runner.model.lm_head else "linears")
    return timers


def decode_steps(engine, prompt: list[int], steps: int, timers: "Timers | None" = None,
                 clock=time.thread_time_ns) -> list[int]:
    """`clock` ns (thread CPU time unless told) of each decode step of one request (the prefill step excluded,
    from `timers` too)."""
    from llmctl.engine.sampling_params import RequestOutputKind, SamplingParams

    # FINAL_ONLY, as `LLM.generate` and the server's non-streaming requests run (no output object per step)
    engine.add_request(f"r{time.monotonic_ns()}", prompt,
                       SamplingParams(temperature=0, max_tokens=steps + 1, ignore_eos=True,
                                      output_kind=RequestOutputKind.FINAL_ONLY))
    engine.step()  # prefill + first token
    if timers is not None:
        timers.total.clear()
    times = []
    while engine.has_unfinished_requests():
        start = clock()
        engine.step()
        times.append(clock() - start)
    return times


def gemv_floor(runner, repeats: int) -> float:
    """Thread CPU ns of the step's linears alone: every linear's native single-row kernel (the dpbf16 GEMV,
    the AMX kernel or the quantised GEMV) on its own weight, in the forward's order, back to back (the weights stream from
    DRAM as in a step: they exceed the LLC)."""
    import torch

    from llmctl.engine.layers.linear import LinearBase

    kernels = runner.attention.native_decode_kernels()
    linears = [m for m in runner.model.modules() if isinstance(m, LinearBase) and m is not runner.model.lm_head]
    linears.append(runner.model.lm_head)
    calls = []
    for linear in linears:
        kind, weight, bias = linear.method.native_row_operands(linear)
        x = torch.randn(1, linear.in_features).bfloat16()
        if kind == "amx":
            calls.append(lambda w=weight, x=x, n=linear.out_features, b=bias: kernels.gemm_amx(w, x, n, b))
        elif kind == "quant":  # a weight in parts (KernelParts) is one GEMV per part, as the native step runs it
            for part, start in zip(weight.weight.parts, weight.weight.starts):
                part_bias = bias[start:start + part.out_features] if bias is not None else None
                calls.append(lambda w=weight, p=part, x=x, b=part_bias: w.kernels.gemv(p, x, b))
        else:
            calls.append(lambda w=weight, x=x, b=bias: kernels.gemv(w, x, b))
    best = None
    for _ in range(repeats):
        start = time.thread_time_ns()
        for call in calls:
            call()
        spent = time.thread_time_ns() - start
        best = spent if best is None else min(best, spent)
    return best


def median(values: list[int]) -> int:
    return sorted(values)[len(values) // 2]


def weight_bytes_per_token(runner) -> int:
    """Bytes of every linear's native row operands as stored (what a batch-1 step reads of the weights)."""
    from llmctl.engine.layers.linear import LinearBase

    total = 0
    for linear in runner.model.modules():
        if not isinstance(linear, LinearBase):
            continue
        kind, operand, bias = linear.method.native_row_operands(linear)
        tensors = [operand.weight.codes, operand.weight.scales, operand.weight.zeros] if kind == "quant" else [operand]
        total += sum(t.numel() * t.element_size() for t in tensors + [bias] if t is not None)
    return total


def streaming(engine, prompt: list[int], args) -> dict:
    """Native batch-1 steps' weight streaming rate against the read bandwidth, passes and bandwidth
    measurements alternated."""
    import statistics

    from quantization import read_bandwidth_gbs

    runner = engine.executor.runner
    step_ns, bandwidths = [], []
    for _ in range(args.repeats):
        step_ns.append(median(decode_steps(engine, prompt, args.steps, clock=time.perf_counter_ns)))
        bandwidths.append(read_bandwidth_gbs(warmup_s=0.2, reps=5))
    weights = weight_bytes_per_token(runner)
    step_s, bandwidth = statistics.median(step_ns) / 1e9, statistics.median(bandwidths)
    fractions = [weights / ns / bw for ns, bw in zip(step_ns, bandwidths)]  # GB/s over GB/s, pass by pass
    return {"quantization": args.quantization, "threads": args.threads, "native_step": runner.native_decode is not None,
            "weight_bytes_per_token": weights, "step_ms_per_pass": [round(ns / 1e6, 3) for ns in step_ns],
            "read_gbs_per_pass": [round(b, 1) for b in bandwidths], "step_ms": round(step_s * 1e3, 3),
            "streamed_gbs": round(weights / step_s / 1e9, 1), "read_gbs": round(bandwidth, 1),
            "fraction_per_pass": [round(f, 3) for f in fractions], "fraction": round(statistics.median(fractions), 3)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=None, help="model folder (default: SmolLM-135M shape, random bf16)")
    parser.add_argument("--steps", type=int, default=64, help="decode steps per pass")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--quantization", default=None,
                        help="--quantization of the engine (int8, int4-g32, int4-g32-asym, ...; default: none, bf16); "
                             "a GGUF --model runs its own quantisation")
    parser.add_argument("--streaming", action="store_true",
                        help="wall-clock native steps: the weights' streaming rate against the read bandwidth")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()

    import torch

    from llmctl.engine import EngineArgs, LLMEngine

    folder, scratch = args.model, None
    if folder is None:
        from offline_throughput import make_model

        scratch = tempfile.TemporaryDirectory(prefix="decode-overhead-")  # removed at exit
        folder = str(make_model(Path(scratch.name), "bfloat16"))
    engine = LLMEngine(EngineArgs.from_dict(dict(model=folder, dtype="bfloat16", skip_tokenizer_init=True,
                                                 enable_prefix_caching=False, max_model_len=1024,
                                                 num_threads=args.threads, quantization=args.quantization)))
    runner = engine.executor.runner
    stack = runner.native_decode
    paths = {"native step": stack, "python forward": None} if stack is not None else {"python forward": None}
    torch.manual_seed(0)
    prompt = torch.randint(0, runner.config.model_config.vocab_size, (128,)).tolist()
    decode_steps(engine, prompt, 8)  # warm-up
    if args.streaming:
        report = streaming(engine, prompt, args)
        if args.json:
            print(json.dumps(report))
        else:
            print_streaming(report, args)
        return
    plain: dict[str, list[int]] = {path: [] for path in paths}
    floors: list[int] = []
    for _ in range(args.repeats):  # interleaved, so a slower phase of a shared host hits every figure
        for path, native in paths.items():
            runner.native_decode = native
            plain[path].append(median(decode_steps(engine, prompt, args.steps)))
        if stack is not None:
            floors.append(gemv_floor(runner, 3))
    floor = min(floors) if floors else None
    timers = instrument(engine)
    splits = {}
    for path, native in paths.items():
        runner.native_decode = native
        best: dict[str, float] = {}
        for _ in range(args.repeats):
            times = decode_steps(engine, prompt, args.steps, timers)
            per_step = {part: ns / len(times) for part, ns in timers.total.items()}
            per_step["engine (rest)"] = sum(times) / len(times) - sum(per_step.values())
            if not best or sum(per_step.values()) < sum(best.values()):
                best = per_step
        splits[path] = {part: round(ns / 1e3, 1) for part, ns in sorted(best.items(), key=lambda kv: -kv[1])}
    runner.native_decode = stack
    report = {"quantization": args.quantization, "threads": args.threads, "steps": args.steps, "repeats": args.repeats,
              "step_us": {path: min(values) / 1e3 for path, values in plain.items()},
              "linears_alone_us": None if floor is None else floor / 1e3, "split_us": splits}
    if args.json:
        print(json.dumps(report))
    else:
        print_split(report, args, floor)


def print_streaming(report: dict, args) -> None:
    print(f"batch-1 {args.quantization or 'bf16'} decode, {args.threads} thread(s), "
          f"{'native step' if report['native_step'] else 'Python forward'}, wall clock, {args.repeats} passes of "
          f"{args.steps} steps alternated with read-bandwidth measurements")
    print(f"  weights a token reads   {report['weight_bytes_per_token'] / 1e6:8.1f} MB")
    print(f"  step (median of passes) {report['step_ms']:8.3f} ms   passes: {report['step_ms_per_pass']}")
    print(f"  weights streamed        {report['streamed_gbs']:8.1f} GB/s")
    print(f"  read bandwidth          {report['read_gbs']:8.1f} GB/s   passes: {report['read_gbs_per_pass']}")
    print(f"  fraction (median of the passes' own) {100 * report['fraction']:.0f} %   passes: "
          f"{[round(100 * f) for f in report['fraction_per_pass']]}")


def print_split(report: dict, args, floor) -> None:
    print(f"batch-1 {args.quantization or 'bf16'} decode step, {args.threads} thread(s), thread CPU time: best of {args.repeats} passes' "
          f"medians ({args.steps} steps each)")
    for path, us in report["step_us"].items():
        outside = "" if floor is None else f"   outside the linears {us - floor / 1e3:7.0f} us"
        print(f"  {path:<16} {us:7.0f} us{outside}")
    if floor is not None:
        print(f"  linears alone    {floor / 1e3:7.0f} us   (every linear + lm_head through its public binding)")
    for path, split in report["split_us"].items():
        print(f"split, {path} (instrumented: ~0.5 us per timer):")
        for part, us in split.items():
            print(f"  {part:<22} {us:8.1f} us")


if __name__ == "__main__":
    main()
