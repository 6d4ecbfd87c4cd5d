"""`llmctl profile cpu` end to end with the real py-spy: a workload llmctl starts, an attached child
process (by --pid and by --port), dumps, exit statuses, Ctrl-C and the bad-input errors."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
from ctrl_c import sigint_as_in_a_terminal

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="py-spy attach tests need Linux")

SPIN = textwrap.dedent("""
    import sys, time
    def spin_in_marked_function(seconds):
        end = time.time() + seconds
        x = 0
        while time.time() < end:
            x += 1
    spin_in_marked_function(float(sys.argv[1]))
    sys.exit(int(sys.argv[2]) if len(sys.argv) > 2 else 0)
""")

SERVER = textwrap.dedent("""
    import socket, sys, time
    sock = socket.socket(socket.AF_INET6 if sys.argv[1] == "6" else socket.AF_INET)
    sock.bind(("::1" if sys.argv[1] == "6" else "127.0.0.1", 0))
    sock.listen()
    print(sock.getsockname()[1], flush=True)
    def busy_server_loop():
        end = time.time() + 30
        while time.time() < end:
            sum(range(1000))
    busy_server_loop()
""")


def llmctl(*args: str, timeout: float = 120) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if not k.startswith("LLMCTL_")}
    return subprocess.run([sys.executable, "-m", "llmctl.cli", "profile", *args], capture_output=True, text=True,
                          env={**env, "NO_COLOR": "1"}, timeout=timeout)


@pytest.fixture
def spin_script(tmp_path) -> Path:
    path = tmp_path / "spin.py"
    path.write_text(SPIN)
    return path


@pytest.fixture
def child(tmp_path):
    """A Python process that is not llmctl's child: llmctl must attach to it."""
    started: list[subprocess.Popen] = []

    def start(source: str, *args: str) -> subprocess.Popen:
        path = tmp_path / f"child{len(started)}.py"
        path.write_text(source)
        proc = subprocess.Popen([sys.executable, str(path), *args], stdout=subprocess.PIPE, text=True)
        started.append(proc)
        return proc

    yield start
    for proc in started:
        proc.kill()
        proc.wait()


def test_workload_flamegraph_names_the_hot_function(spin_script, tmp_path):
    out = tmp_path / "prof"
    proc = llmctl("cpu", "--rate", "50", "--output-dir", str(out), "--", sys.executable, str(spin_script), "1.0")
    assert proc.returncode == 0, proc.stderr
    svg = (out / "flamegraph.svg").read_text()
    assert "spin_in_marked_function" in svg
    manifest = json.loads((out / "manifest.json").read_text())
    assert manifest["status"] == "ok" and manifest["exit_status"] == 0
    assert manifest["command"][1:3] == ["record", "--pid"] and manifest["target_pids"] == [int(manifest["command"][3])]
    assert manifest["workload_command"][-2:] == [str(spin_script), "1.0"]
    assert {"flamegraph.svg", "manifest.json", "py-spy.log"} <= set(manifest["files"])
    assert manifest["result"]["samples"] > 10 and 0.9 < manifest["duration_s"] < 30


def test_failing_workload_fails_llmctl_and_json_is_only_the_manifest(spin_script, tmp_path):
    out = tmp_path / "prof"
    proc = llmctl("cpu", "--format", "speedscope", "--json", "-o", str(out), "--",
                  sys.executable, str(spin_script), "0.5", "7")
    assert proc.returncode == 1
    assert "workload failed (exit status 7)" in proc.stderr and "Traceback" not in proc.stderr
    manifest = json.loads(proc.stdout)  # nothing else on stdout
    assert manifest["status"] == "workload_failed" and manifest["exit_status"] == 7
    speedscope = json.loads((out / "profile.speedscope.json").read_text())
    names = {frame["name"] for frame in speedscope["shared"]["frames"]}
    assert "spin_in_marked_function" in names


def test_attach_by_pid_for_a_duration(child, tmp_path):
    target = child(SPIN, "20")
    out = tmp_path / "prof"
    proc = llmctl("cpu", "--pid", str(target.pid), "--duration", "1", "--format", "raw", "--json", "-o", str(out))
    assert proc.returncode == 0, proc.stderr
    manifest = json.loads(proc.stdout)
    assert manifest["target_pids"] == [target.pid] and manifest["workload_command"] is None
    assert "spin_in_marked_function" in (out / "profile.txt").read_text()
    assert target.poll() is None  # attaching for a while leaves the target running


@pytest.mark.parametrize("family", ["4", "6"])
def test_port_finds_the_listening_process_and_dump_shows_its_stack(child, tmp_path, family):
    server = child(SERVER, family)
    port = server.stdout.readline().strip()
    proc = llmctl("cpu", "--port", port, "--dump", "--json", "-o", str(tmp_path / "dump"))
    assert proc.returncode == 0, proc.stderr
    manifest = json.loads(proc.stdout)
    assert manifest["target_pids"] == [server.pid]
    frames = {frame["name"] for thread in manifest["result"]["stacks"] for frame in thread["frames"]}
    assert "busy_server_loop" in frames
    text = llmctl("cpu", "--pid", str(server.pid), "--dump", "-o", str(tmp_path / "dump2"))
    assert text.returncode == 0 and "busy_server_loop" in text.stdout


def test_ctrl_c_keeps_the_profile_and_writes_the_manifest(spin_script, tmp_path):
    out = tmp_path / "prof"
    proc = subprocess.Popen([sys.executable, "-m", "llmctl.cli", "profile", "cpu", "-o", str(out), "--",
                             sys.executable, str(spin_script), "30"], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, start_new_session=True, preexec_fn=sigint_as_in_a_terminal)
    deadline = time.time() + 30
    while not (out / "py-spy.log").exists() and time.time() < deadline:
        time.sleep(0.1)
    time.sleep(1.5)
    os.killpg(proc.pid, signal.SIGINT)  # what a terminal's Ctrl-C does: the whole group
    _, stderr = proc.communicate(timeout=60)
    assert proc.returncode == 130, stderr
    manifest = json.loads((out / "manifest.json").read_text())
    assert manifest["status"] == "interrupted"
    assert "spin_in_marked_function" in (out / "flamegraph.svg").read_text()


def test_dry_run_prints_the_command_and_runs_nothing(spin_script, tmp_path):
    proc = llmctl("cpu", "--dry-run", "--native", "--rate", "7", "-o", str(tmp_path / "x"), "--", "python", str(spin_script))
    assert proc.returncode == 0, proc.stderr
    lines = proc.stdout.splitlines()
    assert lines[0].startswith(f"python {spin_script}")
    assert "record --pid '<workload-pid>'" in lines[1] and "--rate 7 --native" in lines[1]
    assert not (tmp_path / "x").exists()


@pytest.mark.parametrize("args, code, message", [
    (("cpu", "--pid", "999999"), 3, "no process with PID 999999"),
    (("cpu", "--pid", "1", "--top"), 2, "needs a TTY"),
    (("cpu", "--pid", "1", "--format", "pprof"), 2, "'pprof' is not one of"),
    (("cpu",), 2, "give one of --pid, --port or a workload"),
    (("cpu", "--dump", "--", "python", "x.py"), 2, "give --pid or --port"),
    (("cpu", "--", "no-such-command-xyz"), 2, "command not found: no-such-command-xyz"),
    (("cpu", "--port", "1"), 3, "nothing is listening on TCP port 1"),
])
def test_bad_input_is_one_line(args, code, message):
    proc = llmctl(*args)
    assert proc.returncode == code, proc.stderr
    assert message in proc.stderr and proc.stderr.count("\n") == 1 and "Traceback" not in proc.stderr


def test_missing_py_spy_is_exit_3_with_install_hint(tmp_path):
    env = {k: v for k, v in os.environ.items() if not k.startswith("LLMCTL_")}
    env["PATH"] = str(tmp_path)  # an empty folder: no py-spy anywhere
    proc = subprocess.run([sys.executable, "-m", "llmctl.cli", "profile", "cpu", "--pid", str(os.getpid())],
                          capture_output=True, text=True, env=env, timeout=60)
    assert proc.returncode == 3
    assert "py-spy is not installed" in proc.stderr and "pip install 'llmctl[profile]'" in proc.stderr


def test_top_runs_live_on_a_terminal(child):
    """--top on a pseudo-terminal shows the target's hot function; Ctrl-C leaves it cleanly."""
    import pty
    import select

    target = child(SPIN, "20")
    pid, fd = pty.fork()
    if pid == 0:  # the child: llmctl with the pty as its terminal
        os.execvp(sys.executable, [sys.executable, "-m", "llmctl.cli", "profile", "cpu", "--top", "--pid", str(target.pid)])
    screen, deadline = b"", time.time() + 30
    while b"spin_in_marked_function" not in screen and time.time() < deadline:
        if select.select([fd], [], [], 0.2)[0]:
            try:
                screen += os.read(fd, 65536)
            except OSError:
                break
    os.kill(pid, signal.SIGINT)
    _, status = os.waitpid(pid, 0)
    os.close(fd)
    assert b"spin_in_marked_function" in screen
    assert os.waitstatus_to_exitcode(status) == 0


def test_yaml_config_and_env_fill_flags(spin_script, tmp_path):
    config = tmp_path / "cpu.yaml"
    config.write_text("format: speedscope\nrate: 33\nnative: true\n")
    env = {k: v for k, v in os.environ.items() if not k.startswith("LLMCTL_")}
    proc = subprocess.run([sys.executable, "-m", "llmctl.cli", "profile", "cpu", "--config", str(config), "--dry-run",
                           "--json", "--", "python", str(spin_script)], capture_output=True, text=True,
                          env={**env, "LLMCTL_RATE": "44"}, timeout=60)
    assert proc.returncode == 0, proc.stderr
    command = json.loads(proc.stdout)["command"]
    assert command[command.index("--format") + 1] == "speedscope" and "--native" in command
    assert command[command.index("--rate") + 1] == "44"  # env beats the YAML file
