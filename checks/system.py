"""CPU/OS and memory settings: NUMA balancing, CPU governor, ulimits, THP, swap, /dev/shm."""

from __future__ import annotations

import re
from collections import Counter
from typing import Optional

from llmctl.checks.model import Finding, Result, Status, fold, skip
from llmctl.checks.probe import Host, container_kind, read_value
from llmctl.checks.settings import Plan


def numa_balancing(host: Host, plan: Plan) -> Result:
    """Automatic NUMA balancing is off on hosts with more than one NUMA node.

    The kernel unmaps pages to sample accesses and migrates them between nodes, which stalls
    pinned-memory transfers and CPU threads feeding the GPUs. Irrelevant on one node.
    """
    value = read_value(host, "/proc/sys/kernel/numa_balancing")
    if value is None:
        return skip("numa-balancing", "kernel has no automatic NUMA balancing (/proc/sys/kernel/numa_balancing missing)")
    nodes = len(host.glob("/sys/devices/system/node/node[0-9]*"))
    observed = {"numa_balancing": value, "numa_nodes": nodes}
    if nodes <= 1:
        finding = Finding(Status.PASS, f"single NUMA node (numa_balancing={value} does not matter)")
    elif value != "0":
        finding = Finding(Status.FAIL, f"numa_balancing={value} on a {nodes}-node host", "sudo sysctl -w kernel.numa_balancing=0")
    else:
        finding = Finding(Status.PASS, f"NUMA balancing off on {nodes} nodes")
    return fold("numa-balancing", [finding], observed, {"numa_balancing": "0 when nodes > 1"})


def cpu_governor(host: Host, plan: Plan) -> Result:
    """Every CPU uses the expected frequency governor (thresholds.cpu_governor, default performance).

    Power-saving governors ramp up slowly, which shows as jitter in the CPU work between GPU
    steps (scheduling, sampling, tokenisation) and in time to first token.
    """
    files = host.glob("/sys/devices/system/cpu/cpu[0-9]*/cpufreq/scaling_governor")
    governors = Counter(path.read_text().strip() for path in files)
    want = plan.thresholds.cpu_governor
    if not governors:
        return skip("cpu-governor", "no cpufreq governors exposed (VM, container without sysfs, or firmware-managed)")
    others = {name: n for name, n in governors.items() if name != want}
    if others:
        shown = ", ".join(f"{n} CPU(s) {name}" for name, n in others.items())
        finding = Finding(Status.WARN, f"{shown}, expected {want}", f"sudo cpupower frequency-set -g {want}")
    else:
        finding = Finding(Status.PASS, f"all {sum(governors.values())} CPUs use {want}")
    return fold("cpu-governor", [finding], dict(governors), want)


_LIMIT_LINE = re.compile(r"^(Max [a-z ]+?)\s{2,}(\S+)\s+(\S+)", re.M)


def ulimits(host: Host, plan: Plan) -> Result:
    """Open-file limit is at least nofile_min; locked memory is unlimited when RDMA is present.

    Servers hold a socket per client and a file per shard; NCCL over InfiniBand/RoCE must pin
    (lock) its buffers, and a finite memlock limit makes it fail or fall back to TCP.
    """
    text = host.read("/proc/self/limits")
    if text is None:
        return skip("ulimits", "/proc/self/limits is not readable")
    limits = {name: (soft, hard) for name, soft, hard in _LIMIT_LINE.findall(text)}
    nofile = limits.get("Max open files", ("?", "?"))[0]
    memlock = limits.get("Max locked memory", ("?", "?"))[0]
    rdma = [path.name for path in host.glob("/sys/class/infiniband/*")]
    observed = {"nofile_soft": nofile, "memlock_soft": memlock, "rdma_devices": rdma}
    need = plan.thresholds.nofile_min
    findings = []
    if nofile != "unlimited" and nofile.isdigit() and int(nofile) < need:
        findings.append(Finding(Status.WARN, f"open files limit {nofile} < {need}",
                                f"ulimit -n {need}  # persist in /etc/security/limits.conf; docker: --ulimit nofile={need}:{need}"))
    if rdma and memlock != "unlimited":
        findings.append(Finding(Status.FAIL, f"locked memory limited to {memlock} with RDMA devices {', '.join(rdma)}",
                                "ulimit -l unlimited  # docker: --ulimit memlock=-1; persist in /etc/security/limits.conf"))
    if not findings:
        findings.append(Finding(Status.PASS, f"open files {nofile}" + (f", memlock {memlock}" if rdma else "")))
    return fold("ulimits", findings, observed, {"nofile": f">= {need}", "memlock": "unlimited with RDMA"})


def _selected(text: Optional[str]) -> Optional[str]:
    """`always [madvise] never` -> `madvise`."""
    match = re.search(r"\[(\w+)\]", text or "")
    return match.group(1) if match else None


def thp(host: Host, plan: Plan) -> Result:
    """Transparent huge pages are in an allowed mode (thp_allowed, default madvise or never), defrag not always.

    THP `always` lets khugepaged and direct compaction stall allocating threads, which shows up
    as latency spikes; `madvise` keeps huge pages for the code that asks for them (the engine asks for its CPU
    weights and KV pool, engine/weight_pages.py; under `never` they stay in 4 KiB pages).
    """
    enabled = _selected(host.read("/sys/kernel/mm/transparent_hugepage/enabled"))
    defrag = _selected(host.read("/sys/kernel/mm/transparent_hugepage/defrag"))
    if enabled is None:
        return skip("thp", "transparent huge pages are not available in this kernel")
    allowed = plan.thresholds.thp_allowed
    findings = []
    if enabled not in allowed:
        findings.append(Finding(Status.WARN, f"THP enabled={enabled}, allowed: {', '.join(allowed)}",
                                f"echo {allowed[0]} | sudo tee /sys/kernel/mm/transparent_hugepage/enabled"))
    if defrag == "always":
        findings.append(Finding(Status.WARN, "THP defrag=always (direct compaction stalls allocations)",
                                "echo madvise | sudo tee /sys/kernel/mm/transparent_hugepage/defrag"))
    if not findings:
        findings.append(Finding(Status.PASS, f"THP enabled={enabled}, defrag={defrag}"))
    return fold("thp", findings, {"enabled": enabled, "defrag": defrag}, {"enabled": list(allowed), "defrag": "not always"})


def _meminfo_kib(text: str, key: str) -> Optional[int]:
    match = re.search(rf"^{key}:\s+(\d+)", text, re.M)
    return int(match.group(1)) if match else None


def swap(host: Host, plan: Plan) -> Result:
    """Swap is off, or swappiness is at most swappiness_max so model memory is not swapped out.

    Swapped-out pages of a serving process turn into multi-second stalls; pinned buffers cannot
    be swapped, but tokenizer, scheduler and Python heaps can.
    """
    meminfo = host.read("/proc/meminfo")
    if meminfo is None:
        return skip("swap", "/proc/meminfo is not readable")
    total = _meminfo_kib(meminfo, "SwapTotal") or 0
    free = _meminfo_kib(meminfo, "SwapFree") or 0
    swappiness = read_value(host, "/proc/sys/vm/swappiness")
    limit = plan.thresholds.swappiness_max
    observed = {"swap_total_gib": round(total / (1 << 20), 1), "swap_used_gib": round((total - free) / (1 << 20), 1), "swappiness": swappiness}
    if total == 0:
        finding = Finding(Status.PASS, "no swap")
    elif swappiness is not None and swappiness.isdigit() and int(swappiness) > limit:
        finding = Finding(Status.WARN, f"swap on with swappiness={swappiness} (> {limit})", f"sudo sysctl -w vm.swappiness={limit}")
    else:
        finding = Finding(Status.PASS, f"swap on, swappiness={swappiness}")
    return fold("swap", [finding], observed, {"swap": "off", "swappiness": f"<= {limit} if swap is on"})


def shm_size(host: Host, plan: Plan) -> Result:
    """/dev/shm holds at least shm_min_gib.

    NCCL and PyTorch multiprocessing pass tensors through /dev/shm; Docker's default 64 MiB makes
    tensor-parallel start-up fail with bus errors or NCCL "unhandled system error".
    """
    path = host.path("/dev/shm")
    if not path.is_dir():
        return skip("shm-size", "/dev/shm does not exist")
    total, free = host.disk_usage(path)
    need = plan.thresholds.shm_min_gib
    observed = {"size_gib": round(total / (1 << 30), 2), "free_gib": round(free / (1 << 30), 2)}
    if total >= need * (1 << 30):
        return fold("shm-size", [Finding(Status.PASS, f"/dev/shm is {observed['size_gib']} GiB")], observed, f">= {need} GiB")
    finding = Finding(Status.FAIL, f"/dev/shm is only {round(total / (1 << 20))} MiB", shm_fix(host))
    return fold("shm-size", [finding], observed, f">= {need} GiB")


def shm_fix(host: Host) -> str:
    """How to give /dev/shm more room where this process runs (Kubernetes, a container, the host)."""
    kind = container_kind(host)
    if kind == "kubernetes":
        return "mount an emptyDir with medium: Memory at /dev/shm in the pod spec"
    if kind:
        return "docker run --ipc=host ...  # or --shm-size=16g"
    return "sudo mount -o remount,size=16G /dev/shm"
