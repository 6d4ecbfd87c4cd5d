"""`llmctl bench --gpu/--cpu`: plan the microbenchmarks, run them per device, attach datasheet
peaks, and turn the figures into one report (inventory, results, warnings, notes, errors).

The kernels live in `llmctl.bench.kernels`, the datasheet table in `llmctl.bench.specs`; this
module decides what runs at which size (`--quick`, default, `--full`) and judges the results
(`fail_below`, `spread_warnings`). Nothing here changes device settings.
"""

from __future__ import annotations

import gc
import os
import platform
import statistics
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Callable, Optional

from llmctl.output import format_bytes
from llmctl.bench.memory_budget import MemoryBudget
from llmctl.bench.shapes import BUILTIN, ModelShape
from llmctl.bench.specs import GpuSpec, lookup
from llmctl.errors import one_line

SCHEMA_VERSION = 1
SPREAD_LIMIT_PCT = 5.0
NOISE_LIMIT_PCT = 10.0  # (max - min) / median of one figure's repetitions above this: the host was noisy
CPU_MEMORY_SHARE = 0.7  # of the memory budget for the CPU decode weights; buffers and the allocator take the rest
MIB, GIB = 1 << 20, 1 << 30


@dataclass(frozen=True)
class Plan:
    mode: str  # quick, default, full
    reps: int
    warmup_s: float
    gpu_gemm: int
    cpu_gemm: int
    gpu_copy_min: int  # bytes; at least 16x the L2 cache
    cpu_copy_llc_multiple: int
    transfer_bytes: int
    attention_prefill: tuple[int, int, int, int, int]  # batch, q heads, kv heads, head dim, seq
    attention_decode: tuple[int, int, int, int, int]  # batch, q heads, kv heads, head dim, context
    cpu_shape: str
    gpu_shape: str
    allreduce_sizes: tuple[int, ...] = (MIB, 32 * MIB, 256 * MIB)  # bytes per rank, the NCCL sweep


PLANS = {
    "quick": Plan("quick", 5, 0.1, 8192, 1024, 1 * GIB, 2, 256 * MIB, (2, 32, 8, 128, 4096), (32, 32, 8, 128, 4096),
                  "smollm-135m", "llama-3-8b"),
    "default": Plan("default", 20, 0.5, 8192, 2048, 2 * GIB, 4, 512 * MIB, (4, 32, 8, 128, 4096),
                    (64, 32, 8, 128, 4096), "qwen2.5-0.5b", "llama-3-8b", (MIB, 16 * MIB, 128 * MIB, GIB)),
    "full": Plan("full", 100, 2.0, 8192, 4096, 4 * GIB, 8, 1 * GIB, (8, 32, 8, 128, 8192), (128, 32, 8, 128, 8192),
                 "qwen2.5-0.5b", "llama-3-8b", tuple(MIB << (2 * i) for i in range(7))),
}


@dataclass
class Result:
    name: str
    label: str
    device: str
    unit: str
    median: float
    min: float
    max: float
    repeats: int
    peak: Optional[float]
    pct_of_peak: Optional[float]
    params: dict[str, Any] = field(default_factory=dict)
    spread_pct: Optional[float] = None  # (max - min) / median of the repetitions, in %

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


@dataclass
class Report:
    target: str  # "cuda" or "cpu"
    mode: str
    devices: list[dict[str, Any]]
    results: list[Result] = field(default_factory=list)
    warnings: list[str] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    errors: list[dict[str, str]] = field(default_factory=list)

    def to_dict(self) -> dict[str, Any]:
        import torch

        from llmctl.__about__ import __version__

        return {"schema_version": SCHEMA_VERSION, "llmctl_version": __version__, "torch_version": torch.__version__,
                "target": self.target, "mode": self.mode, "devices": self.devices,
                "results": [r.to_dict() for r in self.results], "warnings": self.warnings, "notes": self.notes,
                "errors": self.errors}


Task = tuple[str, str, Callable[[], Any]]  # (label for progress, device label, returns a Measured)
Progress = Callable[[str, int, int], None]  # (step label, steps done, total steps)
OnResult = Callable[["Result"], None]  # called with each figure as soon as it is measured


def to_result(measured: Any, device: str, spec: Optional[GpuSpec]) -> Result:
    """Median/min/max of the per-repetition rates, beside the datasheet peak when one is known."""
    values = measured.values
    median = statistics.median(values)
    base = spec.peak(measured.peak_key) if spec is not None and measured.peak_key else None
    peak = base * measured.peak_scale if base is not None else None
    pct = 100.0 * median / peak if peak else None
    spread = 100.0 * (max(values) - min(values)) / median if median else None
    return Result(measured.name, measured.label, device, measured.unit, _round(median), _round(min(values)),
                  _round(max(values)), len(values), _round(peak), None if pct is None else round(pct, 1),
                  measured.params, None if spread is None else round(spread, 1))


def _round(value: Optional[float]) -> Optional[float]:
    return None if value is None else float(f"{value:.5g}")


def fail_below(results: list[Result], pct: float) -> list[Result]:
    """Figures with a known peak that reached less than pct % of it."""
    return [r for r in results if r.pct_of_peak is not None and r.pct_of_peak < pct]


def noise_warnings(results: list[Result], limit_pct: float = NOISE_LIMIT_PCT) -> list[str]:
    """One warning per figure whose repetitions spread more than limit_pct of their median: such a
    median may move by as much between two runs."""
    return [f"{r.label} on {r.device}: repetitions spread {r.spread_pct:.0f}% of the median ((max - min) / median "
            f"> {limit_pct:g}%): the host was busy or changing clocks; compare medians across runs with care"
            for r in results if r.spread_pct is not None and r.spread_pct > limit_pct]


def spread_warnings(results: list[Result], devices: list[dict[str, Any]], limit_pct: float = SPREAD_LIMIT_PCT) -> list[str]:
    """One warning per figure whose medians differ by more than limit_pct across GPUs of the same model
    (the slowest measured against the fastest)."""
    model_of = {d["label"]: d.get("name") for d in devices}
    groups: dict[tuple[str, Any], list[Result]] = {}
    for r in results:
        if r.device in model_of:
            groups.setdefault((r.name, model_of[r.device]), []).append(r)
    warnings = []
    for (name, model), rows in groups.items():
        if len(rows) < 2:
            continue
        fast, slow = max(rows, key=lambda r: r.median), min(rows, key=lambda r: r.median)
        spread = 100.0 * (fast.median - slow.median) / fast.median if fast.median else 0.0
        if spread > limit_pct:
            warnings.append(f"{name}: {slow.device} is {spread:.1f}% below {fast.device} "
                            f"({slow.median:g} vs {fast.median:g} {fast.unit}) on {model} GPUs of this host")
    return warnings


# ---- CPU ----------------------------------------------------------------------------------------
def cpu_inventory() -> dict[str, Any]:
    import torch

    caches = _cpu_caches()
    return {"label": "cpu", "kind": "cpu", "name": _cpu_model(), "logical_cores": os.cpu_count(),
            "threads": torch.get_num_threads(), "memory_bytes": _meminfo_total(),
            "l2_bytes_per_core": caches.get(2), "llc_bytes": caches.get(max(caches)) if caches else None,
            "machine": platform.machine()}


def cpu_tasks(plan: Plan, shape: Optional[ModelShape], budget: MemoryBudget) -> tuple[list[Task], list[str]]:
    """The CPU benchmarks sized to the memory budget, and the notes on what was shrunk to fit."""
    import torch

    from llmctl.bench import kernels as k

    cpu = torch.device("cpu")
    timer = k.Timer(plan.warmup_s, plan.reps)
    caches = _cpu_caches()
    l2_total = (caches.get(2) or 2 * MIB) * (os.cpu_count() or 1)
    llc = caches.get(max(caches)) if caches else 32 * MIB
    copy_bytes = max(256 * MIB, plan.cpu_copy_llc_multiple * llc)
    if budget.bytes is not None:  # four buffers of copy_bytes: half the budget at most
        copy_bytes = max(16 * MIB, min(copy_bytes, budget.bytes // 8))
    decode, note = cpu_decode_shape(shape or BUILTIN[plan.cpu_shape], budget)
    tasks: list[Task] = [
        ("GEMM fp32", "cpu", lambda: k.gemm(timer, cpu, "fp32", plan.cpu_gemm, l2_total)),
        ("GEMM bf16", "cpu", lambda: k.gemm(timer, cpu, "bf16", plan.cpu_gemm, l2_total)),
        ("memory copy", "cpu", lambda: k.memory_copy(timer, cpu, copy_bytes, peak_key=None)),
        ("memory read", "cpu", lambda: k.memory_read(timer, cpu, copy_bytes, peak_key=None)),
    ]
    if decode is not None:
        tasks.append((f"decode step {decode.name}", "cpu", lambda: k.decode_step(timer, cpu, torch.float32, decode)))
    return tasks, [note] if note else []


def _fp32_bytes(shape: ModelShape) -> int:
    return 4 * shape.linear_params


def cpu_decode_shape(wanted: ModelShape, budget: MemoryBudget) -> tuple[Optional[ModelShape], Optional[str]]:
    """The wanted shape when its float32 weights fit in CPU_MEMORY_SHARE of the budget, else the largest
    built-in shape that does (None when none does), with a note that says why."""
    room = None if budget.bytes is None else CPU_MEMORY_SHARE * budget.bytes
    if room is None or _fp32_bytes(wanted) <= room:
        return wanted, None
    why = (f"decode step: {wanted.name}'s float32 weights need {format_bytes(_fp32_bytes(wanted))}, more than "
           f"{CPU_MEMORY_SHARE:.0%} of the {budget.describe()} this process may use")
    fits = sorted((s for s in BUILTIN.values() if _fp32_bytes(s) <= room), key=lambda s: s.linear_params)
    if not fits:
        return None, why + "; no built-in shape fits either, so the decode step is skipped"
    return fits[-1], why + f"; measured {fits[-1].name} instead"


def run_cpu(plan: Plan, shape: Optional[ModelShape], progress: Progress, on_result: Optional[OnResult] = None,
            budget: Optional[MemoryBudget] = None) -> Report:
    from llmctl.bench.memory_budget import memory_budget

    report = Report("cpu", plan.mode, [cpu_inventory()])
    report.notes.append("CPUs have no datasheet peak in the spec table: % of peak shows '—'")
    tasks, notes = cpu_tasks(plan, shape, budget or memory_budget())
    report.notes += notes
    _run_tasks(tasks, {}, report, progress, on_result)
    report.warnings += noise_warnings(report.results)
    return report


def _cpu_caches() -> dict[int, int]:
    """Cache size in bytes by level, from sysfs (data/unified caches of cpu0)."""
    root = Path("/sys/devices/system/cpu/cpu0/cache")
    sizes: dict[int, int] = {}
    for index in sorted(root.glob("index*")):
        try:
            if (index / "type").read_text().strip() == "Instruction":
                continue
            level = int((index / "level").read_text())
            sizes[level] = _parse_size((index / "size").read_text().strip())
        except (OSError, ValueError):
            continue
    return sizes


def _parse_size(text: str) -> int:
    units = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}
    return int(text[:-1]) * units[text[-1]] if text[-1] in units else int(text)


def _cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def _meminfo_total() -> Optional[int]:
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemTotal:"):
                return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return None


# ---- CUDA ---------------------------------------------------------------------------------------
def gpu_inventory(index: int, nvml: Any) -> dict[str, Any]:
    import torch

    props = torch.cuda.get_device_properties(index)
    spec = lookup(props.name)
    entry: dict[str, Any] = {
        "label": f"cuda:{index}", "kind": "cuda", "index": index, "name": props.name,
        "product": spec.product if spec else None, "memory_bytes": props.total_memory,
        "compute_capability": f"{props.major}.{props.minor}", "sm_count": props.multi_processor_count,
        "l2_bytes": getattr(props, "L2_cache_size", None), "cuda_version": torch.version.cuda,
        "driver_version": nvml.call("nvmlSystemGetDriverVersion") if nvml else None,
        "pcie": _pcie_link(nvml, _nvml_handle(nvml, props)),
    }
    if spec is not None:
        entry["datasheet_pcie"] = f"gen{spec.pcie_gen} x{spec.pcie_width}"
    return entry


def _nvml_handle(nvml: Any, props: Any) -> Any:
    """NVML's handle for a torch device, matched by UUID (torch and NVML may number GPUs differently,
    e.g. under CUDA_VISIBLE_DEVICES); None when NVML is unavailable or the UUID cannot be matched."""
    if nvml is None:
        return None
    uuid = getattr(props, "uuid", None)
    if uuid is not None:
        text = str(uuid)
        handle = nvml.call("nvmlDeviceGetHandleByUUID", text if text.startswith(("GPU-", "MIG-")) else f"GPU-{text}")
        if handle is not None:
            return handle
    return None


def _pcie_link(nvml: Any, handle: Any) -> Optional[dict[str, Any]]:
    if nvml is None or handle is None:
        return None
    return {"current_gen": nvml.call("nvmlDeviceGetCurrPcieLinkGeneration", handle),
            "current_width": nvml.call("nvmlDeviceGetCurrPcieLinkWidth", handle),
            "max_gen": nvml.call("nvmlDeviceGetMaxPcieLinkGeneration", handle),
            "max_width": nvml.call("nvmlDeviceGetMaxPcieLinkWidth", handle)}


def gpu_tasks(plan: Plan, index: int, shape: Optional[ModelShape], link: Callable[[], Any]) -> list[Task]:
    import torch

    from llmctl.bench import kernels as k

    device = torch.device("cuda", index)
    props = torch.cuda.get_device_properties(index)
    timer = k.CudaTimer(plan.warmup_s, plan.reps, device)
    l2 = getattr(props, "L2_cache_size", 0) or 64 * MIB
    copy_bytes = min(max(plan.gpu_copy_min, 16 * l2), props.total_memory // 8)  # four buffers: half the GPU at most
    capability = (props.major, props.minor)
    label = f"cuda:{index}"
    half = torch.bfloat16 if capability >= (8, 0) else torch.float16
    flash_ok = capability >= (8, 0)  # flash-attn 2 kernels exist for Ampere and newer only
    kinds = ["bf16", "fp16", "tf32", "fp32"] if capability >= (8, 0) else ["fp16", "fp32"]
    if capability >= (8, 9):  # Ada and Hopper have fp8 tensor cores
        kinds.append("fp8")
    tasks: list[Task] = [(f"GEMM {kind}", label, lambda kind=kind: k.gemm(timer, device, kind, plan.gpu_gemm, l2))
                         for kind in kinds]
    tasks += [
        ("memory copy", label, lambda: k.memory_copy(timer, device, copy_bytes)),
        ("memory read", label, lambda: k.memory_read(timer, device, copy_bytes)),
        ("host→device", label, lambda: _with_link(k.host_transfer(timer, device, plan.transfer_bytes, "h2d"), link)),
        ("device→host", label, lambda: _with_link(k.host_transfer(timer, device, plan.transfer_bytes, "d2h"), link)),
        ("host↔device", label, lambda: _with_link(k.host_transfer_bidirectional(timer, device, plan.transfer_bytes),
                                                  link)),
        ("attention prefill", label, lambda: k.attention_prefill(
            timer, device, half, k.AttentionShape(*plan.attention_prefill), use_flash=flash_ok)),
        ("attention decode", label, lambda: k.attention_decode(
            timer, device, half, k.AttentionShape(*plan.attention_decode), use_flash=flash_ok)),
    ]
    chosen = shape or _gpu_shape(plan, props, half)
    tasks.append((f"decode step {chosen.name}", label, lambda: k.decode_step(timer, device, half, chosen)))
    return tasks


def _gpu_shape(plan: Plan, props: Any, dtype: Any) -> ModelShape:
    """The plan's default shape, or the small one when its weights would not fit in 60% of the GPU."""
    shape = BUILTIN[plan.gpu_shape]
    elt = 2 if str(dtype).endswith(("bfloat16", "float16")) else 4
    return shape if shape.linear_params * elt < 0.6 * props.total_memory else BUILTIN["qwen2.5-0.5b"]


def _with_link(measured: Any, link: Callable[[], Any]) -> Any:
    """Record the PCIe link NVML reports right after the transfer (idle links may train down)."""
    measured.params["pcie_link_after_test"] = link()
    return measured


def peer_tasks(plan: Plan, count: int) -> list[Task]:
    """The peer-copy matrix, nvbandwidth-style: cuda:i -> cuda:j for every ordered pair i != j."""
    import torch

    from llmctl.bench import kernels as k

    tasks: list[Task] = []
    for i, j in ((i, j) for i in range(count) for j in range(count) if i != j):
        src, dst = torch.device("cuda", i), torch.device("cuda", j)
        tasks.append((f"peer copy {i}→{j}", f"cuda:{i}->cuda:{j}",
                      lambda src=src, dst=dst: k.peer_copy(src, dst, plan.transfer_bytes, plan.warmup_s, plan.reps)))
    return tasks


def run_gpu(plan: Plan, shape: Optional[ModelShape], progress: Progress, on_result: Optional[OnResult] = None) -> Report:
    import torch

    from llmctl.checks.probe import open_nvml

    count = torch.cuda.device_count()
    with open_nvml() as (nvml, reason, _mismatch):
        devices = [gpu_inventory(i, nvml) for i in range(count)]
        report = Report("cuda", plan.mode, devices)
        if nvml is None:
            report.notes.append(f"NVML unavailable ({reason}): no driver version or PCIe link in the inventory")
        specs = {d["label"]: lookup(d["name"]) for d in devices}
        for d in devices:
            if specs[d["label"]] is None:
                report.notes.append(f"{d['label']} ({d['name']}): no peak known (not in the datasheet table, "
                                    "llmctl/bench/specs.py): % of peak shows '—'")
        tasks: list[Task] = []
        for i in range(count):
            props = torch.cuda.get_device_properties(i)
            handle = _nvml_handle(nvml, props)
            tasks += gpu_tasks(plan, i, shape, lambda handle=handle: _pcie_link(nvml, handle))
        if count > 1:
            tasks += peer_tasks(plan, count)
        _run_tasks(tasks, specs, report, progress, on_result)
    if count > 1:
        _allreduce_sweep(plan, count, report, on_result)
    report.notes += _link_notes(devices)
    report.warnings += spread_warnings(report.results, devices) + noise_warnings(report.results)
    return report


def run_gpu_stress(duration_s: float, progress: Progress, on_result: Optional[OnResult] = None) -> Report:
    """`--stress`: checked GEMMs on every GPU for duration_s with NVML telemetry (llmctl.bench.stress)."""
    import torch

    from llmctl.bench.stress import run_stress
    from llmctl.checks.probe import open_nvml

    count = torch.cuda.device_count()
    with open_nvml() as (nvml, _reason, _mismatch):
        report = Report("cuda", "stress", [gpu_inventory(i, nvml) for i in range(count)])
        handles = {f"cuda:{i}": _nvml_handle(nvml, torch.cuda.get_device_properties(i)) for i in range(count)}
        run_stress(duration_s, report, handles, nvml, progress, on_result)
    return report


def _allreduce_sweep(plan: Plan, count: int, report: Report, on_result: Optional[OnResult]) -> None:
    """nccl-tests-style all-reduce over every local GPU (one spawned process each); wrong sums are errors."""
    from llmctl.bench import collectives

    device = f"cuda:0-{count - 1}"
    try:
        rows = collectives.allreduce_sweep(count, list(plan.allreduce_sizes), "nccl", reps=min(plan.reps, 20))
    except Exception as exc:  # noqa: BLE001 - a failed rank (NCCL error, spawn failure) is one failed figure
        report.errors.append({"benchmark": "all-reduce sweep", "device": device, "error": one_line(exc)[:300]})
        return
    for row in rows:
        report.results.append(to_result(collectives.to_measured(row, count, "nccl"), device, None))
        if on_result is not None:
            on_result(report.results[-1])
        if row.wrong_elements:
            report.errors.append({"benchmark": f"all-reduce {row.nbytes} bytes", "device": device,
                                  "error": f"{row.wrong_elements} element(s) of the sums were wrong"})


def _link_notes(devices: list[dict[str, Any]]) -> list[str]:
    notes = []
    for d in devices:
        spec, link = lookup(d["name"]), d.get("pcie")
        if spec and link and link.get("max_gen") and link.get("max_width"):
            if (link["max_gen"], link["max_width"]) < (spec.pcie_gen, spec.pcie_width):
                notes.append(f"{d['label']}: NVML reports at most PCIe gen{link['max_gen']} x{link['max_width']} "
                             f"(datasheet gen{spec.pcie_gen} x{spec.pcie_width}); host transfers are judged "
                             "against the datasheet link")
    return notes


# ---- shared -------------------------------------------------------------------------------------
def _run_tasks(tasks: list[Task], specs: dict[str, Optional[GpuSpec]], report: Report, progress: Progress,
               on_result: Optional[OnResult] = None) -> None:
    """Run each task once, handing each figure to on_result as it completes; a failing one (out of
    memory, unsupported kernel) is recorded in `report.errors` and the rest still run."""
    import torch

    for done, (label, device, task) in enumerate(tasks):
        progress(f"{device} {label}", done, len(tasks))
        try:
            with _current_device(device):
                measured = task()
        # AssertionError: flash-attn checks its inputs with assert; TypeError: a torch or flash-attn whose
        # signature moved (torch._scaled_mm has changed across releases). Either is one failed figure.
        except (RuntimeError, ValueError, NotImplementedError, AssertionError, TypeError) as exc:
            report.errors.append({"benchmark": label, "device": device, "error": one_line(exc)[:300]})
        else:
            spec = specs.get(device.split("->")[0]) if "->" not in device else None
            report.results.append(to_result(measured, device, spec))
            if on_result is not None:
                on_result(report.results[-1])
        finally:
            gc.collect()
            if torch.cuda.is_available():
                torch.cuda.empty_cache()
    progress("done", len(tasks), len(tasks))


def _current_device(label: str) -> Any:
    """CUDA events record on the current device's stream and graphs capture on it: make the benchmarked
    GPU current (for a peer copy, its source)."""
    import contextlib

    import torch

    if not label.startswith("cuda:"):
        return contextlib.nullcontext()
    return torch.cuda.device(int(label.split("->")[0].split(":")[1]))

