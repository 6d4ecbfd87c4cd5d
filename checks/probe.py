"""How checks see the machine: a filesystem root, an NVML view and a few injectable probes.

The real host is `Host()` with NVML opened by `open_nvml()`; tests build a `Host` on a temporary
directory laid out like `/proc` and `/sys` and pass a fake NVML module with pynvml's function names.
"""

from __future__ import annotations

import os
import re
import shutil
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Generic, Iterator, Mapping, Optional, TypeVar

T = TypeVar("T")

NVIDIA_VENDOR = "0x10de"
GPU_CLASSES = ("0x0300", "0x0302")  # VGA and 3D controllers; NVSwitches and audio functions are not GPUs
BDF = re.compile(r"^[0-9a-f]{4}:[0-9a-f]{2}:[0-9a-f]{2}\.[0-7]$")


class Lazy(Generic[T]):
    """A value computed on first use (torch import, PCIe load), at most once per run."""

    def __init__(self, compute: Callable[[], T]):
        self._compute = compute
        self._done = False
        self._value: Optional[T] = None

    @classmethod
    def of(cls, value: T) -> "Lazy[T]":
        return cls(lambda: value)

    def get(self) -> T:
        if not self._done:
            self._value = self._compute()
            self._done = True
        return self._value  # type: ignore[return-value]


def normalize_bus_id(bus_id: Any) -> str:
    """NVML's `00000000:17:00.0` and sysfs's `0000:17:00.0` become the sysfs form."""
    text = bus_id.decode() if isinstance(bus_id, bytes) else str(bus_id)
    domain, _, rest = text.strip().lower().rpartition(":")
    domain, _, bus = domain.rpartition(":") if domain.count(":") else ("0", "", domain)
    return f"{int(domain or '0', 16):04x}:{bus}:{rest}"


class NvmlMismatch(Exception):
    """An NVML query the driver's library cannot answer the way pynvml asks it: pynvml raises
    NVMLLibraryMismatchError (not an NVMLError) when an unversioned wrapper finds only older versions,
    e.g. nvmlDeviceGetComputeRunningProcesses, which calls the `_v3` function drivers before 510 lack.
    The check that needed it is skipped with this reason (`runner.run_one`)."""


class NvmlView:
    """pynvml (or a fake with the same names) behind calls that return None when unsupported.

    Older drivers lack newer functions (FunctionNotFound), consumer cards lack features
    (NotSupported); checks treat both as "not available" instead of crashing. A query pynvml
    refuses as a library mismatch raises NvmlMismatch.
    """

    def __init__(self, lib: Any):
        self.lib = lib
        self.count = int(lib.nvmlDeviceGetCount())
        self._handles = [lib.nvmlDeviceGetHandleByIndex(i) for i in range(self.count)]

    def call(self, name: str, *args: Any) -> Any:
        function = getattr(self.lib, name, None)
        if function is None:
            return None
        try:
            value = function(*args)
        except Exception as exc:  # noqa: BLE001 - any NVMLError means "not available here"
            if type(exc).__name__ == "NVMLLibraryMismatchError":
                raise NvmlMismatch(f"{name} is not available: the driver's NVML library is older than pynvml "
                                   f"expects ({exc})") from exc
            if type(exc).__name__.startswith("NVMLError"):
                return None
            raise
        return value.decode() if isinstance(value, bytes) else value

    def device(self, index: int, name: str, *args: Any) -> Any:
        return self.call(name, self._handles[index], *args)

    def first(self, index: int, names: tuple[str, ...], *args: Any) -> Any:
        """The first supported of several functions: newer name first, older fallback after."""
        for name in names:
            value = self.device(index, name, *args)
            if value is not None:
                return value
        return None

    def pair(self, a: int, b: int, name: str, *args: Any) -> Any:
        return self.call(name, self._handles[a], self._handles[b], *args)

    def name(self, index: int) -> str:
        return str(self.device(index, "nvmlDeviceGetName") or f"GPU{index}")

    def bus_id(self, index: int) -> Optional[str]:
        info = self.device(index, "nvmlDeviceGetPciInfo")
        return normalize_bus_id(info.busId) if info is not None else None


@dataclass(frozen=True)
class SoftwareFacts:
    """What the Python environment offers; gathered by `checks.software.gather_software`."""

    torch_version: Optional[str] = None
    torch_error: Optional[str] = None
    cuda_runtime: Optional[str] = None
    cuda_available: bool = False
    cuda_error: Optional[str] = None
    device_count: int = 0
    arch_list: tuple[str, ...] = ()
    capabilities: tuple[tuple[int, int], ...] = ()
    cudnn: Optional[int] = None
    nccl: Optional[str] = None
    flash_attn_version: Optional[str] = None
    flash_attn_error: Optional[str] = None
    cuda_wheels: tuple[str, ...] = ()


@dataclass(frozen=True)
class KernelLog:
    """The kernel log's lines since boot and where they came from; source None (with the error) if unreadable."""

    lines: tuple[str, ...] = ()
    source: Optional[str] = None
    error: str = "not read"


@dataclass(frozen=True)
class LoadSample:
    """Best PCIe (generation, width) seen per NVML index while copying; empty with a reason if none."""

    readings: Mapping[int, tuple[int, int]] = field(default_factory=dict)
    note: str = "no load probe"


def _disk_usage(path: Path) -> tuple[int, int]:
    usage = shutil.disk_usage(path)
    return usage.total, usage.free


def try_bind_tcp(address: str, port: int) -> Optional[int]:
    """Bind a TCP socket on (address, port) as torch.distributed's TCPStore does (SO_REUSEADDR) and close it:
    None when it could, else the errno (EADDRINUSE: taken; EADDRNOTAVAIL: not an address of this host)."""
    import socket

    try:
        family = socket.AF_INET6 if ":" in address else socket.AF_INET
        with socket.socket(family, socket.SOCK_STREAM) as sock:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            sock.bind((address, port))
    except OSError as exc:
        return exc.errno if exc.errno is not None else -1
    return None


@dataclass(frozen=True)
class Host:
    root: Path = Path("/")
    nvml: Optional[NvmlView] = None
    nvml_error: str = "NVML was not opened"
    nvml_mismatch: bool = False
    env: Mapping[str, str] = field(default_factory=dict)
    disk_usage: Callable[[Path], tuple[int, int]] = _disk_usage
    try_bind: Callable[[str, int], Optional[int]] = try_bind_tcp
    software: Lazy[SoftwareFacts] = field(default_factory=lambda: Lazy.of(SoftwareFacts(torch_error="not probed")))
    pcie_load: Lazy[LoadSample] = field(default_factory=lambda: Lazy.of(LoadSample()))
    kernel_log: Lazy[KernelLog] = field(default_factory=lambda: Lazy.of(KernelLog()))

    def path(self, absolute: str) -> Path:
        return self.root / absolute.lstrip("/")

    def read(self, absolute: str) -> Optional[str]:
        try:
            return self.path(absolute).read_text(errors="replace")
        except OSError:
            return None

    def read_bytes(self, absolute: str) -> Optional[bytes]:
        try:
            return self.path(absolute).read_bytes()
        except OSError:
            return None

    def glob(self, pattern: str) -> list[Path]:
        return sorted(self.root.glob(pattern.lstrip("/")))

    def exists(self, absolute: str) -> bool:
        return self.path(absolute).exists()


def read_value(host: Host, absolute: str) -> Optional[str]:
    text = host.read(absolute)
    return text.strip() if text is not None else None


def nvidia_pci_gpus(host: Host) -> dict[str, Optional[str]]:
    """NVIDIA GPU functions on the PCI bus (sysfs), mapped to the bound driver's name or None."""
    found = {}
    for device in host.glob("/sys/bus/pci/devices/*"):
        vendor = _strip(device / "vendor")
        klass = _strip(device / "class")
        if vendor != NVIDIA_VENDOR or not klass or not klass.startswith(GPU_CLASSES):
            continue
        driver = device / "driver"
        found[device.name] = os.path.basename(os.readlink(driver)) if driver.is_symlink() else None
    return found


def _strip(path: Path) -> Optional[str]:
    try:
        return path.read_text().strip().lower()
    except OSError:
        return None


def container_kind(host: Host) -> Optional[str]:
    """kubernetes, docker, podman or container when doctor runs inside one; None on the host."""
    if host.env.get("KUBERNETES_SERVICE_HOST") or host.exists("/var/run/secrets/kubernetes.io"):
        return "kubernetes"
    if host.exists("/.dockerenv"):
        return "docker"
    if host.exists("/run/.containerenv"):
        return "podman"
    cgroups = host.read("/proc/1/cgroup") or ""
    if any(word in cgroups for word in ("kubepods", "docker", "containerd", "libpod")):
        return "container"
    return None


def in_vm(host: Host) -> bool:
    flags = re.search(r"^flags\s*:(.*)$", host.read("/proc/cpuinfo") or "", re.M)
    return bool(flags and "hypervisor" in flags.group(1).split())


def parse_cpu_list(text: Optional[str]) -> set[int]:
    """`0-3,8,10-11` as a set of CPU numbers (sysfs and /proc/self/status format)."""
    cpus: set[int] = set()
    for part in filter(None, (text or "").strip().split(",")):
        low, _, high = part.partition("-")
        cpus.update(range(int(low), int(high or low) + 1))
    return cpus


_NVML_REASONS = {
    "NVMLError_LibraryNotFound": "NVML library not found (no NVIDIA driver installed)",
    "NVMLError_DriverNotLoaded": "NVIDIA kernel driver is not loaded",
    "NVMLError_NoPermission": "no permission to open the NVIDIA devices",
    "NVMLError_LibRmVersionMismatch": "NVIDIA driver/library version mismatch (kernel module differs from libnvidia-ml)",
}


@contextmanager
def open_nvml() -> Iterator[tuple[Optional[NvmlView], str, bool]]:
    """(view, reason it is None, driver/library mismatch); shuts NVML down on exit."""
    try:
        import pynvml
    except ImportError:
        yield None, "nvidia-ml-py (pynvml) is not installed", False
        return
    try:
        pynvml.nvmlInit()
    except pynvml.NVMLError as exc:
        name = type(exc).__name__
        yield None, _NVML_REASONS.get(name, f"NVML failed to initialise: {exc}"), name == "NVMLError_LibRmVersionMismatch"
        return
    try:
        try:
            view = NvmlView(pynvml)
        except pynvml.NVMLError as exc:  # e.g. a GPU fell off the bus: handles cannot be opened
            yield None, f"NVML cannot open the GPUs: {exc}", False
            return
        yield view, "", False
    finally:
        pynvml.nvmlShutdown()
