"""Multi-GPU fabric services: NVIDIA Fabric Manager on NVSwitch systems, GPUDirect RDMA (nvidia_peermem)
and InfiniBand/RoCE port state where RDMA devices exist."""

from __future__ import annotations

from pathlib import Path
from typing import Optional

from llmctl.checks.gpu_common import label
from llmctl.checks.model import Finding, Result, Status, fold, skip
from llmctl.checks.probe import NVIDIA_VENDOR, Host, container_kind
from llmctl.checks.settings import Plan

NVSWITCH_CLASS = "0x0680"  # "other bridge": how NVSwitches appear on the PCI bus
FABRIC_PROCESS = "nv-fabricmanager"
FABRIC_COMPLETED = 3  # NVML_GPU_FABRIC_STATE_COMPLETED


def _text(path: Path) -> str:
    try:
        return path.read_text().strip().lower()
    except OSError:
        return ""


def nvswitches(host: Host) -> list[str]:
    """PCI addresses of the NVSwitches on the bus."""
    return [device.name for device in host.glob("/sys/bus/pci/devices/*")
            if _text(device / "vendor") == NVIDIA_VENDOR and _text(device / "class").startswith(NVSWITCH_CLASS)]


def _running(host: Host, comm: str) -> bool:
    return any(_text(proc / "comm") == comm for proc in host.glob("/proc/[0-9]*"))


def fabric_manager(host: Host, plan: Plan) -> Result:
    """On NVSwitch systems (HGX/DGX), NVIDIA Fabric Manager is running and every GPU joined the fabric.

    Without it CUDA calls fail with "system not yet initialized" and NCCL cannot use NVLink.
    Reads NVML's GPU fabric state where the driver reports it (Hopper and newer: state
    COMPLETED with status success passes); otherwise looks for the nv-fabricmanager process
    (inside a container the host's process is not visible, so not finding it only warns).
    """
    switches = nvswitches(host)
    if not switches:
        return skip("fabric-manager", "no NVSwitch on the PCI bus")
    fabric = _fabric_states(host)
    observed = {"nvswitches": len(switches), "fabric": fabric or None}
    fix = "sudo systemctl enable --now nvidia-fabricmanager  # its version must match the driver's"
    if fabric:
        bad = [f"{gpu} {state}" for gpu, state in fabric.items() if state != "completed"]
        if bad:
            return fold("fabric-manager", [Finding(Status.FAIL, f"GPU fabric not ready: {', '.join(bad)}", fix)], observed)
        return fold("fabric-manager", [Finding(Status.PASS, f"{len(fabric)} GPU(s) registered with the NVSwitch fabric")],
                    observed)
    running = _running(host, FABRIC_PROCESS)
    observed["process"] = running
    if running:
        return fold("fabric-manager", [Finding(Status.PASS, f"{FABRIC_PROCESS} is running ({len(switches)} NVSwitches)")],
                    observed)
    status = Status.WARN if container_kind(host) else Status.FAIL
    return fold("fabric-manager", [Finding(status, f"{len(switches)} NVSwitch(es) but no {FABRIC_PROCESS} process"
                                           + (" (inside a container: check the host)" if status == Status.WARN else ""),
                                           fix)], observed)


def _fabric_states(host: Host) -> dict[str, str]:
    nv = host.nvml
    states: dict[str, str] = {}
    for i in range(nv.count if nv else 0):
        info = nv.device(i, "nvmlDeviceGetGpuFabricInfo")
        if info is None:
            continue
        ok = int(info.state) == FABRIC_COMPLETED and int(getattr(info, "status", 0)) == 0
        states[label(i)] = "completed" if ok else f"state {info.state}, status {getattr(info, 'status', '?')}"
    return states


def rdma_peermem(host: Host, plan: Plan) -> Result:
    """Where RDMA devices exist: nvidia_peermem is loaded (GPUDirect RDMA) and the ports are ACTIVE.

    Without nvidia_peermem NCCL stages inter-node traffic through host memory; a port not ACTIVE
    (DOWN, INIT, ARMED) carries nothing. Each non-active port and a missing module warn.
    """
    devices = host.glob("/sys/class/infiniband/*")
    if not devices:
        return skip("rdma-peermem", "no RDMA device in /sys/class/infiniband")
    ports = {f"{d.name}/{p.name}": _port_state(host, d.name, p.name) for d in devices
             for p in host.glob(f"/sys/class/infiniband/{d.name}/ports/*")}
    peermem = host.exists("/sys/module/nvidia_peermem")
    observed = {"ports": ports, "nvidia_peermem": peermem}
    findings = [Finding(Status.WARN, f"RDMA port {port} is {state or 'unreadable'}",
                        f"ibstat {port.split('/')[0]}  # check the cable and the subnet manager")
                for port, state in ports.items() if state != "ACTIVE"]
    if not peermem and host.nvml is not None and host.nvml.count:
        findings.append(Finding(Status.WARN, "nvidia_peermem is not loaded: no GPUDirect RDMA",
                                "sudo modprobe nvidia_peermem"))
    if not findings:
        findings.append(Finding(Status.PASS, f"{len(ports)} RDMA port(s) ACTIVE"
                                + (", nvidia_peermem loaded" if peermem else "")))
    return fold("rdma-peermem", findings, observed, {"ports": "ACTIVE", "nvidia_peermem": "loaded with GPUs"})


def _port_state(host: Host, device: str, port: str) -> Optional[str]:
    """`4: ACTIVE` -> ACTIVE."""
    text = host.read(f"/sys/class/infiniband/{device}/ports/{port}/state")
    return text.split(":", 1)[-1].strip() if text else None
