"""doctor's kernel-log, NVLink and fabric checks on recorded kernel-log lines, a fake NVML and a fake
sysfs/procfs, and `--bundle`'s files and secret masking."""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest

from doctor_fixtures import FakeNvml, h100, make_host, plan, write_tree
from llmctl.checks import bundle, fabric, interconnect, kernel_log
from llmctl.checks.model import Status
from llmctl.checks.probe import KernelLog, Lazy
from llmctl.checks.settings import Thresholds

XID_79 = "[ 1234.5] NVRM: Xid (PCI:0000:3b:00): 79, pid=2211, name=python3, GPU has fallen off the bus."
XID_13 = "NVRM: Xid (PCI:0000:17:00): 13, pid=881, name=python, Graphics Exception: ESR 0x514648=0x1000f"
SXID_FATAL = "nvidia-nvswitch3: SXid (PCI:0000:07:00.0): 12028, Fatal, Link 32 egress non-posted PRIV error"
SXID_MINOR = "nvidia-nvswitch0: SXid (PCI:0000:05:00.0): 20034, Non-fatal, Link 61 LTSSM Fault Up"


def _log_host(tmp_path, lines, source="/dev/kmsg", **kwargs):
    return make_host(tmp_path, kernel_log=Lazy.of(KernelLog(tuple(lines), source, "")), **kwargs)


def test_parse_events_classifies_xids_and_sxids():
    events = kernel_log.parse_events((XID_79, "usb 1-1: new device", XID_13, SXID_FATAL, SXID_MINOR))
    assert [(e.kind, e.code, e.bus, e.fatal) for e in events] == [
        ("XID", 79, "0000:3b:00", True), ("XID", 13, "0000:17:00", False),
        ("SXID", 12028, "0000:07:00.0", True), ("SXID", 20034, "0000:05:00.0", False)]
    assert "fallen off the bus" in events[0].text and events[2].text.startswith("nvidia-nvswitch3")


@pytest.mark.parametrize("lines, status, words", [
    ([XID_79, XID_13], Status.FAIL, "XID 79 on PCI 0000:3b:00"),
    ([XID_13], Status.WARN, "XID 13"),
    ([SXID_FATAL], Status.FAIL, "SXID 12028"),
    ([SXID_MINOR], Status.WARN, "SXID 20034"),
    (["eth0: link up"], Status.PASS, "no XID or SXID since boot (/dev/kmsg)"),
])
def test_xid_events_fail_on_fatal_classes_and_warn_on_others(tmp_path, lines, status, words):
    result = kernel_log.gpu_xid_events(_log_host(tmp_path, lines), plan())
    assert result.status == status and words in result.summary


def test_xid_events_skip_with_the_reason_when_the_log_is_unreadable(tmp_path):
    host = make_host(tmp_path, kernel_log=Lazy.of(KernelLog((), None, "/dev/kmsg: Operation not permitted")))
    result = kernel_log.gpu_xid_events(host, plan())
    assert result.status == Status.SKIP and "Operation not permitted" in result.summary


def _nvlink_gpu(index, errors):
    """An H100 whose link 1 has the given {counter: count}; the other links count nothing."""
    return h100(index, nvmlDeviceGetNvLinkErrorCounter=lambda link, counter: errors.get(counter, 0) if link == 1 else 0)


def test_nvlink_errors_warn_on_replays_and_crc_and_pass_when_clean(tmp_path):
    host = make_host(tmp_path, FakeNvml([_nvlink_gpu(0, {}), _nvlink_gpu(1, {0: 12, 2: 3})]))
    result = interconnect.nvlink_errors(host, plan())
    assert result.status == Status.WARN and "GPU1 NVLink 1: replay 12, crc_flit 3" in result.summary
    assert result.observed["GPU1"][1] == {"replay": 12, "recovery": 0, "crc_flit": 3, "crc_data": 0}
    assert interconnect.nvlink_errors(host, plan(thresholds=Thresholds(nvlink_errors_max=20))).status == Status.PASS
    clean = make_host(tmp_path, FakeNvml([_nvlink_gpu(0, {})]))
    assert interconnect.nvlink_errors(clean, plan()).status == Status.PASS


def test_nvlink_errors_skip_without_counters_or_nvml(tmp_path):
    assert interconnect.nvlink_errors(make_host(tmp_path), plan()).status == Status.SKIP
    no_links = make_host(tmp_path, FakeNvml([h100(0, nvmlDeviceGetNvLinkState={})]))
    assert interconnect.nvlink_errors(no_links, plan()).status == Status.SKIP


def _nvswitch_root(tmp_path, process=None):
    files = {}
    for i in range(2):
        bdf = f"0000:0{5 + i}:00.0"
        files[f"/sys/devices/pci0000:00/{bdf}/vendor"] = "0x10de\n"
        files[f"/sys/devices/pci0000:00/{bdf}/class"] = "0x068000\n"
        files[f"/sys/bus/pci/devices/{bdf}"] = ("link", f"../../../devices/pci0000:00/{bdf}")
    files["/proc/1/comm"] = "systemd\n"
    if process:
        files["/proc/4321/comm"] = process + "\n"
    return write_tree(tmp_path, files)


def test_fabric_manager_needs_its_process_on_nvswitch_hosts(tmp_path):
    assert fabric.fabric_manager(make_host(tmp_path), plan()).status == Status.SKIP  # no NVSwitch
    missing = fabric.fabric_manager(make_host(_nvswitch_root(tmp_path / "a")), plan())
    assert missing.status == Status.FAIL and "2 NVSwitch(es) but no nv-fabricmanager" in missing.summary
    assert "nvidia-fabricmanager" in missing.fix
    running = fabric.fabric_manager(make_host(_nvswitch_root(tmp_path / "b", "nv-fabricmanager")), plan())
    assert running.status == Status.PASS


def test_fabric_manager_reads_nvml_fabric_state_where_reported(tmp_path):
    root = _nvswitch_root(tmp_path)
    done = SimpleNamespace(state=3, status=0)
    ok = make_host(root, FakeNvml([h100(0, nvmlDeviceGetGpuFabricInfo=done)]))
    assert fabric.fabric_manager(ok, plan()).status == Status.PASS
    pending = make_host(root, FakeNvml([h100(0, nvmlDeviceGetGpuFabricInfo=done),
                                        h100(1, nvmlDeviceGetGpuFabricInfo=SimpleNamespace(state=1, status=0))]))
    result = fabric.fabric_manager(pending, plan())
    assert result.status == Status.FAIL and "GPU1 state 1" in result.summary


def _ib_root(tmp_path, states, peermem):
    files = {f"/sys/class/infiniband/mlx5_{i}/ports/1/state": f"{state}\n" for i, state in enumerate(states)}
    if peermem:
        files["/sys/module/nvidia_peermem/refcnt"] = "0\n"
    return write_tree(tmp_path, files)


def test_rdma_ports_active_and_peermem_loaded(tmp_path):
    assert fabric.rdma_peermem(make_host(tmp_path), plan()).status == Status.SKIP
    good = make_host(_ib_root(tmp_path / "a", ["4: ACTIVE", "4: ACTIVE"], True), FakeNvml([h100(0)]))
    assert fabric.rdma_peermem(good, plan()).status == Status.PASS
    bad = make_host(_ib_root(tmp_path / "b", ["4: ACTIVE", "1: DOWN"], False), FakeNvml([h100(0)]))
    result = fabric.rdma_peermem(bad, plan())
    assert result.status == Status.WARN and "mlx5_1/1 is DOWN" in result.summary
    assert any("nvidia_peermem is not loaded" in d for d in result.details)


def test_environment_masking_replaces_credential_values_only():
    env = {"HF_TOKEN": "hf_abc", "OPENAI_API_KEY": "sk-1", "DB_PASSWORD_FILE": "/run/pw", "my_secret_thing": "x",
           "PATH": "/usr/bin", "CUDA_VISIBLE_DEVICES": "0,1", "KEYBOARD": "us"}
    masked = bundle.mask_environment(env)
    assert masked["HF_TOKEN"] == masked["OPENAI_API_KEY"] == masked["DB_PASSWORD_FILE"] == bundle.MASK
    assert masked["my_secret_thing"] == bundle.MASK
    assert masked["PATH"] == "/usr/bin" and masked["CUDA_VISIBLE_DEVICES"] == "0,1" and masked["KEYBOARD"] == "us"


def test_bundle_writes_report_packages_kernel_lines_and_masked_environment(tmp_path, monkeypatch):
    monkeypatch.setattr(bundle.shutil, "which", lambda name: None)  # no nvidia-smi here
    host = _log_host(tmp_path / "root", [XID_13, "eth0: link up"], env={"HF_TOKEN": "hf_secret", "HOME": "/root"})
    folder = tmp_path / "bundle"
    written = bundle.write_bundle(folder, {"summary": {"exit_code": 0}}, host)
    assert written["nvidia-smi-q.txt"] == "nvidia-smi is not on PATH" and not (folder / "nvidia-smi-q.txt").exists()
    assert json.loads((folder / "doctor.json").read_text()) == {"summary": {"exit_code": 0}}
    environment = (folder / "environment.txt").read_text()
    assert "HF_TOKEN=***" in environment and "hf_secret" not in environment and "HOME=/root" in environment
    assert (folder / "kernel-nvidia.txt").read_text() == XID_13 + "\n"
    assert any(line.startswith("torch==") for line in (folder / "pip-freeze.txt").read_text().splitlines())
    assert json.loads((folder / "bundle.json").read_text())["files"] == written


def test_doctor_bundle_flag_writes_the_bundle_beside_the_table(tmp_path, capsys, monkeypatch):
    from llmctl.cli import run

    monkeypatch.setenv("LLMCTL_TEST_API_KEY", "do-not-leak")
    code = run(["doctor", "--only", "swap", "--bundle", str(tmp_path / "b")])
    captured = capsys.readouterr()
    assert code in (0, 1) and "swap" in captured.out
    assert f"support bundle written to {tmp_path / 'b'}" in captured.err
    report = json.loads((tmp_path / "b/doctor.json").read_text())
    assert [r["id"] for r in report["results"]] == ["swap"] and report["host"]["python"]
    assert "LLMCTL_TEST_API_KEY=***" in (tmp_path / "b/environment.txt").read_text()
