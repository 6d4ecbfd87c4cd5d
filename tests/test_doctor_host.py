"""Interconnect, CPU/OS, memory, software and storage checks against fake roots."""

from __future__ import annotations

import socket
from types import SimpleNamespace

import pytest

from doctor_fixtures import GIB, FakeNvml, h100, make_host, pci_gpu, plan, write_tree
from llmctl.checks import interconnect, rendezvous, software, storage, system
from llmctl.checks.model import Status
from llmctl.checks.probe import LoadSample, SoftwareFacts
from llmctl.checks.settings import Thresholds

# pcie-link ------------------------------------------------------------------------


def test_x8_link_under_load_on_an_x16_card_fails(tmp_path):
    load = LoadSample({0: (5, 16), 1: (5, 8)}, note="pinned-copy load")
    result = interconnect.pcie_link(make_host(tmp_path, FakeNvml([h100(0), h100(1)]), load=load), plan())
    assert result.status == Status.FAIL
    assert "GPU1 Gen5 x8, capable of Gen5 x16 under load" in result.summary
    assert "lspci -vv -s 0000:18:00.0" in result.fix
    assert result.observed["GPU1"]["reading"] == "under load"


def test_idle_only_reading_below_max_warns_and_says_so(tmp_path):
    idle = h100(0, nvmlDeviceGetCurrPcieLinkGeneration=1)
    result = interconnect.pcie_link(make_host(tmp_path, FakeNvml([idle]), load=LoadSample(note="torch has no usable CUDA")), plan())
    assert result.status == Status.WARN
    assert "idle reading only: torch has no usable CUDA" in result.summary


def test_link_at_max_under_load_passes(tmp_path):
    idle = h100(0, nvmlDeviceGetCurrPcieLinkGeneration=1)
    result = interconnect.pcie_link(make_host(tmp_path, FakeNvml([idle]), load=LoadSample({0: (5, 16)}, "load")), plan())
    assert result.status == Status.PASS and "under load" in result.summary


def test_slot_slower_than_gpu_and_replays_warn(tmp_path):
    gpu = h100(0, nvmlDeviceGetMaxPcieLinkGeneration=4, nvmlDeviceGetCurrPcieLinkGeneration=4, nvmlDeviceGetPcieReplayCounter=500)
    result = interconnect.pcie_link(make_host(tmp_path, FakeNvml([gpu])), plan())
    assert result.status == Status.WARN
    assert "slot limits the link to Gen4" in result.summary and "replay counter 500" in result.summary


def test_pcie_link_skips_without_nvml_or_link_info(tmp_path):
    assert interconnect.pcie_link(make_host(tmp_path), plan()).status == Status.SKIP
    gpu = {k: v for k, v in h100(0).items() if "Pcie" not in k}
    assert interconnect.pcie_link(make_host(tmp_path, FakeNvml([gpu])), plan()).status == Status.SKIP


# gpu-topology ----------------------------------------------------------------------

def topo_root(tmp_path, process_cpus="0-63"):
    files = {"/proc/self/status": f"Name:\tpython\nCpus_allowed_list:\t{process_cpus}\n"}
    files.update(pci_gpu("0000:17:00.0"))
    files.update(pci_gpu("0000:18:00.0"))
    files["/sys/devices/pci0000:00/0000:00:01.0/0000:18:00.0/local_cpulist"] = "32-63\n"
    return write_tree(tmp_path, files)


def test_topology_passes_with_p2p_nvlink_and_local_affinity(tmp_path):
    fake = FakeNvml([h100(0), h100(1)], pairs={"nvmlDeviceGetP2PStatus": {(0, 1): 0}, "nvmlDeviceGetTopologyCommonAncestor": {(0, 1): 50}})
    result = interconnect.gpu_topology(make_host(topo_root(tmp_path), fake), plan())
    assert result.status == Status.PASS, result
    assert result.observed["nvlinks_active"] == {"GPU0": 4, "GPU1": 4}


def test_topology_warns_on_no_p2p_down_nvlink_cross_socket_and_remote_affinity(tmp_path):
    pcie_only = {k: v for k, v in h100(1).items() if k != "nvmlDeviceGetNvLinkState"}
    down = h100(0, nvmlDeviceGetNvLinkState={0: 1, 1: 0, 2: 1, 3: 1})
    fake = FakeNvml([down, pcie_only], pairs={"nvmlDeviceGetP2PStatus": {(0, 1): 2}, "nvmlDeviceGetTopologyCommonAncestor": {(0, 1): 50}})
    result = interconnect.gpu_topology(make_host(topo_root(tmp_path, process_cpus="0-15"), fake), plan())
    assert result.status == Status.WARN
    text = " | ".join(result.details)
    assert "no P2P read between GPU0 and GPU1" in text
    assert "GPU0 NVLink(s) 1 down" in text
    assert "different CPU sockets without NVLink" in text
    assert "GPU1 is local to CPUs 32-63" in text


def test_topology_skips_without_nvml_or_anything_to_compare(tmp_path):
    assert interconnect.gpu_topology(make_host(tmp_path), plan()).status == Status.SKIP
    single = {k: v for k, v in h100(0).items() if k != "nvmlDeviceGetNvLinkState"}
    assert interconnect.gpu_topology(make_host(tmp_path, FakeNvml([single])), plan()).status == Status.SKIP


# iommu-acs -------------------------------------------------------------------------

def acs_config(control: int) -> bytes:
    """4 KiB config space with an ACS extended capability at 0x100 holding `control`."""
    config = bytearray(4096)
    config[0x100:0x104] = (0x000D | (1 << 16)).to_bytes(4, "little")
    config[0x106:0x108] = control.to_bytes(2, "little")
    return bytes(config)


def acs_root(tmp_path, control: int, cmdline="BOOT_IMAGE=/vmlinuz ro iommu=pt"):
    files = {"/proc/cmdline": cmdline + "\n", "/proc/cpuinfo": "flags\t: fpu sse2\n", "/sys/kernel/iommu_groups/0/.keep": ""}
    files.update(pci_gpu("0000:17:00.0", bridge="0000:16:00.0"))
    files.update(pci_gpu("0000:18:00.0", bridge="0000:16:00.0"))
    files["/sys/devices/pci0000:00/0000:16:00.0/config"] = acs_config(control)
    files["/sys/bus/pci/devices/0000:16:00.0"] = ("link", "../../../devices/pci0000:00/0000:16:00.0")
    return write_tree(tmp_path, files)


def test_iommu_passthrough_without_acs_redirect_passes(tmp_path):
    result = interconnect.iommu_acs(make_host(acs_root(tmp_path, 0x0001)), plan())
    assert result.status == Status.PASS
    assert result.observed["acs_redirect"] == {"0000:16:00.0": "off"}


def test_acs_redirect_on_a_bridge_between_gpus_warns(tmp_path):
    result = interconnect.iommu_acs(make_host(acs_root(tmp_path, 0x001D)), plan())
    assert result.status == Status.WARN and "ACS redirects P2P on bridge 0000:16:00.0" in result.summary
    assert result.fix.startswith("sudo setpci -s 0000:16:00.0 ECAP_ACS+6.w=0000")


def test_translating_iommu_warns(tmp_path):
    result = interconnect.iommu_acs(make_host(acs_root(tmp_path, 0, cmdline="ro intel_iommu=on")), plan())
    assert result.status == Status.WARN and "iommu=pt" in result.summary


def test_iommu_acs_skips_in_a_vm_and_without_gpus(tmp_path):
    write_tree(tmp_path, {"/proc/cpuinfo": "flags\t: fpu hypervisor sse2\n"})
    assert "inside a VM" in interconnect.iommu_acs(make_host(tmp_path), plan()).summary
    (tmp_path / "proc" / "cpuinfo").write_text("flags\t: fpu\n")
    assert interconnect.iommu_acs(make_host(tmp_path), plan()).status == Status.SKIP


# numa-balancing, cpu-governor, ulimits ---------------------------------------------

def numa_root(tmp_path, value: str, nodes: int):
    files = {"/proc/sys/kernel/numa_balancing": value + "\n"}
    files.update({f"/sys/devices/system/node/node{i}/cpulist": "0-1\n" for i in range(nodes)})
    return write_tree(tmp_path, files)


@pytest.mark.parametrize("value, nodes, status", [("1", 2, Status.FAIL), ("0", 2, Status.PASS), ("1", 1, Status.PASS)])
def test_numa_balancing(tmp_path, value, nodes, status):
    result = system.numa_balancing(make_host(numa_root(tmp_path, value, nodes)), plan())
    assert result.status == status
    if status == Status.FAIL:
        assert result.fix == "sudo sysctl -w kernel.numa_balancing=0"


def test_numa_balancing_skips_without_the_sysctl(tmp_path):
    assert system.numa_balancing(make_host(tmp_path), plan()).status == Status.SKIP


def test_cpu_governor(tmp_path):
    files = {f"/sys/devices/system/cpu/cpu{i}/cpufreq/scaling_governor": "performance\n" for i in range(4)}
    write_tree(tmp_path, files)
    assert system.cpu_governor(make_host(tmp_path), plan()).status == Status.PASS
    (tmp_path / "sys/devices/system/cpu/cpu3/cpufreq/scaling_governor").write_text("powersave\n")
    result = system.cpu_governor(make_host(tmp_path), plan())
    assert result.status == Status.WARN and result.observed == {"performance": 3, "powersave": 1}
    assert result.fix == "sudo cpupower frequency-set -g performance"
    assert system.cpu_governor(make_host(tmp_path), plan(thresholds=Thresholds(cpu_governor="powersave"))).status == Status.WARN


def test_cpu_governor_skips_without_cpufreq(tmp_path):
    assert system.cpu_governor(make_host(tmp_path), plan()).status == Status.SKIP


LIMITS = """Limit                     Soft Limit           Hard Limit           Units
Max open files            {nofile}                 1048576              files
Max locked memory         {memlock}              8388608              bytes
"""


def test_ulimits(tmp_path):
    write_tree(tmp_path, {"/proc/self/limits": LIMITS.format(nofile=1048576, memlock=8388608)})
    assert system.ulimits(make_host(tmp_path), plan()).status == Status.PASS
    (tmp_path / "proc/self/limits").write_text(LIMITS.format(nofile=1024, memlock=8388608))
    low = system.ulimits(make_host(tmp_path), plan())
    assert low.status == Status.WARN and "open files limit 1024 < 65536" in low.summary
    write_tree(tmp_path, {"/sys/class/infiniband/mlx5_0/.keep": ""})
    rdma = system.ulimits(make_host(tmp_path), plan())
    assert rdma.status == Status.FAIL and "mlx5_0" in rdma.summary and "ulimit -l unlimited" in rdma.fix


def test_ulimits_skip_without_proc(tmp_path):
    assert system.ulimits(make_host(tmp_path), plan()).status == Status.SKIP


# thp, swap, shm-size ----------------------------------------------------------------

def test_thp(tmp_path):
    thp = "/sys/kernel/mm/transparent_hugepage/"
    write_tree(tmp_path, {thp + "enabled": "always madvise [never]\n", thp + "defrag": "always defer [madvise] never\n"})
    assert system.thp(make_host(tmp_path), plan()).status == Status.PASS
    (tmp_path / thp.lstrip("/") / "enabled").write_text("[always] madvise never\n")
    result = system.thp(make_host(tmp_path), plan())
    assert result.status == Status.WARN and result.observed["enabled"] == "always"
    assert system.thp(make_host(tmp_path), plan(thresholds=Thresholds(thp_allowed=("always",)))).status == Status.PASS


def test_thp_skips_without_sysfs(tmp_path):
    assert system.thp(make_host(tmp_path), plan()).status == Status.SKIP


def test_swap(tmp_path):
    write_tree(tmp_path, {"/proc/meminfo": "MemTotal: 1000 kB\nSwapTotal:       0 kB\nSwapFree: 0 kB\n", "/proc/sys/vm/swappiness": "60\n"})
    assert system.swap(make_host(tmp_path), plan()).status == Status.PASS
    (tmp_path / "proc/meminfo").write_text("SwapTotal:  8388608 kB\nSwapFree:  4194304 kB\n")
    result = system.swap(make_host(tmp_path), plan())
    assert result.status == Status.WARN and result.observed["swap_used_gib"] == 4.0
    (tmp_path / "proc/sys/vm/swappiness").write_text("1\n")
    assert system.swap(make_host(tmp_path), plan()).status == Status.PASS


def test_swap_skips_without_meminfo(tmp_path):
    assert system.swap(make_host(tmp_path), plan()).status == Status.SKIP


def shm_host(tmp_path, size, **files):
    write_tree(tmp_path, {"/dev/shm/.keep": "", **files})
    return make_host(tmp_path, disk_usage=lambda path: (size, size))


def test_shm_size(tmp_path):
    assert system.shm_size(shm_host(tmp_path, 16 * GIB), plan()).status == Status.PASS
    docker = system.shm_size(shm_host(tmp_path, 64 << 20, **{"/.dockerenv": ""}), plan())
    assert docker.status == Status.FAIL and "only 64 MiB" in docker.summary and "--ipc=host" in docker.fix


def test_shm_size_skips_without_dev_shm(tmp_path):
    assert system.shm_size(make_host(tmp_path), plan()).status == Status.SKIP


# driver-version, cuda-torch-compat ---------------------------------------------------

CUDA_TORCH = SoftwareFacts(torch_version="2.6.0+cu124", cuda_runtime="12.4", cuda_available=True, device_count=1,
                           arch_list=("sm_80", "sm_86", "sm_90"), capabilities=((9, 0),))


def test_driver_version_pass_warn_fail(tmp_path):
    fake = FakeNvml([h100(0)])
    assert software.driver_version(make_host(tmp_path, fake, software=CUDA_TORCH), plan()).status == Status.PASS
    older_minor = FakeNvml([h100(0)], system={"nvmlSystemGetCudaDriverVersion": 12020, "nvmlSystemGetDriverVersion": "535.183.01"})
    warn = software.driver_version(make_host(tmp_path, older_minor, software=CUDA_TORCH), plan())
    assert warn.status == Status.WARN and "minor-version compatibility" in warn.summary
    assert warn.fix.startswith("sudo apt install nvidia-driver-550-server")
    cu13 = SoftwareFacts(torch_version="2.9.0+cu130", cuda_runtime="13.0", cuda_available=True)
    fail = software.driver_version(make_host(tmp_path, older_minor, software=cu13), plan())
    assert fail.status == Status.FAIL and "minimum for CUDA 13.x" in fail.summary


def test_driver_version_flash_attn_on_turing_warns(tmp_path):
    turing = h100(0, nvmlDeviceGetName="Tesla T4", nvmlDeviceGetCudaComputeCapability=(7, 5))
    facts = SoftwareFacts(torch_version="2.6", cuda_runtime="12.4", flash_attn_version="2.7.4")
    result = software.driver_version(make_host(tmp_path, FakeNvml([turing]), software=facts), plan())
    assert result.status == Status.WARN and "FlashAttention 2 needs sm80+" in result.summary


def test_driver_version_reads_proc_without_nvml_and_skips_without_driver(tmp_path):
    assert software.driver_version(make_host(tmp_path), plan()).status == Status.SKIP
    write_tree(tmp_path, {"/proc/driver/nvidia/version": "NVRM version: NVIDIA UNIX x86_64 Kernel Module  550.54.15  Tue Mar 5 2024\n"})
    result = software.driver_version(make_host(tmp_path, software=CUDA_TORCH), plan())
    assert result.observed["driver"] == "550.54.15" and result.status == Status.PASS


def test_cuda_torch_compat_pass(tmp_path):
    result = software.cuda_torch_compat(make_host(tmp_path, FakeNvml([h100(0)]), software=CUDA_TORCH), plan())
    assert result.status == Status.PASS, result


@pytest.mark.parametrize("facts, fragment", [
    (SoftwareFacts(torch_version="2.6.0+cpu"), "CPU-only build"),
    (SoftwareFacts(torch_error="ImportError: libcudart.so.12"), "torch does not import"),
    (SoftwareFacts(torch_version="2.6", cuda_runtime="12.4", cuda_available=True, device_count=1, arch_list=("sm_80",), capabilities=((9, 0),)),
     "sm_90, not in torch's arch list"),
])
def test_cuda_torch_compat_failures(tmp_path, facts, fragment):
    result = software.cuda_torch_compat(make_host(tmp_path, FakeNvml([h100(0)]), software=facts), plan())
    assert result.status == Status.FAIL and fragment in result.summary
    assert "download.pytorch.org/whl/cu124" in result.fix


def test_ptx_for_an_older_arch_counts_as_supported(tmp_path):
    facts = SoftwareFacts(torch_version="2.6", cuda_runtime="12.4", cuda_available=True, device_count=1,
                          arch_list=("sm_80", "compute_80"), capabilities=((9, 0),))
    assert software.cuda_torch_compat(make_host(tmp_path, FakeNvml([h100(0)]), software=facts), plan()).status == Status.PASS


def test_cuda_torch_compat_warns_on_mixed_wheels_debug_env_and_broken_flash_attn(tmp_path):
    facts = SoftwareFacts(torch_version="2.6", cuda_runtime="12.4", cuda_available=True, device_count=1, arch_list=("sm_90",),
                          capabilities=((9, 0),), cuda_wheels=("nvidia-cublas-cu11", "nvidia-cublas-cu12"),
                          flash_attn_error="ImportError: undefined symbol")
    host = make_host(tmp_path, FakeNvml([h100(0)]), software=facts, env={"CUDA_LAUNCH_BLOCKING": "1"})
    result = software.cuda_torch_compat(host, plan())
    assert result.status == Status.WARN
    text = " | ".join(result.details)
    assert "CUDA_LAUNCH_BLOCKING=1" in text and "several majors" in text and "does not import" in text
    assert result.fix == "pip install --no-build-isolation --force-reinstall flash-attn"  # the first warning's fix


def test_cuda_torch_compat_skips_without_gpus(tmp_path):
    assert software.cuda_torch_compat(make_host(tmp_path), plan()).status == Status.SKIP


# disk-space-model, cgroup-limits -----------------------------------------------------

def model_dir(tmp_path, size=3000):
    model = tmp_path / "models" / "m"
    model.mkdir(parents=True)
    (model / "model.safetensors").write_bytes(b"\0" * size)
    return model


def test_disk_space_model(tmp_path):
    model = model_dir(tmp_path)
    write_tree(tmp_path, {"/proc/mounts": f"/dev/nvme0n1 / ext4 rw 0 0\nserver:/export {tmp_path / 'models'} nfs4 rw 0 0\n"})
    roomy = make_host(tmp_path, disk_usage=lambda path: (10**6, 10**6))
    result = storage.disk_space_model(roomy, plan(model=model))
    assert result.status == Status.WARN and "nfs4" in result.summary
    (tmp_path / "proc/mounts").write_text("/dev/nvme0n1 / ext4 rw 0 0\n")
    assert storage.disk_space_model(roomy, plan(model=model)).status == Status.PASS
    tight = make_host(tmp_path, disk_usage=lambda path: (10**6, 1000))
    assert "for a" in storage.disk_space_model(tight, plan(model=model)).summary
    assert storage.disk_space_model(tight, plan(model=model)).status == Status.WARN


def test_disk_space_model_skips_without_model_and_fails_on_missing_path(tmp_path):
    assert storage.disk_space_model(make_host(tmp_path), plan()).status == Status.SKIP
    assert storage.disk_space_model(make_host(tmp_path), plan(model=tmp_path / "nope")).status == Status.FAIL


def test_cgroup_v2_limits(tmp_path):
    write_tree(tmp_path, {"/proc/self/cgroup": "0::/\n", "/sys/fs/cgroup/cgroup.controllers": "cpu memory\n",
                          "/sys/fs/cgroup/memory.max": "max\n", "/sys/fs/cgroup/cpu.max": "max 100000\n"})
    assert storage.cgroup_limits(make_host(tmp_path), plan()).status == Status.PASS
    (tmp_path / "sys/fs/cgroup/memory.max").write_text(f"{8 * GIB}\n")
    (tmp_path / "sys/fs/cgroup/cpu.max").write_text("200000 100000\n")
    result = storage.cgroup_limits(make_host(tmp_path, env={"KUBERNETES_SERVICE_HOST": "10.0.0.1"}), plan())
    assert result.status == Status.FAIL and "memory limit 8.0 GiB < 16.0 GiB" in result.summary
    assert "CPU quota 2 < 4 CPUs" in " ".join(result.details)
    assert result.observed["container"] == "kubernetes" and "pod spec" in result.fix


def test_cgroup_v1_limits_and_gpu_request(tmp_path):
    write_tree(tmp_path, {"/proc/self/cgroup": "5:memory:/docker/abc\n4:cpu,cpuacct:/docker/abc\n",
                          "/sys/fs/cgroup/memory/memory.limit_in_bytes": f"{64 * GIB}\n",
                          "/sys/fs/cgroup/cpu,cpuacct/cpu.cfs_quota_us": "800000\n", "/sys/fs/cgroup/cpu,cpuacct/cpu.cfs_period_us": "100000\n"})
    ok = storage.cgroup_limits(make_host(tmp_path, FakeNvml([h100(0), h100(1)]), env={"NVIDIA_VISIBLE_DEVICES": "0,1"}), plan())
    assert ok.status == Status.PASS and ok.observed["cpu_quota"] == 8
    short = storage.cgroup_limits(make_host(tmp_path, FakeNvml([h100(0)]), env={"NVIDIA_VISIBLE_DEVICES": "GPU-a,GPU-b"}), plan())
    assert short.status == Status.FAIL and "2 GPU(s) requested" in short.summary


def test_cgroup_limits_skip_without_cgroups(tmp_path):
    assert storage.cgroup_limits(make_host(tmp_path), plan()).status == Status.SKIP


# tp-rendezvous -----------------------------------------------------------------------

def test_tp_rendezvous_skips_at_one_rank(tmp_path):
    result = rendezvous.tp_rendezvous(shm_host(tmp_path, 16 * GIB), plan())
    assert result.status == Status.SKIP and "--tensor-parallel-size" in result.summary


def test_tp_rendezvous_passes_on_a_free_port_with_room(tmp_path):
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    result = rendezvous.tp_rendezvous(shm_host(tmp_path, 16 * GIB), plan(tensor_parallel_size=2, master_port=port))
    assert result.status == Status.PASS, result.summary
    assert f"port 127.0.0.1:{port} is free" in result.summary and "for 2 ranks" in result.summary


def test_tp_rendezvous_fails_on_a_port_another_process_listens_on(tmp_path):
    with socket.socket() as holder:
        holder.bind(("127.0.0.1", 0))
        holder.listen()
        port = holder.getsockname()[1]
        result = rendezvous.tp_rendezvous(shm_host(tmp_path, 16 * GIB), plan(tensor_parallel_size=2, master_port=port))
    assert result.status == Status.FAIL and f"127.0.0.1:{port} is in use" in result.summary
    assert f"sport = :{port}" in result.fix


def test_tp_rendezvous_fails_without_shm_room_for_the_ranks(tmp_path):
    host = shm_host(tmp_path, 64 << 20, **{"/.dockerenv": ""})
    result = rendezvous.tp_rendezvous(host, plan(tensor_parallel_size=4, master_port=0))
    assert result.status == Status.FAIL
    assert "/dev/shm has 64 MiB free, 4 ranks need 1024 MiB" in result.summary and "--ipc=host" in result.fix
    roomy = plan(tensor_parallel_size=4, master_port=0, thresholds=Thresholds(tp_shm_per_rank_mib=16))
    assert rendezvous.tp_rendezvous(host, roomy).status == Status.PASS


def test_tp_rendezvous_on_another_node_judges_shm_only(tmp_path):
    """192.0.2.1 (TEST-NET-1) is no address of this host: node 0 binds the port, this node cannot."""
    result = rendezvous.tp_rendezvous(shm_host(tmp_path, 16 * GIB),
                                      plan(tensor_parallel_size=2, master_addr="192.0.2.1", master_port=29500))
    assert result.status == Status.PASS and any("not an address of this host" in d for d in result.details)
