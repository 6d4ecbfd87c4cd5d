"""Run selected checks against a host and assemble the report (results, summary, host facts)."""

from __future__ import annotations

import os
import platform
import re
import time
from collections import Counter
from typing import Any, Iterable

from llmctl.checks.model import Check, Result, Status, skip
from llmctl.checks.probe import Host, NvmlMismatch
from llmctl.checks.settings import Plan
from llmctl.checks.software import driver_cuda, driver_version_text

SCHEMA_VERSION = 1


def run_one(check: Check, host: Host, plan: Plan) -> Result:
    """A crashing check becomes a warning naming the error, so one bug cannot hide the rest; a check that
    needs an NVML query this driver cannot answer is skipped with the reason."""
    try:
        return check.run(host, plan)
    except NvmlMismatch as exc:
        return skip(check.id, str(exc))
    except Exception as exc:  # noqa: BLE001 - reported, not swallowed
        return Result(check.id, Status.WARN, f"check could not run: {type(exc).__name__}: {exc}")


def run_checks(checks: Iterable[Check], host: Host, plan: Plan) -> list[Result]:
    return [run_one(check, host, plan) for check in checks]


def exit_code(results: Iterable[Result], strict: bool) -> int:
    """0 when nothing failed (warnings allowed unless strict), 1 otherwise."""
    bad = {Status.FAIL, Status.WARN} if strict else {Status.FAIL}
    return 1 if any(r.status in bad for r in results) else 0


def counts(results: Iterable[Result]) -> dict[str, int]:
    tally = Counter(r.status.value for r in results)
    return {status.value: tally.get(status.value, 0) for status in Status}


def host_facts(host: Host) -> dict[str, Any]:
    """Environment facts in the spirit of `vllm collect-env`."""
    sw = host.software.get()
    cuda = driver_cuda(host)
    return {
        "os": _os_name(host),
        "kernel": (host.read("/proc/sys/kernel/osrelease") or platform.release()).strip(),
        "cpu": _cpu_model(host),
        "cpus": os.cpu_count(),
        "python": platform.python_version(),
        "torch": sw.torch_version,
        "torch_cuda": sw.cuda_runtime,
        "cudnn": sw.cudnn,
        "nccl": sw.nccl,
        "flash_attn": sw.flash_attn_version,
        "driver": driver_version_text(host),
        "driver_cuda": ".".join(map(str, cuda)) if cuda else None,
        "nvml": None if host.nvml else host.nvml_error,
        "gpus": _gpus(host),
    }


def _os_name(host: Host) -> str | None:
    match = re.search(r'^PRETTY_NAME="?([^"\n]*)"?', host.read("/etc/os-release") or "", re.M)
    return match.group(1) if match else None


def _cpu_model(host: Host) -> str | None:
    match = re.search(r"^model name\s*:\s*(.+)$", host.read("/proc/cpuinfo") or "", re.M)
    return match.group(1).strip() if match else platform.processor() or None


def _gpus(host: Host) -> list[dict[str, Any]]:
    nv = host.nvml
    if nv is None:
        return []
    gpus = []
    for i in range(nv.count):
        pci = nv.device(i, "nvmlDeviceGetPciInfo")
        memory = nv.device(i, "nvmlDeviceGetMemoryInfo")
        gpus.append({
            "index": i,
            "name": nv.name(i),
            "bus_id": nv.bus_id(i),
            "pci_device_id": f"{pci.pciDeviceId:#010x}" if pci is not None else None,
            "uuid": nv.device(i, "nvmlDeviceGetUUID"),
            "memory_gib": round(memory.total / (1 << 30), 1) if memory is not None else None,
            "compute_capability": ".".join(map(str, cc)) if (cc := nv.device(i, "nvmlDeviceGetCudaComputeCapability")) else None,
        })
    return gpus


def report(
    results: list[Result], checks: list[Check], host: Host, plan: Plan, strict: bool, started: float, with_facts: bool = True
) -> dict[str, Any]:
    """The JSON report; host facts import torch, so the table view leaves them out."""
    areas = {c.id: c.area for c in checks}
    titles = {c.id: c.title for c in checks}
    return {
        "schema_version": SCHEMA_VERSION,
        "host": host_facts(host) if with_facts else None,
        "summary": {**counts(results), "total": len(results), "strict": strict, "exit_code": exit_code(results, strict),
                    "duration_s": round(time.monotonic() - started, 2)},
        "results": [{**r.to_dict(), "area": areas[r.id], "title": titles[r.id]} for r in results],
        "plan": {"expect_gpus": plan.expect_gpus, "model": str(plan.model) if plan.model else None,
                 "gpu_memory_utilization": plan.gpu_memory_utilization, "thresholds": plan.thresholds.to_dict(),
                 "server": plan.server, "tensor_parallel_size": plan.tensor_parallel_size,
                 "master_addr": plan.master_addr, "master_port": plan.master_port},
    }


def live_host(nvml: Any, nvml_error: str, nvml_mismatch: bool, plan: Plan) -> Host:
    """The real machine: root `/`, this process's environment, torch and the PCIe probe on demand."""
    from llmctl.checks.kernel_log import read_kernel_log
    from llmctl.checks.pcie_load import measure_under_load
    from llmctl.checks.probe import Lazy, LoadSample
    from llmctl.checks.software import gather_software

    if nvml is not None:
        load = Lazy(lambda: measure_under_load(nvml, plan.thresholds.pcie_load_seconds))
    else:
        load = Lazy.of(LoadSample(note="no NVML"))
    return Host(nvml=nvml, nvml_error=nvml_error, nvml_mismatch=nvml_mismatch, env=dict(os.environ),
                software=Lazy(gather_software), pcie_load=load, kernel_log=Lazy(read_kernel_log))
