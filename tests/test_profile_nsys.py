"""`llmctl profile nsys`: the nsys command it runs (capture range on the engine's cudaProfilerApi calls,
the step range handed to the workload), its one-line refusals, and the engine's step bracket: start
before step START, stop after step STOP-1, an NVTX range per step, idle steps not counted."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from llmctl.engine import LLM, SamplingParams
from llmctl.engine.cuda_profiler import ProfilerSteps, StepRange
from llmctl.engine.errors import EngineArgsError


def llmctl(*args: str, env: dict | None = None) -> subprocess.CompletedProcess:
    base = {k: v for k, v in os.environ.items() if not k.startswith("LLMCTL_")}
    return subprocess.run([sys.executable, "-m", "llmctl.cli", *args], capture_output=True, text=True,
                          env={**base, "NO_COLOR": "1", **(env or {})}, timeout=300)


class Recorder:
    """The profiler calls, in order, as (name, argument) pairs."""

    def __init__(self):
        self.calls: list[tuple[str, object]] = []

    def profiler(self, steps: StepRange) -> ProfilerSteps:
        return ProfilerSteps(steps, lambda: self.calls.append(("start", None)),
                             lambda: self.calls.append(("stop", None)),
                             lambda name: self.calls.append(("push", name)), lambda: self.calls.append(("pop", None)))


def test_the_bracket_starts_before_start_stops_after_stop_minus_one_and_skips_idle_steps():
    recorder = Recorder()
    profiler = recorder.profiler(StepRange(1, 3))
    for ran in (True, False, True, False, True, True):  # the idle steps (False) are not counted
        with profiler.step() as ran_a_batch:
            recorder.calls.append(("step", ran))
            ran_a_batch(ran)
    assert recorder.calls == [
        ("step", True),
        ("start", None), ("push", "step 1"), ("step", False), ("pop", None),
        ("push", "step 1"), ("step", True), ("pop", None),
        ("push", "step 2"), ("step", False), ("pop", None),
        ("push", "step 2"), ("step", True), ("pop", None), ("stop", None),
        ("step", True),
    ]


@pytest.mark.parametrize("text", ["3", "5:3", "2:2", "-1:4", "a:b", ""])
def test_a_malformed_range_is_refused(text):
    with pytest.raises(EngineArgsError, match="START:STOP"):
        StepRange.parse(text)


def test_the_engine_brackets_its_steps_that_ran_a_batch():
    llm = LLM(None, num_threads=1)
    recorder = Recorder()
    llm.engine.cuda_profiler = recorder.profiler(StepRange(2, 5))
    llm.generate(["To be"], SamplingParams(max_tokens=8, ignore_eos=True, temperature=0.0))
    names = [name for name, _ in recorder.calls]
    assert names == ["start"] + ["push", "pop"] * 3 + ["stop"]
    assert [arg for name, arg in recorder.calls if name == "push"] == ["step 2", "step 3", "step 4"]


def test_the_flag_needs_a_cuda_device():
    with pytest.raises(EngineArgsError, match="needs a CUDA device"):
        LLM(None, cuda_profiler_steps="1:2", device="cpu")
    proc = llmctl("generate", "hi", "--device", "cpu", env={"LLMCTL_CUDA_PROFILER_STEPS": "1:2"})
    assert proc.returncode != 0 and "Traceback" not in proc.stderr
    assert "cuda_profiler_steps needs a CUDA device" in proc.stderr and len(proc.stderr.strip().splitlines()) == 1


def test_dry_run_hands_the_step_range_to_the_workload_and_captures_on_the_profiler_api():
    proc = llmctl("profile", "nsys", "--steps", "4:9", "--dry-run", "--json", "-o", "out", "--", "llmctl", "serve")
    assert proc.returncode == 0, proc.stderr
    command = json.loads(proc.stdout)["command"]
    assert command[:2] == ["env", "LLMCTL_CUDA_PROFILER_STEPS=4:9"] and command[3] == "profile"
    assert "--capture-range=cudaProfilerApi" in command and "--capture-range-end=stop" in command
    assert "--output=out/llmctl" in command and command[-2:] == ["llmctl", "serve"]
    whole = json.loads(llmctl("profile", "nsys", "--whole-run", "--dry-run", "--json", "--", "python", "x.py").stdout)
    assert not any(part.startswith(("env", "LLMCTL_", "--capture-range")) for part in whole["command"])


@pytest.mark.parametrize("args, message", [
    (["--", "llmctl", "generate"], "nsys (NVIDIA Nsight Systems) is not on PATH"),
    ([], "give the workload to profile after --"),
    (["--steps", "9:3", "--", "llmctl", "generate"], "--steps: cuda_profiler_steps '9:3'"),
])
def test_refusals_are_one_line(args, message):
    proc = llmctl("profile", "nsys", *args, env={"PATH": os.path.dirname(sys.executable)})
    assert proc.returncode in (2, 3) and message in proc.stderr and "Traceback" not in proc.stderr
    assert len(proc.stderr.strip().splitlines()) == 1


def _nsys_and_cuda() -> bool:
    import shutil

    import torch

    return shutil.which("nsys") is not None and torch.cuda.is_available()


@pytest.mark.cuda
@pytest.mark.skipif(not _nsys_and_cuda(), reason="needs nsys on PATH and a CUDA device")
def test_a_gpu_generate_run_leaves_a_report_of_its_bracketed_steps(tmp_path):
    out = tmp_path / "nsys"
    proc = llmctl("profile", "nsys", "--steps", "2:6", "--json", "-o", str(out), "--", sys.executable, "-m",
                  "llmctl.cli", "generate", "To be", "--device", "cuda", "--max-tokens", "16")
    manifest = json.loads(proc.stdout)
    assert proc.returncode == 0 and manifest["status"] == "ok", manifest
    assert "llmctl.nsys-rep" in manifest["files"] and (out / "llmctl.nsys-rep").stat().st_size > 0
