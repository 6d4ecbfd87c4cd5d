"""`llmctl profile nsys -- CMD`: an Nsight Systems timeline of a workload's warm engine steps.

nsys records between cudaProfilerStart and cudaProfilerStop (`--capture-range=cudaProfilerApi`);
the workload's engine makes those calls around the steps named by LLMCTL_CUDA_PROFILER_STEPS (the
environment form of `--cuda-profiler-steps`), so start-up, weight loading and CUDA-graph capture stay
out of the report. `--whole-run` records everything instead, for a workload that is not llmctl.
"""

from __future__ import annotations

import shutil
import subprocess
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

from llmctl.engine.cuda_profiler import StepRange
from llmctl.engine.errors import EngineArgsError
from llmctl.errors import UserError
from llmctl.profiling import procs
from llmctl.profiling.artifacts import Manifest
from llmctl.profiling.preflight import fail, require_platform

STEPS_ENV = "LLMCTL_CUDA_PROFILER_STEPS"
REPORT_BASE = "llmctl"  # nsys adds .nsys-rep
LOG_NAME = "nsys.log"


@dataclass
class NsysPlan:
    nsys: str
    workload: list[str]
    steps: Optional[str]  # START:STOP engine steps; None: the whole run
    trace: str
    sample_cpu: bool

    def validate(self) -> None:
        if not self.workload:
            raise UserError("give the workload to profile after --, e.g. llmctl profile nsys -- llmctl generate ...")
        if self.steps is not None:
            try:
                StepRange.parse(self.steps)
            except EngineArgsError as exc:
                raise UserError(f"--steps: {exc}") from None


def require_nsys() -> str:
    require_platform("nsys", ("linux", "win32"))
    path = shutil.which("nsys")
    if path is None:
        raise fail("nsys (NVIDIA Nsight Systems) is not on PATH; it ships with the CUDA toolkit "
                   "(/usr/local/cuda/bin) or from https://developer.nvidia.com/nsight-systems")
    return path


def record_argv(plan: NsysPlan, output_dir: Path) -> list[str]:
    """The whole command: `env` hands the step range to the workload's engine through nsys."""
    argv = [plan.nsys, "profile", f"--trace={plan.trace}", f"--sample={'process-tree' if plan.sample_cpu else 'none'}",
            "--force-overwrite=true", f"--output={output_dir / REPORT_BASE}"]
    if plan.steps is None:
        return argv + plan.workload
    return ["env", f"{STEPS_ENV}={plan.steps}", *argv, "--capture-range=cudaProfilerApi",
            "--capture-range-end=stop", *plan.workload]


def run_record(plan: NsysPlan, manifest: Manifest) -> None:
    """Run the workload under nsys (its output into nsys.log); fill in `manifest`."""
    argv = record_argv(plan, manifest.output_dir)
    manifest.workload_command = plan.workload
    log_path = manifest.output_dir / LOG_NAME
    with open(log_path, "w") as log:
        proc = procs.spawn(argv, stdout=log, stderr=subprocess.STDOUT)
        try:
            status = proc.wait()
        except KeyboardInterrupt:  # nsys got the terminal's SIGINT too: it stops the workload and writes
            status = procs.after_interrupt(proc, delay_s=30.0)
    manifest.add_file(log_path)
    report = manifest.output_dir / f"{REPORT_BASE}.nsys-rep"
    manifest.add_file(report)
    manifest.result = {"steps": plan.steps or "whole run", "trace": plan.trace, "report": report.name}
    if status != 0:
        manifest.finish("workload_failed", status, f"the workload under nsys failed ({procs.describe_status(status)}); "
                                                   f"see {log_path}")
    elif not report.exists():
        manifest.finish("failed", status, _no_report_hint(plan))
    else:
        manifest.finish("ok", status)


def _no_report_hint(plan: NsysPlan) -> str:
    if plan.steps is None:
        return "nsys wrote no report (see nsys.log)"
    return (f"nsys wrote no report: the workload never reached engine step {StepRange.parse(plan.steps).start} "
            "(is it an llmctl engine running on CUDA? use fewer --steps, or --whole-run for another program)")
