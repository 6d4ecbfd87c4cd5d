#!/usr/bin/env python3
"""The GPU engine at real model size against the roofline, in one run of at most ~5 minutes.

Writes a Llama-3-8B-shaped config.json (hidden 4096, intermediate 14336, 32 layers, 32/8 heads, vocab 128256)
into a temporary folder, runs the engine on it with dummy weights in bf16, and prints one table:

- the GPU's measured copy bandwidth (device-to-device, bytes read + written / time);
- batch-1 decode tok/s as a share of the roofline (bytes a token reads / measured bandwidth);
- 256 x (512 -> 256), greedy, ignore_eos: output tok/s, and the median full-batch decode step against its
  roofline step time (weights + the step's KV bytes, / bandwidth);
- a torch.profiler capture of 5 full-batch steps: GPU-busy share of wall time, host syncs per step, top kernels;
- each workload on every `--backends` entry, an attention backend and its CUDA-graph mode (`triton:full_and_piecewise`;
  no mode: piecewise), in the same run: by default Triton with full decode graphs, Triton with piecewise graphs,
  then torch; with the engine's async scheduling (`--async-scheduling both`, the default: the first entry runs
  once more without it, beside, so the table shows what overlapping host and GPU work gains).

Exits 1 when the first backend misses a gate: batch 1 >= 80 % of the roofline, >= 5,000 output tok/s at
256 x (512 -> 256) on an H100 (6,000 on an H200; other cards are reported, not gated), GPU busy >= 90 % of
full-batch decode wall time, <= 1 blocking sync per decode step. Needs torch with CUDA; llmctl need not be
installed (the checkout's packages are laid out under a temporary folder, as scripts/gpu_check.sh does).

    python scripts/gpu_perf_check.py                      # on a GPU host; --json FILE (default $OUT/...)
    python scripts/gpu_perf_check.py --device cpu --shape tiny --batch 4 --input-len 16 --output-len 8  # logic
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import random
import statistics
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]

SHAPES = {
    "llama-3-8b": dict(hidden_size=4096, intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32,
                       num_key_value_heads=8, vocab_size=128256, max_position_embeddings=8192, rope_theta=500000.0),
    "tiny": dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=2, vocab_size=512, max_position_embeddings=1024, rope_theta=10000.0),
}
# Output tok/s at 256 x (512 -> 256) by card (vLLM's published H100 figure ~6.2k; ours must reach these).
THROUGHPUT_GATES = {"H100": 5000.0, "H200": 6000.0}
ROOFLINE_GATE = 0.80
BUSY_GATE = 0.90
SYNC_GATE = 1.0
BATCH1_PROMPT = 128
SYNC_CALLS = ("cudaStreamSynchronize", "cudaDeviceSynchronize", "cudaEventSynchronize", "cudaMemcpy")


def import_engine():
    """`llmctl.engine` from this checkout: installed, or its package-dir layout mirrored in a temporary folder."""
    try:
        import llmctl.engine  # noqa: F401
        return
    except ImportError:
        pass
    site = Path(tempfile.mkdtemp(prefix="llmctl_site_")) / "llmctl"
    site.mkdir()
    for entry in (REPO / "llmctl").iterdir():
        (site / entry.name).symlink_to(entry)
    for folder in ("engine", "commands", "checks"):
        (site / folder).symlink_to(REPO / folder)
    sys.path.insert(0, str(site.parent))
    for name in [m for m in sys.modules if m == "llmctl" or m.startswith("llmctl.")]:
        del sys.modules[name]


@dataclass(frozen=True)
class ModelBytes:
    """What one decode token reads, from the config's shapes."""
    weights: int  # every decoder weight, the final norm, the lm_head, one embedding row
    kv_per_token: int  # K and V of one cached token, every layer

    @classmethod
    def of(cls, shape: dict, element: int) -> "ModelBytes":
        h, inter, layers = shape["hidden_size"], shape["intermediate_size"], shape["num_hidden_layers"]
        heads, kv_heads = shape["num_attention_heads"], shape["num_key_value_heads"]
        head_dim = h // heads
        attention = 2 * h * heads * head_dim + 2 * h * kv_heads * head_dim
        per_layer = attention + 3 * h * inter + 2 * h
        weights = layers * per_layer + shape["vocab_size"] * h + 2 * h
        return cls(weights * element, 2 * layers * kv_heads * head_dim * element)


@dataclass
class StepTime:
    seconds: float
    rows: int
    tokens: int
    kv_tokens: int  # cached tokens the step's decode rows attend to


@dataclass
class Profile:
    gpu_busy: float | None
    syncs_per_step: float
    top_kernels: list[tuple[str, float]] = field(default_factory=list)  # (name, ms over the captured steps)


def synchronize(device) -> None:
    import torch
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def copy_bandwidth(device, mib: int = 1024, iters: int = 20) -> float:
    """Bytes/s of a device-to-device copy (read + write), the yardstick every roofline here divides by."""
    import torch
    src = torch.ones(mib * 2**20 // 2, dtype=torch.bfloat16, device=device)
    dst = torch.empty_like(src)
    for _ in range(3):
        dst.copy_(src)
    synchronize(device)
    start = time.perf_counter()
    for _ in range(iters):
        dst.copy_(src)
    synchronize(device)
    seconds = (time.perf_counter() - start) / iters
    del src, dst
    return 2 * mib * 2**20 / seconds


def random_prompts(count: int, length: int, vocab: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(vocab) for _ in range(length)] for _ in range(count)]


class Workload:
    """Requests stepped one engine step at a time, each step timed and its decode rows' context counted."""

    def __init__(self, engine, prompts: list[list[int]], max_tokens: int):
        from llmctl.engine import SamplingParams
        from llmctl.engine.sampling_params import RequestOutputKind
        params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True,
                                output_kind=RequestOutputKind.DELTA)
        self.engine, self.prompt_len, self.generated = engine, {}, {}
        for i, prompt in enumerate(prompts):
            rid = f"perf-{id(self)}-{i}"
            engine.add_request(rid, prompt, params)
            self.prompt_len[rid], self.generated[rid] = len(prompt), 0

    def step(self) -> StepTime:
        start = time.perf_counter()
        info = self.engine.step()
        seconds = time.perf_counter() - start
        kv = sum(self.prompt_len[r] + self.generated[r] for r in info.request_ids) if \
            info.num_batched_tokens == len(info.request_ids) else 0
        for out in info.outputs:
            self.generated[out.request_id] += sum(len(c.token_ids) for c in out.outputs)
        return StepTime(seconds, len(info.request_ids), info.num_batched_tokens, kv)

    def run(self) -> list[StepTime]:
        steps = []
        while self.engine.has_unfinished_requests():
            steps.append(self.step())
        return steps

    def abort(self) -> None:
        for rid in self.prompt_len:
            self.engine.abort_request(rid)


def batch1_decode(engine, shape: dict, output_len: int) -> float:
    """Decode tok/s of one sequence: output tokens after the first over the decode steps' time."""
    Workload(engine, random_prompts(1, 32, shape["vocab_size"], 1), 8).run()  # warm-up
    steps = Workload(engine, random_prompts(1, BATCH1_PROMPT, shape["vocab_size"], 2), output_len + 1).run()
    decode = [s.seconds for s in steps if s.tokens == 1]
    return len(decode) / sum(decode)


def full_batch(engine, shape: dict, batch: int, input_len: int, output_len: int) -> dict:
    prompts = random_prompts(batch, input_len, shape["vocab_size"], 3)
    Workload(engine, prompts, 2).run()  # warm-up at the workload's shapes (kernel compilation, graphs)
    start = time.perf_counter()
    steps = Workload(engine, random_prompts(batch, input_len, shape["vocab_size"], 4), output_len).run()
    elapsed = time.perf_counter() - start
    full = [s for s in steps if s.rows == batch and s.tokens == batch]
    median = sorted(full, key=lambda s: s.seconds)[len(full) // 2] if full else None
    return {"output_tok_s": batch * output_len / elapsed, "elapsed_s": elapsed, "full_batch_steps": len(full),
            "median_step_ms": median.seconds * 1e3 if median else None,
            "median_step_kv_tokens": median.kv_tokens if median else None}


def profile_full_batch(engine, shape: dict, batch: int, input_len: int, steps: int = 5) -> Profile:
    """torch.profiler over `steps` full-batch decode steps (after a few unprofiled ones)."""
    import torch
    from torch.profiler import ProfilerActivity, profile, record_function
    work = Workload(engine, random_prompts(batch, input_len, shape["vocab_size"], 5), 64)
    while engine.has_unfinished_requests():
        step = work.step()
        if step.rows == batch and step.tokens == batch:
            break
    else:
        raise RuntimeError(f"the engine never ran {batch} decode rows in one step (max_num_seqs, KV pool?)")
    for _ in range(3):
        work.step()
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if torch.cuda.is_available() else [])
    with profile(activities=activities) as prof:
        for _ in range(steps):
            with record_function("perf_check::step"):
                work.step()
    work.abort()
    while engine.has_unfinished_requests():
        engine.step()
    return summarize_profile(prof.events(), steps)


def summarize_profile(events, steps: int) -> Profile:
    """GPU-busy share of the profiled steps' wall time, blocking syncs per step, the five busiest kernels."""
    marks = [e for e in events if e.name == "perf_check::step"]
    begin = min(e.time_range.start for e in marks)
    end = max(e.time_range.end for e in marks)
    device = [e for e in events if e.device_type.name == "CUDA"]
    busy = union_length([(max(e.time_range.start, begin), min(e.time_range.end, end)) for e in device])
    syncs = sum(1 for e in events if e.device_type.name == "CPU" and e.name in SYNC_CALLS)
    totals: dict[str, float] = {}
    for e in device:
        totals[e.name] = totals.get(e.name, 0.0) + e.time_range.elapsed_us() / 1e3
    top = sorted(totals.items(), key=lambda kv: -kv[1])[:5]
    return Profile(busy / (end - begin) if device else None, syncs / steps, top)


def union_length(intervals: list[tuple[float, float]]) -> float:
    """Length covered by the intervals (overlaps counted once; empty ones ignored)."""
    total, reach = 0.0, float("-inf")
    for start, stop in sorted(i for i in intervals if i[1] > i[0]):
        if stop > reach:
            total += stop - max(start, reach)
            reach = stop
    return total


def parse_runs(text: str) -> list[tuple[str, str]]:
    """`--backends`' entries as (attention backend, cudagraph mode): `triton:full_decode_only`, `torch` (piecewise)."""
    runs = []
    for entry in text.split(","):
        backend, _, mode = entry.strip().partition(":")
        runs.append((backend, mode or "piecewise"))
    return runs


def planned_runs(backends: str, async_mode: str) -> list[tuple[str, str, bool]]:
    """(attention backend, cudagraph mode, async scheduling) of each run, the gated one first: every entry with
    `async_mode`'s setting; `both`: with it, and the first entry once more without it."""
    entries = parse_runs(backends)
    runs = [(backend, mode, async_mode != "off") for backend, mode in entries]
    return runs[:1] + [(*entries[0], False)] + runs[1:] if async_mode == "both" else runs


def build_engine(folder: Path, args, backend: str, mode: str, overlap: bool):
    from llmctl.engine import EngineArgs
    from llmctl.engine.llm_engine import LLMEngine
    return LLMEngine(EngineArgs.from_dict(dict(
        model=str(folder), load_format="dummy", dtype=args.dtype, device=args.device, skip_tokenizer_init=True,
        max_model_len=args.input_len + args.output_len + 256, max_num_seqs=max(args.batch, 1),
        attention_backend=backend, cudagraph_mode=mode, enable_prefix_caching=False, async_scheduling=overlap)))


def run_backend(folder: Path, shape: dict, args, run: tuple[str, str, bool], bandwidth: float,
                model: ModelBytes) -> dict:
    import torch
    backend, mode, overlap = run
    engine = build_engine(folder, args, backend, mode, overlap)
    try:
        tok_s = batch1_decode(engine, shape, args.output_len)
        batch = full_batch(engine, shape, args.batch, args.input_len, args.output_len)
        prof = profile_full_batch(engine, shape, args.batch, args.input_len)
    finally:
        engine.shutdown()
        del engine
        gc.collect()
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
    mean_context = BATCH1_PROMPT + args.output_len / 2
    roofline_tok_s = bandwidth / (model.weights + mean_context * model.kv_per_token)
    kv = batch["median_step_kv_tokens"]
    roofline_step_ms = (model.weights + kv * model.kv_per_token) / bandwidth * 1e3 if kv else None
    return {"backend": backend, "cudagraph_mode": mode, "async_scheduling": overlap,
            "batch1_tok_s": tok_s, "batch1_roofline_tok_s": roofline_tok_s,
            "batch1_share": tok_s / roofline_tok_s, **batch, "roofline_step_ms": roofline_step_ms,
            "gpu_busy": prof.gpu_busy, "syncs_per_step": prof.syncs_per_step, "top_kernels": prof.top_kernels}


def card_gate(card: str) -> float | None:
    return next((gate for name, gate in THROUGHPUT_GATES.items() if name in card), None)


def failed_gates(result: dict, card: str) -> list[str]:
    """The gates the result misses on this card (throughput gated only on the cards named in THROUGHPUT_GATES)."""
    misses = []
    if result["batch1_share"] < ROOFLINE_GATE:
        misses.append(f"batch 1 at {result['batch1_share']:.0%} of the roofline (want >= {ROOFLINE_GATE:.0%})")
    gate = card_gate(card)
    if gate is not None and result["output_tok_s"] < gate:
        misses.append(f"{result['output_tok_s']:,.0f} output tok/s on {card} (want >= {gate:,.0f})")
    if result["gpu_busy"] is not None and result["gpu_busy"] < BUSY_GATE:
        misses.append(f"GPU busy {result['gpu_busy']:.0%} of decode wall time (want >= {BUSY_GATE:.0%})")
    if result["syncs_per_step"] > SYNC_GATE:
        misses.append(f"{result['syncs_per_step']:.1f} blocking syncs per decode step (want <= {SYNC_GATE:g})")
    return misses


def label(result: dict) -> str:
    return f"{result['backend']}/{result['cudagraph_mode']}"


def render(card: str, bandwidth: float, results: list[dict]) -> str:
    pct = lambda v: "-" if v is None else f"{v:.0%}"
    num = lambda v, f=",.1f": "-" if v is None else format(v, f)
    lines = [f"card: {card}   copy bandwidth: {bandwidth / 1e9:,.0f} GB/s",
             f"{'backend/cudagraph mode':28} {'async':>5} {'b1 tok/s':>9} {'roofline':>9} {'share':>6} "
             f"{'out tok/s':>10} {'step ms':>8} {'roof ms':>8} {'busy':>5} {'syncs':>6}"]
    for r in results:
        lines.append(f"{label(r):28} {'on' if r['async_scheduling'] else 'off':>5} {r['batch1_tok_s']:>9,.1f} "
                     f"{r['batch1_roofline_tok_s']:>9,.1f} "
                     f"{pct(r['batch1_share']):>6} {r['output_tok_s']:>10,.0f} {num(r['median_step_ms']):>8} "
                     f"{num(r['roofline_step_ms']):>8} {pct(r['gpu_busy']):>5} {r['syncs_per_step']:>6.1f}")
    for r in results:
        lines.append(f"top kernels ({label(r)}, 5 full-batch steps): " +
                     "; ".join(f"{name[:60]} {ms:.2f} ms" for name, ms in r["top_kernels"]))
    return "\n".join(lines)


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--shape", choices=sorted(SHAPES), default="llama-3-8b")
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--backends", default="triton:full_and_piecewise,triton:piecewise,torch",
                        help="attention backends, each with an optional :cudagraph-mode (default piecewise); the "
                             "first one gated")
    parser.add_argument("--async-scheduling", choices=("on", "off", "both"), default="both",
                        help="the engine's async scheduling; both: on, and the first entry also without it")
    parser.add_argument("--batch", type=int, default=256)
    parser.add_argument("--input-len", type=int, default=512)
    parser.add_argument("--output-len", type=int, default=256)
    out = os.environ.get("OUT")
    parser.add_argument("--json", default=str(Path(out) / "gpu_perf_check.json") if out else None)
    return parser.parse_args(argv)


def main(argv=None) -> int:
    args = parse_args(argv)
    import_engine()
    import torch
    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        print("gpu_perf_check: no CUDA device (pass --device cpu for a logic run)", file=sys.stderr)
        return 2
    card = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    shape = SHAPES[args.shape]
    model = ModelBytes.of(shape, torch.empty((), dtype=getattr(torch, args.dtype)).element_size())
    bandwidth = copy_bandwidth(device, mib=1024 if device.type == "cuda" else 64)
    with tempfile.TemporaryDirectory(prefix="gpu_perf_check_") as tmp:
        folder = Path(tmp)
        (folder / "config.json").write_text(json.dumps({"architectures": ["LlamaForCausalLM"], "model_type": "llama",
                                                        "rms_norm_eps": 1e-5, "torch_dtype": args.dtype, **shape}))
        results = [run_backend(folder, shape, args, run, bandwidth, model)
                   for run in planned_runs(args.backends, args.async_scheduling)]
    print(render(card, bandwidth, results), flush=True)
    misses = failed_gates(results[0], card) if device.type == "cuda" else []
    if args.json:
        Path(args.json).write_text(json.dumps({"card": card, "bandwidth_bytes_s": bandwidth, "shape": shape,
                                               "model_bytes": asdict(model), "results": results,
                                               "failed_gates": misses}, indent=2))
    for miss in misses:
        print(f"BELOW GATE ({label(results[0])}): {miss}")
    return 1 if misses else 0


if __name__ == "__main__":
    sys.exit(main())
