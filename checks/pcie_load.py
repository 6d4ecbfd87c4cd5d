"""The real PCIe load probe: pinned host-to-device copies while NVML reads the link state.

A GPU's link drops to Gen1 when idle; only under traffic does it show what it trained to.
Needs torch with CUDA; otherwise the sample is empty and says why.
"""

from __future__ import annotations

import time

from llmctl.checks.probe import LoadSample, NvmlView

_CHUNK_BYTES = 64 << 20
_COPIES_PER_SAMPLE = 8


def measure_under_load(nv: NvmlView, seconds: float) -> LoadSample:
    """Copy pinned memory to each GPU for `seconds` in total and keep the best link reading."""
    if seconds <= 0:
        return LoadSample(note="load probe disabled (pcie_load_seconds = 0)")
    try:
        import torch
    except Exception as exc:  # noqa: BLE001 - no torch means idle readings only
        return LoadSample(note=f"torch unavailable ({type(exc).__name__})")
    if not torch.cuda.is_available():
        return LoadSample(note="torch has no usable CUDA")
    by_bus = {nv.bus_id(i): i for i in range(nv.count)}
    per_gpu = seconds / max(1, torch.cuda.device_count())
    readings = {}
    try:
        for device in range(torch.cuda.device_count()):
            index = by_bus.get(_torch_bus_id(torch, device))
            if index is not None:
                readings[index] = _load_one(torch, nv, device, index, per_gpu)
    except Exception as exc:  # noqa: BLE001 - a busy or broken GPU must not crash doctor
        return LoadSample(readings, note=f"load probe stopped: {type(exc).__name__}: {exc}")
    return LoadSample(readings, note="pinned-copy load")


def _torch_bus_id(torch, device: int) -> str:
    props = torch.cuda.get_device_properties(device)
    return f"{props.pci_domain_id:04x}:{props.pci_bus_id:02x}:{props.pci_device_id:02x}.0"


def _load_one(torch, nv: NvmlView, device: int, index: int, seconds: float) -> tuple[int, int]:
    source = torch.empty(_CHUNK_BYTES, dtype=torch.uint8).pin_memory()
    target = torch.empty(_CHUNK_BYTES, dtype=torch.uint8, device=device)
    best = (0, 0)
    deadline = time.monotonic() + seconds
    try:
        while time.monotonic() < deadline:
            for _ in range(_COPIES_PER_SAMPLE):
                target.copy_(source, non_blocking=True)
            gen = nv.device(index, "nvmlDeviceGetCurrPcieLinkGeneration") or 0
            width = nv.device(index, "nvmlDeviceGetCurrPcieLinkWidth") or 0
            best = max(best, (gen, width))
            torch.cuda.synchronize(device)
    finally:
        del source, target
        torch.cuda.empty_cache()
    return best
