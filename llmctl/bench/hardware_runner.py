"""What `llmctl bench` (`--gpu`/`--cpu`) does once its flags are parsed: pick the device, run the
microbenchmarks (`hardware`) under a progress bar, print each figure as it completes, then the
device inventory or the `--json` document, then the notes,
warnings and failures on stderr, and return the exit code (1: a benchmark failed or a figure is
under `--fail-below`)."""

from __future__ import annotations

import sys
from dataclasses import dataclass
from typing import Any, Optional

from llmctl.errors import UserError


@dataclass(frozen=True)
class HardwareJob:
    gpu: bool
    cpu: bool
    mode: str  # quick, default, full
    model: Optional[str]  # shape of the decode-step benchmark
    num_threads: Optional[int]
    json_output: bool
    fail_below: Optional[float]
    stress_s: Optional[float] = None  # --stress: seconds of checked GEMMs instead of the microbenchmarks


def run_hardware_job(job: HardwareJob) -> int:
    import torch

    from llmctl.bench import hardware
    from llmctl.bench.report import HardwareRows, measured_line, progress_bar, render_inventory
    from llmctl.bench.shapes import resolve_shape
    from llmctl.output import print_json

    if job.stress_s is not None and (job.cpu or not torch.cuda.is_available()):
        raise UserError("--stress loads CUDA GPUs with checked GEMMs: it needs a CUDA device and not --cpu")
    if job.gpu and not torch.cuda.is_available():
        raise UserError(f"--gpu: no CUDA device is available (torch {torch.__version__}, "
                        f"CUDA build {torch.version.cuda or 'none'}); use --cpu")
    shape = resolve_shape(job.model) if job.model else None
    if job.num_threads:
        torch.set_num_threads(job.num_threads)
    use_gpu = job.gpu or (not job.cpu and torch.cuda.is_available())
    plan = hardware.PLANS[job.mode]
    show = measured_line if job.json_output else HardwareRows()
    with progress_bar(True) as update:
        on_result = lambda result: show(result.to_dict())  # noqa: E731
        if job.stress_s is not None:
            report = hardware.run_gpu_stress(job.stress_s, update, on_result)
        else:
            run = hardware.run_gpu if use_gpu else hardware.run_cpu
            report = run(plan, shape, update, on_result)
    if not job.gpu and not job.cpu and not use_gpu:
        report.notes.insert(0, f"no CUDA device (torch {torch.__version__}): benchmarked the CPU instead; "
                               "pass --cpu to ask for it explicitly")
    doc = report.to_dict()
    if job.json_output:
        print_json(doc)
    else:
        render_inventory(doc["devices"])
    return verdict(report, job.fail_below)


def verdict(report: Any, fail_below: Optional[float]) -> int:
    """Print notes, warnings and failures on stderr; 1 when a benchmark failed or a figure is under --fail-below."""
    from llmctl.bench.hardware import fail_below as below

    lines = [f"llmctl: note: {note}" for note in report.notes]
    lines += [f"llmctl: warning: {warning}" for warning in report.warnings]
    lines += [f"llmctl: error: {e['benchmark']} on {e['device']} failed: {e['error']}" for e in report.errors]
    code = 1 if report.errors else 0
    if fail_below is not None:
        if not any(r.peak for r in report.results):
            lines.append(f"llmctl: note: --fail-below {fail_below:g}: no figure has a datasheet peak on this "
                         "device; nothing to compare")
        for r in below(report.results, fail_below):
            lines.append(f"llmctl: below {fail_below:g}% of peak: {r.name} on {r.device}: {r.median:g} {r.unit} "
                         f"= {r.pct_of_peak:.1f}% of {r.peak:g}")
            code = 1
    sys.stderr.write("".join(line + "\n" for line in lines))
    return code
