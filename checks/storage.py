"""Storage and container limits: room for the model, cgroup memory/CPU quota, GPUs granted."""

from __future__ import annotations

from pathlib import Path
from typing import Optional

from llmctl.checks.model import Finding, Result, Status, fold, skip
from llmctl.checks.probe import Host, container_kind, read_value
from llmctl.checks.settings import Plan

NETWORK_FS = {"nfs", "nfs4", "cifs", "smb3", "smbfs", "fuse.sshfs", "sshfs", "glusterfs", "fuse.glusterfs",
              "ceph", "fuse.ceph", "fuse.s3fs", "fuse.gcsfuse", "fuse.mountpoint-s3", "9p", "lustre", "gpfs", "beegfs"}
_UNLIMITED_V1 = 1 << 62  # cgroup v1 reports "no limit" as a huge page-aligned number


def _model_size(path: Path) -> int:
    if path.is_file():
        return path.stat().st_size
    return sum(f.stat().st_size for f in path.rglob("*") if f.is_file())


def _mount_of(host: Host, path: Path) -> tuple[str, str]:
    """(mount point, filesystem type) of the longest /proc/mounts entry containing path."""
    best = ("/", "unknown")
    for line in (host.read("/proc/mounts") or "").splitlines():
        fields = line.split()
        if len(fields) < 3:
            continue
        point = fields[1].replace("\\040", " ")
        if (str(path) == point or str(path).startswith(point.rstrip("/") + "/")) and len(point) >= len(best[0]):
            best = (point, fields[2])
    return best


def disk_space_model(host: Host, plan: Plan) -> Result:
    """The filesystem holding --model has free space for disk_free_factor x the model's size.

    Room is needed for a converted or cached copy of the weights and compile caches. A model on
    a network filesystem (NFS, CIFS, s3fs, Lustre, ...) is noted: every cold start reads it over
    the network.
    """
    if plan.model is None:
        return skip("disk-space-model", "no --model given (pass --model PATH to compare free space with its size)")
    model = Path(plan.model).expanduser()
    if not model.exists():
        return fold("disk-space-model", [Finding(Status.FAIL, f"model path {model} does not exist", f"ls -ld {model}")], str(model))
    size = _model_size(model)
    total, free = host.disk_usage(model)
    point, fstype = _mount_of(host, model.resolve())
    need = size * plan.thresholds.disk_free_factor
    observed = {"model_gib": _gib(size), "free_gib": _gib(free), "mount": point, "fstype": fstype}
    findings = []
    if free < need:
        findings.append(Finding(Status.WARN, f"{_gib(free)} GiB free on {point} for a {_gib(size)} GiB model",
                                f"df -h {point}  # free space or move the model to a larger local disk"))
    if fstype in NETWORK_FS:
        findings.append(Finding(Status.WARN, f"model is on {fstype} (network filesystem): cold starts read it over the network",
                                f"cp -r {model} /local/nvme/  # then pass the local copy"))
    if not findings:
        findings.append(Finding(Status.PASS, f"{_gib(free)} GiB free for a {_gib(size)} GiB model on {fstype}"))
    return fold("disk-space-model", findings, observed, {"free_gib": f">= {_gib(need)}", "fstype": "local"})


def _gib(value: float) -> float:
    return round(value / (1 << 30), 2)


def _cgroup_dirs(host: Host) -> dict[str, str]:
    """Controller -> this process's cgroup directory; key 'unified' for cgroup v2."""
    dirs = {}
    for line in (host.read("/proc/self/cgroup") or "").splitlines():
        parts = line.split(":", 2)
        if len(parts) != 3:
            continue
        _, controllers, path = parts
        base = f"/sys/fs/cgroup/{controllers}" if controllers else "/sys/fs/cgroup"
        nested = f"{base}{path}".rstrip("/")
        # Inside a cgroup namespace the own group is mounted at the base, not at its path.
        chosen = nested if host.exists(nested) else base
        for name in controllers.split(",") if controllers else ["unified"]:
            dirs[name] = chosen
    return dirs


def _limits(host: Host) -> Optional[tuple[Optional[int], Optional[float]]]:
    """(memory limit in bytes or None, CPU quota in CPUs or None); None when no cgroup files exist."""
    dirs = _cgroup_dirs(host)
    if "unified" in dirs and host.exists(f"{dirs['unified']}/cgroup.controllers"):
        memory = read_value(host, f"{dirs['unified']}/memory.max")
        cpu = (read_value(host, f"{dirs['unified']}/cpu.max") or "max").split()
        mem_limit = int(memory) if memory and memory.isdigit() else None
        cpus = int(cpu[0]) / int(cpu[1]) if cpu[0].isdigit() and len(cpu) > 1 else None
        return mem_limit, cpus
    mem_dir, cpu_dir = dirs.get("memory"), dirs.get("cpu")
    if mem_dir is None and cpu_dir is None:
        return None
    memory = read_value(host, f"{mem_dir}/memory.limit_in_bytes") if mem_dir else None
    quota = read_value(host, f"{cpu_dir}/cpu.cfs_quota_us") if cpu_dir else None
    period = read_value(host, f"{cpu_dir}/cpu.cfs_period_us") if cpu_dir else None
    mem_limit = int(memory) if memory and memory.isdigit() and int(memory) < _UNLIMITED_V1 else None
    cpus = int(quota) / int(period) if quota and quota.isdigit() and period and period.isdigit() else None
    return mem_limit, cpus


def cgroup_memory_limit(host: Host) -> Optional[int]:
    """This process's cgroup memory limit in bytes (v2 memory.max, v1 memory.limit_in_bytes); None if unlimited."""
    return (_limits(host) or (None, None))[0]


def cgroup_limits(host: Host, plan: Plan) -> Result:
    """The cgroup's memory and CPU quota meet the minimums and the container got the GPUs it asked for.

    Loading weights needs host memory (cgroup_min_memory_gib), tokenisation and scheduling need
    CPUs (cgroup_min_cpus). NVIDIA_VISIBLE_DEVICES (set by the NVIDIA container runtime and the
    Kubernetes device plugin) names the GPUs requested; NVML must see that many. Kubernetes is
    detected and noted.
    """
    limits = _limits(host)
    if limits is None:
        return skip("cgroup-limits", "no cgroup information in /proc/self/cgroup")
    memory, cpus = limits
    kind = container_kind(host)
    t = plan.thresholds
    requested = _requested_gpus(host)
    observed = {"memory_limit_gib": _gib(memory) if memory else None, "cpu_quota": cpus, "container": kind,
                "gpus_requested": requested, "gpus_visible": host.nvml.count if host.nvml else 0}
    findings = []
    if memory is not None and memory < t.cgroup_min_memory_gib * (1 << 30):
        findings.append(Finding(Status.FAIL, f"memory limit {_gib(memory)} GiB < {t.cgroup_min_memory_gib} GiB", _raise_fix(kind, "memory")))
    if cpus is not None and cpus < t.cgroup_min_cpus:
        findings.append(Finding(Status.WARN, f"CPU quota {cpus:g} < {t.cgroup_min_cpus:g} CPUs", _raise_fix(kind, "cpu")))
    if requested is not None and requested != observed["gpus_visible"]:
        findings.append(Finding(Status.FAIL, f"{requested} GPU(s) requested (NVIDIA_VISIBLE_DEVICES), NVML sees {observed['gpus_visible']}",
                                "nvidia-smi -L  # check the device plugin / --gpus flag and the NVIDIA container toolkit"))
    if not findings:
        shown = f"memory {_gib(memory)} GiB" if memory else "no memory limit"
        findings.append(Finding(Status.PASS, f"{shown}, {f'{cpus:g} CPUs' if cpus else 'no CPU quota'}" + (f" ({kind})" if kind else "")))
    expected = {"memory_gib": f">= {t.cgroup_min_memory_gib}", "cpus": f">= {t.cgroup_min_cpus}", "gpus": "as requested"}
    return fold("cgroup-limits", findings, observed, expected)


def _requested_gpus(host: Host) -> Optional[int]:
    value = (host.env.get("NVIDIA_VISIBLE_DEVICES") or "").strip()
    if not value or value in ("all", "void"):
        return None
    if value == "none":
        return 0
    return len([item for item in value.split(",") if item.strip()])


def _raise_fix(kind: Optional[str], what: str) -> str:
    if kind == "kubernetes":
        return f"raise resources.limits.{what} in the pod spec"
    if kind:
        return "docker run --memory=64g ..." if what == "memory" else "docker run --cpus=8 ..."
    return f"systemctl show -p {'MemoryMax' if what == 'memory' else 'CPUQuota'} <unit>  # raise it with systemctl set-property"
