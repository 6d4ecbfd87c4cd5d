"""The ten NVML-based GPU checks against a fake NVML and a fake filesystem root."""

from __future__ import annotations

import os
from types import SimpleNamespace

import pytest

from doctor_fixtures import GIB, FakeNvml, dev_nodes, h100, make_host, pci_gpu, plan, write_tree
from llmctl.checks import gpu, gpu_health
from llmctl.checks.model import Status
from llmctl.checks.settings import Thresholds

GPU_CHECKS = [
    gpu.gpu_persistence_mode, gpu.gpu_clocks_consistent, gpu_health.gpu_throttle_reasons, gpu_health.gpu_thermal_power,
    gpu_health.gpu_ecc, gpu_health.gpu_memory_health, gpu_health.gpu_memory_free, gpu.gpu_mig_mode, gpu.gpu_compute_mode,
]


def two_gpu_host(tmp_path, *gpus, **kwargs):
    gpus = gpus or (h100(0), h100(1))
    return make_host(tmp_path, FakeNvml(list(gpus), **kwargs))


@pytest.mark.parametrize("check", GPU_CHECKS)
def test_gpu_checks_skip_without_nvml_with_the_reason(tmp_path, check):
    result = check(make_host(tmp_path), plan())
    assert result.status == Status.SKIP
    assert "NVML library not found" in result.summary


@pytest.mark.parametrize("check", GPU_CHECKS)
def test_gpu_checks_pass_on_healthy_gpus(tmp_path, check):
    result = check(two_gpu_host(tmp_path), plan())
    assert result.status == Status.PASS, result


# gpu-visible -----------------------------------------------------------------

def visible_root(tmp_path, drivers=("nvidia", "nvidia")):
    files = dev_nodes(len(drivers))
    for i, driver in enumerate(drivers):
        files.update(pci_gpu(f"0000:{0x17 + i:02x}:00.0", driver))
    return write_tree(tmp_path, files)


def test_gpu_visible_passes_when_pci_and_nvml_agree(tmp_path):
    result = gpu.gpu_visible(make_host(visible_root(tmp_path), FakeNvml([h100(0), h100(1)])), plan(expect_gpus=2))
    assert result.status == Status.PASS
    assert result.observed["pci_gpus"] == 2 and result.observed["nvml_gpus"] == 2


def test_gpu_visible_fails_when_nvml_misses_a_gpu(tmp_path):
    result = gpu.gpu_visible(make_host(visible_root(tmp_path), FakeNvml([h100(0)])), plan())
    assert result.status == Status.FAIL
    assert "NVML sees 1 GPU(s), 2 on the PCI bus" in result.summary


def test_gpu_visible_only_warns_about_missing_gpus_inside_a_container(tmp_path):
    visible_root(tmp_path)
    write_tree(tmp_path, {"/.dockerenv": ""})
    assert gpu.gpu_visible(make_host(tmp_path, FakeNvml([h100(0)])), plan()).status == Status.WARN


def test_gpu_visible_fails_on_nouveau_and_unbound_gpus(tmp_path):
    host = make_host(visible_root(tmp_path, ("nouveau", None)))
    result = gpu.gpu_visible(host, plan())
    assert result.status == Status.FAIL
    assert "bound to nouveau" in result.summary and "no driver bound" in result.summary
    assert "blacklist nouveau" in result.fix


def test_gpu_visible_reports_driver_library_mismatch(tmp_path):
    host = make_host(visible_root(tmp_path), nvml_error="NVIDIA driver/library version mismatch", nvml_mismatch=True)
    result = gpu.gpu_visible(host, plan())
    assert result.status == Status.FAIL
    assert "mismatch" in result.summary and result.fix.startswith("sudo reboot")


def test_gpu_visible_fails_on_missing_or_inaccessible_device_nodes(tmp_path):
    visible_root(tmp_path)
    (tmp_path / "dev" / "nvidia1").unlink()
    (tmp_path / "dev" / "nvidiactl").chmod(0)
    result = gpu.gpu_visible(make_host(tmp_path, FakeNvml([h100(0), h100(1)])), plan())
    assert result.status == Status.FAIL
    assert "/dev/nvidia1 is missing" in result.summary
    if os.geteuid() != 0:  # root can open anything, so the permission finding needs a normal user
        assert "/dev/nvidiactl is not readable" in result.summary


def test_gpu_visible_checks_the_node_of_each_minor_number_including_zero(tmp_path):
    # NVML index order follows PCI bus ids, minor numbers follow probe order: they need not agree.
    write_tree(tmp_path, {"/dev/nvidiactl": "", "/dev/nvidia-uvm": "", "/dev/nvidia0": "", "/dev/nvidia2": ""})
    result = gpu.gpu_visible(make_host(tmp_path, FakeNvml([h100(0, nvmlDeviceGetMinorNumber=2),
                                                           h100(1, nvmlDeviceGetMinorNumber=0)])), plan())
    assert result.status == Status.PASS, result.summary
    (tmp_path / "dev" / "nvidia0").unlink()
    result = gpu.gpu_visible(make_host(tmp_path, FakeNvml([h100(0, nvmlDeviceGetMinorNumber=2),
                                                           h100(1, nvmlDeviceGetMinorNumber=0)])), plan())
    assert result.status == Status.FAIL and "/dev/nvidia0 is missing" in result.summary


def test_gpu_visible_only_warns_while_nvidia_uvm_is_not_created_yet(tmp_path):
    visible_root(tmp_path)
    (tmp_path / "dev" / "nvidia-uvm").unlink()
    result = gpu.gpu_visible(make_host(tmp_path, FakeNvml([h100(0), h100(1)])), plan())
    assert result.status == Status.WARN and "/dev/nvidia-uvm is missing" in result.summary


def test_gpu_visible_skips_without_gpus_and_fails_when_gpus_are_expected(tmp_path):
    host = make_host(tmp_path)
    skipped = gpu.gpu_visible(host, plan())
    assert skipped.status == Status.SKIP and "no NVIDIA GPU" in skipped.summary
    failed = gpu.gpu_visible(host, plan(expect_gpus=1))
    assert failed.status == Status.FAIL and "expected 1 GPU(s), NVML sees 0" in failed.summary


def test_gpu_visible_fails_with_fewer_gpus_than_expected(tmp_path):
    result = gpu.gpu_visible(make_host(visible_root(tmp_path), FakeNvml([h100(0), h100(1)])), plan(expect_gpus=8))
    assert result.status == Status.FAIL and "expected 8" in result.summary


# gpu-persistence-mode ---------------------------------------------------------

def test_persistence_off_fails_with_the_fix(tmp_path):
    result = gpu.gpu_persistence_mode(two_gpu_host(tmp_path, h100(0), h100(1, nvmlDeviceGetPersistenceMode=0)), plan())
    assert result.status == Status.FAIL
    assert "GPU1" in result.summary and result.fix == "sudo nvidia-smi -pm 1"
    assert result.observed == {"GPU0": "on", "GPU1": "off"}


def test_persistence_unsupported_everywhere_skips(tmp_path):
    gpus = [h100(i) for i in range(2)]
    for g in gpus:
        del g["nvmlDeviceGetPersistenceMode"]
    assert gpu.gpu_persistence_mode(make_host(tmp_path, FakeNvml(gpus)), plan()).status == Status.SKIP


# gpu-clocks-consistent --------------------------------------------------------

def test_different_max_sm_clocks_fail(tmp_path):
    slow = h100(1, nvmlDeviceGetMaxClockInfo={1: 1755, 2: 2619})
    result = gpu.gpu_clocks_consistent(two_gpu_host(tmp_path, h100(0), slow), plan())
    assert result.status == Status.FAIL
    assert "max SM clock (MHz) differs (GPU0=1980, GPU1=1755)" in result.summary


def test_different_power_limits_fail_with_a_pl_fix(tmp_path):
    gpus = [h100(0), h100(1), h100(2, nvmlDeviceGetPowerManagementLimit=500_000)]
    result = gpu.gpu_clocks_consistent(make_host(tmp_path, FakeNvml(gpus)), plan())
    assert result.status == Status.FAIL
    assert "power limit (W) differs" in result.summary and result.fix == "sudo nvidia-smi -pl 700"


def test_application_clock_mismatch_fails_with_reset_fix(tmp_path):
    odd = h100(1, nvmlDeviceGetApplicationsClock={1: 1400, 2: 2619})
    result = gpu.gpu_clocks_consistent(two_gpu_host(tmp_path, h100(0), odd), plan())
    assert result.status == Status.FAIL and result.fix == "sudo nvidia-smi -rac"


def test_current_clocks_compared_only_among_busy_gpus(tmp_path):
    busy = SimpleNamespace(gpu=95, memory=40)
    idle_low_clock = h100(2, nvmlDeviceGetClockInfo={1: 210, 2: 2619})
    gpus = [h100(0, nvmlDeviceGetUtilizationRates=busy, nvmlDeviceGetClockInfo={1: 1980, 2: 2619}),
            h100(1, nvmlDeviceGetUtilizationRates=busy, nvmlDeviceGetClockInfo={1: 1960, 2: 2619}), idle_low_clock]
    assert gpu.gpu_clocks_consistent(make_host(tmp_path, FakeNvml(gpus)), plan()).status == Status.PASS
    gpus[1]["nvmlDeviceGetClockInfo"] = {1: 1410, 2: 2619}
    result = gpu.gpu_clocks_consistent(make_host(tmp_path, FakeNvml(gpus)), plan())
    assert result.status == Status.WARN and "busy GPUs run at SM clocks" in result.summary


def test_clock_comparison_is_per_model(tmp_path):
    other_model = h100(1, nvmlDeviceGetName="NVIDIA L40S", nvmlDeviceGetMaxClockInfo={1: 2520, 2: 9001})
    result = gpu.gpu_clocks_consistent(two_gpu_host(tmp_path, h100(0), other_model), plan())
    assert result.status == Status.INFO and "nothing to compare" in result.summary


# gpu-throttle-reasons ---------------------------------------------------------

def test_hardware_slowdown_fails_and_sw_thermal_warns(tmp_path):
    hw = gpu_health.gpu_throttle_reasons(two_gpu_host(tmp_path, h100(0), h100(1, nvmlDeviceGetCurrentClocksEventReasons=0x40)), plan())
    assert hw.status == Status.FAIL and "GPU1: hardware thermal slowdown" in hw.summary
    sw = gpu_health.gpu_throttle_reasons(two_gpu_host(tmp_path, h100(0, nvmlDeviceGetCurrentClocksEventReasons=0x20)), plan())
    assert sw.status == Status.WARN


def test_throttle_falls_back_to_old_function_name(tmp_path):
    old = h100(0, nvmlDeviceGetCurrentClocksThrottleReasons=0x80)
    del old["nvmlDeviceGetCurrentClocksEventReasons"]
    fake = FakeNvml([old], missing=("nvmlDeviceGetCurrentClocksEventReasons",))
    result = gpu_health.gpu_throttle_reasons(make_host(tmp_path, fake), plan())
    assert result.status == Status.FAIL and "power brake" in result.summary


def test_throttle_skips_when_no_reasons_are_reported(tmp_path):
    g = h100(0)
    del g["nvmlDeviceGetCurrentClocksEventReasons"]
    assert gpu_health.gpu_throttle_reasons(make_host(tmp_path, FakeNvml([g])), plan()).status == Status.SKIP


# gpu-thermal-power ------------------------------------------------------------

@pytest.mark.parametrize("temp, status", [(70, Status.PASS), (75, Status.WARN), (84, Status.FAIL)])
def test_thermal_margin_thresholds(tmp_path, temp, status):
    host = two_gpu_host(tmp_path, h100(0, nvmlDeviceGetTemperature={0: temp}))
    assert gpu_health.gpu_thermal_power(host, plan()).status == status


def test_power_limit_below_default_warns_and_threshold_is_configurable(tmp_path):
    host = two_gpu_host(tmp_path, h100(0, nvmlDeviceGetPowerManagementLimit=600_000))
    result = gpu_health.gpu_thermal_power(host, plan())
    assert result.status == Status.WARN and result.fix == "sudo nvidia-smi -i 0 -pl 700"
    lenient = plan(thresholds=Thresholds(power_limit_tolerance_pct=20))
    assert gpu_health.gpu_thermal_power(host, lenient).status == Status.PASS


def test_thermal_power_skips_when_nothing_is_reported(tmp_path):
    g = {k: v for k, v in h100(0).items() if "Temperature" not in k and "PowerManagement" not in k}
    assert gpu_health.gpu_thermal_power(make_host(tmp_path, FakeNvml([g])), plan()).status == Status.SKIP


# gpu-ecc ------------------------------------------------------------------------

def test_ecc_off_fails_on_datacenter_and_warns_on_consumer(tmp_path):
    dc = gpu_health.gpu_ecc(two_gpu_host(tmp_path, h100(0, nvmlDeviceGetEccMode=(0, 0))), plan())
    assert dc.status == Status.FAIL and "datacenter" in dc.summary
    geforce = h100(0, nvmlDeviceGetName="NVIDIA GeForce RTX 4090", nvmlDeviceGetBrand=5)
    del geforce["nvmlDeviceGetEccMode"]
    consumer = gpu_health.gpu_ecc(make_host(tmp_path, FakeNvml([geforce])), plan())
    assert consumer.status == Status.WARN and "consumer" in consumer.summary


def test_ecc_pending_change_and_uncorrected_errors(tmp_path):
    pending = gpu_health.gpu_ecc(two_gpu_host(tmp_path, h100(0, nvmlDeviceGetEccMode=(1, 0))), plan())
    assert pending.status == Status.WARN and "pending" in pending.summary
    errors = h100(1, nvmlDeviceGetTotalEccErrors=lambda kind, counter: 3 if (kind, counter) == (1, 0) else 0)
    failed = gpu_health.gpu_ecc(two_gpu_host(tmp_path, h100(0), errors), plan())
    assert failed.status == Status.FAIL and "3 volatile uncorrected" in failed.summary


# gpu-memory-health --------------------------------------------------------------

def test_row_remap_failure_fails_and_pending_warns(tmp_path):
    failed = gpu_health.gpu_memory_health(two_gpu_host(tmp_path, h100(0, nvmlDeviceGetRemappedRows=(1, 2, 0, 1))), plan())
    assert failed.status == Status.FAIL and "row remapping failed" in failed.summary
    pending = gpu_health.gpu_memory_health(two_gpu_host(tmp_path, h100(0, nvmlDeviceGetRemappedRows=(0, 1, 1, 0))), plan())
    assert pending.status == Status.WARN


@pytest.mark.parametrize("pages, status", [(3, Status.PASS), (20, Status.WARN), (60, Status.FAIL)])
def test_retired_pages_use_dcgm_limits(tmp_path, pages, status):
    volta = h100(0, nvmlDeviceGetName="Tesla V100-SXM2-32GB",
                 nvmlDeviceGetRetiredPages={0: list(range(pages)), 1: []}, nvmlDeviceGetRetiredPagesPendingStatus=0)
    del volta["nvmlDeviceGetRemappedRows"]
    assert gpu_health.gpu_memory_health(make_host(tmp_path, FakeNvml([volta])), plan()).status == status


def test_memory_health_skips_when_not_reported(tmp_path):
    g = h100(0)
    del g["nvmlDeviceGetRemappedRows"]
    assert gpu_health.gpu_memory_health(make_host(tmp_path, FakeNvml([g])), plan()).status == Status.SKIP


# gpu-memory-free ----------------------------------------------------------------

def test_memory_free_fails_naming_the_other_process(tmp_path):
    write_tree(tmp_path, {"/proc/4242/comm": "python3\n"})
    busy = h100(1, nvmlDeviceGetMemoryInfo=SimpleNamespace(total=80 * GIB, free=30 * GIB, used=50 * GIB),
                nvmlDeviceGetComputeRunningProcesses=[SimpleNamespace(pid=4242, usedGpuMemory=50 * GIB)])
    result = gpu_health.gpu_memory_free(two_gpu_host(tmp_path, h100(0), busy), plan(gpu_memory_utilization=0.9))
    assert result.status == Status.FAIL
    assert "GPU1: 30.0 GiB free, plan needs 72.0 GiB held by python3 (pid 4242, 50.0 GiB)" in result.summary
    assert "--gpu-memory-utilization 0.36" in result.fix
    assert gpu_health.gpu_memory_free(two_gpu_host(tmp_path, h100(0), busy), plan(gpu_memory_utilization=0.3)).status == Status.PASS


def test_memory_free_skips_without_memory_info(tmp_path):
    g = h100(0)
    del g["nvmlDeviceGetMemoryInfo"]
    assert gpu_health.gpu_memory_free(make_host(tmp_path, FakeNvml([g])), plan()).status == Status.SKIP


# gpu-mig-mode / gpu-compute-mode ------------------------------------------------

def test_mig_enabled_warns_unless_allowed_and_pending_warns(tmp_path):
    host = two_gpu_host(tmp_path, h100(0, nvmlDeviceGetMigMode=(1, 1)))
    assert gpu.gpu_mig_mode(host, plan()).status == Status.WARN
    assert gpu.gpu_mig_mode(host, plan(thresholds=Thresholds(mig_allowed=True))).status == Status.PASS
    pending = gpu.gpu_mig_mode(two_gpu_host(tmp_path, h100(0, nvmlDeviceGetMigMode=(0, 1))), plan())
    assert pending.status == Status.WARN and "pending" in pending.summary


@pytest.mark.parametrize("mode, status", [(0, Status.PASS), (3, Status.WARN), (2, Status.FAIL)])
def test_compute_modes(tmp_path, mode, status):
    result = gpu.gpu_compute_mode(two_gpu_host(tmp_path, h100(0), h100(1, nvmlDeviceGetComputeMode=mode)), plan())
    assert result.status == status
    if status != Status.PASS:
        assert result.fix == "sudo nvidia-smi -i 1 -c DEFAULT"


def test_compute_mode_unsupported_skips(tmp_path):
    g = h100(0)
    del g["nvmlDeviceGetComputeMode"]
    assert gpu.gpu_compute_mode(make_host(tmp_path, FakeNvml([g])), plan()).status == Status.SKIP


def test_memory_free_is_skipped_with_the_reason_on_a_driver_without_the_v3_process_query(tmp_path):
    import pynvml

    from llmctl.checks.registry import BY_ID
    from llmctl.checks.runner import run_one

    @pynvml.throwOnVersionMismatch  # pynvml's own wrapper: FunctionNotFound -> NVMLLibraryMismatchError
    def compute_processes_v3_missing():
        raise pynvml.NVMLError(pynvml.NVML_ERROR_FUNCTION_NOT_FOUND)

    old_driver = h100(0, nvmlDeviceGetComputeRunningProcesses=compute_processes_v3_missing)
    result = run_one(BY_ID["gpu-memory-free"], make_host(tmp_path, FakeNvml([old_driver])), plan())
    assert result.status == Status.SKIP, result
    assert "nvmlDeviceGetComputeRunningProcesses is not available" in result.summary
    assert "pyNVML version does not match the NVML lib version" in result.summary
