"""`bench --gpu --stress`'s logic on the CPU: the duration flag, the result check against the reference
(with injected corruption), GEMM rounds, NVML telemetry from a fake NVML, and faults that appear
during the run from recorded kernel-log lines and ECC counts."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch

from doctor_fixtures import FakeNvml, h100
from llmctl.bench import stress
from llmctl.checks.kernel_log import parse_events
from llmctl.checks.probe import NvmlView

XID_79 = "NVRM: Xid (PCI:0000:3b:00): 79, pid=2211, name=python3, GPU has fallen off the bus."
XID_13 = "NVRM: Xid (PCI:0000:17:00): 13, pid=881, name=python, Graphics Exception"


@pytest.mark.parametrize("text, seconds", [("60", 60.0), ("90s", 90.0), ("5m", 300.0), ("1h", 3600.0), ("0.5", 0.5)])
def test_parse_duration(text, seconds):
    assert stress.parse_duration(text) == seconds


@pytest.mark.parametrize("text", ["", "0", "-5", "5d", "soon"])
def test_parse_duration_refuses_nonsense(text):
    with pytest.raises(ValueError, match="--stress"):
        stress.parse_duration(text)


def test_count_mismatches_finds_corrupted_elements_only():
    reference = torch.randn(64, 64)
    result = reference.clone()
    assert int(stress.count_mismatches(result, reference)) == 0
    result += 1e-6 * torch.randn(64, 64)  # rounding-sized noise is not an error
    assert int(stress.count_mismatches(result, reference)) == 0
    result[3, 5] += 0.5
    result[10, 7] = float("nan")
    assert int(stress.count_mismatches(result, reference)) == 2


def test_gemm_rounds_on_the_cpu_count_work_and_catch_a_bad_reference():
    state = stress.prepare(torch.device("cpu"), 32)
    rates = stress.run_interval([state], 0.02, lambda device: None)
    assert len(rates) == 1 and rates[0] > 0 and state.gemms >= 1 and int(state.errors) == 0
    state.reference[0, 0] += 1.0  # as if the device computed one element wrong from now on
    stress.run_interval([state], 0.0, lambda device: None)
    assert int(state.errors) >= 1


def test_telemetry_samples_and_names_throttle_reasons():
    nvml = NvmlView(FakeNvml([h100(0, nvmlDeviceGetPowerUsage=650_000, nvmlDeviceGetCurrentClocksEventReasons=0x45)]))
    telemetry = stress.GpuTelemetry()
    for _ in range(3):
        telemetry.sample(nvml, 0)
    summary = telemetry.summary()
    assert summary["samples"] == 3 and summary["temperature_c"] == {"min": 35, "median": 35, "max": 35}
    assert summary["power_w"]["max"] == 650.0 and summary["sm_clock_mhz"]["median"] == 345
    assert summary["clock_event_reasons"] == ["sw_power_cap", "hw_thermal_slowdown"]
    assert stress.GpuTelemetry().summary()["power_w"] is None


def test_new_xids_and_ecc_errors_during_the_run_are_faults():
    before = parse_events((XID_13,))
    after = parse_events((XID_13, XID_79))
    faults = stress.new_faults(before, after, {"cuda:0": 0, "cuda:1": 2}, {"cuda:0": 0, "cuda:1": 5})
    assert len(faults) == 2
    assert faults[0].startswith("XID 79 on PCI 0000:3b:00 during the stress run")
    assert faults[1] == "cuda:1: 3 new volatile uncorrected ECC error(s) during the stress run"
    assert stress.new_faults(before, before, {"cuda:0": None}, {"cuda:0": None}) == []


@pytest.mark.parametrize("args, message", [
    (["--cpu", "--stress", "10"], "needs a CUDA device"),
    (["--stress", "soon"], "give a positive duration"),
])
def test_stress_flag_errors(args, message):
    if not torch.cuda.is_available() or "--cpu" in args or "soon" in args:
        proc = subprocess.run([sys.executable, "-m", "llmctl.cli", "bench", *args], capture_output=True, text=True,
                              timeout=120)
        assert proc.returncode == 2 and message in proc.stderr and proc.stderr.count("\n") == 1


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_stress_reports_checked_gemms_and_telemetry_per_gpu():
    import json

    proc = subprocess.run([sys.executable, "-m", "llmctl.cli", "bench", "--gpu", "--stress", "3", "--json"],
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    doc = json.loads(proc.stdout)
    rows = [r for r in doc["results"] if r["name"] == "stress_gemm"]
    assert [r["device"] for r in rows] == [f"cuda:{i}" for i in range(torch.cuda.device_count())]
    for row in rows:
        assert row["params"]["compute_errors"] == 0 and row["params"]["gemms"] > 0 and row["median"] > 1
        assert row["params"]["telemetry"]["samples"] == row["repeats"] == 3
