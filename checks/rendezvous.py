"""tp-rendezvous: what a tensor-parallel launch needs of this host before its ranks start."""

from __future__ import annotations

import errno

from llmctl.checks.model import Finding, Result, Status, fold, skip
from llmctl.checks.probe import Host
from llmctl.checks.settings import Plan
from llmctl.checks.system import shm_fix


def tp_rendezvous(host: Host, plan: Plan) -> Result:
    """With --tensor-parallel-size N > 1: the rendezvous port (--master-addr, --master-port) can be bound
    here, and /dev/shm has tp_shm_per_rank_mib free per rank.

    Rank 0 listens on the port for the other ranks (torch.distributed's TCP store, gloo or NCCL); a port
    another process holds makes every rank wait until the rendezvous times out. NCCL's intra-node SHM
    transport and torch.multiprocessing's shared tensors live in /dev/shm; too little there shows as bus
    errors or NCCL "unhandled system error" at the first collective. On a node other than node 0 the
    address is not this host's, and only /dev/shm is judged here (run the check on node 0 for the port).
    """
    size = plan.tensor_parallel_size
    if size <= 1:
        return skip("tp-rendezvous", "tensor-parallel size 1: no rendezvous (give --tensor-parallel-size N)")
    findings = [_port_finding(host, plan.master_addr, plan.master_port)]
    observed = {"tensor_parallel_size": size, "master_addr": plan.master_addr, "master_port": plan.master_port}
    need_mib = size * plan.thresholds.tp_shm_per_rank_mib
    expected = {"port": "bindable on node 0", "shm_free_mib": f">= {need_mib:g} ({size} ranks)"}
    path = host.path("/dev/shm")
    if not path.is_dir():
        findings.append(Finding(Status.FAIL, "/dev/shm does not exist", shm_fix(host)))
    else:
        free_mib = host.disk_usage(path)[1] / (1 << 20)
        observed["shm_free_mib"] = round(free_mib)
        if free_mib < need_mib:
            findings.append(Finding(Status.FAIL, f"/dev/shm has {free_mib:.0f} MiB free, {size} ranks need "
                                                 f"{need_mib:g} MiB", shm_fix(host)))
        else:
            findings.append(Finding(Status.PASS, f"/dev/shm has {free_mib:.0f} MiB free for {size} ranks"))
    return fold("tp-rendezvous", findings, observed, expected)


def _port_finding(host: Host, address: str, port: int) -> Finding:
    if port == 0:
        return Finding(Status.PASS, "a free rendezvous port is chosen at start (--master-port 0)")
    problem = host.try_bind(address, port)
    where = f"{address}:{port}"
    if problem is None:
        return Finding(Status.PASS, f"rendezvous port {where} is free")
    if problem == errno.EADDRINUSE:
        return Finding(Status.FAIL, f"rendezvous port {where} is in use",
                       f"ss -ltnp 'sport = :{port}'  # stop its holder, or choose another --master-port")
    if problem == errno.EADDRNOTAVAIL:
        return Finding(Status.INFO, f"{address} is not an address of this host: node 0 binds the port "
                                    "(run this check there)")
    if problem == errno.EACCES:
        return Finding(Status.FAIL, f"binding {where} is not permitted (ports below 1024 need privileges)",
                       "choose a --master-port of 1024 or above")
    return Finding(Status.FAIL, f"cannot bind {where}: {errno.errorcode.get(problem, problem)}",
                   "check --master-addr (an address of node 0) and --master-port")
