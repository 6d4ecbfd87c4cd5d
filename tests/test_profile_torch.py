"""`llmctl profile torch` on the embedded default model: the trace is gzipped Chrome/Perfetto JSON,
the operator table and the --json rows list the model's matmul/attention ops."""

from __future__ import annotations

import gzip
import json
import os
import subprocess
import sys

import pytest

MATMUL_OPS = ("llmctl::gemm_amx_bf16", "llmctl::gemv_bf16", "llmctl::decode_stack", "aten::mm", "aten::linear", "aten::bmm", "aten::addmm", "aten::mv", "aten::matmul",
              "scaled_dot_product", "mkldnn::_linear_pointwise", "mkl::_mkl_linear")


def llmctl(*args: str) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if not k.startswith("LLMCTL_")}
    return subprocess.run([sys.executable, "-m", "llmctl.cli", "profile", "torch", *args], capture_output=True,
                          text=True, env={**env, "NO_COLOR": "1"}, timeout=300)


def test_trace_loads_and_table_lists_matmul_ops(tmp_path):
    out = tmp_path / "torch"
    proc = llmctl("--batch-size", "2", "--input-len", "16", "--output-len", "8", "--wait", "1", "--warmup", "1",
                  "--active", "2", "--row-limit", "40", "--num-threads", "1", "-o", str(out))
    assert proc.returncode == 0, proc.stderr
    trace = json.load(gzip.open(out / "trace.json.gz"))
    names = {event.get("name", "") for event in trace["traceEvents"]}
    assert sum(name.startswith("ProfilerStep#") for name in names) == 2  # exactly the active steps
    assert any(op in name for name in names for op in MATMUL_OPS)
    assert "Self CPU" in proc.stdout and any(op in proc.stdout for op in MATMUL_OPS)
    manifest = json.loads((out / "manifest.json").read_text())
    assert manifest["tool"]["name"] == "torch.profiler" and manifest["command"][:3] == ["llmctl", "profile", "torch"]
    assert "--active" in manifest["command"] and {"trace.json.gz", "ops.txt"} <= set(manifest["files"])


def test_json_rows_are_sorted_and_limited(tmp_path):
    proc = llmctl("--batch-size", "2", "--input-len", "8", "--output-len", "4", "--active", "1", "--sort-by", "count",
                  "--row-limit", "5", "--num-threads", "1", "--json", "-o", str(tmp_path / "t"))
    assert proc.returncode == 0, proc.stderr
    manifest = json.loads(proc.stdout)
    rows = manifest["result"]["ops"]
    assert len(rows) == 5 and [r["calls"] for r in rows] == sorted((r["calls"] for r in rows), reverse=True)
    assert set(rows[0]) == {"name", "calls", "self_cpu_time_us", "cpu_time_total_us"}  # no CUDA columns on CPU
    assert manifest["result"]["device"] == "cpu" and manifest["result"]["steps"] == 3


@pytest.mark.parametrize("steps, schedule", [(3, (0, 1, 2)), (2, (0, 1, 1)), (1, (0, 0, 1)), (5, (1, 1, 3)), (9, (1, 1, 3))])
def test_steps_shrink_the_default_schedule(steps, schedule):
    from llmctl.profiling.torch_trace import fit_schedule

    sched, shrunk = fit_schedule(steps, None, None, None)
    assert (sched["wait"], sched["warmup"], sched["active"]) == schedule and shrunk == (steps < 5)
    assert fit_schedule(3, None, None, 3)[0] == {"wait": 0, "warmup": 0, "active": 3}  # a given part stays


def test_three_steps_profile_with_a_shrunk_schedule_and_no_kineto_noise(tmp_path):
    proc = llmctl("--steps", "3", "--batch-size", "2", "--input-len", "8", "--output-len", "4", "--num-threads", "1",
                  "--json", "-o", str(tmp_path / "t"))
    assert proc.returncode == 0, proc.stderr
    result = json.loads(proc.stdout)["result"]
    assert result["steps"] == 3 and result["schedule"] == {"wait": 0, "warmup": 1, "active": 2}
    assert "llmctl: note: --steps 3 is shorter than the default schedule; profiling wait 0 + warmup 1 + active 2" \
        in proc.stderr
    noise = [line for line in proc.stderr.splitlines() if line.startswith(("USDT:", "STAGE:", "ERROR:"))]
    assert not noise, noise  # kineto's C++ log lines


def test_stack_memory_and_flops_options_reach_the_trace_and_table(tmp_path):
    out = tmp_path / "t"
    proc = llmctl("--batch-size", "2", "--input-len", "8", "--output-len", "4", "--wait", "0", "--active", "1",
                  "--num-threads", "1", "--with-stack", "--profile-memory", "--with-flops", "--row-limit", "50",
                  "-o", str(out))
    assert proc.returncode == 0, proc.stderr
    table = (out / "ops.txt").read_text()
    assert "FLOPS" in table.upper() and "CPU Mem" in table
    trace = json.load(gzip.open(out / "trace.json.gz"))
    assert any(event.get("cat") == "python_function" for event in trace["traceEvents"])  # --with-stack
    assert any(event.get("name") == "[memory]" for event in trace["traceEvents"])  # --profile-memory
    options = json.loads((out / "manifest.json").read_text())["result"]["options"]
    assert options == {"with_stack": True, "profile_memory": True, "with_flops": True, "memory_snapshot": None}


def test_memory_snapshot_is_refused_without_cuda():
    proc = llmctl("--memory-snapshot", "--device", "cpu")
    assert proc.returncode == 2 and proc.stderr.count("\n") == 1
    assert "--memory-snapshot" in proc.stderr and "needs a CUDA device" in proc.stderr


def test_bad_schedule_and_sort_key():
    short = llmctl("--steps", "2", "--wait", "1", "--warmup", "1", "--active", "2")
    assert short.returncode == 2 and "shorter than the schedule" in short.stderr
    bad_key = llmctl("--sort-by", "speed")
    assert bad_key.returncode == 2 and "'speed' is not one of" in bad_key.stderr


def _cuda() -> bool:
    import torch

    return torch.cuda.is_available()


@pytest.mark.cuda
@pytest.mark.skipif(not _cuda(), reason="needs a CUDA device")
def test_cuda_trace_has_kernels_and_device_times(tmp_path):
    out = tmp_path / "cuda"
    proc = llmctl("--device", "cuda", "--batch-size", "4", "--active", "2", "--row-limit", "50", "--json", "-o", str(out))
    assert proc.returncode == 0, proc.stderr
    manifest = json.loads(proc.stdout)
    assert manifest["result"]["device"].startswith("cuda")
    rows = manifest["result"]["ops"]
    assert all("self_device_time_us" in row for row in rows)
    assert sum(row["device_time_total_us"] for row in rows) > 0
    trace = json.load(gzip.open(out / "trace.json.gz"))
    assert any(event.get("cat") == "kernel" for event in trace["traceEvents"])


@pytest.mark.cuda
@pytest.mark.skipif(not _cuda(), reason="needs a CUDA device")
def test_cuda_memory_snapshot_is_a_pickle_memory_viz_reads(tmp_path):
    import pickle

    out = tmp_path / "snap"
    proc = llmctl("--device", "cuda", "--batch-size", "2", "--active", "1", "--memory-snapshot", "--json", "-o", str(out))
    assert proc.returncode == 0, proc.stderr
    snapshot = pickle.loads((out / "memory_snapshot.pickle").read_bytes())
    assert snapshot["segments"] and any(snapshot["device_traces"])  # allocations recorded during the steps
    assert "memory_snapshot.pickle" in json.loads(proc.stdout)["files"]
