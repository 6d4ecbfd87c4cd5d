"""How much host memory this process may still allocate, so `llmctl bench --cpu` sizes its buffers
and decode shape to fit instead of being killed by the OOM killer (which prints nothing).

Three limits apply and the tightest wins: the kernel's MemAvailable estimate, this process's
cgroup limit (v2 `memory.max`, v1 `memory.limit_in_bytes`) and the soft `RLIMIT_AS` less the
address space already mapped.
"""

from __future__ import annotations

import resource
from dataclasses import dataclass
from typing import Optional

from llmctl.checks.probe import Host
from llmctl.output import format_bytes

KIB = 1 << 10


@dataclass(frozen=True)
class MemoryBudget:
    bytes: Optional[int]  # None: no limit could be read
    source: str  # which limit is the tightest, for the note that names it

    def describe(self) -> str:
        return f"{format_bytes(self.bytes)} ({self.source})" if self.bytes is not None else "unknown"


def _status_kib(text: Optional[str], key: str) -> Optional[int]:
    """A `Key:   123 kB` line of /proc/meminfo or /proc/self/status, in bytes."""
    for line in (text or "").splitlines():
        if line.startswith(key + ":"):
            parts = line.split()
            return int(parts[1]) * KIB if len(parts) > 1 and parts[1].isdigit() else None
    return None


def memory_budget(host: Optional[Host] = None, address_limit: Optional[int] = None) -> MemoryBudget:
    """The tightest of MemAvailable, the cgroup limit and RLIMIT_AS minus VmSize. `address_limit`
    overrides the soft RLIMIT_AS (tests); RLIM_INFINITY counts as no limit."""
    from llmctl.checks.storage import cgroup_memory_limit

    host = host or Host()
    if address_limit is None:
        soft = resource.getrlimit(resource.RLIMIT_AS)[0]
        address_limit = None if soft == resource.RLIM_INFINITY else soft
    candidates: list[tuple[int, str]] = []
    available = _status_kib(host.read("/proc/meminfo"), "MemAvailable")
    if available is not None:
        candidates.append((available, "MemAvailable"))
    cgroup = cgroup_memory_limit(host)
    if cgroup is not None:
        candidates.append((cgroup, "cgroup memory limit"))
    if address_limit is not None:
        mapped = _status_kib(host.read("/proc/self/status"), "VmSize") or 0
        candidates.append((max(address_limit - mapped, 0), "RLIMIT_AS less the mapped address space"))
    if not candidates:
        return MemoryBudget(None, "no limit readable")
    return MemoryBudget(*min(candidates))
