"""Interconnect: PCIe link training, GPU-to-GPU topology and CPU affinity, NVLink error counters,
IOMMU and ACS."""

from __future__ import annotations

import re
from typing import Any, Optional

from llmctl.checks.gpu_common import gpu_gate, label
from llmctl.checks.model import Finding, Result, Status, fold, skip
from llmctl.checks.probe import BDF, Host, in_vm, nvidia_pci_gpus, parse_cpu_list
from llmctl.checks.settings import Plan

_LINK = {
    "gen": "nvmlDeviceGetCurrPcieLinkGeneration",
    "width": "nvmlDeviceGetCurrPcieLinkWidth",
    "max_gen": "nvmlDeviceGetMaxPcieLinkGeneration",
    "max_width": "nvmlDeviceGetMaxPcieLinkWidth",
    "gpu_max_gen": "nvmlDeviceGetGpuMaxPcieLinkGeneration",
    "replays": "nvmlDeviceGetPcieReplayCounter",
}


def pcie_link(host: Host, plan: Plan) -> Result:
    """Each GPU's PCIe link runs at its maximum generation and width, with few replays.

    Idle GPUs downshift the link to save power, so like DCGM (which judges only in P0) the link
    is read under a short pinned-copy load (pcie_load_seconds, needs torch with CUDA); a link
    below its maximum under load fails. When only the idle link could be read, a link below its
    maximum warns and says so. A slot slower than the GPU supports warns; more than
    pcie_replay_max replays since boot warns.
    """
    gate = gpu_gate("pcie-link", host)
    if gate:
        return gate
    nv = host.nvml
    links = {i: {key: nv.device(i, fn) for key, fn in _LINK.items()} for i in range(nv.count)}
    if all(link["max_gen"] is None for link in links.values()):
        return skip("pcie-link", "PCIe link information is not reported (e.g. no PCIe to this GPU)")
    sample = host.pcie_load.get()
    findings, observed = [], {}
    for i, link in links.items():
        loaded = sample.readings.get(i)
        if loaded:
            link = {**link, "gen": loaded[0], "width": loaded[1]}
        observed[label(i)] = {**link, "bus_id": nv.bus_id(i), "reading": "under load" if loaded else "idle"}
        findings += _link_findings(i, link, bool(loaded), sample.note, plan.thresholds.pcie_replay_max, nv.bus_id(i))
    if not any(f.status in (Status.FAIL, Status.WARN) for f in findings):
        how = "under load" if sample.readings else f"idle only ({sample.note})"
        findings.append(Finding(Status.PASS, f"links at maximum generation and width ({how})"))
    return fold("pcie-link", findings, observed, "current == max generation and width under load")


def _link_findings(i: int, link: dict, loaded: bool, note: str, replay_max: int, bus: Optional[str]) -> list[Finding]:
    findings = []
    gen, width, max_gen, max_width = link["gen"], link["width"], link["max_gen"], link["max_width"]
    shown = f"{label(i)} Gen{gen} x{width}, capable of Gen{max_gen} x{max_width}"
    below = None not in (gen, width, max_gen, max_width) and (gen < max_gen or width < max_width)
    lspci = f"sudo lspci -vv -s {bus or '<bus>'} | grep -E 'LnkCap|LnkSta'"
    if below and loaded:
        findings.append(Finding(Status.FAIL, f"{shown} under load", f"{lspci}  # reseat the card, check riser and BIOS slot settings"))
    elif below:
        findings.append(Finding(Status.WARN, f"{shown} (idle reading only: {note})", f"{lspci}  # re-run with torch+CUDA to judge under load"))
    if link["gpu_max_gen"] and max_gen and max_gen < link["gpu_max_gen"]:
        findings.append(Finding(Status.WARN, f"{label(i)} slot limits the link to Gen{max_gen}, the GPU supports Gen{link['gpu_max_gen']}",
                                f"{lspci}  # move the GPU to a faster slot or check the BIOS PCIe speed setting"))
    if link["replays"] is not None and link["replays"] > replay_max:
        findings.append(Finding(Status.WARN, f"{label(i)} PCIe replay counter {link['replays']}", f"{lspci}  # signal integrity: reseat or replace the riser"))
    return findings


def gpu_topology(host: Host, plan: Plan) -> Result:
    """GPUs can reach each other peer-to-peer, NVLinks are up, and this process runs near its GPUs.

    Reports pairs without P2P (traffic then bounces through host memory), NVLinks that are down,
    GPU pairs that cross CPU sockets without NVLink, and GPUs whose local CPUs (sysfs
    local_cpulist) do not overlap this process's CPU affinity.
    """
    gate = gpu_gate("gpu-topology", host)
    if gate:
        return gate
    nv = host.nvml
    nvlinks = {i: _nvlink_states(nv, i) for i in range(nv.count)}
    findings = _affinity_findings(host) + _nvlink_findings(nvlinks) + _pair_findings(nv, nvlinks)
    observed = {
        "gpus": nv.count,
        "nvlinks_active": {label(i): sum(states.values()) for i, states in nvlinks.items()},
        "process_cpus": _cpu_list_text(host),
    }
    if not findings:
        return skip("gpu-topology", "one GPU and no CPU-affinity information: nothing to check", observed)
    if not any(f.status in (Status.FAIL, Status.WARN) for f in findings):
        findings = [Finding(Status.PASS, "P2P, NVLink and CPU affinity fine")]
    return fold("gpu-topology", findings, observed, "P2P between all GPUs, NVLinks up, affinity local")


def _cpu_list_text(host: Host) -> Optional[str]:
    status = host.read("/proc/self/status") or ""
    match = re.search(r"^Cpus_allowed_list:\s*(\S+)", status, re.M)
    return match.group(1) if match else None


def _affinity_findings(host: Host) -> list[Finding]:
    allowed = parse_cpu_list(_cpu_list_text(host))
    if not allowed:
        return []
    findings = []
    for i in range(host.nvml.count):
        bus = host.nvml.bus_id(i)
        local_text = (host.read(f"/sys/bus/pci/devices/{bus}/local_cpulist") or "").strip() if bus else ""
        local = parse_cpu_list(local_text)
        if not local:
            continue
        if local & allowed:
            findings.append(Finding(Status.PASS, f"{label(i)} local CPUs overlap the process affinity"))
        else:
            findings.append(Finding(Status.WARN, f"{label(i)} is local to CPUs {local_text}, this process may run only on others",
                                    f"taskset -c {local_text} <command>  # or numactl --cpunodebind to the GPU's node"))
    return findings


def _nvlink_states(nv: Any, i: int) -> dict[int, int]:
    """Link number -> 1 active / 0 down, for the links this GPU has (absent links are unsupported)."""
    max_links = int(getattr(nv.lib, "NVML_NVLINK_MAX_LINKS", 18))
    states = {}
    for link in range(max_links):
        state = nv.device(i, "nvmlDeviceGetNvLinkState", link)
        if state is not None:
            states[link] = int(state)
    return states


# nvmlNvLinkErrorCounter_t: data-link replays, recoveries, CRC errors on flits and on data
NVLINK_COUNTERS = {"replay": 0, "recovery": 1, "crc_flit": 2, "crc_data": 3}


def nvlink_errors(host: Host, plan: Plan) -> Result:
    """NVLink data-link error counters (replay, recovery, CRC flit/data) since the driver loaded are
    at most nvlink_errors_max on every active link.

    A few replays recover silently, but counts that grow mean a marginal link that slows NCCL
    all-reduce and may take the GPU off the fabric (XID 74). Any count above the threshold warns.
    """
    gate = gpu_gate("nvlink-errors", host)
    if gate:
        return gate
    nv, limit = host.nvml, plan.thresholds.nvlink_errors_max
    findings, observed = [], {}
    for i in range(nv.count):
        active = [link for link, state in _nvlink_states(nv, i).items() if state]
        counts = {link: {name: nv.device(i, "nvmlDeviceGetNvLinkErrorCounter", link, counter)
                         for name, counter in NVLINK_COUNTERS.items()} for link in active}
        observed[label(i)] = counts
        for link, values in counts.items():
            high = {name: value for name, value in values.items() if value is not None and value > limit}
            if high:
                shown = ", ".join(f"{name} {value}" for name, value in high.items())
                findings.append(Finding(Status.WARN, f"{label(i)} NVLink {link}: {shown}",
                                        f"nvidia-smi nvlink -e -i {i}  # reseat or service the link if it keeps growing"))
    if not any(observed.values()):
        return skip("nvlink-errors", "no active NVLink reported", observed)
    if not findings:
        findings.append(Finding(Status.PASS, f"NVLink error counters <= {limit} on every active link"))
    return fold("nvlink-errors", findings, observed, {name: f"<= {limit}" for name in NVLINK_COUNTERS})


def _nvlink_findings(nvlinks: dict[int, dict[int, int]]) -> list[Finding]:
    findings = []
    for i, states in nvlinks.items():
        down = [link for link, state in states.items() if not state]
        if down and any(states.values()):
            findings.append(Finding(Status.WARN, f"{label(i)} NVLink(s) {', '.join(map(str, down))} down",
                                    f"nvidia-smi nvlink --status -i {i}"))
    return findings


def _pair_findings(nv: Any, nvlinks: dict[int, dict[int, int]]) -> list[Finding]:
    findings = []
    for a in range(nv.count):
        for b in range(a + 1, nv.count):
            p2p = nv.pair(a, b, "nvmlDeviceGetP2PStatus", 0)  # NVML_P2P_CAPS_INDEX_READ
            if p2p not in (None, 0):
                findings.append(Finding(Status.WARN, f"no P2P read between {label(a)} and {label(b)} (status {p2p})",
                                        "nvidia-smi topo -p2p r  # see iommu-acs; check ACS and IOMMU settings"))
            elif p2p == 0:
                findings.append(Finding(Status.PASS, f"P2P {label(a)}-{label(b)}"))
            ancestor = nv.pair(a, b, "nvmlDeviceGetTopologyCommonAncestor")
            linked = any(nvlinks[a].values()) and any(nvlinks[b].values())
            if ancestor == 50 and not linked:  # NVML_TOPOLOGY_SYSTEM: across the CPU interconnect
                findings.append(Finding(Status.WARN, f"{label(a)} and {label(b)} sit on different CPU sockets without NVLink",
                                        "nvidia-smi topo -m  # choose GPUs on one socket with CUDA_VISIBLE_DEVICES"))
    return findings


_PASSTHROUGH_FLAGS = ("iommu=pt", "iommu.passthrough=1", "intel_iommu=off", "amd_iommu=off", "iommu=off")
_ACS_CAP_ID = 0x000D
_ACS_REDIRECT = 0x0004 | 0x0008  # P2P Request Redirect, P2P Completion Redirect


def iommu_acs(host: Host, plan: Plan) -> Result:
    """IOMMU is off or in passthrough mode, and no PCIe bridge above the GPUs redirects P2P (ACS).

    With the IOMMU translating DMA, or ACS redirecting peer requests up to the root complex,
    GPU peer-to-peer traffic (NCCL) slows down or hangs. Reading ACS needs root (extended PCI
    config space); inside a VM these settings belong to the hypervisor and the check skips.
    """
    if in_vm(host):
        return skip("iommu-acs", "inside a VM: IOMMU and ACS are the hypervisor's settings")
    gpus = sorted(nvidia_pci_gpus(host))
    if not gpus:
        return skip("iommu-acs", "no NVIDIA GPU on the PCI bus")
    cmdline = (host.read("/proc/cmdline") or "").split()
    iommu_on = bool(host.glob("/sys/kernel/iommu_groups/*"))
    passthrough = any(flag in cmdline for flag in _PASSTHROUGH_FLAGS)
    findings = []
    if iommu_on and not passthrough:
        findings.append(Finding(Status.WARN, "IOMMU translates DMA (no iommu=pt on the kernel command line)",
                                "sudo sed -i 's/^GRUB_CMDLINE_LINUX=\"/&iommu=pt /' /etc/default/grub && sudo update-grub && sudo reboot"))
    acs = {bridge: _acs_control(host, bridge) for bridge in _bridges_above(host, gpus)} if len(gpus) > 1 else {}
    findings += _acs_findings(acs)
    if not any(f.status in (Status.FAIL, Status.WARN) for f in findings):
        findings.append(Finding(Status.PASS, "IOMMU passthrough/off, no ACS redirect between GPUs" if acs else "IOMMU passthrough/off"))
    observed = {"iommu": "on" if iommu_on else "off", "passthrough": passthrough,
                "acs_redirect": {b: _acs_text(v) for b, v in acs.items()}}
    return fold("iommu-acs", findings, observed, {"iommu": "off or passthrough", "acs_redirect": "off on bridges between GPUs"})


def _acs_text(control: Optional[int]) -> str:
    return "unreadable" if control is None else ("on" if control & _ACS_REDIRECT else "off")


def _acs_findings(acs: dict[str, Optional[int]]) -> list[Finding]:
    findings = []
    for bridge, control in acs.items():
        if control is not None and control & _ACS_REDIRECT:
            findings.append(Finding(Status.WARN, f"ACS redirects P2P on bridge {bridge}",
                                    f"sudo setpci -s {bridge} ECAP_ACS+6.w=0000  # or disable ACS in the BIOS"))
    unreadable = [bridge for bridge, control in acs.items() if control is None]
    if unreadable:
        findings.append(Finding(Status.INFO, f"ACS of {', '.join(unreadable)} unreadable (extended config space needs root)",
                                "sudo llmctl doctor --only iommu-acs"))
    return findings


def _bridges_above(host: Host, gpus: list[str]) -> list[str]:
    bridges: list[str] = []
    for gpu in gpus:
        real = host.path(f"/sys/bus/pci/devices/{gpu}").resolve()
        for parent in real.parents:
            if BDF.match(parent.name) and parent.name not in bridges:
                bridges.append(parent.name)
    return bridges


def _acs_control(host: Host, bridge: str) -> Optional[int]:
    """The ACS control register, 0 when the bridge has no ACS, None when config space is unreadable."""
    config = host.read_bytes(f"/sys/bus/pci/devices/{bridge}/config")
    if config is None or len(config) <= 0x100:
        return None
    offset, seen = 0x100, set()
    while offset and offset + 8 <= len(config) and offset not in seen:
        seen.add(offset)
        header = int.from_bytes(config[offset:offset + 4], "little")
        if header & 0xFFFF == _ACS_CAP_ID:
            return int.from_bytes(config[offset + 6:offset + 8], "little")
        offset = (header >> 20) & 0xFFC
    return 0
