"""The batch-1 decode step on this tree's native kernels against a git revision's, paired in one process.

A shared host's memory speed moves within seconds (on a 2-vCPU Zen 4 VM the two vCPUs sit on one CCD or on two,
~33 against ~55 GB/s of read bandwidth, and the state flips between runs), so two builds timed in two processes
compare two moments. Here one engine (decode_overhead.py's SmolLM-135M shape, one 128-token prompt, greedy) runs
its native step (`ModelRunner.native_decode`) on this tree's kernels and on `--rev`'s: that revision's whole
`engine/kernels/` package (its Python binding its own C, the CPU library and the quantised one) loaded beside the
tree's and bound to the same model. First `--check-steps` steps run both on the same inputs and compare their logits
bitwise (and `--quant-check` compares the quantised library's entry points on random weights, which also runs on
AVX2-only CPUs where the native step does not); then the timing: swapped pass by pass (ABBA), `--steps` engine steps
a pass (wall clock, the engine's Python included), with a read-bandwidth probe (`llmctl bench --cpu`'s) before and
after each pair. Pairs whose probes agree are counted for a state: both above `--fast` GB/s, or both below `--slow`;
per state it prints the step medians, the share of the read figure the token's weights stream at, the median of the
pairs' own ratios and how many pairs the tree won.

    python benchmarks/kernel_ab.py --rev b45d88d [--quantization int4-g32|int8|bf16] [--pairs 60] [--threads 2]
    python benchmarks/kernel_ab.py --rev b45d88d --quant-check --pairs 0
"""

from __future__ import annotations

import argparse
import importlib
import importlib.util
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))

ROOT = Path(__file__).resolve().parents[1]
KERNELS = "engine/kernels"


def revision_package(rev: str):
    """`rev`'s engine/kernels/ files (its top level: Python, C and headers) as an importable package of its own."""
    listing = subprocess.run(["git", "-C", str(ROOT), "ls-tree", "--name-only", f"{rev}:{KERNELS}"], check=True,
                             capture_output=True, text=True).stdout.split()
    name = f"kernel_ab_rev_{abs(hash(rev)):x}"
    folder = Path(tempfile.mkdtemp(prefix="kernel-ab-")) / name
    folder.mkdir()
    for file in listing:
        if file.endswith((".py", ".c", ".h")):
            text = subprocess.run(["git", "-C", str(ROOT), "show", f"{rev}:{KERNELS}/{file}"], check=True,
                                  capture_output=True, text=True).stdout
            (folder / file).write_text(text)
    spec = importlib.util.spec_from_file_location(name, folder / "__init__.py", submodule_search_locations=[str(folder)])
    package = importlib.util.module_from_spec(spec)
    sys.modules[name] = package
    spec.loader.exec_module(package)
    return package


class RevisionKernels:
    """`rev`'s CPU kernels as a model's `native_decode_step` takes them, each quantised linear's operand re-pointed
    at `rev`'s quantised library (the class `rev`'s DecodeStack accepts: its own, or the tree's where it imports
    that)."""

    def __init__(self, package):
        self.cpu = package.load_cpu_kernels()
        self.quant = importlib.import_module(f"{package.__name__}.quant").load_quant_kernels()
        stack_module = sys.modules.get(f"{package.__name__}.decode_stack")
        from llmctl.engine.kernels import quant as tree_quant

        self.operand_class = getattr(stack_module, "QuantRowOperand", tree_quant.QuantRowOperand)

    def supports_decode(self, *args) -> bool:
        return self.cpu.supports_decode(*args)

    def _operand(self, linear):
        kind, operand = linear
        return (kind, self.operand_class(self.quant, operand.weight)) if kind == "quant" else linear

    def decode_stack(self, layers, embedding, final_norm, lm_head, cos, sin, **sizes):
        linears = ("qkv", "o", "gate_up", "down")
        layers = [{name: self._operand(value) if name in linears else value for name, value in layer.items()}
                  for layer in layers]
        return self.cpu.decode_stack(layers, embedding, final_norm, self._operand(lm_head), cos, sin, **sizes)


def quant_check(tree, theirs) -> int:
    """The quantised library's entry points on random weights (each code format, grouped and per-row, with zeros
    and without), tree against `rev`, bitwise; returns how many results differ."""
    import torch

    generator = torch.Generator().manual_seed(0)
    differing, compared = 0, 0
    for bits, group, zeros, (n, k) in [(4, 32, False, (200, 256)), (4, 64, True, (96, 512)), (8, 256, False, (64, 512)),
                                       (8, 128, True, (48, 384)), (6, 16, False, (80, 256)), (6, 32, True, (40, 256)),
                                       (0x48, 32, False, (64, 256))]:
        grid = torch.tensor([1, 24, 45, 63, 79, 93, 106, 118, 129, 141, 153, 166, 181, 197, 217, 241], dtype=torch.uint8)
        codes = grid[torch.randint(0, 16, (n, k), generator=generator)] if bits == 0x48 \
            else torch.randint(0, 1 << bits, (n, k), generator=generator, dtype=torch.uint8)
        scales = torch.rand(n, k // group, generator=generator) / 50 + 1e-3
        zero_points = torch.randint(0, 1 << min(bits, 8), (n, k // group), generator=generator).float() if zeros else None
        weight = tree.pack(codes, scales, zero_points, bits, group)
        for rows in (1, 3, 16, 40):
            x = (torch.randn(rows, k, generator=generator) / 4).to(torch.bfloat16)
            for method in ("gemv", "gemm_bf16", "gemm_amx", "gemm_amx_int8"):
                usable = {"gemm_bf16": tree.has_bf16_gemm, "gemm_amx": tree.has_amx,
                          "gemm_amx_int8": tree.has_amx and bits in (4, 8) and tree.int8_tile_depth(group, bits)}
                if usable.get(method, True):
                    compared += 1
                    differing += not torch.equal(getattr(tree, method)(weight, x), getattr(theirs, method)(weight, x))
        compared += 1
        differing += not torch.equal(tree.dequantize(weight), theirs.dequantize(weight))
    print(f"quantised library ({'AVX-512' if tree.isa == 512 else 'AVX2'} body): {compared} results compared, "
          f"{differing} differ")
    return differing


class BothSteps:
    """A native step that runs `ours`, then `theirs` on the same inputs (the same K/V written twice where they
    agree), hands on ours' result and counts the steps whose logits or argmaxes differ."""

    def __init__(self, ours, theirs):
        self.ours, self.theirs, self.differing = ours, theirs, []

    def can_run(self, query_lens, max_row_tokens) -> bool:
        return self.ours.can_run(query_lens, max_row_tokens) and self.theirs.can_run(query_lens, max_row_tokens)

    def __call__(self, *args):
        import torch

        logits, argmax = self.ours(*args)
        mine = logits.clone()
        other, other_argmax = self.theirs(*args)
        self.differing.append(not torch.equal(mine, other) or argmax != other_argmax)
        return logits, argmax


def compare_steps(engine, prompt, ours, theirs, steps: int) -> int:
    """`steps` engine steps with every native step run on both stacks; returns how many differ."""
    from decode_overhead import decode_steps

    runner, both = engine.executor.runner, BothSteps(ours, theirs)
    runner.native_decode = both
    decode_steps(engine, prompt, steps)
    runner.native_decode = ours
    print(f"outputs: {len(both.differing)} native steps compared, {sum(both.differing)} with different logits or "
          f"argmax")
    return sum(both.differing) + (not both.differing)


def time_pairs(engine, prompt, ours, theirs, args) -> list[tuple[float, float, float, float]]:
    from decode_overhead import decode_steps, median
    from quantization import read_bandwidth_gbs

    runner, pairs = engine.executor.runner, []
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
    return pairs


def report(pairs, weights: int, args) -> None:
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
    ratio = statistics.median(p[0] / p[1] for p in pairs) if pairs else float("nan")
    print(f"  all {len(pairs)} pairs: paired tree/{args.rev} {ratio:.3f}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rev", required=True, help="git revision whose engine/kernels/ is the baseline")
    parser.add_argument("--quantization", default="int4-g32", help="int4-g32, int8, ... or bf16 (none)")
    parser.add_argument("--pairs", type=int, default=60)
    parser.add_argument("--steps", type=int, default=64)
    parser.add_argument("--check-steps", type=int, default=32, help="native steps whose outputs are compared first")
    parser.add_argument("--quant-check", action="store_true", help="also compare the quantised library's kernels")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--fast", type=float, default=42.0, help="GB/s: both probes above: the fast state")
    parser.add_argument("--slow", type=float, default=40.0, help="GB/s: both probes below: the slow state")
    args = parser.parse_args()

    import torch

    from decode_overhead import decode_steps, weight_bytes_per_token
    from llmctl.engine import EngineArgs, LLMEngine
    from llmctl.engine.kernels.quant import load_quant_kernels
    from offline_throughput import make_model

    revision = RevisionKernels(revision_package(args.rev))
    if args.quant_check and quant_check(load_quant_kernels(), revision.quant):
        sys.exit("kernel_ab: the quantised library's outputs differ")
    if revision.cpu is None:
        sys.exit(f"kernel_ab: no native decode step here ({args.rev}'s CPU kernels need AVX-512)")
    scratch = tempfile.TemporaryDirectory(prefix="kernel-ab-")
    folder = str(make_model(Path(scratch.name), "bfloat16"))
    engine = LLMEngine(EngineArgs.from_dict(dict(
        model=folder, dtype="bfloat16", skip_tokenizer_init=True, enable_prefix_caching=False, max_model_len=1024,
        num_threads=args.threads, quantization=None if args.quantization == "bf16" else args.quantization)))
    runner = engine.executor.runner
    ours = runner.native_decode
    if ours is None:
        sys.exit("kernel_ab: no native decode step here (it needs the native kernels with AVX512-BF16)")
    theirs = runner.model.native_decode_step(revision, runner.kv_caches)
    torch.manual_seed(0)
    prompt = torch.randint(0, 49152, (128,)).tolist()
    if compare_steps(engine, prompt, ours, theirs, args.check_steps):
        sys.exit("kernel_ab: the native steps' outputs differ")
    decode_steps(engine, prompt, 8)  # warm-up
    report(time_pairs(engine, prompt, ours, theirs, args), weight_bytes_per_token(runner), args)


if __name__ == "__main__":
    main()
