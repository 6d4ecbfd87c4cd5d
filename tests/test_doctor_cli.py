"""`llmctl doctor` end to end on this machine, plus the command's options, JSON and exit codes."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from doctor_fixtures import FakeNvml, h100, make_host, plan
from llmctl.checks.model import Result, Status
from llmctl.checks.registry import CHECKS, select
from llmctl.checks.runner import exit_code, report, run_checks, run_one
from llmctl.checks.settings import Thresholds, parse_thresholds
from llmctl.cli import run

IDS = [
    "gpu-visible", "gpu-persistence-mode", "gpu-clocks-consistent", "gpu-throttle-reasons", "gpu-thermal-power", "gpu-ecc",
    "gpu-memory-health", "gpu-memory-free", "gpu-mig-mode", "gpu-compute-mode", "gpu-xid-events", "pcie-link",
    "gpu-topology", "nvlink-errors", "fabric-manager", "rdma-peermem", "iommu-acs", "tp-rendezvous",
    "numa-balancing", "cpu-governor", "ulimits", "thp", "swap", "shm-size", "driver-version", "cuda-torch-compat",
    "disk-space-model", "cgroup-limits",
]
NVML_CHECKS = IDS[:10] + ["pcie-link", "gpu-topology", "nvlink-errors"]


def llmctl(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "llmctl.cli", *args], capture_output=True, text=True, timeout=120)


@pytest.fixture(scope="module")
def real_json():
    """One real `llmctl doctor --json` run on this machine, shared by the end-to-end assertions."""
    return llmctl("doctor", "--json")


def test_ids_are_the_interface():
    assert [c.id for c in CHECKS] == IDS


def test_real_doctor_json_on_this_machine(real_json):
    assert real_json.returncode == 0, real_json.stderr
    report = json.loads(real_json.stdout)
    assert report["schema_version"] == 1
    assert [r["id"] for r in report["results"]] == IDS
    for key in ("os", "kernel", "cpu", "python", "torch", "torch_cuda", "cudnn", "nccl", "driver", "flash_attn", "gpus"):
        assert key in report["host"]
    by_id = {r["id"]: r for r in report["results"]}
    if report["host"]["gpus"] == []:  # this machine: no GPU, so every NVML check skips with its reason
        for check_id in NVML_CHECKS:
            assert by_id[check_id]["status"] == "skip" and by_id[check_id]["summary"], check_id
    assert report["summary"]["total"] == 28 and report["summary"]["exit_code"] == 0


def test_expect_gpus_fails_on_a_host_without_them(real_json):
    """On this GPU-less machine `--expect-gpus 1` must exit 1; a GPU host is asked for more than it has."""
    wanted = 64 if json.loads(real_json.stdout)["host"]["gpus"] else 1
    proc = llmctl("doctor", "--json", "--expect-gpus", str(wanted))
    assert proc.returncode == 1
    report = json.loads(proc.stdout)
    assert len(report["results"]) == 28
    visible = next(r for r in report["results"] if r["id"] == "gpu-visible")
    assert visible["status"] == "fail" and f"expected {wanted} GPU(s)" in visible["summary"]


def test_table_output_when_piped_is_plain(capsys):
    code = run(["doctor", "--only", "swap,thp", "--skip", "thp"])
    out = capsys.readouterr().out
    assert code in (0, 1)
    assert "\x1b[" not in out
    assert "swap" in out and "thp" not in out.replace("checks:", "")
    assert out.strip().splitlines()[-1].startswith("1 checks:")


def test_list_and_explain(capsys):
    assert run(["doctor", "--list"]) == 0
    lines = capsys.readouterr().out.strip().splitlines()
    assert [line.split()[0] for line in lines] == IDS + ["server-ready"]  # the deployment check (--server) last
    assert run(["doctor", "--explain", "numa-balancing", "--json"]) == 0
    explained = json.loads(capsys.readouterr().out)
    assert explained["id"] == "numa-balancing" and "NUMA" in explained["explain"]
    assert run(["doctor", "--explain", "shm-size", "--thresholds", "shm-min-gib=8"]) == 0
    assert "shm_min_gib=8.0" in capsys.readouterr().out


@pytest.mark.parametrize("args, message", [
    (["--only", "gpu-visible,nope"], "--only: unknown check id(s) nope"),
    (["--skip", "bogus"], "--skip: unknown check id(s) bogus"),
    (["--explain", "bogus"], "--explain: unknown check id 'bogus'"),
    (["--thresholds", "no-such=1"], "unknown threshold 'no-such'"),
    (["--thresholds", "shm-min-gib=lots"], "threshold shm_min_gib: expected float"),
])
def test_usage_errors_exit_2_with_one_line(args, message, capsys):
    assert run(["doctor", *args]) == 2
    err = capsys.readouterr().err
    assert message in err and err.count("\n") == 1 and err.startswith("llmctl: error: ")


def test_thresholds_come_from_the_yaml_config(tmp_path, capsys):
    config = tmp_path / "doctor.yaml"
    config.write_text("strict: true\nthresholds:\n  shm-min-gib: 100000\n  thp-allowed: [always]\n")
    code = run(["doctor", "--config", str(config), "--only", "shm-size", "--json"])
    result = json.loads(capsys.readouterr().out)
    assert result["plan"]["thresholds"]["shm_min_gib"] == 100000 and result["plan"]["thresholds"]["thp_allowed"] == ["always"]
    assert result["summary"]["strict"] is True
    assert result["results"][0]["status"] in ("fail", "skip")
    assert code == (1 if result["results"][0]["status"] == "fail" else 0)


def test_parse_thresholds_types():
    t = parse_thresholds({"nofile-min": "1024", "mig_allowed": "yes", "thp_allowed": "madvise|never"})
    assert t == Thresholds(nofile_min=1024, mig_allowed=True, thp_allowed=("madvise", "never"))
    with pytest.raises(ValueError):
        parse_thresholds({"nofile_min": True})
    with pytest.raises(ValueError):
        parse_thresholds("nofile_min")


def test_exit_codes_and_strict():
    warn = [Result("swap", Status.WARN, "w"), Result("thp", Status.PASS, "p")]
    assert exit_code(warn, strict=False) == 0 and exit_code(warn, strict=True) == 1
    assert exit_code([Result("thp", Status.FAIL, "f"), Result("swap", Status.SKIP, "s")], strict=False) == 1
    assert exit_code([Result("thp", Status.SKIP, "s"), Result("swap", Status.INFO, "i")], strict=True) == 0


def test_a_crashing_check_becomes_a_warning_and_others_still_run(tmp_path):
    crashing = CHECKS[0].__class__("gpu-visible", "GPU", "t", lambda host, plan: 1 / 0)
    result = run_one(crashing, make_host(tmp_path), plan())
    assert result.status == Status.WARN and "ZeroDivisionError" in result.summary


def test_full_run_on_a_fake_two_gpu_host_is_json_serialisable(tmp_path):
    host = make_host(tmp_path, FakeNvml([h100(0), h100(1, nvmlDeviceGetPersistenceMode=0)]))
    checks = select([], [])
    results = run_checks(checks, host, plan())
    data = json.loads(json.dumps(report(results, checks, host, plan(), strict=False, started=0.0)))
    by_id = {r["id"]: r for r in data["results"]}
    assert by_id["gpu-persistence-mode"]["status"] == "fail" and by_id["gpu-persistence-mode"]["fix"] == "sudo nvidia-smi -pm 1"
    assert data["summary"]["exit_code"] == 1
    assert [g["bus_id"] for g in data["host"]["gpus"]] == ["0000:17:00.0", "0000:18:00.0"]
    assert data["host"]["driver"] == "550.54.15" and data["host"]["driver_cuda"] == "12.4"


def test_docs_list_every_check_and_threshold_default():
    import dataclasses
    from pathlib import Path

    docs = (Path(__file__).resolve().parent.parent / "docs" / "doctor.md").read_text()
    for check_id in IDS:
        assert f"`{check_id}`" in docs, check_id
    for field in dataclasses.fields(Thresholds):
        default = field.default
        shown = ", ".join(default) if isinstance(default, tuple) else str(default).lower() if isinstance(default, bool) else str(default)
        assert f"| `{field.name}` | {shown} |" in docs, field.name


def test_open_nvml_on_this_machine_reports_why_it_is_unavailable():
    from llmctl.checks.probe import open_nvml

    with open_nvml() as (view, reason, mismatch):
        if view is None:
            assert reason and mismatch is False
        else:
            assert view.count >= 0 and reason == ""


def test_pcie_load_probe_without_cuda_returns_an_empty_sample_with_the_reason():
    import torch

    from llmctl.checks.pcie_load import measure_under_load
    from llmctl.checks.probe import NvmlView

    view = NvmlView(FakeNvml([h100(0)]))
    assert measure_under_load(view, 0).note.startswith("load probe disabled")
    if not torch.cuda.is_available():
        sample = measure_under_load(view, 1.0)
        assert sample.readings == {} and sample.note == "torch has no usable CUDA"


def test_tp_rendezvous_from_the_command_line_and_the_environment(capsys, monkeypatch):
    """-tp / --master-port reach the plan (and the JSON report); LLMCTL_TENSOR_PARALLEL_SIZE is the same setting."""
    import socket

    with socket.socket() as holder:
        holder.bind(("127.0.0.1", 0))
        holder.listen()
        port = holder.getsockname()[1]
        code = run(["doctor", "--only", "tp-rendezvous", "-tp", "2", "--master-port", str(port), "--json"])
        report = json.loads(capsys.readouterr().out)
    assert code == 1 and report["results"][0]["status"] == "fail"
    assert f"127.0.0.1:{port} is in use" in report["results"][0]["summary"]
    assert (report["plan"]["tensor_parallel_size"], report["plan"]["master_port"]) == (2, port)
    monkeypatch.setenv("LLMCTL_TENSOR_PARALLEL_SIZE", "1")
    assert run(["doctor", "--only", "tp-rendezvous", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["results"][0]["status"] == "skip"
