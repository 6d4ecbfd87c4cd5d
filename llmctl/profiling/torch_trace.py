"""`llmctl profile torch`: run engine steps under `torch.profiler` and keep the operator view.

The workload is `batch_size` random-token prompts of `input_len` tokens generating `output_len`
tokens each, driven through `LLMEngine.add_request`/`step` directly; finished requests are replaced
at once so every profiled step sees a full batch. The profiler schedule skips `wait` steps, warms up
for `warmup` and records `active`; the recorded window is exported as a Chrome/Perfetto trace
(`trace.json.gz`) and summarised with `key_averages()`.
"""

from __future__ import annotations

import contextlib
import random
from dataclasses import dataclass
from typing import Any, Iterator, Optional

from llmctl.errors import UserError
from llmctl.profiling import ui
from llmctl.profiling.artifacts import Manifest

TRACE_NAME = "trace.json.gz"
TABLE_NAME = "ops.txt"
SNAPSHOT_NAME = "memory_snapshot.pickle"  # what https://pytorch.org/memory_viz reads
SNAPSHOT_MAX_ENTRIES = 100_000  # allocation events kept by the CUDA caching allocator's history
SORT_KEYS = ("self_cpu_time_total", "cpu_time_total", "self_device_time_total", "device_time_total", "count",
             "self_cpu_memory_usage", "cpu_memory_usage")

DEFAULT_SCHEDULE = {"wait": 1, "warmup": 1, "active": 3}
# Which default part gives way first when --steps is shorter than the default schedule: the steps
# before profiling, then recorded steps (down to one), and the profiler's warm-up step last (the
# first step it records after starting carries its set-up cost).
SHRINK_ORDER = (("wait", 0), ("active", 1), ("warmup", 0))


def fit_schedule(steps: Optional[int], wait: Optional[int], warmup: Optional[int],
                 active: Optional[int]) -> tuple[dict[str, int], bool]:
    """The schedule (wait, warmup, active) for `--steps`; parts not given take their defaults, and
    those shrink until the schedule fits in `steps`. Returns it and whether a default was shrunk."""
    given = {"wait": wait, "warmup": warmup, "active": active}
    sched = {k: DEFAULT_SCHEDULE[k] if v is None else v for k, v in given.items()}
    shrunk = False
    for name, floor in SHRINK_ORDER:
        while steps is not None and sum(sched.values()) > steps and given[name] is None and sched[name] > floor:
            sched[name] -= 1
            shrunk = True
    return sched, shrunk


@dataclass
class TorchPlan:
    engine_args: Any
    batch_size: int = 4
    input_len: int = 32
    output_len: int = 16
    wait: int = 1
    warmup: int = 1
    active: int = 3
    steps: Optional[int] = None
    sort_by: str = "self_cpu_time_total"
    row_limit: int = 20
    record_shapes: bool = True
    seed: int = 0
    with_stack: bool = False  # Python/C++ call stacks per op (larger trace, slower)
    profile_memory: bool = False  # tensor allocations and frees per op
    with_flops: bool = False  # FLOP estimates for matmul and convolution ops
    memory_snapshot: bool = False  # CUDA caching-allocator history -> memory_snapshot.pickle

    @property
    def total_steps(self) -> int:
        return self.steps if self.steps is not None else self.wait + self.warmup + self.active

    def validate(self) -> None:
        for name in ("batch_size", "input_len", "output_len", "active", "row_limit"):
            if getattr(self, name) < 1:
                raise UserError(f"--{name.replace('_', '-')} must be >= 1")
        if self.wait < 0 or self.warmup < 0:
            raise UserError("--wait and --warmup must be >= 0")
        if self.total_steps < self.wait + self.warmup + self.active:
            raise UserError(f"--steps {self.total_steps} is shorter than the schedule "
                            f"(wait {self.wait} + warmup {self.warmup} + active {self.active})")
        if self.sort_by not in SORT_KEYS:
            raise UserError(f"--sort-by must be one of {', '.join(SORT_KEYS)}")
        if self.memory_snapshot and not _cuda_planned(self.engine_args):
            raise UserError("--memory-snapshot records the CUDA caching allocator and needs a CUDA device "
                            f"(--device {getattr(self.engine_args, 'device', 'auto')}; torch.cuda.is_available() "
                            "is False or the device is cpu)")


def _cuda_planned(engine_args: Any) -> bool:
    import torch

    device = str(getattr(engine_args, "device", "auto"))
    return device != "cpu" and torch.cuda.is_available()


def run_torch(plan: TorchPlan, manifest: Manifest) -> str:
    """Profile the engine steps; returns the operator table and fills in `manifest`."""
    import torch
    from torch.profiler import ProfilerActivity, profile, schedule

    from llmctl.profiling import quiet_kineto

    plan.validate()
    quiet_kineto()
    with ui.waiting("loading model"):
        engine = _engine(plan.engine_args)
    _check_lengths(plan, engine)
    device = engine.executor.device
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    trace = manifest.output_dir / TRACE_NAME
    feeder = _Feeder(engine, plan)
    sched = schedule(wait=plan.wait, warmup=plan.warmup, active=plan.active, repeat=1)
    with _memory_history(plan, manifest), \
            profile(activities=activities, record_shapes=plan.record_shapes, schedule=sched,
                    with_stack=plan.with_stack, profile_memory=plan.profile_memory, with_flops=plan.with_flops,
                    on_trace_ready=lambda prof: prof.export_chrome_trace(str(trace))) as prof:
        with ui.steps("engine steps", plan.total_steps) as bar:
            for _ in range(plan.total_steps):
                feeder.top_up()
                engine.step()
                if device.type == "cuda":
                    torch.cuda.synchronize(device)  # so the step's kernels land inside its profiler step
                prof.step()
                bar.advance()
    averages = prof.key_averages()
    table = averages.table(sort_by=plan.sort_by, row_limit=plan.row_limit)
    (manifest.output_dir / TABLE_NAME).write_text(table + "\n")
    manifest.add_file(trace)
    manifest.add_file(manifest.output_dir / TABLE_NAME)
    manifest.result.update(
        device=str(device), dtype=str(engine.executor.dtype).replace("torch.", ""), steps=plan.total_steps,
        schedule={"wait": plan.wait, "warmup": plan.warmup, "active": plan.active},
        batch_size=plan.batch_size, input_len=plan.input_len, output_len=plan.output_len,
        requests_started=feeder.count, trace=TRACE_NAME if trace.exists() else None,
        sort_by=plan.sort_by, ops=op_rows(averages, plan.sort_by, plan.row_limit, device.type == "cuda"),
        options={"with_stack": plan.with_stack, "profile_memory": plan.profile_memory, "with_flops": plan.with_flops,
                 "memory_snapshot": SNAPSHOT_NAME if plan.memory_snapshot else None},
    )
    if not trace.exists():
        manifest.finish("tool_failed", None, "torch.profiler exported no trace")
    else:
        manifest.finish("ok")
    manifest.write()
    return table


@contextlib.contextmanager
def _memory_history(plan: TorchPlan, manifest: Manifest) -> Iterator[None]:
    """With --memory-snapshot: record the CUDA caching allocator's history around the profiled steps and
    dump it as a pickle that https://pytorch.org/memory_viz opens."""
    if not plan.memory_snapshot:
        yield
        return
    import torch

    torch.cuda.memory._record_memory_history(max_entries=SNAPSHOT_MAX_ENTRIES)
    try:
        yield
        path = manifest.output_dir / SNAPSHOT_NAME
        torch.cuda.memory._dump_snapshot(str(path))
        manifest.add_file(path)
    finally:
        torch.cuda.memory._record_memory_history(enabled=None)


def _engine(args):
    from llmctl.engine import LLMEngine

    return LLMEngine(args)


def _check_lengths(plan: TorchPlan, engine) -> None:
    need = plan.input_len + plan.output_len
    if need > engine.max_model_len:
        raise UserError(f"--input-len {plan.input_len} + --output-len {plan.output_len} = {need} tokens exceeds the "
                        f"model's max_model_len {engine.max_model_len}")


class _Feeder:
    """Keeps `batch_size` requests in flight: a finished request is replaced before the next step."""

    def __init__(self, engine, plan: TorchPlan):
        from llmctl.engine import SamplingParams

        self.engine, self.plan = engine, plan
        self.rng = random.Random(plan.seed)
        self.params = SamplingParams(max_tokens=plan.output_len, ignore_eos=True, temperature=0.0)
        self.count = 0

    def top_up(self) -> None:
        for _ in range(self.plan.batch_size - len(self.engine.requests)):  # finished ones are dropped by step()
            prompt = [self.rng.randrange(self.engine.vocab_size) for _ in range(self.plan.input_len)]
            self.engine.add_request(f"profile-{self.count}", prompt, self.params)
            self.count += 1


def op_rows(averages, sort_by: str, limit: int, with_device: bool) -> list[dict[str, Any]]:
    """One JSON row per operator: name, calls, self/total CPU time (us) and, on CUDA, device time."""
    ordered = sorted(averages, key=lambda evt: getattr(evt, sort_by), reverse=True)[:limit]
    rows = []
    for evt in ordered:
        row = {"name": evt.key, "calls": evt.count, "self_cpu_time_us": round(evt.self_cpu_time_total, 3),
               "cpu_time_total_us": round(evt.cpu_time_total, 3)}
        if with_device:
            row.update(self_device_time_us=round(evt.self_device_time_total, 3),
                       device_time_total_us=round(evt.device_time_total, 3))
        rows.append(row)
    return rows
