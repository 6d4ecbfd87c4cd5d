"""Fakes for the doctor tests: an NVML module with pynvml's names, and a fake filesystem root."""

from __future__ import annotations

import os
from pathlib import Path
from types import SimpleNamespace
from typing import Any, Callable, Optional

import pynvml

from llmctl.checks.probe import Host, Lazy, LoadSample, NvmlView, SoftwareFacts
from llmctl.checks.settings import Plan

GIB = 1 << 30


def not_supported() -> pynvml.NVMLError:
    return pynvml.NVMLError(pynvml.NVML_ERROR_NOT_SUPPORTED)


def h100(index: int = 0, **overrides: Any) -> dict[str, Any]:
    """A healthy, busy-free H100 as NVML would describe it; values per pynvml function name."""
    gpu = {
        "nvmlDeviceGetName": "NVIDIA H100 80GB HBM3",
        "nvmlDeviceGetPciInfo": SimpleNamespace(busId=f"00000000:{0x17 + index:02X}:00.0", pciDeviceId=0x233010DE),
        "nvmlDeviceGetMinorNumber": index,
        "nvmlDeviceGetBrand": 2,
        "nvmlDeviceGetUUID": f"GPU-{index:08d}",
        "nvmlDeviceGetPersistenceMode": 1,
        "nvmlDeviceGetMaxClockInfo": {1: 1980, 2: 2619},
        "nvmlDeviceGetApplicationsClock": {1: 1755, 2: 2619},
        "nvmlDeviceGetClockInfo": {1: 345, 2: 2619},
        "nvmlDeviceGetPowerManagementLimit": 700_000,
        "nvmlDeviceGetPowerManagementDefaultLimit": 700_000,
        "nvmlDeviceGetUtilizationRates": SimpleNamespace(gpu=0, memory=0),
        "nvmlDeviceGetCurrentClocksEventReasons": 0x1,
        "nvmlDeviceGetTemperature": {0: 35},
        "nvmlDeviceGetTemperatureThreshold": {1: 87},
        "nvmlDeviceGetEccMode": (1, 1),
        "nvmlDeviceGetTotalEccErrors": lambda kind, counter: 0,
        "nvmlDeviceGetRemappedRows": (0, 0, 0, 0),
        "nvmlDeviceGetMemoryInfo": SimpleNamespace(total=80 * GIB, free=79 * GIB, used=1 * GIB),
        "nvmlDeviceGetComputeRunningProcesses": [],
        "nvmlDeviceGetMigMode": (0, 0),
        "nvmlDeviceGetComputeMode": 0,
        "nvmlDeviceGetCurrPcieLinkGeneration": 5,
        "nvmlDeviceGetCurrPcieLinkWidth": 16,
        "nvmlDeviceGetMaxPcieLinkGeneration": 5,
        "nvmlDeviceGetMaxPcieLinkWidth": 16,
        "nvmlDeviceGetGpuMaxPcieLinkGeneration": 5,
        "nvmlDeviceGetPcieReplayCounter": 0,
        "nvmlDeviceGetNvLinkState": {link: 1 for link in range(4)},
        "nvmlDeviceGetCudaComputeCapability": (9, 0),
    }
    gpu.update(overrides)
    return gpu


class FakeNvml:
    """Stands in for the `pynvml` module: device handles are indices into `gpus`.

    A device value missing from a GPU's dict raises NotSupported; a function named in `missing`
    does not exist at all (an older library), like pynvml raising FunctionNotFound.
    """

    NVML_NVLINK_MAX_LINKS = 4

    def __init__(self, gpus: list[dict], *, system: Optional[dict] = None, pairs: Optional[dict] = None, missing: tuple = ()):
        self.gpus = gpus
        self.system = {"nvmlSystemGetDriverVersion": "550.54.15", "nvmlSystemGetCudaDriverVersion": 12040, **(system or {})}
        self.pairs = pairs or {}
        self.missing = set(missing)

    def nvmlDeviceGetCount(self) -> int:
        return len(self.gpus)

    def nvmlDeviceGetHandleByIndex(self, index: int) -> int:
        return index

    def __getattr__(self, name: str) -> Callable[..., Any]:
        if not name.startswith("nvml") or name in self.missing:
            raise AttributeError(name)
        if name.startswith("nvmlSystem"):
            return lambda *args: self._system_value(name, args)
        if name in ("nvmlDeviceGetP2PStatus", "nvmlDeviceGetTopologyCommonAncestor"):
            return lambda a, b, *args: self._lookup(self.pairs.get(name, {}), (min(a, b), max(a, b)))
        return lambda handle, *args: self._device_value(self.gpus[handle], name, args)

    def _system_value(self, name: str, args: tuple) -> Any:
        if name not in self.system:
            raise not_supported()
        value = self.system[name]
        return value(*args) if callable(value) else value

    def _device_value(self, gpu: dict, name: str, args: tuple) -> Any:
        if name not in gpu:
            raise not_supported()
        value = gpu[name]
        if callable(value):
            return value(*args)
        if isinstance(value, dict) and args:
            return self._lookup(value, args[0])
        return value

    @staticmethod
    def _lookup(table: dict, key: Any) -> Any:
        if key not in table:
            raise not_supported()
        return table[key]


def write_tree(root: Path, files: dict[str, Any]) -> Path:
    """Create files under root: str/bytes contents, or ('link', target) for a symlink."""
    for rel, content in files.items():
        path = root / rel.lstrip("/")
        path.parent.mkdir(parents=True, exist_ok=True)
        if isinstance(content, tuple):
            os.symlink(content[1], path)
        elif isinstance(content, bytes):
            path.write_bytes(content)
        else:
            path.write_text(content)
    return root


def pci_gpu(bdf: str, driver: Optional[str] = "nvidia", bridge: str = "0000:00:01.0") -> dict[str, Any]:
    """sysfs entries for an NVIDIA 3D controller below `bridge`, bound to `driver`."""
    real = f"/sys/devices/pci0000:00/{bridge}/{bdf}"
    files: dict[str, Any] = {
        f"{real}/vendor": "0x10de\n",
        f"{real}/class": "0x030200\n",
        f"{real}/local_cpulist": "0-31\n",
        f"/sys/bus/pci/devices/{bdf}": ("link", f"../../../devices/pci0000:00/{bridge}/{bdf}"),
    }
    if driver:
        files[f"/sys/bus/pci/drivers/{driver}/.keep"] = ""
        files[f"{real}/driver"] = ("link", f"../../../../bus/pci/drivers/{driver}")
    return files


def dev_nodes(count: int) -> dict[str, str]:
    nodes = {"/dev/nvidiactl": "", "/dev/nvidia-uvm": ""}
    nodes.update({f"/dev/nvidia{i}": "" for i in range(count)})
    return nodes


def make_host(root: Path, nvml: Optional[FakeNvml] = None, **kwargs: Any) -> Host:
    software = kwargs.pop("software", None)
    load = kwargs.pop("load", None)
    if nvml is not None:
        kwargs.setdefault("nvml_error", "")
    else:
        kwargs.setdefault("nvml_error", "NVML library not found (no NVIDIA driver installed)")
    return Host(
        root=root,
        nvml=NvmlView(nvml) if nvml is not None else None,
        software=Lazy.of(software or SoftwareFacts()),
        pcie_load=Lazy.of(load or LoadSample(note="test: no load")),
        **kwargs,
    )


def plan(**kwargs: Any) -> Plan:
    return Plan(**kwargs)
