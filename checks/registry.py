"""The 28 host checks in report order, and the deployment check `--server` adds; their ids are part of
the command-line and JSON interface."""

from __future__ import annotations

from typing import Iterable

from llmctl.checks import (deployment, fabric, gpu, gpu_health, interconnect, kernel_log, rendezvous, software, storage,
                           system)
from llmctl.checks.model import Check
from llmctl.errors import UserError

CHECKS: tuple[Check, ...] = (
    Check("gpu-visible", "GPU", "NVML sees every NVIDIA GPU on the PCI bus, driver nvidia, /dev nodes usable", gpu.gpu_visible),
    Check("gpu-persistence-mode", "GPU", "persistence mode is on", gpu.gpu_persistence_mode),
    Check("gpu-clocks-consistent", "GPU", "clocks and power limits match across GPUs of one model", gpu.gpu_clocks_consistent),
    Check("gpu-throttle-reasons", "GPU", "no hardware slowdown, thermal slowdown or power brake", gpu_health.gpu_throttle_reasons),
    Check("gpu-thermal-power", "GPU", "thermal margin to slowdown, power limit not below default", gpu_health.gpu_thermal_power),
    Check("gpu-ecc", "GPU", "ECC on, no pending change, no volatile uncorrected errors", gpu_health.gpu_ecc),
    Check("gpu-memory-health", "GPU", "row remapping / retired pages within DCGM limits", gpu_health.gpu_memory_health),
    Check("gpu-memory-free", "GPU", "free GPU memory covers --gpu-memory-utilization", gpu_health.gpu_memory_free),
    Check("gpu-mig-mode", "GPU", "MIG mode as planned, no change pending", gpu.gpu_mig_mode),
    Check("gpu-compute-mode", "GPU", "compute mode is Default", gpu.gpu_compute_mode),
    Check("gpu-xid-events", "GPU", "no fatal XID/SXID in the kernel log since boot", kernel_log.gpu_xid_events),
    Check("pcie-link", "Interconnect", "PCIe link at max generation and width under load", interconnect.pcie_link),
    Check("gpu-topology", "Interconnect", "P2P, NVLink state, cross-socket pairs, CPU affinity", interconnect.gpu_topology),
    Check("nvlink-errors", "Interconnect", "NVLink replay/recovery/CRC error counters within limits", interconnect.nvlink_errors),
    Check("fabric-manager", "Interconnect", "NVSwitch systems: Fabric Manager running, GPUs in the fabric", fabric.fabric_manager),
    Check("rdma-peermem", "Interconnect", "RDMA ports ACTIVE, nvidia_peermem loaded for GPUDirect RDMA", fabric.rdma_peermem),
    Check("iommu-acs", "Interconnect", "IOMMU off or passthrough, no ACS redirect between GPUs", interconnect.iommu_acs),
    Check("tp-rendezvous", "Interconnect", "tensor-parallel rendezvous port bindable, /dev/shm room for the ranks",
          rendezvous.tp_rendezvous),
    Check("numa-balancing", "CPU/OS", "automatic NUMA balancing off on multi-node hosts", system.numa_balancing),
    Check("cpu-governor", "CPU/OS", "CPU frequency governor is performance", system.cpu_governor),
    Check("ulimits", "CPU/OS", "open-file limit high enough, memlock unlimited with RDMA", system.ulimits),
    Check("thp", "Memory", "transparent huge pages madvise/never, defrag not always", system.thp),
    Check("swap", "Memory", "swap off or low swappiness", system.swap),
    Check("shm-size", "Memory", "/dev/shm large enough for NCCL and tensor parallel", system.shm_size),
    Check("driver-version", "Software", "driver supports torch's CUDA runtime; flash-attn fits the GPU", software.driver_version),
    Check("cuda-torch-compat", "Software", "torch sees the GPUs with a matching CUDA build and arch", software.cuda_torch_compat),
    Check("disk-space-model", "Storage/container", "free disk space for the model; network filesystems noted", storage.disk_space_model),
    Check("cgroup-limits", "Storage/container", "cgroup memory/CPU quota and GPUs granted", storage.cgroup_limits),
)

# Run only with `--server URL`: they look at a running server, not at this host.
DEPLOYMENT_CHECKS: tuple[Check, ...] = (
    Check("server-ready", "Deployment", "a running llmctl serve is healthy, exposes the alerted metrics, guards /v1",
          deployment.server_ready),
)

BY_ID = {check.id: check for check in CHECKS + DEPLOYMENT_CHECKS}


def parse_ids(text: str | None, flag: str) -> list[str]:
    """Comma-separated check ids; an unknown id is a usage error naming the valid ones."""
    ids = [part.strip() for part in (text or "").split(",") if part.strip()]
    unknown = [i for i in ids if i not in BY_ID]
    if unknown:
        raise UserError(f"{flag}: unknown check id(s) {', '.join(unknown)} (see 'llmctl doctor --list')")
    return ids


def select(only: Iterable[str], skip: Iterable[str], server: bool = False) -> list[Check]:
    """The host checks (and, with a server to check, the deployment checks) that --only/--skip leave."""
    only, skip = set(only), set(skip)
    if not server and only & {c.id for c in DEPLOYMENT_CHECKS}:
        raise UserError(f"--only {', '.join(sorted(only & {c.id for c in DEPLOYMENT_CHECKS}))} needs --server URL "
                        "(the running llmctl serve to check)")
    pool = CHECKS + DEPLOYMENT_CHECKS if server else CHECKS
    return [c for c in pool if (not only or c.id in only) and c.id not in skip]
