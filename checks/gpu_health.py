"""GPU health: throttling, temperature and power, ECC, memory errors, free memory."""

from __future__ import annotations

from typing import Any

from llmctl.checks.gpu_common import gib, gpu_gate, is_consumer, label
from llmctl.checks.model import Finding, Result, Status, fold, skip
from llmctl.checks.probe import Host, NvmlView
from llmctl.checks.settings import Plan

# nvmlClocksEventReason* bit values (the same bits as the older nvmlClocksThrottleReason*).
_REASONS = {
    0x8: ("hardware slowdown", Status.FAIL, "nvidia-smi -q -d PERFORMANCE,POWER,TEMPERATURE  # check power cabling and cooling"),
    0x40: ("hardware thermal slowdown", Status.FAIL, "nvidia-smi -q -d TEMPERATURE  # check airflow and fans"),
    0x80: ("hardware power brake", Status.FAIL, "nvidia-smi -q -d PERFORMANCE  # the chassis asserted power brake: check PSUs"),
    0x20: ("software thermal slowdown", Status.WARN, "nvidia-smi -q -d TEMPERATURE  # check airflow and fans"),
    0x4: ("software power cap", Status.INFO, None),
}
_REASON_FUNCTIONS = ("nvmlDeviceGetCurrentClocksEventReasons", "nvmlDeviceGetCurrentClocksThrottleReasons")


def gpu_throttle_reasons(host: Host, plan: Plan) -> Result:
    """No GPU is slowed by hardware slowdown, thermal slowdown or power brake right now.

    Reads NVML clocks event reasons (falling back to the older throttle reasons on drivers that
    lack them). Hardware reasons fail, software thermal slowdown warns, the software power cap
    (normal under full load) is reported as information.
    """
    gate = gpu_gate("gpu-throttle-reasons", host)
    if gate:
        return gate
    nv = host.nvml
    findings, observed = [], {}
    for i in range(nv.count):
        mask = nv.first(i, _REASON_FUNCTIONS)
        if mask is None:
            observed[label(i)] = "n/a"
            continue
        active = [(bit, *_REASONS[bit]) for bit in _REASONS if mask & bit]
        observed[label(i)] = [name for _, name, _, _ in active] or ["none"]
        findings += [Finding(status, f"{label(i)}: {name}", fix) for _, name, status, fix in active]
    if all(value == "n/a" for value in observed.values()):
        return skip("gpu-throttle-reasons", "clocks event reasons are not reported by this driver", observed)
    if not any(f.status in (Status.FAIL, Status.WARN) for f in findings):
        findings.append(Finding(Status.PASS, "no hardware or thermal slowdown"))
    return fold("gpu-throttle-reasons", findings, observed, "no hardware/thermal slowdown or power brake")


def gpu_thermal_power(host: Host, plan: Plan) -> Result:
    """Each GPU has thermal headroom and its power limit is not below the default.

    Margin = slowdown threshold minus current temperature; below thermal_margin_warn_c warns,
    below thermal_margin_fail_c fails. A power limit more than power_limit_tolerance_pct under
    the board's default limit warns (someone capped it).
    """
    gate = gpu_gate("gpu-thermal-power", host)
    if gate:
        return gate
    nv, limits = host.nvml, plan.thresholds
    findings, observed = [], {}
    for i in range(nv.count):
        temp = nv.device(i, "nvmlDeviceGetTemperature", 0)  # NVML_TEMPERATURE_GPU
        slowdown = nv.device(i, "nvmlDeviceGetTemperatureThreshold", 1)  # ..._THRESHOLD_SLOWDOWN
        limit = nv.device(i, "nvmlDeviceGetPowerManagementLimit")
        default = nv.device(i, "nvmlDeviceGetPowerManagementDefaultLimit")
        observed[label(i)] = {"temp_c": temp, "slowdown_c": slowdown, "power_limit_w": _w(limit), "default_limit_w": _w(default)}
        findings += _thermal(i, temp, slowdown, limits) + _power(i, limit, default, limits)
    if not findings:
        return skip("gpu-thermal-power", "temperature thresholds and power limits are not reported", observed)
    if not any(f.status != Status.PASS for f in findings):
        findings = [Finding(Status.PASS, "thermal margin and power limits fine")]
    expected = {"margin_c": f">= {limits.thermal_margin_warn_c}", "power_limit": "default limit"}
    return fold("gpu-thermal-power", findings, observed, expected)


def _w(milliwatts: Any) -> Any:
    return round(milliwatts / 1000) if milliwatts is not None else None


def _thermal(i: int, temp: Any, slowdown: Any, limits: Any) -> list[Finding]:
    if temp is None or slowdown is None:
        return []
    margin = slowdown - temp
    fix = "nvidia-smi -q -d TEMPERATURE  # check airflow, fans and inlet temperature"
    if margin < limits.thermal_margin_fail_c:
        return [Finding(Status.FAIL, f"{label(i)} at {temp} C, {margin} C below slowdown ({slowdown} C)", fix)]
    if margin < limits.thermal_margin_warn_c:
        return [Finding(Status.WARN, f"{label(i)} at {temp} C, only {margin} C below slowdown ({slowdown} C)", fix)]
    return [Finding(Status.PASS, f"{label(i)} thermal margin {margin} C")]


def _power(i: int, limit: Any, default: Any, limits: Any) -> list[Finding]:
    if limit is None or default is None:
        return []
    if limit < default * (1 - limits.power_limit_tolerance_pct / 100):
        return [Finding(Status.WARN, f"{label(i)} power limit {_w(limit)} W is below the default {_w(default)} W",
                        f"sudo nvidia-smi -i {i} -pl {_w(default)}")]
    return [Finding(Status.PASS, f"{label(i)} power limit at default")]


def gpu_ecc(host: Host, plan: Plan) -> Result:
    """ECC is enabled (and not about to change) with no volatile uncorrected errors.

    ECC off on a datacenter or workstation card fails; consumer cards (GeForce, TITAN) without
    ECC only warn. A pending mode differing from the current one needs a reboot. More than
    ecc_uncorrected_max volatile uncorrected errors since the last reset fails.
    """
    gate = gpu_gate("gpu-ecc", host)
    if gate:
        return gate
    nv = host.nvml
    findings, observed = [], {}
    for i in range(nv.count):
        modes = nv.device(i, "nvmlDeviceGetEccMode")
        errors = nv.device(i, "nvmlDeviceGetTotalEccErrors", 1, 0)  # UNCORRECTED, VOLATILE_ECC
        observed[label(i)] = {"mode": _onoff(modes, 0), "pending": _onoff(modes, 1), "volatile_uncorrected": errors}
        findings += _ecc_findings(nv, i, modes, errors, plan.thresholds.ecc_uncorrected_max)
    if not any(f.status in (Status.FAIL, Status.WARN) for f in findings):
        findings.append(Finding(Status.PASS, "ECC on, no uncorrected errors"))
    return fold("gpu-ecc", findings, observed, {"mode": "on", "volatile_uncorrected": f"<= {plan.thresholds.ecc_uncorrected_max}"})


def _onoff(modes: Any, position: int) -> str:
    return "n/a" if modes is None else ("on" if modes[position] else "off")


def _ecc_findings(nv: NvmlView, i: int, modes: Any, errors: Any, max_errors: int) -> list[Finding]:
    findings = []
    enable = f"sudo nvidia-smi -i {i} -e 1 && sudo reboot"
    if modes is None or not modes[0]:
        state = "not supported" if modes is None else "off"
        if is_consumer(nv, i):
            findings.append(Finding(Status.WARN, f"{label(i)} ECC {state} (consumer card)", None if modes is None else enable))
        elif modes is None:
            findings.append(Finding(Status.INFO, f"{label(i)} does not report ECC"))
        else:
            findings.append(Finding(Status.FAIL, f"{label(i)} ECC off on a datacenter card", enable))
    if modes is not None and modes[0] != modes[1]:
        findings.append(Finding(Status.WARN, f"{label(i)} ECC change pending until reboot", "sudo reboot"))
    if errors is not None and errors > max_errors:
        findings.append(Finding(Status.FAIL, f"{label(i)} has {errors} volatile uncorrected ECC errors",
                                f"nvidia-smi -q -d ECC -i {i}  # drain the GPU and reset it (sudo nvidia-smi -r -i {i})"))
    return findings


def gpu_memory_health(host: Host, plan: Plan) -> Result:
    """No failed row remapping, no pending remaps or retirements, retired pages within DCGM limits.

    Ampere and newer remap rows: a remapping failure fails (the GPU needs service), a pending
    remap warns (reset the GPU). Older GPUs retire pages: at least retired_pages_max (DCGM: 60)
    fails, at least retired_pages_warn (DCGM soft limit: 15) warns, a pending retirement warns.
    """
    gate = gpu_gate("gpu-memory-health", host)
    if gate:
        return gate
    nv, limits = host.nvml, plan.thresholds
    findings, observed = [], {}
    for i in range(nv.count):
        rows = nv.device(i, "nvmlDeviceGetRemappedRows")
        if rows is not None:
            observed[label(i)] = {"remapped_correctable": rows[0], "remapped_uncorrectable": rows[1],
                                  "pending": bool(rows[2]), "failure": bool(rows[3])}
            findings += _remap_findings(i, rows)
            continue
        pages = _retired_pages(nv, i)
        if pages is not None:
            observed[label(i)] = pages
            findings += _retired_findings(i, pages, limits)
    if not observed:
        return skip("gpu-memory-health", "neither remapped rows nor retired pages are reported (e.g. consumer GPUs)")
    if not any(f.status in (Status.FAIL, Status.WARN) for f in findings):
        findings.append(Finding(Status.PASS, "no memory remapping failures or pending retirements"))
    expected = {"remap_failure": False, "pending": False, "retired_pages": f"< {limits.retired_pages_warn}"}
    return fold("gpu-memory-health", findings, observed, expected)


def _remap_findings(i: int, rows: Any) -> list[Finding]:
    if rows[3]:
        return [Finding(Status.FAIL, f"{label(i)} row remapping failed", f"nvidia-smi -q -d ROW_REMAPPER -i {i}  # the GPU needs service")]
    if rows[2]:
        return [Finding(Status.WARN, f"{label(i)} has a row remap pending", f"sudo nvidia-smi -r -i {i}  # with no processes on it")]
    return []


def _retired_pages(nv: NvmlView, i: int) -> Any:
    single = nv.device(i, "nvmlDeviceGetRetiredPages", 0)  # MULTIPLE_SINGLE_BIT_ECC_ERRORS
    double = nv.device(i, "nvmlDeviceGetRetiredPages", 1)  # DOUBLE_BIT_ECC_ERROR
    if single is None and double is None:
        return None
    pending = nv.device(i, "nvmlDeviceGetRetiredPagesPendingStatus")
    return {"single_bit": len(single or []), "double_bit": len(double or []), "pending": bool(pending)}


def _retired_findings(i: int, pages: dict, limits: Any) -> list[Finding]:
    total = pages["single_bit"] + pages["double_bit"]
    findings = []
    if total >= limits.retired_pages_max:
        findings.append(Finding(Status.FAIL, f"{label(i)} has {total} retired pages", f"nvidia-smi -q -d PAGE_RETIREMENT -i {i}  # the GPU needs service"))
    elif total >= limits.retired_pages_warn:
        findings.append(Finding(Status.WARN, f"{label(i)} has {total} retired pages", f"nvidia-smi -q -d PAGE_RETIREMENT -i {i}"))
    if pages["pending"]:
        findings.append(Finding(Status.WARN, f"{label(i)} has a page retirement pending", f"sudo nvidia-smi -r -i {i}  # with no processes on it"))
    return findings


def gpu_memory_free(host: Host, plan: Plan) -> Result:
    """Each GPU has the memory the plan needs free: --gpu-memory-utilization x total.

    A server that takes gpu_memory_utilization of each GPU fails at start-up if other processes
    already hold more than the rest; those processes are named with their memory.
    """
    gate = gpu_gate("gpu-memory-free", host)
    if gate:
        return gate
    nv, fraction = host.nvml, plan.gpu_memory_utilization
    findings, observed = [], {}
    for i in range(nv.count):
        memory = nv.device(i, "nvmlDeviceGetMemoryInfo")
        if memory is None:
            continue
        users = _processes(host, i)
        observed[label(i)] = {"total_gib": gib(memory.total), "free_gib": gib(memory.free), "processes": users}
        findings.append(_free_finding(i, memory, fraction, users))
    if not findings:
        return skip("gpu-memory-free", "memory information is not reported")
    return fold("gpu-memory-free", findings, observed, {"free": f">= {fraction} x total"})


def _free_finding(i: int, memory: Any, fraction: float, users: list[str]) -> Finding:
    needed = fraction * memory.total
    if memory.free >= needed:
        return Finding(Status.PASS, f"{label(i)}: {gib(memory.free)} GiB free of {gib(memory.total)} GiB")
    held = f" held by {', '.join(users)}" if users else ""
    fits = max(0.0, memory.free / memory.total - 0.01)
    return Finding(Status.FAIL, f"{label(i)}: {gib(memory.free)} GiB free, plan needs {gib(needed)} GiB{held}",
                   f"nvidia-smi --query-compute-apps=pid,process_name,used_memory --format=csv  # stop them or use --gpu-memory-utilization {fits:.2f}")


def _processes(host: Host, i: int) -> list[str]:
    procs = host.nvml.first(i, ("nvmlDeviceGetComputeRunningProcesses",)) or []
    shown = []
    for proc in procs:
        name = host.nvml.call("nvmlSystemGetProcessName", proc.pid) or (host.read(f"/proc/{proc.pid}/comm") or "?").strip()
        used = getattr(proc, "usedGpuMemory", None)
        shown.append(f"{name} (pid {proc.pid}, {gib(used)} GiB)" if used else f"{name} (pid {proc.pid})")
    return shown
