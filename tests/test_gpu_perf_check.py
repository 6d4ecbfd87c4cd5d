"""scripts/gpu_perf_check.py's logic on the CPU: a tiny shape through every measurement, the JSON document, the
roofline arithmetic, the profile summary and the gates (the GPU figures themselves come from a GPU host)."""

import importlib.util
import json
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest

ROOT = Path(__file__).resolve().parents[1]
spec = importlib.util.spec_from_file_location("gpu_perf_check", ROOT / "scripts/gpu_perf_check.py")
perf = importlib.util.module_from_spec(spec)
sys.modules["gpu_perf_check"] = perf  # dataclasses resolve their module through sys.modules
spec.loader.exec_module(perf)


def test_llama_3_8b_reads_15_gb_a_token_and_128_kib_a_cached_token():
    model = perf.ModelBytes.of(perf.SHAPES["llama-3-8b"], 2)
    assert 14.9e9 < model.weights < 15.1e9  # 7.5B parameters read (one embedding row), bf16
    assert model.kv_per_token == 2 * 32 * 8 * 128 * 2


def test_union_length_counts_overlaps_once():
    assert perf.union_length([(0, 2), (1, 3), (5, 6), (4, 4)]) == 4
    assert perf.union_length([]) == 0


def _event(name, device, start, end):
    span = SimpleNamespace(start=start, end=end, elapsed_us=lambda: end - start)
    return SimpleNamespace(name=name, device_type=SimpleNamespace(name=device), time_range=span)


def test_profile_summary_busy_share_syncs_and_top_kernels():
    events = [_event("perf_check::step", "CPU", 0, 50), _event("perf_check::step", "CPU", 50, 100),
              _event("gemm", "CUDA", 0, 40), _event("gemm", "CUDA", 30, 60), _event("attn", "CUDA", 70, 80),
              _event("cudaStreamSynchronize", "CPU", 45, 46), _event("cudaLaunchKernel", "CPU", 1, 2)]
    summary = perf.summarize_profile(events, steps=2)
    assert summary.gpu_busy == pytest.approx(0.7)
    assert summary.syncs_per_step == 0.5
    assert summary.top_kernels[0] == ("gemm", pytest.approx(0.07))


def test_gates_name_every_miss_and_gate_throughput_by_card():
    good = {"batch1_share": 0.85, "output_tok_s": 6500.0, "gpu_busy": 0.95, "syncs_per_step": 1.0}
    assert perf.failed_gates(good, "NVIDIA H200") == []
    bad = {"batch1_share": 0.5, "output_tok_s": 5500.0, "gpu_busy": 0.6, "syncs_per_step": 9.0}
    misses = perf.failed_gates(bad, "NVIDIA H200")
    assert len(misses) == 4 and "5,500 output tok/s" in misses[1]
    assert len(perf.failed_gates(bad, "NVIDIA H100 80GB HBM3")) == 3  # 5,500 passes the H100's 5,000
    assert len(perf.failed_gates(bad, "NVIDIA A10")) == 3  # throughput reported, not gated


def test_each_backends_entry_names_a_backend_and_its_cudagraph_mode():
    assert perf.parse_runs("triton:full_and_piecewise, triton,torch:none") == [
        ("triton", "full_and_piecewise"), ("triton", "piecewise"), ("torch", "none")]
    assert perf.parse_args([]).backends.split(",")[0] == "triton:full_and_piecewise"  # the gated run: full graphs


def test_runs_put_the_gated_one_first_and_the_serial_engine_beside_it():
    assert perf.planned_runs("triton,torch", "both") == [
        ("triton", "piecewise", True), ("triton", "piecewise", False), ("torch", "piecewise", True)]
    assert perf.planned_runs("triton:none,torch", "off") == [("triton", "none", False), ("torch", "piecewise", False)]
    assert perf.planned_runs("torch", "on") == [("torch", "piecewise", True)]


@pytest.mark.timeout(300)
def test_tiny_run_on_cpu_writes_every_figure(tmp_path, capsys):
    out = tmp_path / "perf.json"
    code = perf.main(["--device", "cpu", "--shape", "tiny", "--batch", "4", "--input-len", "16", "--output-len", "8",
                      "--backends", "torch", "--json", str(out)])
    assert code == 0
    doc = json.loads(out.read_text())
    result, serial = doc["results"]  # --async-scheduling both: the first backend with it, then without it
    assert (result["async_scheduling"], serial["async_scheduling"]) == (True, False)
    assert serial["backend"] == "torch" and serial["full_batch_steps"] >= 5
    assert result["backend"] == "torch" and result["cudagraph_mode"] == "piecewise" and result["full_batch_steps"] >= 5
    assert result["batch1_tok_s"] > 0 and result["output_tok_s"] > 0
    assert result["median_step_kv_tokens"] >= 4 * 16  # four rows past their 16-token prompts
    assert result["roofline_step_ms"] > 0 and result["syncs_per_step"] >= 0
    assert "copy bandwidth" in capsys.readouterr().out
