"""`llmctl bench --gpu/--cpu`: datasheet lookup, peak arithmetic, --fail-below and the >5% spread
warning on fake results, the CPU kernels at tiny sizes, the CPU run end to end, bad flags."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch

from llmctl.bench import hardware, kernels
from llmctl.bench.hardware import Report, Result, fail_below, spread_warnings, to_result
from llmctl.bench.shapes import BUILTIN, ModelShape, resolve_shape
from llmctl.bench.specs import SPECS, lookup, pcie_gbs
from llmctl.cli import run


def llmctl(*args: str) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if not k.startswith("LLMCTL_")}
    return subprocess.run([sys.executable, "-m", "llmctl.cli", *args], capture_output=True, text=True,
                          env={**env, "NO_COLOR": "1"}, timeout=300)


# ---- spec table ---------------------------------------------------------------------------------
@pytest.mark.parametrize("name, product, bf16, memory", [
    ("NVIDIA H100 80GB HBM3", "H100 SXM5 80GB", 989.4, 3352),
    ("NVIDIA H200", "H200 SXM", 989.4, 4800),
    ("NVIDIA H200 NVL", "H200 NVL", 835.5, 4800),
    ("NVIDIA H100 PCIe", "H100 PCIe 80GB", 756.0, 2039),
    ("NVIDIA A100-SXM4-80GB", "A100 SXM4 80GB", 312.0, 2039),
    ("NVIDIA A100-SXM4-40GB", "A100 SXM4 40GB", 312.0, 1555),
    ("NVIDIA A100 80GB PCIe", "A100 PCIe 80GB", 312.0, 1935),
    ("NVIDIA L40S", "L40S", 362.05, 864),
    ("NVIDIA L4", "L4", 121.0, 300),
    ("NVIDIA GeForce RTX 4090", "GeForce RTX 4090", 165.2, 1008),
    ("Tesla V100-SXM2-32GB", "V100 SXM2", None, 900),
    ("NVIDIA B200", "B200 (HGX)", 2250.0, 7700),
    ("NVIDIA GB200", "GB200 (B200 in a Grace superchip)", 2500.0, 8000),
    ("NVIDIA GH200 480GB", "GH200 96GB HBM3", 989.4, 4000),
    ("NVIDIA H20", "H20", 148.0, 4000),
    ("NVIDIA H800", "H800 SXM5 80GB", 989.4, 3352),
    ("NVIDIA A800-SXM4-80GB", "A800 SXM4 80GB", 312.0, 2039),
    ("NVIDIA RTX 6000 Ada Generation", "RTX 6000 Ada", 364.2, 960),
    ("NVIDIA L20", "L20", 119.5, 864),
])
def test_lookup_matches_nvml_names(name, product, bf16, memory):
    spec = lookup(name)
    assert spec is not None and spec.product == product
    assert spec.bf16_tflops == bf16 and spec.memory_gbs == memory


@pytest.mark.parametrize("name", [None, "", "NVIDIA H100 80GB HBM3 MIG 1g.10gb", "NVIDIA L40", "NVIDIA B100",
                                  "Intel(R) Xeon(R) Processor", "NVIDIA H1000"])
def test_lookup_unknown_or_partial_names(name):
    spec = lookup(name)
    if name == "NVIDIA L40":  # exists, and is not L4 or L40S
        assert spec is not None and spec.product == "L40"
    else:
        assert spec is None


def test_lookup_ignores_case_and_spacing():
    assert lookup("  nvidia   h100 80gb hbm3 ") is lookup("NVIDIA H100 80GB HBM3")


def test_spec_table_is_dense_and_consistent():
    names = [n for s in SPECS for n in s.names]
    assert len(names) == len(set(names))
    for spec in SPECS:
        # Tensor cores beat CUDA-core fp32; dense fp8 is twice dense fp16 (a sparse figure left
        # undivided would break this), within the datasheets' own rounding (L40S: 362.05 vs 733).
        assert spec.fp16_tflops > spec.fp32_tflops
        if spec.fp8_tflops is not None:
            assert spec.fp8_tflops == pytest.approx(2 * spec.fp16_tflops, rel=0.02)
        if spec.tf32_tflops is not None:
            assert spec.tf32_tflops <= spec.fp16_tflops / 2 * 1.02


def test_peak_keys_and_pcie_rates():
    h100 = lookup("NVIDIA H100 80GB HBM3")
    assert h100.peak("gemm_bf16") == 989.4 and h100.peak("gemm_fp8") == 1978.9 and h100.peak("memory") == 3352
    assert h100.peak("pcie") == pytest.approx(63.02, abs=0.01)
    assert lookup("NVIDIA A100-SXM4-80GB").peak("gemm_fp8") is None
    assert h100.peak("p2p") is None
    assert pcie_gbs(4, 16) == pytest.approx(31.51, abs=0.01) and pcie_gbs(3, 8) == pytest.approx(7.88, abs=0.01)
    with pytest.raises(ValueError):
        pcie_gbs(9, 16)
    assert lookup("NVIDIA GH200 480GB").peak("pcie") == 450.0  # NVLink-C2C is the host link there
    assert lookup("NVIDIA B200").peak("pcie") == pytest.approx(63.02, abs=0.01)


# ---- peak arithmetic, --fail-below, spread warning ---------------------------------------------
def _measured(name="gemm_bf16", values=(700.0, 750.0, 740.0), key="gemm_bf16", scale=1.0):
    return kernels.Measured(name, name, "TFLOP/s", list(values), {}, peak_key=key, peak_scale=scale)


def test_to_result_median_min_max_and_percent_of_peak():
    result = to_result(_measured(), "cuda:0", lookup("NVIDIA H200"))
    assert (result.median, result.min, result.max, result.repeats) == (740.0, 700.0, 750.0, 3)
    assert result.peak == 989.4 and result.pct_of_peak == pytest.approx(74.8, abs=0.05)
    unknown = to_result(_measured(), "cuda:0", None)
    assert unknown.peak is None and unknown.pct_of_peak is None


def test_decode_step_peak_is_bandwidth_over_weight_bytes():
    weight_bytes = 16e9
    result = to_result(_measured("decode_step", (200.0,), "memory", 1e9 / weight_bytes), "cuda:0", lookup("NVIDIA H200"))
    assert result.peak == pytest.approx(4800e9 / weight_bytes)
    assert result.pct_of_peak == pytest.approx(100 * 200 / 300, abs=0.05)


def _result(name, device, median, pct=None, peak=None):
    return Result(name, name, device, "TFLOP/s", median, median, median, 1, peak, pct)


def test_fail_below_only_judges_figures_with_a_peak():
    rows = [_result("gemm_bf16", "cuda:0", 700, 70.7, 989.4), _result("memory_copy", "cuda:0", 4300, 89.6, 4800),
            _result("p2p", "cuda:0->cuda:1", 300)]
    assert [r.name for r in fail_below(rows, 75)] == ["gemm_bf16"]
    assert fail_below(rows, 70) == []
    assert [r.name for r in fail_below(rows, 90)] == ["gemm_bf16", "memory_copy"]


def test_spread_warning_over_five_percent_between_same_model_gpus():
    devices = [{"label": f"cuda:{i}", "name": "NVIDIA H200"} for i in range(3)] + [
        {"label": "cuda:3", "name": "NVIDIA L4"}]
    rows = [_result("gemm_bf16", "cuda:0", 800), _result("gemm_bf16", "cuda:1", 790),
            _result("gemm_bf16", "cuda:2", 720), _result("gemm_bf16", "cuda:3", 100),
            _result("memory_copy", "cuda:0", 4300), _result("memory_copy", "cuda:1", 4200)]
    warnings = spread_warnings(rows, devices)
    assert len(warnings) == 1
    assert "gemm_bf16" in warnings[0] and "cuda:2" in warnings[0] and "cuda:0" in warnings[0]
    assert "10.0%" in warnings[0]
    assert spread_warnings(rows[:2], devices) == []  # 1.25% apart


def test_verdict_exit_codes_and_messages(capsys):
    from llmctl.bench.hardware_runner import verdict as _verdict

    report = Report("cuda", "quick", [], results=[_result("gemm_bf16", "cuda:0", 700, 70.7, 989.4)])
    assert _verdict(report, 75.0) == 1
    err = capsys.readouterr().err
    assert "gemm_bf16 on cuda:0" in err and "70.7% of 989.4" in err
    assert _verdict(report, 50.0) == 0
    assert _verdict(report, None) == 0
    report.errors.append({"benchmark": "GEMM fp8", "device": "cuda:0", "error": "no kernel"})
    assert _verdict(report, None) == 1
    assert "GEMM fp8 on cuda:0 failed: no kernel" in capsys.readouterr().err


# ---- kernels on the CPU at tiny sizes -----------------------------------------------------------
def test_fill_tiles_large_cpu_buffers_with_non_zero_random_values():
    t = kernels._random((int(kernels._POOL * 2.5),), torch.float32, torch.device("cpu"))
    assert bool((t >= 0.5).all()) and bool((t < 1.5).all())
    assert t[: kernels._POOL].unique().numel() > kernels._POOL // 2  # random, not constant
    signed = kernels._signed_random((kernels._POOL + 7,), torch.bfloat16, torch.device("cpu"), 0.02)
    assert signed.dtype == torch.bfloat16 and float(signed.float().std()) == pytest.approx(0.02, rel=0.2)


def test_rotating_sets_exceed_twice_the_cache():
    assert kernels.rotating_sets(10 << 20, 64 << 20) == 8  # capped
    assert kernels.rotating_sets(30 << 20, 40 << 20) == 3
    assert kernels.rotating_sets(512 << 20, 64 << 20) == 2  # never fewer than two


def test_cpu_kernels_measure_and_count_work():
    timer = kernels.Timer(0.0, 3)
    cpu = torch.device("cpu")
    gemm = kernels.gemm(timer, cpu, "fp32", 64, 1 << 20)
    assert gemm.unit == "GFLOP/s" and len(gemm.values) == 3 and min(gemm.values) > 0
    assert gemm.peak_key == "gemm_fp32" and gemm.peak_scale == 1e3  # a TFLOP/s peak in GFLOP/s
    fp8 = kernels.gemm(timer, cpu, "fp8", 32, 1 << 20)  # the torch._scaled_mm call CUDA hosts make
    assert fp8.params["dtype"] == "fp8_e4m3" and min(fp8.values) > 0
    copy = kernels.memory_copy(timer, cpu, 4 << 20, peak_key=None)
    assert copy.params["bytes"] == 4 << 20 and copy.params["counted"] == "read + written"
    shape = kernels.AttentionShape(2, 4, 2, 16, 32)
    prefill = kernels.attention_prefill(timer, cpu, torch.float32, shape, use_flash=False)
    assert prefill.params["backend"] == "torch-sdpa" and min(prefill.values) > 0
    decode = kernels.attention_decode(timer, cpu, torch.float32, shape, use_flash=False)
    assert decode.unit == "GB/s" and decode.params["kv_bytes"] == 2 * 2 * 32 * 2 * 16 * 4
    tiny = ModelShape("tiny", 64, 128, 2, 4, 2, 16, 100)
    step = kernels.decode_step(timer, cpu, torch.float32, tiny)
    assert step.params["weight_bytes"] == tiny.linear_params * 4
    assert tiny.linear_params == 2 * (64 * (64 + 64) + 64 * 64 + 3 * 64 * 128) + 100 * 64


def test_decode_step_output_is_a_token_id():
    step = kernels._DecodeStep(ModelShape("tiny", 32, 64, 1, 2, 1, 16, 50), torch.float32, torch.device("cpu"))
    token = step()
    assert token.shape == (1,) and 0 <= int(token) < 50


def test_shapes_builtin_and_from_config(tiny_models):
    assert resolve_shape("llama-3-8b").linear_params == pytest.approx(7.5e9, rel=0.02)
    shape = resolve_shape(str(tiny_models["qwen3"]))
    assert (shape.hidden, shape.layers, shape.head_dim, shape.vocab) == (64, 2, 32, 512)
    assert set(BUILTIN) >= {"llama-3-8b", "qwen2.5-0.5b"}


# ---- the CPU run end to end ---------------------------------------------------------------------
def test_cpu_quick_json_reports_sane_figures():
    proc = llmctl("bench", "--cpu", "--json", "--quick", "--model", "smollm-135m")
    assert proc.returncode == 0, proc.stderr
    doc = json.loads(proc.stdout)
    assert doc["schema_version"] == hardware.SCHEMA_VERSION and doc["llmctl_version"]
    assert doc["target"] == "cpu" and doc["mode"] == "quick" and doc["errors"] == []
    (device,) = doc["devices"]
    assert device["kind"] == "cpu" and device["threads"] >= 1 and device["logical_cores"] >= 1
    results = {r["name"]: r for r in doc["results"]}
    assert set(results) == {"gemm_fp32", "gemm_bf16", "memory_copy", "memory_read", "decode_step"}
    for r in results.values():
        assert set(r) >= {"name", "unit", "median", "min", "max", "peak", "pct_of_peak"}
        assert r["min"] <= r["median"] <= r["max"] and r["peak"] is None and r["pct_of_peak"] is None
    assert results["gemm_fp32"]["unit"] == "GFLOP/s" and 1 < results["gemm_fp32"]["median"] < 20_000
    assert 0.5 < results["memory_copy"]["median"] < 1000 and results["memory_copy"]["unit"] == "GB/s"
    assert 0.5 < results["memory_read"]["median"] < 1000
    assert results["decode_step"]["unit"] == "tokens/s" and results["decode_step"]["median"] > 0
    assert "no datasheet peak" in proc.stderr


def test_fail_below_without_any_peak_is_a_note_not_a_failure(capsys):
    code = run(["bench", "--cpu", "--quick", "--model", "smollm-135m", "--fail-below", "50"])
    captured = capsys.readouterr()
    assert code == 0
    assert "no figure has a datasheet peak" in captured.err
    assert "GEMM fp32" in captured.out and "—" in captured.out


@pytest.mark.parametrize("args, message", [
    (["--cpu", "--fail-below", "-5"], "--fail-below"),
    (["--cpu", "--fail-below", "150"], "--fail-below"),
    (["--gpu", "--cpu"], "give --gpu or --cpu, not both"),
    (["--cpu", "--quick", "--full"], "give --quick or --full, not both"),
    (["--cpu", "--model", "no-such-shape"], "neither a folder nor a built-in shape"),
    (["--cpu", "--num-threads", "0"], "--num-threads"),
    (["--gpu", "throughput"], "belong(s) to the hardware benchmark"),
])
def test_bad_flags_are_one_line_exit_2(args, message):
    proc = llmctl("bench", *args)
    assert proc.returncode == 2, proc.stderr
    assert proc.stderr.count("\n") == 1 and proc.stderr.startswith("llmctl: error:")
    assert message in proc.stderr


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the no-CUDA error")
def test_gpu_without_cuda_is_a_clear_error():
    proc = llmctl("bench", "--gpu")
    assert proc.returncode == 2
    assert proc.stderr.strip().startswith("llmctl: error: --gpu: no CUDA device is available")
    assert "use --cpu" in proc.stderr and proc.stdout == ""


# ---- CUDA (scripts/gpu_check.sh on a lent GPU) -------------------------------------------------
@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_gpu_quick_json_has_every_figure_and_known_peaks():
    # scripts/gpu_check.sh runs `bench --gpu --json --quick` once and hands its output over (saves a minute).
    given = os.environ.get("GPU_CHECK_BENCH_JSON")
    if given:  # gpu_check.sh's bench step: its failure is reported as such, not as a JSON decoding error
        text = open(given).read() if os.path.exists(given) else ""
        try:
            doc = json.loads(text)
        except ValueError:
            pytest.fail(f"`llmctl bench --gpu --json --quick` (gpu_check.sh's bench_gpu step) wrote no JSON report "
                        f"to {given} ({len(text)} bytes: {text[:200]!r}); see that step in gpu_check.log")
        model, stderr = hardware.PLANS["quick"].gpu_shape, ""
    else:
        proc = llmctl("bench", "--gpu", "--json", "--quick", "--model", "qwen2.5-0.5b")
        doc, model, stderr = json.loads(proc.stdout), "qwen2.5-0.5b", proc.stderr
    assert doc["target"] == "cuda" and doc["mode"] == "quick" and doc["errors"] == [], (doc["errors"], stderr)
    count = torch.cuda.device_count()
    assert [d["label"] for d in doc["devices"]] == [f"cuda:{i}" for i in range(count)]
    for d in doc["devices"]:
        props = torch.cuda.get_device_properties(d["index"])
        assert d["name"] == props.name and d["memory_bytes"] == props.total_memory
        assert d["sm_count"] == props.multi_processor_count and d["l2_bytes"] > 0
    capability = torch.cuda.get_device_capability(0)
    expected = {"gemm_fp16", "gemm_fp32", "memory_copy", "memory_read", "h2d", "d2h", "bidirectional",
                "attention_prefill", "attention_decode", "decode_step"}
    if capability >= (8, 0):
        expected |= {"gemm_bf16", "gemm_tf32"}
    if capability >= (8, 9):
        expected.add("gemm_fp8")
    first = {r["name"]: r for r in doc["results"] if r["device"] == "cuda:0"}
    assert expected <= set(first)
    assert sum(r["name"] == "p2p" for r in doc["results"]) == count * (count - 1)  # the full peer matrix
    sweep = [r for r in doc["results"] if r["name"] == "allreduce_busbw"]
    assert len(sweep) == (len(hardware.PLANS["quick"].allreduce_sizes) if count > 1 else 0)
    assert all(r["params"]["wrong_elements"] == 0 for r in sweep)
    known = lookup(doc["devices"][0]["name"]) is not None
    for r in doc["results"]:
        assert 0 < r["min"] <= r["median"] <= r["max"] and r["repeats"] == hardware.PLANS["quick"].reps
        if r["pct_of_peak"] is not None:
            assert r["pct_of_peak"] < 110, r  # above the datasheet: the FLOP or byte count is wrong
    if known:  # a healthy GPU reaches well over a quarter of these peaks; far less means a broken measurement
        for name in ("gemm_fp16", "gemm_bf16", "memory_copy", "memory_read"):
            if name in first:
                assert first[name]["pct_of_peak"] > 25, first[name]
    # Each GEMM dtype keeps most of its datasheet advantage over the next slower one (a TF32 setting that
    # did not apply, or fp8 inputs silently upcast, show here).
    spec = lookup(doc["devices"][0]["name"])
    for fast, slow in (("tf32", "fp32"), ("bf16", "tf32"), ("fp8", "bf16")):
        if spec and f"gemm_{fast}" in first and getattr(spec, f"{fast}_tflops"):
            datasheet = getattr(spec, f"{fast}_tflops") / getattr(spec, f"{slow}_tflops")
            measured = first[f"gemm_{fast}"]["median"] / first[f"gemm_{slow}"]["median"]
            assert measured > 0.6 * datasheet, (fast, slow, measured, datasheet)
    gpu = doc["devices"][0]
    assert first["memory_copy"]["params"]["bytes"] >= min(16 * gpu["l2_bytes"], gpu["memory_bytes"] // 8) - 4
    assert first["decode_step"]["params"]["cuda_graph"] is True
    assert first["decode_step"]["params"]["model"]["name"] in (model, "qwen2.5-0.5b")  # the small one if 8B won't fit
    flash = kernels._flash_attn() is not None and capability >= (8, 0)
    assert first["attention_prefill"]["params"]["backend"] == ("flash-attn" if flash else "torch-sdpa")
    assert first["attention_decode"]["params"]["paged"] is flash


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_decode_step_graph_is_captured_on_every_gpu():
    """Each device's decode-step graph records its kernels: captured in turn on cuda:0, cuda:1, ..., a capture
    on the class-wide default stream would be empty on every GPU but the first one."""
    import warnings

    shape = ModelShape("tiny", 256, 512, 2, 4, 2, 64, 1000)
    for index in range(torch.cuda.device_count()):
        device = torch.device("cuda", index)
        step = kernels._DecodeStep(shape, torch.float32, device)
        with warnings.catch_warnings():
            warnings.filterwarnings("error", message=".*CUDA Graph is empty")
            run, graphed = kernels._cuda_graph(step, device)
        assert graphed, device
        for _ in range(3):  # new inputs in place: each replay's token is the eager step's on them
            step.x.normal_()
            assert run(0).device == device and run(0).item() == step().item(), device


# ---- GPU inventory with a fake NVML and fake device properties ---------------------------------
class _FakeNvml:
    """pynvml's function names over one H100 whose link trained at gen4 x16."""

    def nvmlDeviceGetCount(self):
        return 1

    def nvmlDeviceGetHandleByIndex(self, index):
        return f"handle-{index}"

    def nvmlDeviceGetHandleByUUID(self, uuid):
        if uuid != "GPU-1234-abcd":
            raise type("NVMLError_NotFound", (Exception,), {})()
        return "handle-0"

    def nvmlSystemGetDriverVersion(self):
        return b"560.35.03"

    def nvmlDeviceGetCurrPcieLinkGeneration(self, handle):
        return 4

    def nvmlDeviceGetCurrPcieLinkWidth(self, handle):
        return 16

    nvmlDeviceGetMaxPcieLinkGeneration = nvmlDeviceGetCurrPcieLinkGeneration
    nvmlDeviceGetMaxPcieLinkWidth = nvmlDeviceGetCurrPcieLinkWidth


def test_gpu_inventory_matches_nvml_by_uuid_and_notes_a_slow_link(monkeypatch):
    from types import SimpleNamespace

    from llmctl.checks.probe import NvmlView

    props = SimpleNamespace(name="NVIDIA H100 80GB HBM3", total_memory=80 << 30, major=9, minor=0,
                            multi_processor_count=132, L2_cache_size=50 << 20, uuid="1234-abcd")
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda index: props)
    entry = hardware.gpu_inventory(0, NvmlView(_FakeNvml()))
    assert entry["product"] == "H100 SXM5 80GB" and entry["driver_version"] == "560.35.03"
    assert entry["pcie"] == {"current_gen": 4, "current_width": 16, "max_gen": 4, "max_width": 16}
    assert entry["compute_capability"] == "9.0" and entry["datasheet_pcie"] == "gen5 x16"
    (note,) = hardware._link_notes([entry])
    assert "cuda:0" in note and "gen4 x16" in note and "datasheet gen5 x16" in note
    props.uuid = "other"
    assert hardware.gpu_inventory(0, NvmlView(_FakeNvml()))["pcie"] is None  # unmatched: no guess by index
    assert hardware.gpu_inventory(0, None)["driver_version"] is None
