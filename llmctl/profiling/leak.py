"""`llmctl profile leak`: run a workload repeatedly in this process and decide whether memory grows.

After every iteration (and a `gc.collect()`) it samples RSS and, when the workload uses CUDA, torch's
allocated/reserved bytes. The least-squares slope over the post-warm-up iterations is the growth per
iteration. The verdict is "growing" when that slope reaches the threshold and the growth is spread
over the window: the slopes of its first and second halves each reach half the threshold, so a single
jump (a new allocator arena, a cache filling once) is not called a leak. On growth, memray's in-process
`Tracker` records one more iteration and the allocations still alive at its end are the leak suspects.
"""

from __future__ import annotations

import gc
import importlib
import importlib.util
import math
import os
import random
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Optional

from llmctl.errors import UserError
from llmctl.output import format_bytes
from llmctl.profiling import ui
from llmctl.profiling.artifacts import Manifest

MIN_POST_WARMUP = 6  # three samples for each half's slope
CAPTURE_NAME = "leak-iteration.bin"
MAX_FRAMES = 6


@dataclass
class LeakPlan:
    iterations: int = 20
    warmup: int = 5
    threshold_kb: float = 32.0
    capture: bool = True
    sites: int = 10

    def validate(self) -> None:
        if self.warmup < 0:
            raise UserError("--warmup must be >= 0")
        if self.iterations - self.warmup < MIN_POST_WARMUP:
            raise UserError(f"--iterations must exceed --warmup by at least {MIN_POST_WARMUP} to fit a slope "
                            f"(got {self.iterations} iterations, {self.warmup} warm-up)")
        if self.threshold_kb <= 0:
            raise UserError("--threshold-kb-per-iter must be > 0")


@dataclass
class Sample:
    iteration: int
    seconds: float
    rss_bytes: int
    cuda_allocated: Optional[int] = None
    cuda_reserved: Optional[int] = None


@dataclass
class Workload:
    name: str
    call: Callable[[], Any]
    details: dict = field(default_factory=dict)


# ---- workloads ----------------------------------------------------------------------------------
def load_callable(spec: str) -> Workload:
    """`package.module:function` or `path/to/file.py:function`, called with no arguments."""
    target, sep, func_name = spec.rpartition(":")
    if not sep or not target or not func_name:
        raise UserError(f"workload {spec!r} must be 'module:function' or 'path.py:function'")
    module = _import_file(Path(target)) if target.endswith(".py") else _import_module(target)
    func = getattr(module, func_name, None)
    if func is None:
        raise UserError(f"{target} has no attribute {func_name!r}")
    if not callable(func):
        raise UserError(f"{spec} is not callable")
    return Workload(spec, func)


def _import_file(path: Path):
    if not path.is_file():
        raise UserError(f"workload file {path} does not exist")
    name = f"_llmctl_leak_{path.stem}"
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    sys.path.insert(0, str(path.resolve().parent))  # so the file's own imports of its neighbours work
    try:
        spec.loader.exec_module(module)
    except Exception as exc:  # noqa: BLE001 - user code: one line, not a traceback
        raise UserError(f"importing {path} failed: {type(exc).__name__}: {exc}") from None
    return module


def _import_module(name: str):
    if os.getcwd() not in sys.path:
        sys.path.insert(0, os.getcwd())
    try:
        return importlib.import_module(name)
    except ModuleNotFoundError as exc:
        raise UserError(f"cannot import {name!r}: {exc}") from None
    except Exception as exc:  # noqa: BLE001 - user code: one line, not a traceback
        raise UserError(f"importing {name} failed: {type(exc).__name__}: {exc}") from None


def engine_workload(args, batch_size: int, input_len: int, output_len: int, seed: int = 0) -> Workload:
    """The engine's own generate loop: each iteration generates for a fresh batch of random-token prompts."""
    from llmctl.engine import LLM, SamplingParams

    with ui.waiting("loading model"):
        llm = LLM.from_engine_args(args)
    engine = llm.engine
    if input_len + output_len > engine.max_model_len:
        raise UserError(f"--input-len + --output-len = {input_len + output_len} exceeds max_model_len "
                        f"{engine.max_model_len}")
    rng = random.Random(seed)
    params = SamplingParams(max_tokens=output_len, ignore_eos=True, temperature=0.0)

    def generate_once() -> None:
        prompts = [[rng.randrange(engine.vocab_size) for _ in range(input_len)] for _ in range(batch_size)]
        llm.generate(prompts, params)

    return Workload("engine generate", generate_once,
                    {"batch_size": batch_size, "input_len": input_len, "output_len": output_len,
                     "device": str(engine.executor.device)})


# ---- measuring ----------------------------------------------------------------------------------
def rss_bytes() -> int:
    """Resident set size now (Linux /proc/self/statm); elsewhere the peak RSS, the best stdlib offers."""
    try:
        with open("/proc/self/statm") as handle:
            return int(handle.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except OSError:
        import resource

        peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        return peak if sys.platform == "darwin" else peak * 1024


def cuda_bytes() -> tuple[Optional[int], Optional[int]]:
    torch = sys.modules.get("torch")  # only when the workload brought torch in: importing it costs seconds
    if torch is None or not torch.cuda.is_available() or not torch.cuda.is_initialized():
        return None, None
    # Summed over every GPU: the workload may run on cuda:1 while cuda:0 is current. The allocator's
    # counters are host-side bookkeeping, so no synchronisation is needed (and none creates a context).
    devices = range(torch.cuda.device_count())
    return (sum(torch.cuda.memory_allocated(i) for i in devices), sum(torch.cuda.memory_reserved(i) for i in devices))


def sample(iteration: int, seconds: float) -> Sample:
    gc.collect()
    allocated, reserved = cuda_bytes()
    return Sample(iteration, seconds, rss_bytes(), allocated, reserved)


def fit(values: list[float]) -> dict[str, float]:
    """Least-squares line through (i, values[i]): slope, its standard error, t and R^2."""
    n = len(values)
    xs = range(n)
    mean_x, mean_y = (n - 1) / 2, sum(values) / n
    sxx = sum((x - mean_x) ** 2 for x in xs)
    sxy = sum((x - mean_x) * (y - mean_y) for x, y in zip(xs, values))
    slope = sxy / sxx
    residual = sum((y - (mean_y + slope * (x - mean_x))) ** 2 for x, y in zip(xs, values))
    total = sum((y - mean_y) ** 2 for y in values)
    stderr = math.sqrt(residual / (n - 2) / sxx) if n > 2 else 0.0
    t = math.inf if stderr == 0 and slope != 0 else (slope / stderr if stderr else 0.0)
    return {"slope": slope, "stderr": stderr, "t": t, "r2": 1 - residual / total if total else 0.0}


def verdict(samples: list[Sample], plan: LeakPlan) -> dict[str, Any]:
    """Growth per iteration after warm-up, for RSS and (when sampled) CUDA allocated memory."""
    post = samples[plan.warmup:]
    series = {"rss": [s.rss_bytes / 1024 for s in post]}
    if post and post[0].cuda_allocated is not None:
        series["cuda_allocated"] = [s.cuda_allocated / 1024 for s in post]
    report: dict[str, Any] = {"threshold_kb_per_iter": plan.threshold_kb}
    growing = False
    for name, values in series.items():
        line = fit(values)
        half = len(values) // 2
        halves = (fit(values[:half])["slope"], fit(values[-half:])["slope"])
        grows = line["slope"] >= plan.threshold_kb and min(halves) >= plan.threshold_kb / 2
        growing |= grows
        report[name] = {"slope_kb_per_iter": round(line["slope"], 3), "stderr_kb": round(line["stderr"], 3),
                        "t": None if math.isinf(line["t"]) else round(line["t"], 2), "r2": round(line["r2"], 4),
                        "half_slopes_kb_per_iter": [round(h, 3) for h in halves],
                        "start_kb": round(values[0], 1), "end_kb": round(values[-1], 1), "growing": grows}
    report["verdict"] = "growing" if growing else "flat"
    return report


# ---- the run ------------------------------------------------------------------------------------
def run_leak(workload: Workload, plan: LeakPlan, manifest: Manifest) -> dict[str, Any]:
    plan.validate()
    manifest.target_pids = [os.getpid()]
    samples = [sample(0, 0.0)]  # the baseline before the first iteration
    with ui.steps("iterations", plan.iterations, detail="") as bar:
        for iteration in range(1, plan.iterations + 1):
            started = time.perf_counter()
            _call(workload, iteration, manifest, samples)
            samples.append(sample(iteration, time.perf_counter() - started))
            bar.advance(detail=f"RSS {format_bytes(samples[-1].rss_bytes)}")
    result = verdict(samples[1:], plan)
    manifest.result.update(workload=workload.name, **workload.details, iterations=plan.iterations,
                           warmup=plan.warmup, samples=[vars(s) for s in samples], **result)
    if result["verdict"] == "growing" and plan.capture:
        manifest.result["suspects"] = _suspects(workload, plan, manifest)
    manifest.finish("ok")
    manifest.write()
    return manifest.result


def _call(workload: Workload, iteration: int, manifest: Manifest, samples: list[Sample]) -> None:
    try:
        workload.call()
    except Exception as exc:  # noqa: BLE001 - the workload is user code; report, don't trace back
        manifest.result.update(workload=workload.name, samples=[vars(s) for s in samples])
        message = f"the workload raised {type(exc).__name__} at iteration {iteration}: {exc}"
        manifest.finish("workload_failed", 1, message)
        manifest.write()
        raise UserError(message, exit_code=1) from None


def _suspects(workload: Workload, plan: LeakPlan, manifest: Manifest) -> Any:
    """Track one more iteration with memray; the allocations alive at its end, largest first."""
    if importlib.util.find_spec("memray") is None:
        manifest.result["capture_skipped"] = "memray is not installed: pip install 'llmctl[profile]'"
        return []
    import memray

    path = manifest.output_dir / CAPTURE_NAME
    path.unlink(missing_ok=True)
    try:
        with ui.waiting("memray: tracking one more iteration"):
            with memray.Tracker(str(path), trace_python_allocators=True):
                workload.call()
                gc.collect()  # garbage in reference cycles is not a leak: free it while tracking
    except RuntimeError as exc:  # e.g. this process already runs under a memray tracker
        manifest.result["capture_skipped"] = f"memray could not track this process: {exc}"
        return []
    manifest.add_file(path)
    from importlib.metadata import version

    manifest.result["capture"] = {"file": CAPTURE_NAME, "memray_version": version("memray")}
    return top_leaked(path, plan.sites)


def top_leaked(path: Path, limit: int) -> list[dict[str, Any]]:
    from memray import FileReader

    records = sorted(FileReader(str(path)).get_leaked_allocation_records(merge_threads=True),
                     key=lambda record: record.size, reverse=True)
    sites = []
    for record in records:
        stack = _own_frames_dropped(record.stack_trace())
        if not stack:
            continue  # allocated by the tracking harness itself
        sites.append({"size_bytes": record.size, "allocations": record.n_allocations,
                      "allocator": getattr(record.allocator, "name", str(record.allocator)).lower(),
                      "stack": [f"{func} {file}:{line}" for func, file, line in stack[:MAX_FRAMES]]})
        if len(sites) == limit:
            break
    return sites


def _own_frames_dropped(stack: list[tuple[str, str, int]]) -> list[tuple[str, str, int]]:
    """memray stacks run innermost first; cut at the harness frame that called the workload."""
    here = os.path.abspath(__file__)
    for index, (func, filename, _line) in enumerate(stack):
        if func == "_suspects" and os.path.abspath(filename) == here:
            return stack[:index]
    return stack
