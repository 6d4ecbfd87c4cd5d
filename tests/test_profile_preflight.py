"""Preflight rules (Yama ptrace_scope, CAP_SYS_PTRACE, container hints, port -> PID through a fake /proc),
the artifact folder naming and the manifest file."""

from __future__ import annotations

import datetime as dt
import json
import os
from pathlib import Path

import pytest

from llmctl.errors import UserError
from llmctl.profiling import preflight
from llmctl.profiling.artifacts import Manifest, default_output_dir, prepare_output_dir
from llmctl.profiling.preflight import AttachFacts, attach_problem


def facts(**overrides) -> AttachFacts:
    base = dict(ptrace_scope=1, cap_sys_ptrace=False, uid=1000, target_uid=1000, is_descendant=False, in_container=False)
    return AttachFacts(**{**base, **overrides})


@pytest.mark.parametrize("overrides, expected", [
    (dict(ptrace_scope=0), None),
    (dict(ptrace_scope=None), None),  # no Yama: classic same-uid rule
    (dict(ptrace_scope=1, is_descendant=True), None),
    (dict(ptrace_scope=1), "ptrace_scope = 1"),
    (dict(ptrace_scope=2), "ptrace_scope = 2"),
    (dict(ptrace_scope=2, cap_sys_ptrace=True), None),
    (dict(ptrace_scope=3, cap_sys_ptrace=True), "ptrace_scope = 3"),
    (dict(ptrace_scope=0, target_uid=0), "runs as uid 0"),
    (dict(ptrace_scope=0, target_uid=0, cap_sys_ptrace=True), None),
])
def test_attach_rules(overrides, expected):
    problem = attach_problem(facts(**overrides))
    if expected is None:
        assert problem is None
    else:
        assert problem is not None and expected in problem


def test_container_hint_names_the_capability_and_kubectl_debug():
    problem = attach_problem(facts(ptrace_scope=2, in_container=True))
    assert "--cap-add SYS_PTRACE" in problem and "kubectl debug" in problem
    assert "--cap-add" not in attach_problem(facts(ptrace_scope=2))


def test_attach_facts_read_from_proc(tmp_path):
    proc = tmp_path / "proc"
    (proc / "sys/kernel/yama").mkdir(parents=True)
    (proc / "sys/kernel/yama/ptrace_scope").write_text("2\n")
    (proc / "self").mkdir()
    (proc / "self/status").write_text("Name:\tx\nCapEff:\t00000000a80425fb\n")  # docker's default set: no bit 19
    (proc / "4242").mkdir()
    (proc / "4242/status").write_text(f"Name:\tpy\nPPid:\t1\nUid:\t0\t{os.geteuid()}\t0\t0\n")
    got = preflight.attach_facts(4242, proc)
    assert got.ptrace_scope == 2 and got.cap_sys_ptrace is False and got.target_uid == os.geteuid()
    assert got.is_descendant is False
    (proc / "self/status").write_text("CapEff:\t000001ffffffffff\n")
    assert preflight.attach_facts(4242, proc).cap_sys_ptrace is True


def _fake_proc(tmp_path: Path, port: int, inode: str, pid: int, v6: bool = False) -> Path:
    proc = tmp_path / "proc"
    (proc / "net").mkdir(parents=True)
    header = "  sl  local_address rem_address   st tx_queue rx_queue tr tm->when retrnsmt   uid  timeout inode\n"
    listen = f"   0: 0100007F:{port:04X} 00000000:0000 0A 00000000:00000000 00:00000000 00000000  1000        0 {inode} 1\n"
    other = f"   1: 0100007F:{port:04X} 0100007F:9999 01 00000000:00000000 00:00000000 00000000  1000        0 777 1\n"
    (proc / "net/tcp6" if v6 else proc / "net/tcp").write_text(header + listen + other)
    (proc / "net/tcp" if v6 else proc / "net/tcp6").write_text(header)
    fd = proc / str(pid) / "fd"
    fd.mkdir(parents=True)
    os.symlink(f"socket:[{inode}]", fd / "5")
    os.symlink("/dev/null", fd / "0")
    (proc / "999" / "fd").mkdir(parents=True)
    os.symlink("socket:[777]", proc / "999/fd/3")  # an established connection, not the listener
    return proc


@pytest.mark.parametrize("v6", [False, True])
def test_port_to_pid_through_socket_inode(tmp_path, v6):
    proc = _fake_proc(tmp_path, 8000, "123456", 4321, v6)
    assert preflight.listening_inodes(8000, proc) == {"123456"}
    assert preflight.pid_for_port(8000, proc) == 4321
    with pytest.raises(UserError, match="nothing is listening on TCP port 8001") as err:
        preflight.pid_for_port(8001, proc)
    assert err.value.exit_code == 3


def test_output_dir_is_timestamped_and_never_reused(tmp_path):
    now = dt.datetime(2026, 1, 2, 3, 4, 5)
    first = default_output_dir("cpu", now, root=tmp_path)
    assert first.name == "cpu-20260102-030405"
    first.mkdir()
    assert default_output_dir("cpu", now, root=tmp_path).name == "cpu-20260102-030405-2"
    (tmp_path / "file").write_text("x")
    with pytest.raises(UserError, match="not a folder"):
        prepare_output_dir(tmp_path / "file", "cpu")


def test_manifest_lists_only_written_files(tmp_path):
    manifest = Manifest(kind="cpu", tool="py-spy", tool_version="0.4.3", command=["py-spy", "record"], output_dir=tmp_path)
    (tmp_path / "flamegraph.svg").write_text("<svg/>")
    manifest.add_file(tmp_path / "flamegraph.svg")
    manifest.add_file(tmp_path / "never-written.txt")
    manifest.finish("ok", 0)
    data = json.loads(manifest.write().read_text())
    assert data["files"] == ["flamegraph.svg", "manifest.json"]
    assert data["tool"] == {"name": "py-spy", "version": "0.4.3"} and data["status"] == "ok"
    assert data["duration_s"] >= 0 and not list(tmp_path.glob("*.tmp"))


def test_missing_memray_is_exit_3_with_install_hint(monkeypatch, capsys):
    from llmctl.cli import run

    real = preflight.importlib.util.find_spec
    monkeypatch.setattr(preflight.importlib.util, "find_spec", lambda name, *a: None if name == "memray" else real(name, *a))
    assert run(["profile", "mem", "--", "x.py"]) == 3
    assert "memray is not installed" in capsys.readouterr().err


def test_memray_target_forms(tmp_path):
    from llmctl.profiling.memray_tools import memray_target

    script = tmp_path / "work.py"
    script.write_text("print(1)\n")
    assert memray_target([str(script), "a"]) == [str(script), "a"]
    assert memray_target(["python3", str(script)]) == [str(script)]
    assert memray_target(["-m", "json.tool", "x"]) == ["-m", "json.tool", "x"]
    console_script = tmp_path / "tool"
    console_script.write_text("#!/usr/bin/env python3\nprint(1)\n")
    assert memray_target([str(console_script)]) == [str(console_script)]
    with pytest.raises(UserError, match="Python programs"):
        memray_target(["/bin/sh", "-c", "true"])
