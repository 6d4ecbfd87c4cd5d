"""GPU presence and configuration: visibility, persistence, clocks, MIG and compute mode."""

from __future__ import annotations

import os
from collections import Counter
from typing import Any

from llmctl.checks.gpu_common import gpu_gate, groups_by_model, label
from llmctl.checks.model import Finding, Result, Status, fold, skip
from llmctl.checks.probe import Host, container_kind, nvidia_pci_gpus
from llmctl.checks.settings import Plan

CLOCK_SM, CLOCK_MEM = 1, 2  # NVML_CLOCK_SM, NVML_CLOCK_MEM


def gpu_visible(host: Host, plan: Plan) -> Result:
    """Every NVIDIA GPU on the PCI bus is driven by `nvidia` and visible to NVML.

    Compares NVIDIA PCI functions in /sys/bus/pci with NVML's device count, flags GPUs bound to
    `nouveau` or to no driver, checks /dev/nvidiactl, /dev/nvidia-uvm and /dev/nvidiaN exist and
    are readable and writable, and reports a driver/library version mismatch (a driver upgraded
    without a reboot). With --expect-gpus N, fewer than N GPUs is a failure, also on a host
    with no GPU at all (which otherwise skips).
    """
    pci = nvidia_pci_gpus(host)
    nv = host.nvml
    count = nv.count if nv else 0
    observed = {"nvml_gpus": count, "pci_gpus": len(pci), "drivers": pci, "nvml_error": host.nvml_error or None}
    expected = {"gpus": plan.expect_gpus, "driver": "nvidia"}
    if nv is None and not pci and not plan.expect_gpus:
        return skip("gpu-visible", f"no NVIDIA GPU on the PCI bus and no NVML ({host.nvml_error})", observed)
    findings = _driver_findings(pci)
    if nv is None:
        findings.append(_nvml_missing(host, pci))
    else:
        findings += _count_findings(host, pci, count) + _device_node_findings(host, count)
    if plan.expect_gpus and count < plan.expect_gpus:
        findings.append(Finding(Status.FAIL, f"expected {plan.expect_gpus} GPU(s), NVML sees {count}",
                                "nvidia-smi -L; sudo dmesg | grep -i -e NVRM -e Xid"))
    if not any(f.status in (Status.FAIL, Status.WARN) for f in findings):
        findings.append(Finding(Status.PASS, f"{count} GPU(s) visible, all bound to nvidia"))
    return fold("gpu-visible", findings, observed, expected)


def _driver_findings(pci: dict[str, Any]) -> list[Finding]:
    findings = []
    for bdf, driver in pci.items():
        if driver == "nouveau":
            findings.append(Finding(Status.FAIL, f"{bdf} is bound to nouveau, not nvidia",
                                    "echo 'blacklist nouveau' | sudo tee /etc/modprobe.d/blacklist-nouveau.conf && sudo update-initramfs -u && sudo reboot"))
        elif driver is None:
            findings.append(Finding(Status.FAIL, f"{bdf} has no driver bound", "sudo modprobe nvidia && nvidia-smi"))
        elif driver != "nvidia":
            findings.append(Finding(Status.INFO, f"{bdf} is bound to {driver} (not usable here, e.g. VM passthrough)"))
    return findings


def _nvml_missing(host: Host, pci: dict[str, Any]) -> Finding:
    if host.nvml_mismatch:
        return Finding(Status.FAIL, host.nvml_error, "sudo reboot  # loads the kernel module matching the upgraded driver libraries")
    where = f"{len(pci)} NVIDIA GPU(s) on the PCI bus but " if pci else ""
    return Finding(Status.FAIL, f"{where}NVML unavailable: {host.nvml_error}", "sudo modprobe nvidia && nvidia-smi")


def _count_findings(host: Host, pci: dict[str, Any], count: int) -> list[Finding]:
    usable = sum(1 for driver in pci.values() if driver == "nvidia")
    if not pci or usable == count:
        return []
    fix = "nvidia-smi -L; sudo dmesg | grep -i -e NVRM -e Xid"
    message = f"NVML sees {count} GPU(s), {usable} on the PCI bus are bound to nvidia"
    kind = container_kind(host)
    if kind and count < usable:  # container runtimes pass a subset of the host's GPUs
        return [Finding(Status.WARN, f"{message} (inside {kind}: the runtime may expose only some)", fix)]
    return [Finding(Status.FAIL, message, fix)]


def _device_node_findings(host: Host, count: int) -> list[Finding]:
    nodes = ["/dev/nvidiactl", "/dev/nvidia-uvm"]
    nodes += [f"/dev/nvidia{_minor_number(host, i)}" for i in range(count)]
    findings = []
    for node in nodes:
        path = host.path(node)
        if not path.exists():
            # nvidia-uvm appears on first CUDA use on a fresh host; the others must always exist.
            status = Status.WARN if node == "/dev/nvidia-uvm" else Status.FAIL
            findings.append(Finding(status, f"{node} is missing", "sudo nvidia-modprobe -u -c=0"))
        elif not os.access(path, os.R_OK | os.W_OK):
            findings.append(Finding(Status.FAIL, f"{node} is not readable and writable by this user",
                                    f"ls -l {node}  # add the user to the owning group (e.g. sudo usermod -aG video $USER)"))
    return findings


def _minor_number(host: Host, index: int) -> int:
    """The N of /dev/nvidiaN: NVML's minor number (0 is a real one), the index where it is not reported."""
    minor = host.nvml.device(index, "nvmlDeviceGetMinorNumber")
    return index if minor is None else minor


def gpu_persistence_mode(host: Host, plan: Plan) -> Result:
    """Persistence mode is on for every GPU.

    Without it the driver tears the GPU state down when the last process exits, so the next
    start pays seconds of initialisation and clocks/ECC state can reset between jobs.
    """
    gate = gpu_gate("gpu-persistence-mode", host)
    if gate:
        return gate
    nv = host.nvml
    modes = {label(i): nv.device(i, "nvmlDeviceGetPersistenceMode") for i in range(nv.count)}
    if all(mode is None for mode in modes.values()):
        return skip("gpu-persistence-mode", "persistence mode is not reported by this driver/platform", modes)
    off = [name for name, mode in modes.items() if mode == 0]
    observed = {name: {1: "on", 0: "off"}.get(mode, "n/a") for name, mode in modes.items()}
    if off:
        finding = Finding(Status.FAIL, f"persistence mode off on {', '.join(off)}", "sudo nvidia-smi -pm 1")
    else:
        finding = Finding(Status.PASS, "persistence mode on")
    return fold("gpu-persistence-mode", [finding], observed, "on")


_CLOCK_FIELDS = (
    ("max SM clock (MHz)", "nvmlDeviceGetMaxClockInfo", CLOCK_SM,
     "nvidia-smi --query-gpu=index,vbios_version,clocks.max.sm --format=csv  # same model, different max clock: compare VBIOS"),
    ("max memory clock (MHz)", "nvmlDeviceGetMaxClockInfo", CLOCK_MEM,
     "nvidia-smi --query-gpu=index,vbios_version,clocks.max.mem --format=csv  # compare VBIOS"),
    ("application SM clock (MHz)", "nvmlDeviceGetApplicationsClock", CLOCK_SM, "sudo nvidia-smi -rac"),
    ("application memory clock (MHz)", "nvmlDeviceGetApplicationsClock", CLOCK_MEM, "sudo nvidia-smi -rac"),
)


def gpu_clocks_consistent(host: Host, plan: Plan) -> Result:
    """Max SM/memory clocks, application clock targets and power limits match across GPUs of one model.

    One slow GPU sets the pace of every tensor-parallel step. Current SM clocks are compared
    only among non-idle GPUs (utilisation >= busy_util_pct), since idle GPUs drop their clocks;
    they may differ by clock_tolerance_pct.
    """
    gate = gpu_gate("gpu-clocks-consistent", host)
    if gate:
        return gate
    nv, limits = host.nvml, plan.thresholds
    findings, observed = [], {}
    for model, indices in groups_by_model(nv).items():
        values = {field: {label(i): nv.device(i, fn, arg) for i in indices} for field, fn, arg, _ in _CLOCK_FIELDS}
        values["power limit (W)"] = {label(i): _watts(nv.device(i, "nvmlDeviceGetPowerManagementLimit")) for i in indices}
        observed[model] = values
        if len(indices) < 2:
            continue
        fixes = {field: fix for field, _, _, fix in _CLOCK_FIELDS}
        fixes["power limit (W)"] = _power_fix(values["power limit (W)"])
        findings += [_mismatch(model, field, per_gpu, fixes[field]) for field, per_gpu in values.items()]
        findings.append(_current_clock_finding(nv, indices, limits, observed[model]))
    findings = [f for f in findings if f is not None]
    if not findings:
        return fold("gpu-clocks-consistent", [Finding(Status.INFO, "one GPU per model: nothing to compare")], observed)
    if not any(f.status != Status.PASS for f in findings):
        findings = [Finding(Status.PASS, "clocks and power limits match across GPUs of each model")]
    return fold("gpu-clocks-consistent", findings, observed, "equal across GPUs of one model")


def _watts(milliwatts: Any) -> Any:
    return round(milliwatts / 1000) if milliwatts is not None else None


def _power_fix(per_gpu: dict[str, Any]) -> str:
    common = Counter(v for v in per_gpu.values() if v is not None).most_common(1)
    return f"sudo nvidia-smi -pl {common[0][0] if common else '<watts>'}"


def _mismatch(model: str, field: str, per_gpu: dict[str, Any], fix: str) -> Any:
    known = {name: value for name, value in per_gpu.items() if value is not None}
    if len(set(known.values())) <= 1:
        return Finding(Status.PASS, f"{field} equal") if known else None
    shown = ", ".join(f"{name}={value}" for name, value in known.items())
    return Finding(Status.FAIL, f"{model}: {field} differs ({shown})", fix)


def _current_clock_finding(nv: Any, indices: list[int], limits: Any, observed: dict) -> Any:
    busy = {}
    for i in indices:
        util = nv.device(i, "nvmlDeviceGetUtilizationRates")
        clock = nv.device(i, "nvmlDeviceGetClockInfo", CLOCK_SM)
        if util is not None and clock is not None and util.gpu >= limits.busy_util_pct:
            busy[label(i)] = clock
    observed["current SM clock of busy GPUs (MHz)"] = busy
    if len(busy) < 2:
        return None
    spread = (max(busy.values()) - min(busy.values())) / max(busy.values()) * 100
    if spread <= limits.clock_tolerance_pct:
        return Finding(Status.PASS, "busy GPUs run at matching SM clocks")
    shown = ", ".join(f"{name}={mhz}" for name, mhz in busy.items())
    return Finding(Status.WARN, f"busy GPUs run at SM clocks {spread:.0f}% apart ({shown} MHz)",
                   "nvidia-smi -q -d PERFORMANCE  # look for the throttle reason on the slow GPU")


def gpu_mig_mode(host: Host, plan: Plan) -> Result:
    """MIG mode matches the plan (off unless thresholds.mig_allowed), with no change pending.

    With MIG on, processes see GPU instances instead of whole GPUs, and tensor parallelism across
    instances is not possible; a pending mode only takes effect after a GPU reset.
    """
    gate = gpu_gate("gpu-mig-mode", host)
    if gate:
        return gate
    nv, allowed = host.nvml, plan.thresholds.mig_allowed
    findings, observed = [], {}
    for i in range(nv.count):
        modes = nv.device(i, "nvmlDeviceGetMigMode")
        if modes is None:
            observed[label(i)] = "not MIG-capable"
            continue
        current, pending = modes
        observed[label(i)] = {"current": "on" if current else "off", "pending": "on" if pending else "off"}
        if current != pending:
            findings.append(Finding(Status.WARN, f"{label(i)} MIG change pending until GPU reset", f"sudo nvidia-smi -r -i {i}"))
        if current and not allowed:
            findings.append(Finding(Status.WARN, f"{label(i)} has MIG enabled", f"sudo nvidia-smi -i {i} -mig 0"))
    if not findings:
        findings.append(Finding(Status.PASS, "MIG mode as planned" if observed else "no GPUs"))
    return fold("gpu-mig-mode", findings, observed, {"mig": "allowed" if allowed else "off"})


_COMPUTE_MODES = {0: "Default", 1: "Exclusive_Thread", 2: "Prohibited", 3: "Exclusive_Process"}


def gpu_compute_mode(host: Host, plan: Plan) -> Result:
    """Compute mode is Default on every GPU.

    Prohibited refuses every CUDA context; Exclusive_Process allows one process per GPU, which
    breaks multi-process serving, profilers and health probes that open a context.
    """
    gate = gpu_gate("gpu-compute-mode", host)
    if gate:
        return gate
    nv = host.nvml
    modes = {i: nv.device(i, "nvmlDeviceGetComputeMode") for i in range(nv.count)}
    if all(mode is None for mode in modes.values()):
        return skip("gpu-compute-mode", "compute mode is not reported by this driver")
    findings = []
    for i, mode in modes.items():
        if mode == 2:
            findings.append(Finding(Status.FAIL, f"{label(i)} is Prohibited", f"sudo nvidia-smi -i {i} -c DEFAULT"))
        elif mode in (1, 3):
            findings.append(Finding(Status.WARN, f"{label(i)} is {_COMPUTE_MODES[mode]}", f"sudo nvidia-smi -i {i} -c DEFAULT"))
    if not findings:
        findings.append(Finding(Status.PASS, "all GPUs in Default compute mode"))
    observed = {label(i): _COMPUTE_MODES.get(mode, "n/a") for i, mode in modes.items()}
    return fold("gpu-compute-mode", findings, observed, "Default")
