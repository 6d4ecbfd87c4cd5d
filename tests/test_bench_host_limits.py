"""`llmctl bench --cpu` within the host's memory and with its noise named: the memory budget from
MemAvailable, the cgroup limit and RLIMIT_AS (a fake /proc and /sys), the decode shape shrunk to fit
it, the per-figure spread warning, and figures printed as they complete."""

from __future__ import annotations

import pytest

from llmctl.bench import hardware, kernels
from llmctl.bench.hardware import NOISE_LIMIT_PCT, cpu_decode_shape, noise_warnings, to_result
from llmctl.bench.memory_budget import MemoryBudget, memory_budget
from llmctl.bench.shapes import BUILTIN
from llmctl.checks.probe import Host
from llmctl.cli import run

GIB = 1 << 30


def _host(tmp_path, available_kib, cgroup_max=None, vm_size_kib=1_000_000):
    (tmp_path / "proc/self").mkdir(parents=True)
    (tmp_path / "proc/meminfo").write_text(f"MemTotal:       25165824 kB\nMemAvailable:   {available_kib} kB\n")
    (tmp_path / "proc/self/status").write_text(f"Name:\tpython\nVmSize:\t {vm_size_kib} kB\n")
    (tmp_path / "proc/self/cgroup").write_text("0::/\n")
    cgroup = tmp_path / "sys/fs/cgroup"
    cgroup.mkdir(parents=True)
    (cgroup / "cgroup.controllers").write_text("cpu memory\n")
    (cgroup / "memory.max").write_text(f"{cgroup_max}\n" if cgroup_max else "max\n")
    return Host(root=tmp_path)


def test_budget_is_the_tightest_of_memavailable_cgroup_and_rlimit(tmp_path):
    host = _host(tmp_path, available_kib=20 * 1024 * 1024)
    assert memory_budget(host, address_limit=None) == MemoryBudget(20 * GIB, "MemAvailable")
    host = _host(tmp_path / "c", available_kib=20 * 1024 * 1024, cgroup_max=8 * GIB)
    assert memory_budget(host, address_limit=None) == MemoryBudget(8 * GIB, "cgroup memory limit")
    budget = memory_budget(host, address_limit=4 * GIB)  # less the 1 000 000 kB VmSize already mapped
    assert budget.bytes == 4 * GIB - 1_000_000 * 1024 and budget.source.startswith("RLIMIT_AS")


def test_budget_without_any_readable_limit_is_unknown(tmp_path):
    budget = memory_budget(Host(root=tmp_path), address_limit=None)
    assert budget.bytes is None and budget.describe() == "unknown"


def test_llama_3_8b_on_a_24_gib_host_falls_back_to_a_shape_that_fits():
    wanted = BUILTIN["llama-3-8b"]  # 32 GB of float32 weights: the OOM killer's victim on a 24 GiB host
    shape, note = cpu_decode_shape(wanted, MemoryBudget(22 * GIB, "MemAvailable"))
    assert shape is not None and 4 * shape.linear_params <= 0.7 * 22 * GIB
    assert shape.linear_params == max(s.linear_params for s in BUILTIN.values()
                                      if 4 * s.linear_params <= 0.7 * 22 * GIB)
    assert "llama-3-8b" in note and "MemAvailable" in note and f"measured {shape.name} instead" in note
    assert cpu_decode_shape(wanted, MemoryBudget(64 * GIB, "MemAvailable")) == (wanted, None)
    assert cpu_decode_shape(wanted, MemoryBudget(None, "no limit readable")) == (wanted, None)
    none, note = cpu_decode_shape(wanted, MemoryBudget(100 << 20, "cgroup memory limit"))
    assert none is None and "skipped" in note


def test_cpu_tasks_cap_the_copy_buffers_to_the_budget():
    tasks, notes = hardware.cpu_tasks(hardware.PLANS["full"], BUILTIN["llama-3-8b"], MemoryBudget(1 * GIB, "test"))
    labels = [label for label, _, _ in tasks]
    assert labels[-1] == "decode step smollm-135m" and len(notes) == 1
    tasks, notes = hardware.cpu_tasks(hardware.PLANS["quick"], None, MemoryBudget(None, "no limit readable"))
    assert tasks[-1][0] == "decode step smollm-135m" and notes == []


def test_cli_shrinks_the_decode_shape_and_prints_figures_as_they_complete(monkeypatch, capsys):
    monkeypatch.setattr(hardware, "PLANS", {**hardware.PLANS, "quick": hardware.Plan(
        "quick", 2, 0.0, 64, 128, 1 << 20, 1, 1 << 20, (1, 2, 1, 8, 16), (1, 2, 1, 8, 16), "smollm-135m", "smollm-135m")})
    from llmctl.bench import memory_budget as budget_module

    monkeypatch.setattr(budget_module, "memory_budget", lambda *a, **k: MemoryBudget(1 * GIB, "cgroup memory limit"))
    printed = []
    monkeypatch.setattr(hardware, "_run_tasks", _recording(hardware._run_tasks, printed, capsys))
    assert run(["bench", "--cpu", "--quick", "-m", "llama-3-8b"]) == 0
    out, err = capsys.readouterr()
    assert "llama-3-8b's float32 weights need" in err and "cgroup memory limit" in err
    assert printed and "GEMM fp32" in printed[0] and "spread" in printed[0]  # on stdout before the next task ran
    assert "GEMM fp32" not in out and "decode step smollm-135m" in out


def _recording(real, printed, capsys):
    def run_tasks(tasks, specs, report, progress, on_result=None):
        def after_first(result):
            on_result(result)
            if not printed:
                printed.append(capsys.readouterr().out)
        return real(tasks, specs, report, progress, after_first)
    return run_tasks


def test_spread_is_reported_and_a_wide_one_warned_about():
    tight = to_result(kernels.Measured("gemm_fp32", "GEMM fp32", "GFLOP/s", [100.0, 102.0, 104.0]), "cpu", None)
    wide = to_result(kernels.Measured("memory_copy", "memory copy", "GB/s", [10.0, 20.0, 22.0]), "cpu", None)
    assert tight.spread_pct == pytest.approx(3.9, abs=0.05) and wide.spread_pct == 60.0
    (warning,) = noise_warnings([tight, wide])
    assert "memory copy on cpu" in warning and "60%" in warning and f"> {NOISE_LIMIT_PCT:g}%" in warning
    assert noise_warnings([wide], limit_pct=70.0) == []
