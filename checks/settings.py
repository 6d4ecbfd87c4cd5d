"""Thresholds (configurable in YAML under `thresholds:`) and the plan the checks judge against."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Mapping, Optional


@dataclass(frozen=True)
class Thresholds:
    """Defaults are the documented values; docs/doctor.md lists each with its reason."""

    clock_tolerance_pct: float = 5.0  # current SM clocks of busy GPUs may differ this much
    busy_util_pct: float = 50.0  # a GPU this busy counts as non-idle for current-clock comparison
    thermal_margin_warn_c: float = 15.0  # degrees below the slowdown threshold
    thermal_margin_fail_c: float = 5.0
    power_limit_tolerance_pct: float = 5.0  # power limit may sit this far below the default
    retired_pages_max: int = 60  # DCGM_LIMIT_MAX_RETIRED_PAGES
    retired_pages_warn: int = 15  # DCGM_LIMIT_MAX_RETIRED_PAGES_SOFT_LIMIT
    ecc_uncorrected_max: int = 0  # volatile uncorrected ECC errors since the last reset
    pcie_replay_max: int = 100  # cumulative replay counter since boot
    nvlink_errors_max: int = 0  # each NVLink replay/recovery/CRC counter since the driver loaded
    pcie_load_seconds: float = 1.0  # pinned-copy load while reading the link; 0 reads the idle link
    mig_allowed: bool = False
    cpu_governor: str = "performance"
    nofile_min: int = 65536
    swappiness_max: int = 10
    thp_allowed: tuple[str, ...] = ("madvise", "never")
    shm_min_gib: float = 1.0
    tp_shm_per_rank_mib: float = 256.0  # free /dev/shm per tensor-parallel rank (NCCL SHM transport, shared tensors)
    disk_free_factor: float = 1.0  # free space on the model's filesystem vs the model's size
    cgroup_min_memory_gib: float = 16.0
    cgroup_min_cpus: float = 4.0

    def to_dict(self) -> dict[str, Any]:
        return {key: list(value) if isinstance(value, tuple) else value for key, value in dataclasses.asdict(self).items()}


@dataclass(frozen=True)
class Plan:
    """What the operator intends to run; the checks compare the host against it."""

    expect_gpus: Optional[int] = None
    model: Optional[Path] = None
    gpu_memory_utilization: float = 0.9
    thresholds: Thresholds = field(default_factory=Thresholds)
    server: Optional[str] = None  # a running llmctl serve to check (--server URL)
    tensor_parallel_size: int = 1  # ranks the planned engine runs (tp-rendezvous)
    master_addr: str = "127.0.0.1"  # where they meet: torch.distributed's rendezvous on node 0
    master_port: int = 29500  # torch.distributed's default (MASTER_PORT)


def parse_thresholds(value: Any) -> Thresholds:
    """Thresholds from a YAML mapping or a `key=value,key=value` string (flag or environment)."""
    if isinstance(value, Thresholds):
        return value
    if isinstance(value, str):
        value = _parse_pairs(value)
    if not isinstance(value, Mapping):
        raise ValueError("thresholds must be a mapping of threshold names to values")
    fields = {f.name: f for f in dataclasses.fields(Thresholds)}
    defaults = Thresholds()
    changes = {}
    for raw_key, raw in value.items():
        key = str(raw_key).replace("-", "_")
        if key not in fields:
            raise ValueError(f"unknown threshold {raw_key!r}; known: {', '.join(sorted(fields))}")
        changes[key] = _coerce(key, raw, getattr(defaults, key))
    return dataclasses.replace(defaults, **changes)


def _parse_pairs(text: str) -> dict[str, str]:
    pairs = {}
    for item in filter(None, (part.strip() for part in text.split(","))):
        key, sep, raw = item.partition("=")
        if not sep:
            raise ValueError(f"expected key=value, got {item!r}")
        pairs[key.strip()] = raw.strip()
    return pairs


def _coerce(key: str, raw: Any, default: Any) -> Any:
    """Convert to the default's type; tuples accept a YAML list or a `a|b` string."""
    try:
        if isinstance(default, bool):
            return _to_bool(raw)
        if isinstance(default, tuple):
            items = raw.split("|") if isinstance(raw, str) else list(raw)
            return tuple(str(item).strip() for item in items)
        if isinstance(default, (int, float)) and isinstance(raw, bool):
            raise ValueError
        return type(default)(raw)
    except (TypeError, ValueError):
        raise ValueError(f"threshold {key}: expected {type(default).__name__}, got {raw!r}") from None


def _to_bool(raw: Any) -> bool:
    if isinstance(raw, bool):
        return raw
    text = str(raw).strip().lower()
    if text in {"1", "true", "yes", "on"}:
        return True
    if text in {"0", "false", "no", "off"}:
        return False
    raise ValueError
