"""scripts/gpu_check.sh's step runner and verdicts (scripts/gpu_check_steps.sh) run by bash on the CPU with stub
commands in place of doctor, bench and pytest: each step's status must say what happened."""

from __future__ import annotations

import json
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
DOCTOR_REPORT = json.dumps({"summary": {"pass": 20, "fail": 1}, "results": []})
BENCH_REPORT = json.dumps({"results": [], "errors": []})


def run_steps(tmp_path: Path, body: str, budget: int = 450) -> list[list[str]]:
    """Source the step library, run `body` (calls of `step`), return the rows of the steps table."""
    steps = tmp_path / "steps.tsv"
    script = f"""
set -uo pipefail
source {shlex.quote(str(ROOT / "scripts/gpu_check_steps.sh"))}
PY={shlex.quote(sys.executable)} deadline=$((SECONDS + {budget})) steps={shlex.quote(str(steps))}
errdir={shlex.quote(str(tmp_path))} out={shlex.quote(str(tmp_path))}
{body}
"""
    subprocess.run(["bash", "-c", script], check=False, capture_output=True, text=True, timeout=120)
    return [line.split("\t") for line in steps.read_text().splitlines()]


def py(code: str) -> str:
    return f"{shlex.quote(sys.executable)} -c {shlex.quote(code)}"


@pytest.mark.parametrize("stub, status", [
    (f"print({DOCTOR_REPORT!r}); raise SystemExit(1)", "ok (exit 1)"),  # a host check failed: doctor worked
    (f"print({DOCTOR_REPORT!r})", "ok (exit 0)"),
    ("import llmctl.checks.nothing_here", "FAILED (exit 1 with a traceback: doctor crashed)"),
    ("import sys; sys.exit(2)", "FAILED (exit 2: doctor crashed or refused its flags)"),
    ("import os; os.kill(os.getpid(), 9)", "FAILED (exit 137: doctor crashed or refused its flags)"),
    ("raise SystemExit(1)", "FAILED (exit 1 without a JSON report on stdout)"),
    ("print('{\"summary\": {}}')", "FAILED (exit 0 without a JSON report on stdout)"),
])
def test_doctor_step_passes_only_when_doctor_itself_worked(tmp_path, stub, status):
    rows = run_steps(tmp_path, f'step doctor 60 verdict_doctor "$out/doctor.json" {py(stub)}')
    assert [row[:2] for row in rows] == [["doctor", status]]


def test_a_killed_doctor_is_not_ok(tmp_path):
    (row,) = run_steps(tmp_path, f'step doctor 60 verdict_doctor "$out/doctor.json" {py("import os; os.abort()")}')
    assert row[1] == "FAILED (exit 134: doctor crashed or refused its flags)"


@pytest.mark.parametrize("stub, status", [
    (f"print({BENCH_REPORT!r})", "ok (exit 0)"),
    ("pass", "FAILED (exit 0 without a JSON report on stdout)"),  # an empty bench_gpu.json
    ("raise RuntimeError('CUDA error: out of memory')", "FAILED (exit 1)"),
])
def test_bench_step_needs_its_json_report(tmp_path, stub, status):
    (row,) = run_steps(tmp_path, f'step bench_gpu 150 verdict_bench_json "$out/bench_gpu.json" {py(stub)}')
    assert row[:2] == ["bench_gpu", status]


OFFLINE_REPORT = {"quantization": "fp8", "weight_bytes": 1, "kv_cache_bytes": 2, "output_tokens_per_second": {}}


@pytest.mark.parametrize("stub, status", [
    (f"print({json.dumps(OFFLINE_REPORT)!r})", "ok (exit 0)"),
    # a report without the quantisation and bytes (an older llmctl, or a run that did not quantise) is not proof
    (f"print({json.dumps({'output_tokens_per_second': {}})!r})",
     "FAILED (exit 0 without a bench report naming quantization, weight and KV bytes)"),
    ("raise SystemExit(2)", "FAILED (exit 2)"),
])
def test_quant_bench_step_needs_the_quantised_report(tmp_path, stub, status):
    (row,) = run_steps(tmp_path, f'step quant_bench 60 verdict_offline_json "$out/quant_bench.json" {py(stub)}')
    assert row[:2] == ["quant_bench", status]


@pytest.mark.parametrize("code, status", [(0, "ok (exit 0)"), (1, "FAILED (exit 1: tests failed)"),
                                          (5, "FAILED (exit 5: no tests collected)"), (4, "FAILED (exit 4: pytest error)")])
def test_pytest_step_verdicts(tmp_path, code, status):
    (row,) = run_steps(tmp_path, f'step pytest 60 verdict_pytest "$out/pytest.log" {py(f"raise SystemExit({code})")}')
    assert row[:2] == ["pytest", status]


@pytest.mark.parametrize("summary, code, status", [
    ("5 passed, 2 skipped in 30.0s", 0, "ok (exit 0)"),
    ("9 skipped in 8.00s", 0, "FAILED (exit 0 but no test passed)"),  # CUDA not usable: every test skipped
    ("1 failed, 8 passed in 40.1s", 1, "FAILED (exit 1: tests failed)"),
])
def test_engine_step_needs_tests_that_ran(tmp_path, summary, code, status):
    stub = py(f"print('.s'); print({'=' * 10 + ' ' + summary + ' ' + '=' * 10!r}); raise SystemExit({code})")
    (row,) = run_steps(tmp_path, f'step engine 60 verdict_pytest_ran "$out/engine.log" {stub}')
    assert row[:2] == ["engine", status]


def test_timeouts_and_a_spent_budget_are_reported(tmp_path):
    rows = run_steps(tmp_path, f'step slow 21 verdict_exit0 - {py("import time; time.sleep(60)")}\n'
                               f'step late 60 verdict_exit0 - {py("pass")}', budget=40)
    assert rows[0][:2] == ["slow", "timed out after 21s"]
    assert rows[1][:2] == ["late", "skipped (time budget spent)"]


def test_stderr_reaches_the_log_and_the_log_is_complete_when_the_run_returns(tmp_path):
    log = tmp_path / "gpu_check.log"
    lines = "; ".join(["import sys", "[print(f'line {i}') for i in range(20000)]", "print('last', file=sys.stderr)",
                       "raise SystemExit(3)"])
    script = f"""
source {shlex.quote(str(ROOT / "scripts/gpu_check_steps.sh"))}
PY={shlex.quote(sys.executable)} deadline=$((SECONDS + 100)) steps={shlex.quote(str(tmp_path / "steps.tsv"))}
errdir={shlex.quote(str(tmp_path))}
main() {{ step work 60 verdict_exit0 - {py(lines)}; echo "the end"; return 7; }}
run_logged {shlex.quote(str(log))} main > /dev/null
echo "status $?"
tail -n 1 {shlex.quote(str(log))}
"""
    proc = subprocess.run(["bash", "-c", script], capture_output=True, text=True, timeout=120)
    assert proc.stdout.splitlines() == ["status 7", "the end"]  # read at once: nothing still in flight
    text = log.read_text()
    assert "line 19999\n" in text and "last\n" in text and "== work: FAILED (exit 3)" in text


@pytest.mark.parametrize("lines, code, status", [
    (["..", "2 passed in 41.0s"], 0, "ok (exit 0)"),
    (["ss", "SKIPPED [2] tests/test_cuda_tensor_parallel.py:30: TP=2 over NCCL needs two GPUs, this host has 1",
      "2 skipped in 3.10s"], 0, "ok (skipped: TP=2 over NCCL needs two GPUs, this host has 1)"),
    (["F.", "1 failed, 1 passed in 50.2s"], 1, "FAILED (exit 1: tests failed)"),
])
def test_tp_nccl_step_says_why_it_skipped(tmp_path, lines, code, status):
    stub = py(f"print({chr(10).join(lines)!r}); raise SystemExit({code})")
    (row,) = run_steps(tmp_path, f'step tp_nccl 60 verdict_pytest_or_skip "$out/tp_nccl.log" {stub}')
    assert row[:2] == ["tp_nccl", status]
