"""Datasheet peaks of common NVIDIA GPUs, matched from the name NVML / CUDA report.

Every figure is the vendor's *dense* number (no structured sparsity): tensor-core TFLOP/s per
dtype (fp16/bf16 with fp32 accumulation, which is what cuBLAS does for torch), fp32 without
tensor cores, HBM/GDDR bandwidth, and the PCIe link of the datasheet. A name that is not in
the table (or a MIG slice, or any CPU) has no peak: callers show "—", never an estimate.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

# Per-direction PCIe payload bandwidth in GB/s per lane: transfer rate x line-code efficiency / 8.
_PCIE_GBS_PER_LANE = {1: 0.25, 2: 0.5, 3: 8 * 128 / 130 / 8, 4: 16 * 128 / 130 / 8, 5: 32 * 128 / 130 / 8,
                      6: 64 * 242 / 256 / 8}


@dataclass(frozen=True)
class GpuSpec:
    """One product's datasheet; None where the product has no such unit (e.g. bf16 on V100)."""

    product: str
    names: tuple[str, ...]  # exact device names as NVML / cudaGetDeviceProperties report them
    fp32_tflops: float
    tf32_tflops: Optional[float]
    fp16_tflops: float
    bf16_tflops: Optional[float]
    fp8_tflops: Optional[float]
    memory_gbs: float
    pcie_gen: int
    pcie_width: int = 16
    c2c_gbs: Optional[float] = None  # Grace superchips: per-direction NVLink-C2C, the host link instead of PCIe

    @property
    def pcie_gbs(self) -> float:
        """Theoretical per-direction host link bandwidth: the datasheet's PCIe generation and width, or
        NVLink-C2C on a Grace superchip (host copies do not cross PCIe there)."""
        return self.c2c_gbs if self.c2c_gbs is not None else pcie_gbs(self.pcie_gen, self.pcie_width)

    def peak(self, metric: str) -> Optional[float]:
        """The peak for a metric key: gemm_<dtype> (TFLOP/s), memory (GB/s), pcie (GB/s)."""
        if metric.startswith("gemm_"):
            return getattr(self, f"{metric[len('gemm_'):]}_tflops", None)
        if metric == "memory":
            return self.memory_gbs
        if metric == "pcie":
            return self.pcie_gbs
        return None


def pcie_gbs(gen: int, width: int) -> float:
    """Per-direction payload bandwidth (GB/s) of a PCIe link; ValueError for an unknown generation."""
    if gen not in _PCIE_GBS_PER_LANE or width < 1:
        raise ValueError(f"unknown PCIe link gen {gen} x{width}")
    return _PCIE_GBS_PER_LANE[gen] * width


# Sources: NVIDIA product datasheets and architecture whitepapers (A100, H100, H200, Ada, Volta,
# Turing, HGX B200 / GB200 NVL72, GH200, H20, L20). Sparse figures were halved to their dense values
# where a datasheet only lists sparse ones. H800/A800 are the export variants of H100/A100: same
# compute and memory, narrower NVLink. NVLink-C2C: 900 GB/s total, 450 GB/s per direction.
SPECS: tuple[GpuSpec, ...] = (
    GpuSpec("B200 (HGX)", ("NVIDIA B200",), 75.0, 1100.0, 2250.0, 2250.0, 4500.0, 7700, 5),
    GpuSpec("GB200 (B200 in a Grace superchip)", ("NVIDIA GB200",), 80.0, 1250.0, 2500.0, 2500.0, 5000.0, 8000, 5,
            c2c_gbs=450.0),
    GpuSpec("GH200 96GB HBM3", ("NVIDIA GH200 480GB",), 66.9, 494.7, 989.4, 989.4, 1978.9, 4000, 5, c2c_gbs=450.0),
    GpuSpec("H800 SXM5 80GB", ("NVIDIA H800",), 66.9, 494.7, 989.4, 989.4, 1978.9, 3352, 5),
    GpuSpec("H800 PCIe 80GB", ("NVIDIA H800 PCIe",), 51.2, 378.0, 756.0, 756.0, 1513.0, 2039, 5),
    GpuSpec("H20", ("NVIDIA H20",), 44.0, 74.0, 148.0, 148.0, 296.0, 4000, 5),
    GpuSpec("A800 SXM4 80GB", ("NVIDIA A800-SXM4-80GB",), 19.5, 156.0, 312.0, 312.0, None, 2039, 4),
    GpuSpec("A800 PCIe 80GB", ("NVIDIA A800 80GB PCIe",), 19.5, 156.0, 312.0, 312.0, None, 1935, 4),
    GpuSpec("RTX 6000 Ada", ("NVIDIA RTX 6000 Ada Generation",), 91.1, 182.1, 364.2, 364.2, 728.5, 960, 4),
    GpuSpec("L20", ("NVIDIA L20",), 59.8, 59.8, 119.5, 119.5, 239.0, 864, 4),
    GpuSpec("H200 SXM", ("NVIDIA H200",), 66.9, 494.7, 989.4, 989.4, 1978.9, 4800, 5),
    GpuSpec("H200 NVL", ("NVIDIA H200 NVL",), 60.0, 417.5, 835.5, 835.5, 1670.5, 4800, 5),
    GpuSpec("H100 SXM5 80GB", ("NVIDIA H100 80GB HBM3",), 66.9, 494.7, 989.4, 989.4, 1978.9, 3352, 5),
    GpuSpec("H100 PCIe 80GB", ("NVIDIA H100 PCIe",), 51.2, 378.0, 756.0, 756.0, 1513.0, 2039, 5),
    GpuSpec("H100 NVL 94GB", ("NVIDIA H100 NVL",), 60.0, 417.5, 835.5, 835.5, 1670.5, 3900, 5),
    GpuSpec("A100 SXM4 80GB", ("NVIDIA A100-SXM4-80GB",), 19.5, 156.0, 312.0, 312.0, None, 2039, 4),
    GpuSpec("A100 SXM4 40GB", ("NVIDIA A100-SXM4-40GB",), 19.5, 156.0, 312.0, 312.0, None, 1555, 4),
    GpuSpec("A100 PCIe 80GB", ("NVIDIA A100 80GB PCIe", "NVIDIA A100-PCIE-80GB"), 19.5, 156.0, 312.0, 312.0, None,
            1935, 4),
    GpuSpec("A100 PCIe 40GB", ("NVIDIA A100-PCIE-40GB",), 19.5, 156.0, 312.0, 312.0, None, 1555, 4),
    GpuSpec("L40S", ("NVIDIA L40S",), 91.6, 183.0, 362.05, 362.05, 733.0, 864, 4),
    GpuSpec("L40", ("NVIDIA L40",), 90.5, 90.5, 181.05, 181.05, 362.0, 864, 4),
    GpuSpec("L4", ("NVIDIA L4",), 30.3, 60.0, 121.0, 121.0, 242.5, 300, 4),
    GpuSpec("GeForce RTX 4090", ("NVIDIA GeForce RTX 4090",), 82.6, 82.6, 165.2, 165.2, 330.3, 1008, 4),
    GpuSpec("A10", ("NVIDIA A10",), 31.2, 62.5, 125.0, 125.0, None, 600, 4),
    GpuSpec("A30", ("NVIDIA A30",), 10.3, 82.0, 165.0, 165.0, None, 933, 4),
    GpuSpec("A40", ("NVIDIA A40",), 37.4, 74.8, 149.7, 149.7, None, 696, 4),
    GpuSpec("V100 SXM2", ("Tesla V100-SXM2-16GB", "Tesla V100-SXM2-32GB"), 15.7, None, 125.0, None, None, 900, 3),
    GpuSpec("V100 PCIe", ("Tesla V100-PCIE-16GB", "Tesla V100-PCIE-32GB"), 14.0, None, 112.0, None, None, 900, 3),
    GpuSpec("V100S PCIe", ("Tesla V100S-PCIE-32GB",), 16.4, None, 130.0, None, None, 1134, 3),
    GpuSpec("T4", ("Tesla T4",), 8.1, None, 65.0, None, None, 320, 3),
)


def _normalize(name: str) -> str:
    return " ".join(name.split()).casefold()


_BY_NAME = {_normalize(name): spec for spec in SPECS for name in spec.names}


def lookup(device_name: Optional[str]) -> Optional[GpuSpec]:
    """The datasheet for an exact device name (case and spacing aside); None when unknown.

    Exact matching on purpose: "NVIDIA L4" must not match "NVIDIA L40S", and a MIG slice
    ("NVIDIA H100 80GB HBM3 MIG 1g.10gb") only has a fraction of the full chip's peak.
    """
    if not device_name:
        return None
    return _BY_NAME.get(_normalize(device_name))
