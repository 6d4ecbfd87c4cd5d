"""The batch-1 decode step on this tree's native kernels against a git revision's, paired in one process.

A shared host's memory speed moves within seconds (on a 2-vCPU Zen 4 VM the two vCPUs sit on one CCD or on two,
~33 against ~55 GB/s of read bandwidth, and the state flips between runs), so two builds timed in two processes
compare two moments. Here one engine (decode_overhead.py's SmolLM-135M shape, one 128-token prompt, greedy) runs
its native step (`ModelRunner.native_decode`) on this tree's `cpu_kernels.c` and on `--rev`'s (the same model's
step bound to that library), swapped pass by
pass (ABBA), `--steps` engine steps a pass (wall clock, the engine's Python included), with a read-bandwidth
probe (`llmctl bench --cpu`'s) before and after each pair. Pairs whose probes agree are counted for a state:
both above `--fast` GB/s, or both below `--slow`; per state it prints the step medians, the share of the read
figure the token's weights stream at, the median of the pairs' own ratios and how many pairs the tree won.

`--rev`'s library is bound by the tree's Python: it needs the tree's C signatures (`decode_stack_bf16`'s above all).

    python benchmarks/kernel_ab.py --rev HEAD~1 [--quantization int4-g32|int8|bf16] [--pairs 60] [--threads 2]
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))

ROOT = Path(__file__).resolve().parents[1]


def revision_kernels(rev: str):
    """`rev`'s cpu_kernels.c built as the engine builds its own (cached per source), bound by this tree's Python."""
    from llmctl.engine.kernels import FLAGS, CpuKernels, build_library

    text = subprocess.run(["git", "-C", str(ROOT), "show", f"{rev}:engine/kernels/cpu_kernels.c"], check=True,
                          capture_output=True, text=True).stdout
    source = Path(tempfile.mkdtemp(prefix="kernel-ab-")) / "cpu_kernels.c"
    source.write_text(text)
    library = build_library(source, FLAGS, f"{rev}'s kernels")
    if library is None:
        sys.exit(f"kernel_ab: {rev}'s cpu_kernels.c did not build")
    return CpuKernels(library)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rev", required=True, help="git revision whose cpu_kernels.c is the baseline")
    parser.add_argument("--quantization", default="int4-g32", help="int4-g32, int8, ... or bf16 (none)")
    parser.add_argument("--pairs", type=int, default=60)
    parser.add_argument("--steps", type=int, default=64)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--fast", type=float, default=42.0, help="GB/s: both probes above: the fast state")
    parser.add_argument("--slow", type=float, default=40.0, help="GB/s: both probes below: the slow state")
    args = parser.parse_args()

    import torch

    from decode_overhead import decode_steps, median, weight_bytes_per_token
    from llmctl.engine import EngineArgs, LLMEngine
    from offline_throughput import make_model
    from quantization import read_bandwidth_gbs

    scratch = tempfile.TemporaryDirectory(prefix="kernel-ab-")
    folder = str(make_model(Path(scratch.name), "bfloat16"))
    engine = LLMEngine(EngineArgs.from_dict(dict(
        model=folder, dtype="bfloat16", skip_tokenizer_init=True, enable_prefix_caching=False, max_model_len=1024,
        num_threads=args.threads, quantization=None if args.quantization == "bf16" else args.quantization)))
    runner = engine.executor.runner
    ours = runner.native_decode
    if ours is None:
        sys.exit("kernel_ab: no native decode step here (it needs the native kernels with AVX512-BF16)")
    theirs = runner.model.native_decode_step(revision_kernels(args.rev), runner.kv_caches)
    torch.manual_seed(0)
    prompt = torch.randint(0, 49152, (128,)).tolist()
    decode_steps(engine, prompt, 8)  # warm-up
    weights = weight_bytes_per_token(runner)
    pairs = []
    for i in range(args.pairs):
        before = read_bandwidth_gbs(warmup_s=0.1, reps=3)
        ms = {}
        for name in (("tree", "rev") if i % 2 == 0 else ("rev", "tree")):
            runner.native_decode = ours if name == "tree" else theirs
            ms[name] = median(decode_steps(engine, prompt, args.steps, clock=time.perf_counter_ns)) / 1e6
        after = read_bandwidth_gbs(warmup_s=0.1, reps=3)
        pairs.append((ms["tree"], ms["rev"], before, after))
        print(f"pair {i}: tree {ms['tree']:.3f} ms, {args.rev} {ms['rev']:.3f} ms, read {before:.1f} / {after:.1f} GB/s",
              flush=True)
    runner.native_decode = ours
    print(f"{args.quantization}, {args.threads} threads, {weights / 1e6:.1f} MB of weights a token:")
    for label, keep in ((f"fast state (probes > {args.fast:g} GB/s)", lambda p: min(p[2], p[3]) > args.fast),
                        (f"slow state (probes < {args.slow:g} GB/s)", lambda p: max(p[2], p[3]) < args.slow)):
        chosen = [p for p in pairs if keep(p)]
        if not chosen:
            continue
        read = statistics.median((p[2] + p[3]) / 2 for p in chosen)
        tree, rev = statistics.median(p[0] for p in chosen), statistics.median(p[1] for p in chosen)
        ratio = statistics.median(p[0] / p[1] for p in chosen)
        print(f"  {label}: {len(chosen)} pairs, read {read:.1f} GB/s; tree {tree:.3f} ms "
              f"({weights / tree / 1e6 / read:.0%}), {args.rev} {rev:.3f} ms ({weights / rev / 1e6 / read:.0%}); "
              f"paired tree/{args.rev} {ratio:.3f}, tree faster in {sum(p[0] < p[1] for p in chosen)}")


if __name__ == "__main__":
    main()
