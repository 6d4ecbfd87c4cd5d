"""XID (GPU) and SXID (NVSwitch) events in the kernel log since boot, as the NVIDIA driver writes them:

    NVRM: Xid (PCI:0000:3b:00): 79, pid=1234, name=python, GPU has fallen off the bus.
    nvidia-nvswitch2: SXid (PCI:0000:07:00.0): 12028, Fatal, Link 32 egress non-posted PRIV error

The log is read from /dev/kmsg (needs CAP_SYSLOG or kernel.dmesg_restrict=0), else from
`journalctl -k -b`; tests hand `Host.kernel_log` recorded lines instead.
"""

from __future__ import annotations

import errno
import os
import re
import subprocess
from dataclasses import dataclass
from typing import Optional

from llmctl.checks.model import Finding, Result, Status, fold, skip
from llmctl.checks.probe import Host, KernelLog
from llmctl.checks.settings import Plan

# Hardware or driver faults that take the GPU out of service until a reset or repair, as NVIDIA's
# XID catalogue, NVSentinel's syslog monitor and the k8s device plugin treat them: double-bit ECC (48),
# row remap events/failure (63, 64), NVLink error (74), fallen off the bus (79), high single-bit ECC rate
# (92), contained/uncontained ECC (94, 95), GSP RPC timeout / error (119, 120).
FATAL_XIDS = frozenset({48, 63, 64, 74, 79, 92, 94, 95, 119, 120})
_XID = re.compile(r"NVRM: Xid \(PCI:(?P<bus>[0-9a-fA-F:.]+)\): (?P<code>\d+),(?P<rest>.*)")
_SXID = re.compile(r"(?P<switch>nvidia-nvswitch\d+): SXid \(PCI:(?P<bus>[0-9a-fA-F:.]+)\): (?P<code>\d+), "
                   r"(?P<severity>Non-fatal|Fatal)(?P<rest>.*)", re.I)
KMSG_RECORDS_MAX = 1 << 20  # the kernel ring buffer holds far fewer; guards against a device that never says EAGAIN


@dataclass(frozen=True)
class Event:
    kind: str  # "XID" or "SXID"
    code: int
    bus: str
    fatal: bool
    text: str


def parse_events(lines: tuple[str, ...]) -> list[Event]:
    events = []
    for line in lines:
        if (match := _XID.search(line)) is not None:
            code = int(match["code"])
            events.append(Event("XID", code, match["bus"], code in FATAL_XIDS, match["rest"].strip()))
        elif (match := _SXID.search(line)) is not None:
            events.append(Event("SXID", int(match["code"]), match["bus"], match["severity"].lower() == "fatal",
                                f"{match['switch']}{match['rest']}".strip()))
    return events


def read_kernel_log() -> KernelLog:
    """The kernel log since boot: /dev/kmsg, else `journalctl -k -b`; empty with the reason when neither reads."""
    try:
        return KernelLog(tuple(_read_kmsg()), "/dev/kmsg")
    except OSError as exc:
        kmsg_error = f"/dev/kmsg: {exc.strerror or exc}"
    try:
        proc = subprocess.run(["journalctl", "-k", "-b", "--no-pager", "-q", "-o", "cat"], capture_output=True,
                              text=True, timeout=20)
    except (OSError, subprocess.TimeoutExpired) as exc:
        return KernelLog((), None, f"{kmsg_error}; journalctl: {exc}")
    if proc.returncode != 0:
        return KernelLog((), None, f"{kmsg_error}; journalctl -k: {proc.stderr.strip()[:200] or proc.returncode}")
    return KernelLog(tuple(proc.stdout.splitlines()), "journalctl -k -b")


def _read_kmsg() -> list[str]:
    """Every record still in the ring buffer; each read() returns one `prio,seq,usec,flags;message` record."""
    fd = os.open("/dev/kmsg", os.O_RDONLY | os.O_NONBLOCK)
    lines: list[str] = []
    try:
        while len(lines) < KMSG_RECORDS_MAX:
            try:
                record = os.read(fd, 8192)
            except OSError as exc:
                if exc.errno == errno.EAGAIN:
                    break
                if exc.errno == errno.EPIPE:  # the record was overwritten while reading: skip to the next
                    continue
                raise
            lines.append(record.decode(errors="replace").split(";", 1)[-1].split("\n", 1)[0])
    finally:
        os.close(fd)
    return lines


def gpu_xid_events(host: Host, plan: Plan) -> Result:
    """No fatal XID or SXID in the kernel log since boot.

    XIDs in FATAL_XIDS (48 double-bit ECC, 63/64 row remapping, 74 NVLink, 79 fallen off the bus,
    92 high single-bit ECC rate, 94/95 contained/uncontained ECC, 119/120 GSP) and SXIDs the
    NVSwitch driver marks Fatal fail; any other XID or SXID (often an application fault, e.g. 13,
    31, 43) warns. Read from /dev/kmsg or `journalctl -k -b`; skipped when neither is readable.
    """
    log = host.kernel_log.get()
    if log.source is None:
        return skip("gpu-xid-events", f"kernel log not readable ({log.error}); run as root or with CAP_SYSLOG")
    events = parse_events(log.lines)
    observed = {"source": log.source, "events": [f"{e.kind} {e.code} on {e.bus}" for e in events]}
    findings = []
    for event in events:
        status = Status.FAIL if event.fatal else Status.WARN
        findings.append(Finding(status, f"{event.kind} {event.code} on PCI {event.bus}: {event.text[:120]}",
                                _xid_fix(event)))
    if not findings:
        findings.append(Finding(Status.PASS, f"no XID or SXID since boot ({log.source})"))
    return fold("gpu-xid-events", findings, observed, {"fatal_xids": sorted(FATAL_XIDS), "events": "none"})


def _xid_fix(event: Event) -> Optional[str]:
    if not event.fatal:
        return "dmesg -T | grep -i xid  # usually an application fault; look up the code in NVIDIA's XID catalogue"
    if event.kind == "SXID":
        return "nvidia-smi -q | grep -i fabric; journalctl -u nvidia-fabricmanager  # drain the node; NVSwitch needs service"
    return f"nvidia-smi -q -i {event.bus}  # drain the node and reset the GPU (nvidia-smi -r); repeated: RMA"
