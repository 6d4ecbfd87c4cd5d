"""`llmctl bench --gpu --stress DURATION`: sustained GEMMs on every GPU with each result checked
against a reference (gpu-burn style), NVML telemetry sampled beside every figure, and new XIDs or
ECC errors during the run reported as failures.

Each GPU multiplies the same two fp32 matrices (TF32 off, so every product is the exact same
computation) and compares every result with the first one; an element further than the tolerance
from it is a compute error, the count per GPU is the verdict. Work is queued on all GPUs at once
and the host synchronises once per sampling interval, where it reads clocks, temperature, power and
throttle reasons through NVML.
"""

from __future__ import annotations

import re
import statistics
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Optional

STRESS_SIZE = 8192  # gpu-burn's default matrix side
SAMPLE_S = 1.0  # one figure and one telemetry sample per GPU per interval
TOLERANCE = 1e-3  # |result - reference| above this (relative to the reference's magnitude) is an error
_DURATION = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([smh]?)\s*$")
_UNIT_S = {"": 1, "s": 1, "m": 60, "h": 3600}


def parse_duration(text: str) -> float:
    """`60`, `60s`, `5m`, `1h` -> seconds; ValueError otherwise."""
    match = _DURATION.match(text or "")
    if not match or float(match[1]) <= 0:
        raise ValueError(f"--stress {text!r}: give a positive duration such as 60, 90s, 5m or 1h")
    return float(match[1]) * _UNIT_S[match[2]]


def count_mismatches(result: Any, reference: Any, tolerance: float = TOLERANCE) -> Any:
    """Elements of result further than tolerance x max(1, |reference|) from reference, NaN included (a 0-d
    tensor, so the count stays on the device until the host reads it)."""
    import torch

    allowed = tolerance * torch.clamp(reference.abs(), min=1.0)
    return (~((result - reference).abs() <= allowed)).sum()  # NaN compares False: counted


@dataclass
class GpuTelemetry:
    """NVML samples of one GPU taken beside the figures."""

    sm_clock_mhz: list[int] = field(default_factory=list)
    temperature_c: list[int] = field(default_factory=list)
    power_w: list[float] = field(default_factory=list)
    throttle_masks: list[int] = field(default_factory=list)

    def sample(self, nvml: Any, handle: Any) -> None:
        if nvml is None or handle is None:
            return
        for values, value in ((self.sm_clock_mhz, nvml.call("nvmlDeviceGetClockInfo", handle, 1)),  # NVML_CLOCK_SM
                              (self.temperature_c, nvml.call("nvmlDeviceGetTemperature", handle, 0)),
                              (self.power_w, _watts(nvml.call("nvmlDeviceGetPowerUsage", handle))),
                              (self.throttle_masks, nvml.call("nvmlDeviceGetCurrentClocksEventReasons", handle))):
            if value is not None:
                values.append(value)

    def summary(self) -> dict[str, Any]:
        def span(values: list) -> Optional[dict[str, float]]:
            return {"min": min(values), "median": statistics.median(values), "max": max(values)} if values else None

        return {"sm_clock_mhz": span(self.sm_clock_mhz), "temperature_c": span(self.temperature_c),
                "power_w": span(self.power_w), "clock_event_reasons": throttle_names(_or(self.throttle_masks)),
                "samples": len(self.temperature_c)}


def _watts(milliwatts: Optional[int]) -> Optional[float]:
    return None if milliwatts is None else milliwatts / 1000


# nvmlClocksEventReason* bits worth naming under load (GPU idle 0x1 and app clocks 0x2 are not slowdowns)
_REASON_NAMES = {0x4: "sw_power_cap", 0x8: "hw_slowdown", 0x20: "sw_thermal_slowdown", 0x40: "hw_thermal_slowdown",
                 0x80: "hw_power_brake"}
HARDWARE_REASONS = 0x8 | 0x40 | 0x80


def throttle_names(mask: int) -> list[str]:
    return [name for bit, name in _REASON_NAMES.items() if mask & bit]


@dataclass
class StressState:
    """One GPU's operands, reference product and running error count (all on that GPU)."""

    device: Any
    a: Any
    b: Any
    reference: Any
    out: Any
    errors: Any
    gemms: int = 0


def prepare(device: Any, size: int) -> StressState:
    import torch

    generator = torch.Generator(device=device).manual_seed(1234)
    a = torch.randn((size, size), device=device, generator=generator)
    b = torch.randn((size, size), device=device, generator=generator)
    return StressState(device, a, b, a @ b, torch.empty_like(a), torch.zeros((), dtype=torch.int64, device=device))


def step(state: StressState) -> None:
    """Queue one GEMM and its check; nothing waits for the device here."""
    import torch

    torch.mm(state.a, state.b, out=state.out)
    state.errors += count_mismatches(state.out, state.reference)
    state.gemms += 1


def run_interval(states: list[StressState], seconds: float, sync: Callable[[Any], None]) -> list[float]:
    """Queue GEMMs round-robin on every GPU for about `seconds`; returns each GPU's TFLOP/s over it."""
    started = [s.gemms for s in states]
    begin = time.perf_counter()
    while True:
        for state in states:
            step(state)
        for state in states:  # bounded queue: wait for each GPU's latest GEMM before queuing the next round
            sync(state.device)
        if time.perf_counter() - begin >= seconds:
            break
    elapsed = time.perf_counter() - begin
    side = states[0].a.shape[0] if states else 0
    return [2.0 * side ** 3 * (s.gemms - n) / elapsed / 1e12 for s, n in zip(states, started)]


def new_faults(events_before: list[Any], events_after: list[Any], ecc_before: dict[str, Optional[int]],
               ecc_after: dict[str, Optional[int]]) -> list[str]:
    """XIDs/SXIDs logged and volatile uncorrected ECC errors counted during the run, one line each."""
    faults = [f"{e.kind} {e.code} on PCI {e.bus} during the stress run: {e.text[:120]}"
              for e in events_after[len(events_before):]]
    for label, after in ecc_after.items():
        before = ecc_before.get(label)
        if after is not None and before is not None and after > before:
            faults.append(f"{label}: {after - before} new volatile uncorrected ECC error(s) during the stress run")
    return faults


def _ecc(nvml: Any, handles: dict[str, Any]) -> dict[str, Optional[int]]:
    return {label: nvml.call("nvmlDeviceGetTotalEccErrors", h, 1, 0) if nvml and h is not None else None
            for label, h in handles.items()}  # UNCORRECTED, VOLATILE_ECC


def _xids() -> tuple[list[Any], Optional[str]]:
    from llmctl.checks.kernel_log import parse_events, read_kernel_log

    log = read_kernel_log()
    return parse_events(log.lines), (None if log.source else log.error)


def run_stress(duration_s: float, report: Any, handles: dict[str, Any], nvml: Any,
               progress: Callable[[str, int, int], None], on_result: Optional[Callable[[Any], None]]) -> None:
    """Stress every GPU in `handles` (label -> NVML handle) for duration_s; figures, telemetry and faults
    go into report (a hardware.Report)."""
    import torch

    from llmctl.bench.hardware import Result, to_result
    from llmctl.bench.kernels import Measured

    devices = [torch.device(label) for label in handles]
    events_before, log_error = _xids()
    ecc_before = _ecc(nvml, handles)
    previous = torch.get_float32_matmul_precision()
    torch.set_float32_matmul_precision("highest")  # plain fp32: every repetition is the same computation
    try:
        states = [prepare(device, STRESS_SIZE) for device in devices]
        telemetry = {label: GpuTelemetry() for label in handles}
        rates: dict[str, list[float]] = {label: [] for label in handles}
        intervals = max(1, round(duration_s / SAMPLE_S))
        for done in range(intervals):
            progress(f"stress {done * SAMPLE_S:.0f}/{duration_s:.0f} s", done, intervals)
            for label, rate in zip(handles, run_interval(states, SAMPLE_S, torch.cuda.synchronize)):
                rates[label].append(rate)
                telemetry[label].sample(nvml, handles[label])
        progress("done", intervals, intervals)
        errors = {label: int(state.errors.item()) for label, state in zip(handles, states)}
        gemms = {label: state.gemms for label, state in zip(handles, states)}
    finally:
        torch.set_float32_matmul_precision(previous)
    for label in handles:
        params = {"duration_s": duration_s, "size": STRESS_SIZE, "dtype": "fp32", "gemms": gemms[label],
                  "compute_errors": errors[label], "telemetry": telemetry[label].summary()}
        result: Result = to_result(Measured("stress_gemm", f"stress GEMM fp32 {STRESS_SIZE}³ checked", "TFLOP/s",
                                            rates[label], params), label, None)
        report.results.append(result)
        if on_result is not None:
            on_result(result)
        if errors[label]:
            report.errors.append({"benchmark": "stress", "device": label,
                                  "error": f"{errors[label]} wrong element(s) in {gemms[label]} checked GEMMs"})
        hardware_reasons = throttle_names(_or(telemetry[label].throttle_masks) & HARDWARE_REASONS)
        if hardware_reasons:
            report.warnings.append(f"{label}: {', '.join(hardware_reasons)} during the stress run")
    _report_faults(report, events_before, ecc_before, nvml, handles, log_error)


def _or(masks: list[int]) -> int:
    combined = 0
    for mask in masks:
        combined |= mask
    return combined


def _report_faults(report: Any, events_before: list[Any], ecc_before: dict[str, Optional[int]], nvml: Any,
                   handles: dict[str, Any], log_error: Optional[str]) -> None:
    events_after, _ = _xids()
    for fault in new_faults(events_before, events_after, ecc_before, _ecc(nvml, handles)):
        report.errors.append({"benchmark": "stress", "device": "host", "error": fault})
    if log_error:
        report.notes.append(f"kernel log not readable ({log_error}): XIDs during the stress run were not checked")
    if nvml is None:
        report.notes.append("NVML unavailable: no clocks, temperature, power or ECC beside the stress figures")
