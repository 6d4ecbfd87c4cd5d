"""Helpers shared by the NVML-based checks: the skip gate, labels, per-GPU folding."""

from __future__ import annotations

from typing import Optional

from llmctl.checks.model import Result, skip
from llmctl.checks.probe import Host, NvmlView


def gpu_gate(check_id: str, host: Host) -> Optional[Result]:
    """A skip result when there is no NVML or no GPU; None when the check can read GPUs."""
    if host.nvml is None:
        return skip(check_id, f"no NVIDIA GPU to check: {host.nvml_error}")
    if host.nvml.count == 0:
        return skip(check_id, "NVML reports no GPUs")
    return None


def label(index: int) -> str:
    return f"GPU{index}"


def gib(value_bytes: float) -> float:
    return round(value_bytes / (1 << 30), 1)


def groups_by_model(nv: NvmlView) -> dict[str, list[int]]:
    """GPU indices grouped by product name: only GPUs of one model are expected to match."""
    groups: dict[str, list[int]] = {}
    for index in range(nv.count):
        groups.setdefault(nv.name(index), []).append(index)
    return groups


def is_consumer(nv: NvmlView, index: int) -> bool:
    """GeForce and TITAN cards ship without ECC; datacenter and workstation cards have it."""
    brand = nv.device(index, "nvmlDeviceGetBrand")
    name = nv.name(index).lower()
    return brand in (5, 6) or "geforce" in name or "titan" in name
