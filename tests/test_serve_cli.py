"""`llmctl serve` as users run it: a subprocess on the embedded model, graceful SIGTERM drain with
exit 0, profiling endpoints, the API key from the environment, and one-line startup errors."""

from __future__ import annotations

import gzip
import json
import os
import signal
import subprocess
import sys
import threading
import time

import httpx
import pytest

from server_helpers import free_port


def _env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("LLMCTL_")}
    return {**env, "NO_COLOR": "1", **extra}


def _start(*args: str, env: dict[str, str] | None = None) -> tuple[subprocess.Popen, str]:
    port = free_port()
    proc = subprocess.Popen([sys.executable, "-m", "llmctl.cli", "serve", "--port", str(port), *args],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env or _env())
    base = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 90
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise AssertionError(f"server exited: {proc.stderr.read()}")
        try:
            if httpx.get(base + "/health", timeout=1).status_code == 200:
                return proc, base
        except httpx.HTTPError:
            pass
        time.sleep(0.1)
    proc.kill()
    raise AssertionError("server did not become healthy")


def _requests_running(base: str) -> float:
    for line in httpx.get(base + "/metrics", timeout=5).text.splitlines():
        if line.startswith("llmctl:num_requests_running"):
            return float(line.split()[-1])
    raise AssertionError("/metrics has no llmctl:num_requests_running")


def test_sigterm_drains_in_flight_streams_then_exits_zero():
    proc, base = _start("--shutdown-timeout", "120")  # a loaded CI host ran 200 tokens past 30 s
    events: list[str] = []
    first_chunk = threading.Event()

    def stream() -> None:
        body = {"prompt": "A long tale", "max_tokens": 64, "ignore_eos": True, "stream": True}
        with httpx.stream("POST", base + "/v1/completions", json=body, timeout=60) as response:
            for line in response.iter_lines():
                if line.startswith("data: "):
                    events.append(line)
                    first_chunk.set()

    reader = threading.Thread(target=stream)
    reader.start()
    assert first_chunk.wait(30)
    proc.send_signal(signal.SIGTERM)
    reader.join(150)
    assert proc.wait(150) == 0
    stderr = proc.stderr.read()
    assert "listening on http://127.0.0.1" in stderr and "draining" in stderr
    assert events[-1] == "data: [DONE]"
    text_chunks = [json.loads(e[6:]) for e in events[:-1]]
    assert "choices" in text_chunks[-1], text_chunks[-1]  # an error chunk: the drain cut it off
    assert text_chunks[-1]["choices"][0]["finish_reason"] == "length"  # finished, not cut off
    with pytest.raises(httpx.ConnectError):
        httpx.get(base + "/health", timeout=2)


def test_requests_still_running_when_the_drain_times_out_get_an_openai_ending():
    # The work must outlast the drain on any machine: both requests together are 2 x 8 x 480 tokens
    # (2.9 s on the CI machine, idle), the drain 0.2 s, and SIGTERM goes as soon as both run. (With
    # one sequence each and a 1 s drain, an idle machine finished them in 0.9 s and nothing was cut.)
    proc, base = _start("--shutdown-timeout", "0.2")
    events: list[str] = []
    plain: list[httpx.Response] = []
    first_chunk = threading.Event()
    long = {"prompt": "A long tale", "max_tokens": 480, "ignore_eos": True, "n": 8}

    def stream() -> None:
        with httpx.stream("POST", base + "/v1/completions", json={**long, "stream": True}, timeout=60) as response:
            for line in response.iter_lines():
                if line.startswith("data: "):
                    events.append(line)
                    first_chunk.set()

    threads = [threading.Thread(target=stream),
               threading.Thread(target=lambda: plain.append(httpx.post(base + "/v1/completions", json=long,
                                                                       timeout=60)))]
    for thread in threads:
        thread.start()
    assert first_chunk.wait(30)
    deadline = time.monotonic() + 30
    while _requests_running(base) < 2:  # the plain request is running too
        assert time.monotonic() < deadline, "the plain request never started"
        time.sleep(0.01)
    proc.send_signal(signal.SIGTERM)
    for thread in threads:
        thread.join(60)
    assert proc.wait(60) == 0
    stderr = proc.stderr.read()
    assert events[-1] == "data: [DONE]"
    assert json.loads(events[-2][6:])["error"]["code"] == "server_shutting_down"
    [response] = plain
    assert response.status_code == 503 and response.json()["error"]["code"] == "server_shutting_down"
    assert "Traceback" not in stderr and stderr.count("cut off: still running when the drain ended") == 2


def test_profile_endpoints_write_a_trace_and_need_the_key(tmp_path):
    proc, base = _start("--profile-dir", str(tmp_path / "traces"), env=_env(LLMCTL_API_KEY="sk-env"))
    try:
        auth = {"Authorization": "Bearer sk-env"}
        assert httpx.post(base + "/start_profile").status_code == 401
        assert httpx.post(base + "/start_profile", headers=auth).status_code == 200
        assert httpx.post(base + "/start_profile", headers=auth).status_code == 409
        done = httpx.post(base + "/v1/completions", headers=auth, timeout=30,
                          json={"prompt": "ROMEO:", "max_tokens": 4})
        assert done.status_code == 200
        stopped = httpx.post(base + "/stop_profile", headers=auth, timeout=60)
        assert stopped.status_code == 200
        [trace] = stopped.json()["files"]
        events = json.load(gzip.open(trace))["traceEvents"]
        assert any(op in e.get("name", "") for e in events for op in ("linear", "mm", "llmctl::decode_stack"))
    finally:
        proc.terminate()
        proc.wait(30)


def test_api_key_from_a_file_and_timeouts_from_flags(tmp_path):
    key_file = tmp_path / "key"
    key_file.write_text("sk-from-file\n")
    key_file.chmod(0o600)  # a key file others can read is refused
    proc, base = _start("--api-key-file", str(key_file), "--timeout-headers", "1")
    try:
        assert httpx.get(base + "/v1/models").status_code == 401
        assert httpx.get(base + "/v1/models", headers={"Authorization": "Bearer sk-from-file"}).status_code == 200
        import socket

        port = int(base.rsplit(":", 1)[1])
        with socket.create_connection(("127.0.0.1", port), timeout=10) as silent:
            started = time.monotonic()
            assert silent.recv(100) == b""  # closed by the server at --timeout-headers
            assert time.monotonic() - started < 8
    finally:
        proc.terminate()
        assert proc.wait(30) == 0


def test_profile_endpoints_absent_without_profile_dir():
    proc, base = _start()
    try:
        assert httpx.post(base + "/start_profile").status_code == 404
        assert httpx.get(base + "/version").json()["version"]
    finally:
        proc.terminate()
        assert proc.wait(30) == 0


@pytest.mark.parametrize("args, message", [
    (("--rate-limit", "lots"), "invalid rate limit"),
    (("--model", "/no/such/model"), "does not exist"),
    (("--max-output-tokens", "0"), "--max-output-tokens must be >= 1"),
    (("--audit-log-prompts",), "needs --audit-log"),
    (("--request-timeout", "-1"), "--request-timeout must be > 0"),
    (("--timeout-body", "0"), "--timeout-body must be > 0"),
    (("--limit-concurrency", "0"), "--limit-concurrency must be >= 1"),
    (("--auth-failure-limit", "many"), "invalid rate limit"),
    (("--api-key-file", "/no/such/key"), "--api-key-file /no/such/key: cannot read it"),
])
def test_bad_serve_flags_are_one_line_errors(args, message):
    proc = subprocess.run([sys.executable, "-m", "llmctl.cli", "serve", "--port", str(free_port()), *args],
                          capture_output=True, text=True, env=_env(), timeout=120)
    assert proc.returncode == 2
    assert message in proc.stderr and "Traceback" not in proc.stderr
    assert proc.stderr.strip().splitlines()[-1].startswith("llmctl: error:")


def test_port_in_use_is_a_one_line_error():
    proc, base = _start()
    try:
        port = base.rsplit(":", 1)[1]
        second = subprocess.run([sys.executable, "-m", "llmctl.cli", "serve", "--port", port], capture_output=True,
                                text=True, env=_env(), timeout=120)
        assert second.returncode == 2 and "could not listen" in second.stderr
        assert "Traceback" not in second.stderr
    finally:
        proc.terminate()
        proc.wait(30)


@pytest.mark.parametrize("host, cause", [
    ("127.0.0.1", "is already in use (another server?); pick another --port, or --port 0 for a free one"),
    ("192.0.2.1", "--host 192.0.2.1 is not an address of this machine"),  # TEST-NET-1: never local
    ("no-such-host.invalid", "--host no-such-host.invalid is not an address or a name this machine resolves"),
])
def test_bind_errors_are_one_llmctl_line_with_their_cause_before_the_model_loads(host, cause):
    import socket

    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        port = taken.getsockname()[1]
        started = time.monotonic()
        proc = subprocess.run([sys.executable, "-m", "llmctl.cli", "serve", "--host", host, "--port", str(port)],
                              capture_output=True, text=True, env=_env(), timeout=120)
    assert proc.returncode == 2
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"llmctl: error: could not listen on {host}:{port}: "), proc.stderr
    assert cause in lines[0]
    assert "ERROR:" not in proc.stderr and "Errno" not in proc.stderr  # not uvicorn's raw line
    assert time.monotonic() - started < 60  # the model never loaded (generous: shared CI cores)


def test_cpu_fallback_of_device_auto_is_info_not_a_warning(caplog):
    import logging

    import torch

    from llmctl.engine.llm_engine import resolve_device

    if torch.cuda.is_available():
        pytest.skip("CUDA is available here: --device auto picks it")
    with caplog.at_level(logging.INFO, logger="llmctl"):
        assert resolve_device("auto").type == "cpu"
    [record] = [r for r in caplog.records if "CUDA is not available" in r.getMessage()]
    assert record.levelno == logging.INFO
