"""`llmctl serve --tensor-parallel-size 2` as users run it (issue 17): real processes on this machine,
gloo ranks, the embedded model, the real openai client. SIGTERM drains and leaves no rank behind; a
killed rank makes the server unhealthy and exit non-zero; a two-node launch simulated with two
commands on 127.0.0.1 serves a completion. `--pipeline-parallel-size 2` (issue 43) serves TP=1's greedy
text, and a rank killed mid-stream ends the stream in an engine_dead error and the server with exit 1."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time

import httpx
import openai
from server_helpers import free_port

START_TIMEOUT_S = 120  # two ranks load under contention on a 2-core host


def _env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("LLMCTL_")}
    return {**env, "NO_COLOR": "1"}


def _serve(*args: str, port: int | None = None) -> subprocess.Popen:
    http = ["--port", str(port)] if port is not None else []
    return subprocess.Popen([sys.executable, "-m", "llmctl.cli", "serve", *http, "--max-model-len", "128",
                             "--max-num-seqs", "4", *args],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=_env())


def _wait_healthy(proc: subprocess.Popen, base: str) -> None:
    deadline = time.monotonic() + START_TIMEOUT_S
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise AssertionError(f"server exited {proc.returncode}: {proc.stderr.read()}")
        try:
            if httpx.get(base + "/health", timeout=1).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.2)
    proc.kill()
    raise AssertionError(f"server did not become healthy: {proc.stderr.read() if proc.poll() is not None else ''}")


def _children(pid: int) -> list[int]:
    """The live processes whose parent is `pid` (Linux /proc)."""
    found = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as stat:
                    fields = stat.read().rsplit(")", 1)[1].split()
            except OSError:
                continue
            if int(fields[1]) == pid and fields[0] != "Z":
                found.append(int(entry))
    return found


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as stat:
            return stat.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def _rank_pids(pid: int) -> list[int]:
    """The server's rank processes: its children started by torch.multiprocessing's spawn (the resource
    tracker, also a child, runs another main)."""
    ranks = []
    for child in _children(pid):
        try:
            with open(f"/proc/{child}/cmdline", "rb") as cmdline:
                if b"spawn_main" in cmdline.read():
                    ranks.append(child)
        except OSError:
            continue
    return ranks


def _complete(base: str) -> str:
    client = openai.OpenAI(base_url=base + "/v1", api_key="unused", timeout=60)
    completion = client.completions.create(model=client.models.list().data[0].id, prompt="To be, or not",
                                           max_tokens=8, temperature=0.0)
    return completion.choices[0].text


def test_serve_tp2_answers_the_openai_client_and_sigterm_stops_every_rank():
    port = free_port()
    proc = _serve("--tensor-parallel-size", "2", port=port)
    base = f"http://127.0.0.1:{port}"
    try:
        _wait_healthy(proc, base)
        ranks = _rank_pids(proc.pid)
        assert len(ranks) == 1  # rank 1; rank 0 is the server itself
        assert _complete(base)
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(60) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
    assert not [pid for pid in ranks if _alive(pid)]


@contextlib.contextmanager
def _healthy_server_of_two_ranks(*args: str):
    """A server of two ranks once healthy: (the server process, its base URL, the pid of rank 1); killed on
    the way out if still running."""
    port = free_port()
    proc = _serve(*args, port=port)
    base = f"http://127.0.0.1:{port}"
    try:
        _wait_healthy(proc, base)
        (rank,) = _rank_pids(proc.pid)
        yield proc, base, rank
    finally:
        if proc.poll() is None:
            proc.kill()


def test_a_killed_rank_makes_the_server_unhealthy_then_exit_non_zero():
    with _healthy_server_of_two_ranks("-tp", "2") as (proc, base, rank):
        os.kill(rank, signal.SIGKILL)
        killed = time.monotonic()
        statuses = []
        while proc.poll() is None and time.monotonic() - killed < 60:
            try:
                statuses.append(httpx.get(base + "/health", timeout=2).status_code)
            except httpx.HTTPError:
                pass
            time.sleep(0.2)
        assert proc.wait(5) == 1
        assert time.monotonic() - killed < 60
    assert 503 in statuses
    assert "rank 1" in proc.stderr.read()


def test_two_node_launch_on_this_machine_serves_a_completion():
    master = free_port()
    port = free_port()
    common = ("--tensor-parallel-size", "2", "--nnodes", "2", "--master-addr", "127.0.0.1", "--master-port",
              str(master))
    node1 = _serve(*common, "--node-rank", "1")
    node0 = _serve(*common, "--node-rank", "0", port=port)
    base = f"http://127.0.0.1:{port}"
    try:
        _wait_healthy(node0, base)
        assert _complete(base)
        node0.send_signal(signal.SIGTERM)
        assert node0.wait(60) == 0
        assert node1.wait(30) == 0  # node 1's ranks stop when rank 0 does
    finally:
        for proc in (node0, node1):
            if proc.poll() is None:
                proc.kill()
    assert "node 1 of 2: ranks 1-1 joining 127.0.0.1" in node1.stderr.read()


def test_under_torchrun_each_process_is_one_rank_and_rank_0_serves():
    """torchrun's environment (RANK, WORLD_SIZE, MASTER_ADDR/PORT, ...) places the ranks: llmctl starts
    none itself; rank 1 runs the model only. Stopping torchrun stops both ranks."""
    port = free_port()
    agent = subprocess.Popen([sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2",
                              "--master-addr", "127.0.0.1", "--master-port", str(free_port()), "-m", "llmctl.cli",
                              "serve", "--port", str(port), "--max-model-len", "128", "--max-num-seqs", "4"],
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=_env())
    base = f"http://127.0.0.1:{port}"
    try:
        _wait_healthy(agent, base)
        ranks = _children(agent.pid)
        assert len(ranks) == 2 and not [pid for pid in ranks if _rank_pids(pid)]  # llmctl spawned no rank
        assert _complete(base)
        agent.send_signal(signal.SIGTERM)
        agent.wait(60)  # torchrun's own exit status for a signalled run
    finally:
        if agent.poll() is None:
            agent.kill()
    assert not [pid for pid in ranks if _alive(pid)]
    assert "node 0 of 1: rank 1 (torchrun) joining 127.0.0.1" in agent.stderr.read()


def test_serve_pp2_a_rank_killed_mid_request_fails_the_client_and_the_server_exits_non_zero():
    """Two pipeline stages: the embedded model's greedy completion, then rank 1 (the last stage) is killed
    while a streamed completion runs: the stream ends in an engine_dead error naming the rank, and the server
    exits 1 with no rank left, within the collective timeout."""
    with _healthy_server_of_two_ranks("--pipeline-parallel-size", "2") as (proc, base, rank):
        assert _complete(base) == " my lord,\nAnd, by my"  # TP=1's greedy text
        body = {"model": "llmctl-default", "prompt": "To be", "max_tokens": 120, "temperature": 0.0,
                "ignore_eos": True, "stream": True}
        events = []
        with httpx.stream("POST", base + "/v1/completions", json=body, timeout=60) as response:
            for line in response.iter_lines():
                events.append(line)
                if len(events) == 1:
                    os.kill(rank, signal.SIGKILL)
                    killed = time.monotonic()
        errors = [e for e in events if e.startswith('data: {"error"')]
        assert len(errors) == 1 and "rank 1" in errors[0] and '"code": "engine_dead"' in errors[0]
        assert not [e for e in events if '"finish_reason": "length"' in e]  # the completion never finished
        assert proc.wait(60) == 1
        assert time.monotonic() - killed < 60
    assert not _alive(rank)
