"""Software stack: NVIDIA driver vs torch's CUDA runtime, torch's view of the GPUs, flash-attn."""

from __future__ import annotations

import re
from typing import Optional

from llmctl.checks.gpu_common import label
from llmctl.checks.model import Finding, Result, Status, fold, skip
from llmctl.checks.probe import Host, SoftwareFacts, nvidia_pci_gpus
from llmctl.checks.settings import Plan

# Minimum Linux driver per CUDA major for minor-version compatibility (CUDA release notes).
MIN_DRIVER_FOR_MAJOR = {11: (450, 80, 2), 12: (525, 60, 13), 13: (580, 65, 6)}
# Driver branch that ships each CUDA toolkit version (full compatibility, PTX JIT included).
DRIVER_FOR_TOOLKIT = {
    (11, 8): 520, (12, 0): 525, (12, 1): 530, (12, 2): 535, (12, 3): 545, (12, 4): 550,
    (12, 5): 555, (12, 6): 560, (12, 8): 570, (12, 9): 575, (13, 0): 580,
}
DEBUG_ENV = {
    "CUDA_LAUNCH_BLOCKING": "serialises every kernel launch",
    "PYTORCH_NO_CUDA_MEMORY_CACHING": "disables the CUDA caching allocator",
    "TORCH_USE_CUDA_DSA": "adds device-side assertion bookkeeping",
    "NCCL_P2P_DISABLE": "forces GPU-to-GPU traffic through host memory",
    "NCCL_SHM_DISABLE": "disables NCCL shared-memory transport",
    "CUDA_DEVICE_MAX_CONNECTIONS": "changes stream scheduling (set for training, not serving)",
}


def gather_software() -> SoftwareFacts:
    """Import torch (and flash-attn if installed) to see what this Python environment offers."""
    import importlib.metadata as metadata
    import importlib.util

    wheels = tuple(sorted({d.metadata["Name"] for d in metadata.distributions()
                           if re.match(r"nvidia-.*-cu\d+$", d.metadata["Name"] or "")}))
    try:
        import torch
    except Exception as exc:  # noqa: BLE001 - a broken torch install is what we report
        return SoftwareFacts(torch_error=f"{type(exc).__name__}: {exc}", cuda_wheels=wheels)
    facts = dict(torch_version=torch.__version__, cuda_runtime=torch.version.cuda, cuda_wheels=wheels)
    facts.update(_torch_cuda(torch))
    if importlib.util.find_spec("flash_attn") is not None:
        try:
            import flash_attn

            facts["flash_attn_version"] = getattr(flash_attn, "__version__", "unknown")
        except Exception as exc:  # noqa: BLE001 - ABI mismatches surface as ImportError/OSError
            facts["flash_attn_error"] = f"{type(exc).__name__}: {exc}"
    return SoftwareFacts(**facts)


def _torch_cuda(torch) -> dict:
    try:
        available = torch.cuda.is_available()
        count = torch.cuda.device_count() if available else 0
        return {
            "cuda_available": available,
            "device_count": count,
            "arch_list": tuple(torch.cuda.get_arch_list()) if available else (),
            "capabilities": tuple(torch.cuda.get_device_capability(i) for i in range(count)),
            "cudnn": torch.backends.cudnn.version() if available else None,
            "nccl": ".".join(map(str, torch.cuda.nccl.version())) if available else None,
        }
    except Exception as exc:  # noqa: BLE001 - CUDA init errors are the finding
        return {"cuda_error": f"{type(exc).__name__}: {exc}"}


def _version(text: Optional[str]) -> Optional[tuple[int, ...]]:
    if not text:
        return None
    parts = re.findall(r"\d+", text)
    return tuple(int(p) for p in parts) if parts else None


def driver_version_text(host: Host) -> Optional[str]:
    if host.nvml is not None:
        version = host.nvml.call("nvmlSystemGetDriverVersion")
        if version:
            return str(version)
    match = re.search(r"Kernel Module\s+(?:for \S+\s+)?([\d.]+)", host.read("/proc/driver/nvidia/version") or "")
    return match.group(1) if match else None


def driver_cuda(host: Host) -> Optional[tuple[int, int]]:
    code = host.nvml.call("nvmlSystemGetCudaDriverVersion") if host.nvml is not None else None
    return (code // 1000, code % 1000 // 10) if code else None


def driver_version(host: Host, plan: Plan) -> Result:
    """The driver supports torch's CUDA runtime, and flash-attn fits the GPU architecture.

    A torch built for a newer CUDA major than the driver fails; a newer minor of the same major
    runs through minor-version compatibility (warns: PTX JIT and some features unavailable) if
    the driver reaches the major's minimum branch (11.x: 450.80.02, 12.x: 525.60.13, 13.x:
    580.65.06). FlashAttention 2 needs sm80 or newer and CUDA 12; FlashAttention 3 needs sm90
    and CUDA >= 12.3.
    """
    driver = driver_version_text(host)
    if driver is None:
        return skip("driver-version", f"no NVIDIA driver found ({host.nvml_error or 'no version reported'})")
    sw = host.software.get()
    cuda = driver_cuda(host)
    observed = {"driver": driver, "driver_cuda": ".".join(map(str, cuda)) if cuda else None,
                "torch_cuda": sw.cuda_runtime, "flash_attn": sw.flash_attn_version}
    findings = _runtime_findings(_version(driver), cuda, _version(sw.cuda_runtime)) + _flash_findings(host, sw)
    if not any(f.status in (Status.FAIL, Status.WARN) for f in findings):
        findings.append(Finding(Status.PASS, f"driver {driver} serves torch CUDA {sw.cuda_runtime}"))
    expected = {"driver_cuda": f">= torch CUDA {sw.cuda_runtime}" if sw.cuda_runtime else "any"}
    return fold("driver-version", findings, observed, expected)


def _driver_fix(runtime: tuple[int, ...]) -> str:
    branch = DRIVER_FOR_TOOLKIT.get(tuple(runtime[:2]), MIN_DRIVER_FOR_MAJOR.get(runtime[0], (0,))[0])
    return f"sudo apt install nvidia-driver-{branch}-server  # or a torch build for the driver's CUDA version"


def _runtime_findings(driver: Optional[tuple], cuda: Optional[tuple], runtime: Optional[tuple]) -> list[Finding]:
    if runtime is None:
        return [Finding(Status.INFO, "torch has no CUDA runtime (CPU build or missing); see cuda-torch-compat")]
    minimum = MIN_DRIVER_FOR_MAJOR.get(runtime[0])
    if minimum and driver and driver < minimum:
        shown = ".".join(map(str, minimum))
        return [Finding(Status.FAIL, f"driver {'.'.join(map(str, driver))} is below {shown}, the minimum for CUDA {runtime[0]}.x", _driver_fix(runtime))]
    if cuda is None:
        return []
    if runtime[0] > cuda[0]:
        return [Finding(Status.FAIL, f"torch needs CUDA {runtime[0]}.x, the driver supports CUDA {cuda[0]}.{cuda[1]}", _driver_fix(runtime))]
    if runtime[0] == cuda[0] and tuple(runtime[:2]) > cuda:
        return [Finding(Status.WARN, f"torch CUDA {runtime[0]}.{runtime[1]} on a CUDA {cuda[0]}.{cuda[1]} driver "
                                     "(minor-version compatibility: no PTX JIT)", _driver_fix(runtime))]
    return []


def _flash_findings(host: Host, sw: SoftwareFacts) -> list[Finding]:
    if not sw.flash_attn_version or host.nvml is None:
        return []
    runtime = _version(sw.cuda_runtime) or (0,)
    findings = []
    for i in range(host.nvml.count):
        cc = host.nvml.device(i, "nvmlDeviceGetCudaComputeCapability")
        if cc is None:
            continue
        if tuple(cc) < (8, 0):
            findings.append(Finding(Status.WARN, f"flash-attn is installed but {label(i)} is sm{cc[0]}{cc[1]}; FlashAttention 2 needs sm80+",
                                    "pip uninstall -y flash-attn  # use the SDPA attention backend on this GPU"))
        elif runtime[0] < 12:
            findings.append(Finding(Status.WARN, f"flash-attn needs CUDA 12, torch has CUDA {sw.cuda_runtime}",
                                    "pip install torch --index-url https://download.pytorch.org/whl/cu124"))
        elif tuple(cc) == (9, 0) and tuple(runtime[:2]) < (12, 3):
            findings.append(Finding(Status.INFO, f"{label(i)} is Hopper; FlashAttention 3 needs CUDA >= 12.3 (torch has {sw.cuda_runtime})"))
    return findings


def _has_gpu(host: Host) -> bool:
    return (host.nvml is not None and host.nvml.count > 0) or bool(nvidia_pci_gpus(host))


def cuda_torch_compat(host: Host, plan: Plan) -> Result:
    """torch sees the GPUs with a CUDA build that includes their architecture.

    Checks torch imports with CUDA, torch.cuda.is_available(), the device count against NVML,
    that each GPU's sm_XY is in torch.cuda.get_arch_list() (or PTX for an older arch), that an
    installed flash-attn imports, that nvidia-*-cuXX wheels of only one CUDA major are installed,
    and that no debug environment variable (CUDA_LAUNCH_BLOCKING, ...) slows serving down.
    """
    if not _has_gpu(host):
        return skip("cuda-torch-compat", "no NVIDIA GPU: torch's CUDA support is not needed here")
    sw = host.software.get()
    observed = {"torch": sw.torch_version, "torch_cuda": sw.cuda_runtime, "cuda_available": sw.cuda_available,
                "devices": sw.device_count, "arch_list": list(sw.arch_list), "flash_attn": sw.flash_attn_version or sw.flash_attn_error,
                "cuda_wheels": list(sw.cuda_wheels)}
    findings = _torch_findings(host, sw) + _wheel_findings(sw) + _env_findings(host)
    if not any(f.status in (Status.FAIL, Status.WARN) for f in findings):
        findings.append(Finding(Status.PASS, f"torch {sw.torch_version} (CUDA {sw.cuda_runtime}) sees {sw.device_count} GPU(s)"))
    return fold("cuda-torch-compat", findings, observed, {"cuda_available": True, "arch": "every GPU's sm in arch_list"})


def _torch_findings(host: Host, sw: SoftwareFacts) -> list[Finding]:
    wheel = "pip install --force-reinstall torch --index-url https://download.pytorch.org/whl/cu{}".format(_cuda_tag(host))
    if sw.torch_version is None:
        return [Finding(Status.FAIL, f"torch does not import: {sw.torch_error}", wheel)]
    if sw.cuda_runtime is None:
        return [Finding(Status.FAIL, f"torch {sw.torch_version} is a CPU-only build on a GPU host", wheel)]
    if not sw.cuda_available:
        reason = sw.cuda_error or "torch.cuda.is_available() is False"
        return [Finding(Status.FAIL, f"torch cannot use CUDA: {reason}", "python -c 'import torch; torch.cuda.init()'  # prints the CUDA error")]
    findings = []
    nvml_count = host.nvml.count if host.nvml is not None else None
    if nvml_count is not None and sw.device_count != nvml_count:
        hidden = host.env.get("CUDA_VISIBLE_DEVICES")
        why = f" (CUDA_VISIBLE_DEVICES={hidden})" if hidden is not None else ""
        findings.append(Finding(Status.WARN, f"torch sees {sw.device_count} GPU(s), NVML {nvml_count}{why}", "echo $CUDA_VISIBLE_DEVICES; nvidia-smi -L"))
    for i, cc in enumerate(sw.capabilities):
        if not _arch_supported(tuple(cc), sw.arch_list):
            findings.append(Finding(Status.FAIL, f"cuda:{i} is sm_{cc[0]}{cc[1]}, not in torch's arch list {' '.join(sw.arch_list)}", wheel))
    if sw.flash_attn_error:
        findings.append(Finding(Status.WARN, f"flash-attn is installed but does not import: {sw.flash_attn_error}",
                                "pip install --no-build-isolation --force-reinstall flash-attn"))
    return findings


def _cuda_tag(host: Host) -> str:
    cuda = driver_cuda(host)
    known = [v for v in DRIVER_FOR_TOOLKIT if cuda is None or v <= cuda]
    major, minor = max(known) if known else (12, 4)
    return f"{major}{minor}"


def _arch_supported(cc: tuple[int, int], arch_list: tuple[str, ...]) -> bool:
    """Native cubin for the exact arch, or PTX (compute_XY) for an older arch of the same major to JIT from."""
    sm = f"sm_{cc[0]}{cc[1]}"
    if sm in arch_list or f"{sm}a" in arch_list:
        return True
    for arch in arch_list:
        match = re.fullmatch(r"compute_(\d+)(\d)", arch)
        if match and (int(match.group(1)), int(match.group(2))) <= cc:
            return True
    return False


def _wheel_findings(sw: SoftwareFacts) -> list[Finding]:
    majors = sorted({int(name.rsplit("cu", 1)[1]) for name in sw.cuda_wheels})
    if len(majors) > 1:
        runtime = _version(sw.cuda_runtime)
        stray = [name for name in sw.cuda_wheels if not runtime or not name.endswith(f"cu{runtime[0]}")]
        return [Finding(Status.WARN, f"CUDA wheels of several majors installed: {', '.join(sw.cuda_wheels)}",
                        f"pip uninstall -y {' '.join(stray)}")]
    return []


def _env_findings(host: Host) -> list[Finding]:
    findings = []
    for name, why in DEBUG_ENV.items():
        value = host.env.get(name)
        if value not in (None, "", "0"):
            findings.append(Finding(Status.WARN, f"{name}={value} {why}", f"unset {name}"))
    if host.env.get("CUDA_VISIBLE_DEVICES") in ("", "-1"):
        findings.append(Finding(Status.WARN, "CUDA_VISIBLE_DEVICES hides every GPU", "unset CUDA_VISIBLE_DEVICES"))
    return findings
