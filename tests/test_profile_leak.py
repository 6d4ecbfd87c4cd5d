"""`llmctl profile leak`: a planted leak (appending to a global list) is flagged as growing and memray
names the leaking function; a workload that frees what it allocates and the engine's own generate loop
are reported flat; the verdict ignores a one-off jump."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import pytest

from llmctl.profiling.leak import LeakPlan, Sample, fit, verdict

WORKLOADS = textwrap.dedent("""
    HOARD = []

    def append_to_global_list():
        HOARD.append(bytearray(256 * 1024))

    def allocate_and_free():
        scratch = [bytearray(256 * 1024) for _ in range(4)]
        return sum(len(block) for block in scratch)

    def explode():
        if len(HOARD) >= 2:
            raise ValueError("planted failure")
        HOARD.append(1)
""")


def llmctl(*args: str) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if not k.startswith("LLMCTL_")}
    return subprocess.run([sys.executable, "-m", "llmctl.cli", "profile", "leak", *args], capture_output=True,
                          text=True, env={**env, "NO_COLOR": "1"}, timeout=300)


@pytest.fixture
def workloads(tmp_path):
    path = tmp_path / "planted.py"
    path.write_text(WORKLOADS)
    return path


def test_global_list_append_is_growing_and_memray_names_it(workloads, tmp_path):
    out = tmp_path / "leak"
    proc = llmctl(f"{workloads}:append_to_global_list", "-n", "12", "--warmup", "2", "--json", "-o", str(out))
    assert proc.returncode == 1, proc.stderr  # growing
    result = json.loads(proc.stdout)["result"]
    assert result["verdict"] == "growing"
    assert 200 < result["rss"]["slope_kb_per_iter"] < 400  # 256 KiB a call
    top = result["suspects"][0]
    assert top["size_bytes"] >= 256 * 1024 and top["stack"][0].startswith("append_to_global_list ")
    assert (out / "leak-iteration.bin").exists() and len(result["samples"]) == 13


def test_allocate_and_free_is_flat(workloads, tmp_path):
    proc = llmctl(f"{workloads}:allocate_and_free", "-n", "12", "--warmup", "2", "-o", str(tmp_path / "flat"))
    assert proc.returncode == 0, proc.stderr
    assert "verdict: FLAT" in proc.stdout
    manifest = json.loads((tmp_path / "flat" / "manifest.json").read_text())
    assert "suspects" not in manifest["result"] and manifest["files"] == ["manifest.json"]


def test_engine_generate_loop_is_flat(tmp_path):
    # The prefix cache keeps each finished prompt's full blocks until the pool needs them: a few KB an
    # iteration, bounded by the pool. The verdict (both halves of the run must grow) is the check; the
    # overall slope alone is allocator noise on some hosts.
    proc = llmctl("--engine", "-n", "16", "--warmup", "6", "--batch-size", "2", "--input-len", "16", "--output-len", "8",
                  "--num-threads", "1", "--json", "-o", str(tmp_path / "engine"))
    assert proc.returncode == 0, proc.stderr
    result = json.loads(proc.stdout)["result"]
    assert result["verdict"] == "flat" and result["workload"] == "engine generate"
    assert not result["rss"]["growing"]


def test_failing_workload_is_one_line_exit_1(workloads, tmp_path):
    proc = llmctl(f"{workloads}:explode", "-n", "8", "--warmup", "1", "-o", str(tmp_path / "boom"))
    assert proc.returncode == 1
    assert "raised ValueError at iteration 3: planted failure" in proc.stderr and "Traceback" not in proc.stderr
    assert json.loads((tmp_path / "boom" / "manifest.json").read_text())["status"] == "workload_failed"


@pytest.mark.parametrize("spec, message", [
    ("no_such_module_xyz:f", "cannot import 'no_such_module_xyz'"),
    ("json:no_such_function", "has no attribute 'no_such_function'"),
    ("justaname", "must be 'module:function'"),
])
def test_bad_workload_specs(spec, message):
    proc = llmctl(spec, "-n", "8", "--warmup", "1")
    assert proc.returncode == 2 and message in proc.stderr


def _samples(kb: list[float]) -> list[Sample]:
    return [Sample(i, 0.0, int(v * 1024)) for i, v in enumerate(kb)]


def test_fit_recovers_a_line_and_ignores_a_single_jump():
    assert fit([10.0 + 3 * i for i in range(8)])["slope"] == pytest.approx(3.0)
    plan = LeakPlan(iterations=20, warmup=0, threshold_kb=32.0)
    steady = verdict(_samples([1000 + 64 * i + (7 if i % 2 else -7) for i in range(20)]), plan)
    assert steady["verdict"] == "growing" and steady["rss"]["slope_kb_per_iter"] == pytest.approx(64, abs=1)
    jump = verdict(_samples([1000.0] * 10 + [3000.0] * 10), plan)  # one 2 MB arena, not a leak
    assert jump["rss"]["slope_kb_per_iter"] > 100 and jump["verdict"] == "flat"
    late = verdict(_samples([1000.0] * 7 + [1000.0 + 500 * i for i in range(1, 14)]), plan)
    assert late["verdict"] == "growing"  # a leak that starts after a third of the window still counts
    small = verdict(_samples([1000 + 8 * i for i in range(20)]), plan)  # steady but under the threshold
    assert small["verdict"] == "flat" and small["rss"]["growing"] is False


@pytest.mark.cuda
@pytest.mark.skipif(not __import__("torch").cuda.is_available(), reason="needs a CUDA device")
def test_engine_generate_loop_on_cuda_samples_device_memory(tmp_path):
    proc = llmctl("--engine", "--device", "cuda", "-n", "12", "--warmup", "4", "--batch-size", "2", "--json",
                  "-o", str(tmp_path / "cuda"))
    assert proc.returncode == 0, proc.stderr
    result = json.loads(proc.stdout)["result"]
    assert result["verdict"] == "flat" and result["device"].startswith("cuda")
    assert result["cuda_allocated"]["start_kb"] > 0  # the KV cache and weights live on the GPU
    assert all(sample["cuda_reserved"] is not None for sample in result["samples"])
