"""`llmctl profile server` end to end against real `llmctl serve` subprocesses on loopback: one with
--profile-dir and an API key (shared by the module), one without --profile-dir. Checks the trace the
server writes is copied, loads as gzipped Chrome JSON and names matmul/linear ops; the load summary;
the key, 404 and 409 refusals; that /stop_profile runs after a failed or interrupted load; that
--dry-run sends nothing; and the unreachable-server error."""

from __future__ import annotations

import gzip
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

from ctrl_c import sigint_as_in_a_terminal
from server_helpers import free_port

KEY = "sk-profile-test"
AUTH = {"Authorization": f"Bearer {KEY}"}
MATMUL_OPS = ("llmctl::gemm_amx_bf16", "llmctl::gemv_bf16", "llmctl::decode_stack", "aten::mm", "aten::linear", "aten::bmm", "aten::addmm", "aten::matmul", "mkldnn::_linear_pointwise")
SMALL_LOAD = ("--random-input-len", "8", "--random-output-len", "8")


def _env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("LLMCTL_") and k != "OPENAI_API_KEY"}
    return {**env, "NO_COLOR": "1", **extra}


def _command(*args: str) -> list[str]:
    return [sys.executable, "-m", "llmctl.cli", "profile", "server", *args]


def llmctl(*args: str, **env: str) -> subprocess.CompletedProcess:
    return subprocess.run(_command(*args), capture_output=True, text=True, env=_env(**env), timeout=120)


class Server:
    def __init__(self, *args: str):
        self.port = free_port()
        self.base = f"http://127.0.0.1:{self.port}"
        self.proc = subprocess.Popen([sys.executable, "-m", "llmctl.cli", "serve", "--port", str(self.port), *args],
                                     stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, env=_env())
        deadline = time.monotonic() + 90
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise AssertionError(f"server exited: {self.proc.stderr.read()}")
            try:
                if httpx.get(self.base + "/health", timeout=1).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.1)
        self.stop()
        raise AssertionError("server did not become healthy")

    def stop(self) -> None:
        self.proc.terminate()
        self.proc.wait(30)

    def http_counts(self) -> dict[str, float]:
        """llmctl:http_requests_total by (endpoint, status), leaving out the /metrics scrapes themselves."""
        counts = {}
        for line in httpx.get(self.base + "/metrics", timeout=5).text.splitlines():
            if line.startswith("llmctl:http_requests_total{") and 'endpoint="/metrics"' not in line:
                labels, value = line.rsplit(" ", 1)
                counts[labels] = float(value)
        return counts

    def is_recording(self) -> bool:
        """True when a profile is running (and then it is stopped): /stop_profile answers 409 otherwise."""
        return httpx.post(self.base + "/stop_profile", headers=AUTH, timeout=60).status_code == 200


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    traces = tmp_path_factory.mktemp("server-traces")
    running = Server("--profile-dir", str(traces), "--api-key", KEY)
    running.traces = traces
    yield running
    running.stop()


def _traces(server: Server) -> set[str]:
    return {p.name for p in server.traces.iterdir()}


def test_profiles_a_load_and_copies_a_readable_trace(server, tmp_path):
    out = tmp_path / "prof"
    proc = llmctl("--port", str(server.port), "--api-key", KEY, "--num-prompts", "4", *SMALL_LOAD,
                  "--row-limit", "40", "--json", "-o", str(out))
    assert proc.returncode == 0, proc.stderr
    manifest = json.loads(proc.stdout)
    assert manifest == json.loads((out / "manifest.json").read_text())
    assert manifest["status"] == "ok" and manifest["kind"] == "server"
    assert manifest["tool"]["name"] == "torch.profiler (via llmctl serve)" and manifest["tool"]["version"]
    assert manifest["target_pids"] == [server.proc.pid]
    assert KEY not in proc.stdout and "***" in manifest["command"]
    result = manifest["result"]
    assert result["server"] == server.base and result["profile_dir"] == str(server.traces)
    load = result["load"]
    assert (load["completed"], load["failed"]) == (4, 0) and load["total_output_tokens"] == 4 * 8
    assert 0 < load["ttft_ms"]["p50"] <= load["ttft_ms"]["p99"] and load["request_throughput"] > 0
    [remote] = result["server_traces"]
    assert Path(remote).parent == server.traces and Path(remote).exists()
    [trace] = result["traces"]
    local = out / trace["local_copy"]
    assert local.read_bytes() == Path(remote).read_bytes() and trace["local_copy"] in manifest["files"]
    events = json.load(gzip.open(local))["traceEvents"]
    names = {e.get("name", "") for e in events if e.get("cat") in ("cpu_op", "user_annotation")}  # llmctl:: labels
    assert any(op in name for name in names for op in MATMUL_OPS)
    summary = trace["summary"]
    assert summary["events"] == len(events) and summary["span_ms"] > 0
    top = summary["top_ops"]
    assert len(top) <= 40 and any(op in row["name"] for row in top for op in MATMUL_OPS)
    assert [row["total_ms"] for row in top] == sorted((row["total_ms"] for row in top), reverse=True)
    assert not server.is_recording()


def test_text_report_takes_the_key_from_the_environment(server, tmp_path):
    proc = llmctl("--base-url", server.base + "/v1", "--endpoint", "chat", "--num-prompts", "2", *SMALL_LOAD,
                  "-o", str(tmp_path / "p"), OPENAI_API_KEY=KEY)
    assert proc.returncode == 0, proc.stderr
    assert "2 completed, 0 failed" in proc.stdout and "TTFT p50" in proc.stdout
    assert "copied to" in proc.stdout and "CPU ops by total time" in proc.stdout
    assert f"manifest: {tmp_path / 'p' / 'manifest.json'}" in proc.stderr


def test_missing_or_wrong_key_and_busy_profiler_are_refused(server, tmp_path):
    before = _traces(server)
    for args, message in (((), "requires an API key: pass --api-key"), (("--api-key", "wrong"), "rejected the API key")):
        proc = llmctl("--port", str(server.port), *args, "-o", str(tmp_path / "none"))
        assert proc.returncode == 3 and message in proc.stderr, proc.stderr
        assert proc.stderr.count("\n") == 1 and not (tmp_path / "none").exists()
    assert httpx.post(server.base + "/start_profile", headers=AUTH, timeout=60).status_code == 200
    busy = llmctl("--port", str(server.port), "--api-key", KEY)
    assert busy.returncode == 3 and "already recording" in busy.stderr and "/stop_profile" in busy.stderr
    assert server.is_recording()  # the refused run left our recording alone; stopping it wrote one trace
    assert len(_traces(server) - before) == 1


def test_a_failed_load_still_stops_the_profiler(server, tmp_path):
    # 1000 random words exceed the embedded model's 512-token context: every request gets HTTP 400.
    proc = llmctl("--port", str(server.port), "--api-key", KEY, "--num-prompts", "3", "--random-input-len", "1000",
                  "--json", "-o", str(tmp_path / "f"))
    assert proc.returncode == 1
    assert "all 3 load requests failed (HTTP 400" in proc.stderr
    manifest = json.loads(proc.stdout)
    assert manifest["status"] == "workload_failed" and manifest["result"]["load"]["ttft_ms"] is None
    assert len(manifest["result"]["server_traces"]) == 1
    assert not server.is_recording()


def test_ctrl_c_during_the_load_stops_the_profiler(server, tmp_path):
    out = tmp_path / "int"
    done = 'endpoint="/v1/completions",status="200"'
    baseline = sum(v for k, v in server.http_counts().items() if done in k)
    proc = subprocess.Popen(_command("--port", str(server.port), "--api-key", KEY, "--num-prompts", "200",
                                     "--max-concurrency", "1", *SMALL_LOAD, "--json", "-o", str(out)),
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=_env(),
                            preexec_fn=sigint_as_in_a_terminal)
    deadline = time.monotonic() + 60
    while sum(v for k, v in server.http_counts().items() if done in k) < baseline + 2:
        assert time.monotonic() < deadline and proc.poll() is None, proc.stderr.read() if proc.poll() is not None else ""
        time.sleep(0.1)
    proc.send_signal(signal.SIGINT)
    assert proc.wait(60) == 130
    manifest = json.loads((out / "manifest.json").read_text())
    assert manifest["status"] == "interrupted" and "Ctrl-C" in manifest["message"]
    [trace] = manifest["result"]["traces"]
    assert (out / trace["local_copy"]).exists() and trace["summary"]["events"] > 0
    assert not server.is_recording()


def test_dry_run_sends_nothing(server):
    before, traces = server.http_counts(), _traces(server)
    text = llmctl("--port", str(server.port), "--api-key", KEY, "--num-prompts", "3", "--dry-run")
    as_json = llmctl("--port", str(server.port), "--api-key", KEY, "--dry-run", "--json", "--max-concurrency", "2")
    assert text.returncode == 0 and as_json.returncode == 0, text.stderr + as_json.stderr
    assert server.http_counts() == before and _traces(server) == traces
    assert f"POST {server.base}/start_profile" in text.stdout and f"POST {server.base}/stop_profile" in text.stdout
    assert f"POST {server.base}/v1/completions x 3" in text.stdout and KEY not in text.stdout + as_json.stdout
    plan = json.loads(as_json.stdout)
    assert plan["dry_run"] and plan["load"]["max_concurrency"] == 2 and plan["load"]["request_rate"] == "inf"
    assert plan["load_command"][:3] == ["llmctl", "bench", "serve"]


def test_server_without_profile_dir_gets_the_hint():
    plain = Server()
    try:
        proc = llmctl("--port", str(plain.port), "--num-prompts", "1")
    finally:
        plain.stop()
    assert proc.returncode == 3
    assert "start the server with --profile-dir DIR" in proc.stderr and proc.stderr.count("\n") == 1


def test_unreachable_server_is_one_line_exit_2(tmp_path):
    proc = llmctl("--port", str(free_port()), "-o", str(tmp_path / "x"))
    assert proc.returncode == 2 and "cannot reach the server at http://127.0.0.1:" in proc.stderr
    assert proc.stderr.count("\n") == 1 and not (tmp_path / "x").exists()


@pytest.mark.parametrize("args, message", [
    (("--port", "9", "--base-url", "http://127.0.0.1:9"), "give --base-url or --port, not both"),
    (("--base-url", "ftp://host"), "must be an http:// or https:// URL"),
    (("--request-rate", "0"), "request rate must be > 0"),
    (("--num-prompts", "0"), "--num-prompts"),
])
def test_bad_flags(args, message):
    proc = llmctl(*args, "--dry-run")
    assert proc.returncode == 2 and message in proc.stderr and proc.stderr.count("\n") == 1


def test_trace_summary_ranks_ops_and_kernels_by_total_time(tmp_path):
    from llmctl.profiling.server_profile import load_trace, summarise_trace

    events = [
        {"ph": "X", "cat": "cpu_op", "name": "aten::linear", "ts": 0, "dur": 100},
        {"ph": "X", "cat": "cpu_op", "name": "aten::addmm", "ts": 10, "dur": 80},
        {"ph": "X", "cat": "cpu_op", "name": "aten::linear", "ts": 200, "dur": 100},
        {"ph": "X", "cat": "cpu_op", "name": "aten::add", "ts": 400, "dur": 5},
        {"ph": "X", "cat": "kernel", "name": "sm90_gemm", "ts": 20, "dur": 60},
        {"ph": "X", "cat": "python_function", "name": "step", "ts": 0, "dur": 1000},
        {"ph": "i", "cat": "cpu_op", "name": "marker", "ts": 5},
    ]
    path = tmp_path / "t.json.gz"
    with gzip.open(path, "wt") as stream:
        json.dump({"traceEvents": events, "deviceProperties": []}, stream)
    summary = summarise_trace(load_trace(path), limit=2)
    assert summary["events"] == 7 and summary["span_ms"] == 1.0
    assert summary["top_ops"] == [{"name": "aten::linear", "calls": 2, "total_ms": 0.2, "mean_us": 100.0},
                                  {"name": "aten::addmm", "calls": 1, "total_ms": 0.08, "mean_us": 80.0}]
    assert summary["top_kernels"] == [{"name": "sm90_gemm", "calls": 1, "total_ms": 0.06, "mean_us": 60.0}]
    plain = tmp_path / "bare.json"
    plain.write_text(json.dumps(events[:1]))  # the bare-array form of the Chrome trace format
    assert summarise_trace(load_trace(plain), limit=5)["top_ops"][0]["name"] == "aten::linear"
    assert "top_kernels" not in summarise_trace(load_trace(plain), limit=5)


def test_only_a_trace_written_during_this_run_counts_as_local(tmp_path):
    from llmctl.profiling.server_profile import readable_here

    trace = tmp_path / "llmctl-trace.json.gz"
    trace.write_bytes(b"x")
    now = time.time()
    assert readable_here(str(trace), now - 60) == trace
    os.utime(trace, (now - 3600, now - 3600))  # a stale file of the same name is not this run's trace
    assert readable_here(str(trace), now - 60) is None
    assert readable_here(str(tmp_path / "elsewhere.json.gz"), now - 60) is None


def test_traces_on_another_host_are_listed_and_broken_ones_explained(tmp_path):
    from llmctl.profiling.artifacts import Manifest
    from llmctl.profiling.server_profile import collect_traces

    manifest = Manifest(kind="server", tool="t", tool_version=None, command=[], output_dir=tmp_path / "out")
    manifest.output_dir.mkdir()
    broken = tmp_path / "cut.json.gz"
    broken.write_bytes(gzip.compress(b'{"traceEvents": [{"ph": "X"')[:-8])  # truncated mid-stream
    rows = collect_traces(["/srv/elsewhere/llmctl-trace-1.json.gz", str(broken)], manifest, time.time() - 60, 5)
    assert rows[0]["local_copy"] is None and "not readable on this host" in rows[0]["note"]
    assert rows[1]["local_copy"] == "cut.json.gz" and rows[1]["summary"] is None
    assert rows[1]["note"].startswith("could not read the trace")


def test_health_waits_for_a_warming_server_and_refuses_an_unhealthy_one(monkeypatch):
    from llmctl.errors import UserError
    from llmctl.profiling import server_profile as sp

    monkeypatch.setattr(sp.time, "sleep", lambda _s: None)
    answers = [(503, {"status": "starting"}), (503, {"status": "starting"}), (200, {"status": "ok"})]
    seen = []

    def handler(request: httpx.Request) -> httpx.Response:
        seen.append(request.url.path)
        status, body = answers.pop(0)
        return httpx.Response(status, json=body)

    with httpx.Client(transport=httpx.MockTransport(handler)) as client:
        sp.check_health(client, "http://srv")
    assert seen == ["/health"] * 3
    dead = httpx.Client(transport=httpx.MockTransport(
        lambda _r: httpx.Response(503, json={"status": "unhealthy", "error": "engine thread stopped"})))
    with dead, pytest.raises(UserError, match="HTTP 503: engine thread stopped") as err:
        sp.check_health(dead, "http://srv")
    assert err.value.exit_code == 3


def _session_run(code: str, folder: Path) -> subprocess.CompletedProcess:
    """Run `code` (which prints the trace path) in a fresh interpreter without KINETO_LOG_LEVEL."""
    env = {k: v for k, v in _env().items() if k != "KINETO_LOG_LEVEL"}
    proc = subprocess.run([sys.executable, "-c", code, str(folder)], capture_output=True, text=True, env=env,
                          timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert Path(proc.stdout.strip()).is_file()
    return proc


def test_server_profiler_session_prints_no_kineto_lines(tmp_path):
    """`/start_profile` and `/stop_profile` run this session in the server process; kineto's C++ side
    used to print `USDT: ... profiler_start` / `profiler_stop` (and `ERROR:` on CPU hosts) on its stderr."""
    code = ("import sys, torch; from llmctl.server.profiler import TorchProfilerSession as S; "
            "s = S(sys.argv[1]); s.start(); torch.ones(64, 64).mm(torch.ones(64, 64)); print(s.stop())")
    proc = _session_run(code, tmp_path)
    noise = [line for line in proc.stderr.splitlines() if line.startswith(("USDT:", "STAGE:", "ERROR:"))]
    assert not noise, noise


def test_server_profiler_on_the_engine_thread_prints_no_kineto_init_error(tmp_path):
    """The server makes the session on its main thread and starts it on the engine thread: kineto printed
    "ERROR: External init callback must run in same thread as registerClient" there."""
    code = ("import sys, threading, torch; from llmctl.server.profiler import TorchProfilerSession as S; "
            "s = S(sys.argv[1]); out = []; "
            "t = threading.Thread(target=lambda: (s.start(), torch.ones(8).sum(), out.append(s.stop()))); "
            "t.start(); t.join(); print(out[0])")
    proc = _session_run(code, tmp_path)
    assert "External init callback" not in proc.stderr and not proc.stderr.strip(), proc.stderr
