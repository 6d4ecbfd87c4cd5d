"""Checks made before any profiler starts, each failing with an actionable one-line error (exit 3):
the tool is installed, the platform is supported, the target PID exists and this process may
attach to it (Yama ptrace_scope, CAP_SYS_PTRACE, container hints). Also finds the process
listening on a TCP port, for `--port`."""

from __future__ import annotations

import importlib.util
import os
import shutil
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

from llmctl.errors import UserError

EXIT_PREFLIGHT = 3
INSTALL_HINT = "pip install 'llmctl[profile]'"
CAP_SYS_PTRACE = 19
TCP_LISTEN = "0A"
PROC = Path("/proc")


def fail(message: str) -> UserError:
    return UserError(message, exit_code=EXIT_PREFLIGHT)


def require_platform(tool: str, supported: tuple[str, ...]) -> None:
    if not sys.platform.startswith(supported):
        raise fail(f"{tool} is not supported on {sys.platform} (supported: {', '.join(supported)})")


def require_pyspy() -> str:
    require_platform("py-spy", ("linux", "darwin", "win32"))
    path = shutil.which("py-spy")
    if path is None:
        raise fail(f"py-spy is not installed (or not on PATH); install it with: {INSTALL_HINT}")
    return path


def tool_version(path: str, timeout_s: float = 10.0) -> Optional[str]:
    """The last word `path --version` prints (py-spy's, nsys's version number), or None."""
    try:
        out = subprocess.run([path, "--version"], capture_output=True, text=True, timeout=timeout_s).stdout
    except (OSError, subprocess.SubprocessError):
        return None
    return out.split()[-1] if out.split() else None


def require_memray() -> str:
    require_platform("memray", ("linux", "darwin"))
    if importlib.util.find_spec("memray") is None:
        raise fail(f"memray is not installed for {sys.executable}; install it with: {INSTALL_HINT}")
    from importlib.metadata import version

    return version("memray")


def require_debugger() -> None:
    """`memray attach` injects itself into the target through gdb or lldb."""
    if not (shutil.which("gdb") or shutil.which("lldb")):
        raise fail("memray attach needs gdb or lldb on PATH (e.g. apt-get install gdb); "
                   "or run the workload under llmctl instead: llmctl profile mem -- script.py")


def require_pid(pid: int) -> None:
    if pid <= 0:
        raise fail(f"--pid must be a positive process id, got {pid}")
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        raise fail(f"no process with PID {pid} (it may have exited; check with: ps -p {pid})") from None
    except PermissionError:
        pass  # it exists; whether we may trace it is attach_problem()'s question


@dataclass(frozen=True)
class AttachFacts:
    """What decides whether ptrace attach is allowed (Linux)."""

    ptrace_scope: Optional[int]  # None: no Yama LSM
    cap_sys_ptrace: bool
    uid: int
    target_uid: Optional[int]
    is_descendant: bool
    in_container: bool


def attach_problem(facts: AttachFacts) -> Optional[str]:
    """Why attaching would fail, following the kernel's Yama rules; None when it should work."""
    scope = facts.ptrace_scope
    if scope == 3:
        return ("ptrace is disabled on this host (kernel.yama.ptrace_scope = 3; only a reboot resets it); "
                "run the workload under llmctl instead of attaching")
    if facts.cap_sys_ptrace:
        return None
    hint = _container_hint(facts.in_container)
    if facts.target_uid is not None and facts.target_uid != facts.uid:
        return f"the target runs as uid {facts.target_uid}, not as you (uid {facts.uid}); run llmctl with sudo{hint}"
    if scope == 2:
        return f"kernel.yama.ptrace_scope = 2 allows attaching only with CAP_SYS_PTRACE; run llmctl with sudo{hint}"
    if scope == 1 and not facts.is_descendant:
        return ("kernel.yama.ptrace_scope = 1 allows attaching only to your own child processes; run llmctl with "
                f"sudo, or 'sudo sysctl kernel.yama.ptrace_scope=0', or start the workload under llmctl{hint}")
    return None


def _container_hint(in_container: bool) -> str:
    if not in_container:
        return ""
    return ("; in a container add the capability: 'docker run --cap-add SYS_PTRACE ...' or, on Kubernetes, "
            "securityContext.capabilities.add: [SYS_PTRACE], or attach from a debug container: "
            "'kubectl debug -it POD --image=IMAGE --target=CONTAINER --profile=general'")


def attach_facts(pid: int, proc: Path = PROC) -> AttachFacts:
    return AttachFacts(
        ptrace_scope=_read_int(proc / "sys/kernel/yama/ptrace_scope"),
        cap_sys_ptrace=_has_cap(proc / "self/status", CAP_SYS_PTRACE),
        uid=os.geteuid(),
        target_uid=_status_uid(proc / str(pid) / "status"),
        is_descendant=_is_descendant(pid, os.getpid(), proc),
        in_container=in_container(proc),
    )


def require_attach(pid: int) -> None:
    """The PID exists and (on Linux) this process may ptrace it."""
    require_pid(pid)
    if sys.platform.startswith("linux"):
        problem = attach_problem(attach_facts(pid))
        if problem:
            raise fail(f"not permitted to attach to PID {pid}: {problem}")


def in_container(proc: Path = PROC) -> bool:
    if Path("/.dockerenv").exists() or Path("/run/.containerenv").exists() or os.environ.get("KUBERNETES_SERVICE_HOST"):
        return True
    try:
        cgroup = (proc / "1/cgroup").read_text()
    except OSError:
        return False
    return any(word in cgroup for word in ("docker", "kubepods", "containerd", "libpod"))


def _read_int(path: Path) -> Optional[int]:
    try:
        return int(path.read_text().strip())
    except (OSError, ValueError):
        return None


def _status_field(path: Path, name: str) -> Optional[str]:
    try:
        for line in path.read_text().splitlines():
            if line.startswith(name + ":"):
                return line.split(":", 1)[1].strip()
    except OSError:
        return None
    return None


def _has_cap(status: Path, bit: int) -> bool:
    value = _status_field(status, "CapEff")
    return value is not None and bool(int(value, 16) >> bit & 1)


def _status_uid(status: Path) -> Optional[int]:
    value = _status_field(status, "Uid")
    return int(value.split()[1]) if value else None  # effective uid


def _parent(pid: int, proc: Path) -> Optional[int]:
    value = _status_field(proc / str(pid) / "status", "PPid")
    return int(value) if value else None


def _is_descendant(pid: int, ancestor: int, proc: Path) -> bool:
    seen = set()
    while pid and pid not in seen:
        if pid == ancestor:
            return True
        seen.add(pid)
        pid = _parent(pid, proc) or 0
    return False


def pid_for_port(port: int, proc: Path = PROC) -> int:
    """The PID of the process listening on TCP `port` (IPv4 or IPv6): socket inode -> /proc/*/fd."""
    if not sys.platform.startswith("linux"):
        raise fail("--port needs Linux /proc; give --pid instead")
    if not 0 < port < 65536:
        raise UserError(f"--port must be 1-65535, got {port}")
    inodes = listening_inodes(port, proc)
    if not inodes:
        raise fail(f"nothing is listening on TCP port {port} (is 'llmctl serve' running? check with: ss -ltnp)")
    pids = sorted(_pids_holding(inodes, proc))
    if not pids:
        raise fail(f"port {port} is open but its process is not visible (another user's or another PID "
                   "namespace); run with sudo or give --pid")
    return pids[0]


def listening_inodes(port: int, proc: Path = PROC) -> set[str]:
    found: set[str] = set()
    for table in ("net/tcp", "net/tcp6"):
        try:
            lines = (proc / table).read_text().splitlines()[1:]
        except OSError:
            continue
        for line in lines:
            cols = line.split()
            if len(cols) > 9 and cols[3] == TCP_LISTEN and int(cols[1].rsplit(":", 1)[1], 16) == port:
                found.add(cols[9])
    found.discard("0")
    return found


def _pids_holding(inodes: set[str], proc: Path) -> set[int]:
    targets = {f"socket:[{inode}]" for inode in inodes}
    pids: set[int] = set()
    for entry in proc.iterdir():
        if not entry.name.isdigit():
            continue
        try:
            fds = list((entry / "fd").iterdir())
        except OSError:
            continue
        for fd in fds:
            try:
                if os.readlink(fd) in targets:
                    pids.add(int(entry.name))
                    break
            except OSError:
                continue
    return pids


def attach_target(pid: Optional[int], port: Optional[int], workload: Optional[list[str]], *,
                  allow_workload: bool = True) -> Optional[int]:
    """Exactly one of --pid, --port or a workload; returns the PID to attach to (None: a workload)."""
    given = [name for name, value in (("--pid", pid), ("--port", port), ("a workload", workload)) if value]
    if len(given) != 1:
        what = "--pid, --port or a workload after --" if allow_workload else "--pid or --port"
        raise UserError(f"give one of {what} (got {', '.join(given) or 'none'})")
    if workload and not allow_workload:
        raise UserError("this mode attaches to a running process: give --pid or --port")
    if workload:
        return None
    target = pid_for_port(port) if port is not None else pid
    require_attach(target)
    return target


def require_command(workload: list[str]) -> None:
    if not (shutil.which(workload[0]) or (os.sep in workload[0] and os.path.exists(workload[0]))):
        raise UserError(f"workload command not found: {workload[0]}")
