"""`llmctl bench serve` end to end against a small OpenAI-like server (FastAPI + uvicorn in a thread).

The fake server streams SSE with deterministic delays (first token after `ttft_s`, then one token
every `itl_s`), reports usage when asked, can fail every k-th request with HTTP 500, and records
what it received. A last test drives our own `llmctl serve` with the default model.
"""

from __future__ import annotations

import asyncio
import json
import os
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import numpy as np
import pytest
from fastapi import FastAPI, Request  # module level: handler annotations must resolve (postponed evaluation)
from fastapi.responses import JSONResponse, StreamingResponse

from llmctl.bench.arrivals import arrival_offsets
from llmctl.cli import run

DEFAULT_MODEL = Path(__file__).resolve().parents[1] / "llmctl" / "default_model"


class FakeOpenAI:
    """Behaviour knobs plus a log of the requests it saw; `app()` builds the FastAPI application."""

    def __init__(self, ttft_s=0.03, itl_s=0.004, fail_every=0, usage=True, error_after=None, max_model_len=None,
                 api_key=None):
        self.ttft_s, self.itl_s, self.fail_every, self.usage = ttft_s, itl_s, fail_every, usage
        self.api_key = api_key  # when set, anything without "Bearer <api_key>" gets a 401 (as vLLM's --api-key)
        self.max_model_len = max_model_len  # listed in /v1/models (as vLLM does) when set
        self.error_after = error_after  # tokens streamed before an in-stream error event
        self.bodies: list[dict] = []
        self.headers: list[dict] = []
        self.refused: list[str] = []  # "METHOD /path" of each request answered 401
        self.on_request = lambda request: None  # a test's hook, called after each request is recorded
        self.in_flight = 0
        self.peak = 0

    def app(self):
        app = FastAPI()

        @app.middleware("http")
        async def check_key(request: Request, call_next):
            if self.api_key and request.headers.get("authorization") != f"Bearer {self.api_key}":
                self.refused.append(f"{request.method} {request.url.path}")
                return JSONResponse({"error": "Unauthorized"}, status_code=401)
            return await call_next(request)

        @app.get("/v1/models")
        async def models():
            first = {"id": "fake-model", "object": "model"}
            if self.max_model_len:
                first["max_model_len"] = self.max_model_len
            return {"object": "list", "data": [first, {"id": "other"}]}

        async def handle(request: Request, chat: bool):
            body = await request.json()
            self.bodies.append(body)
            self.headers.append(dict(request.headers))
            self.on_request(request)
            if self.fail_every and len(self.bodies) % self.fail_every == 0:
                return JSONResponse({"error": {"message": "boom", "type": "server_error"}}, status_code=500)
            if body.get("stream") is False:
                return JSONResponse(await self._whole(body, chat))
            return StreamingResponse(self._events(body, chat), media_type="text/event-stream")

        @app.post("/v1/completions")
        async def completions(request: Request):
            return await handle(request, chat=False)

        @app.post("/v1/chat/completions")
        async def chat(request: Request):
            return await handle(request, chat=True)

        return app

    async def _whole(self, body: dict, chat: bool) -> dict:
        n = body["max_tokens"] if body.get("ignore_eos") else min(3, body["max_tokens"])
        await asyncio.sleep(self.ttft_s + self.itl_s * (n - 1))
        text = "".join(f" w{i}" for i in range(n))
        choice = {"index": 0, "message": {"role": "assistant", "content": text}} if chat else {"index": 0, "text": text}
        usage = {"prompt_tokens": 7, "completion_tokens": n, "total_tokens": 7 + n}
        return {"choices": [{**choice, "finish_reason": "length"}], "usage": usage}

    async def _events(self, body: dict, chat: bool):
        self.in_flight += 1
        self.peak = max(self.peak, self.in_flight)
        try:
            n = body["max_tokens"] if body.get("ignore_eos") else min(3, body["max_tokens"])
            if chat:  # OpenAI announces the role at once, before any token exists
                yield _sse({"choices": [{"index": 0, "delta": {"role": "assistant", "content": ""}, "finish_reason": None}]})
            await asyncio.sleep(self.ttft_s)
            for i in range(n):
                if i == self.error_after:
                    yield _sse({"error": {"message": "engine died", "code": 500}})
                    return
                if i:
                    await asyncio.sleep(self.itl_s)
                text = f" w{i}"
                choice = {"index": 0, "delta": {"content": text}} if chat else {"index": 0, "text": text}
                yield _sse({"choices": [{**choice, "finish_reason": None}]})
            end = {"index": 0, "delta": {}} if chat else {"index": 0, "text": ""}
            yield _sse({"choices": [{**end, "finish_reason": "length"}]})  # finish-only chunk: no token
            if self.usage and body.get("stream_options", {}).get("include_usage"):
                yield _sse({"choices": [], "usage": {"prompt_tokens": 7, "completion_tokens": n, "total_tokens": 7 + n}})
            yield "data: [DONE]\n\n"
        finally:
            self.in_flight -= 1


def _sse(obj: dict) -> str:
    return f"data: {json.dumps(obj)}\n\n"


class ThreadServer:
    def __init__(self, app):
        import uvicorn

        self.server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=0, log_level="error", lifespan="off"))
        self.thread = threading.Thread(target=self.server.run, daemon=True)

    def __enter__(self) -> str:
        self.thread.start()
        deadline = time.monotonic() + 20
        while not self.server.started:
            if time.monotonic() > deadline or not self.thread.is_alive():
                raise RuntimeError("fake server did not start")
            time.sleep(0.01)
        port = self.server.servers[0].sockets[0].getsockname()[1]
        return f"http://127.0.0.1:{port}"

    def __exit__(self, *exc) -> None:
        self.server.should_exit = True
        self.thread.join(timeout=10)


@pytest.fixture
def fake():
    behaviour = FakeOpenAI()
    with ThreadServer(behaviour.app()) as url:
        behaviour.url = url
        yield behaviour


def bench(capsys, *args: str) -> tuple[int, str, str]:
    capsys.readouterr()
    code = run(["bench", "serve", *args])
    out, err = capsys.readouterr()
    return code, out, err


SMALL = ("--random-input-len", "12", "--random-output-len", "8", "--json")


def test_completions_json_counts_and_timings(fake, capsys):
    code, out, err = bench(capsys, "--base-url", fake.url, "--num-prompts", "12", *SMALL)
    assert code == 0, err
    doc = json.loads(out)  # nothing but the document on stdout
    assert doc["model_id"] == "fake-model" and doc["endpoint"] == "/v1/completions"
    assert (doc["completed"], doc["failed"]) == (12, 0)
    assert doc["total_output_tokens"] == 12 * 8 and doc["token_count_source"] == "usage"
    assert doc["total_input_tokens"] == 12 * 7  # the server's prompt_tokens win over the client's estimate
    assert doc["mean_ttft_ms"] >= 30 and doc["p99_ttft_ms"] >= doc["median_ttft_ms"] >= 30
    assert 4 <= doc["median_itl_ms"] < 200 and 4 <= doc["mean_tpot_ms"] < 200
    assert doc["max_concurrent_requests"] == 12  # rate inf: all in flight together
    assert doc["request_throughput"] == pytest.approx(12 / doc["duration"])
    assert doc["output_throughput"] == pytest.approx(96 / doc["duration"])
    assert doc["request_goodput"] is None and doc["error_samples"] == []
    body = fake.bodies[0]
    assert body["stream"] is True and body["stream_options"] == {"include_usage": True}
    assert body["ignore_eos"] is True and body["max_tokens"] == 8 and body["model"] == "fake-model"
    assert len(body["prompt"].split()) == 12  # random words, one per requested token
    assert "Authorization" not in fake.headers[0] and "authorization" not in fake.headers[0]


def test_chat_ignores_role_and_finish_only_chunks(fake, capsys):
    fake.ttft_s = 0.05
    code, out, err = bench(capsys, "--base-url", fake.url + "/v1/", "--endpoint", "chat", "--num-prompts", "4",
                           "--save-detailed", *SMALL)
    assert code == 0, err
    doc = json.loads(out)
    assert doc["endpoint"] == "/v1/chat/completions" and doc["completed"] == 4
    # The role chunk arrives at once: counting it would put TTFT near 0.
    assert min(doc["ttfts"]) >= 0.05
    # 8 tokens -> 7 gaps; the finish-only chunk adds none.
    assert [len(gaps) for gaps in doc["itls"]] == [7] * 4
    assert doc["generated_texts"][0] == "".join(f" w{i}" for i in range(8))
    assert fake.bodies[0]["messages"][0]["role"] == "user"


def test_failed_requests_exit_1_unless_within_max_failure_rate(fake, capsys):
    """A server failing part of the run (before: exit 0, which CI scripts took as a pass)."""
    fake.fail_every = 4
    code, out, err = bench(capsys, "--base-url", fake.url, "--num-prompts", "20", "--max-concurrency", "1", *SMALL)
    assert code == 1
    doc = json.loads(out)
    assert (doc["completed"], doc["failed"]) == (15, 5)
    assert doc["failure_rate"] == 0.25 and doc["failures_by_cause"] == {"HTTP 500": 5}
    assert doc["error_samples"] == [{"status": 500, "message": "boom", "count": 5}]
    assert doc["total_output_tokens"] == 15 * 8
    assert "5 request(s) failed: HTTP 500: boom" in err
    assert "llmctl: error: 5 of 20 requests failed (25.0% > --max-failure-rate 0): HTTP 500: 5" in err
    code, out, err = bench(capsys, "--base-url", fake.url, "--num-prompts", "8", "--max-concurrency", "1",
                           "--max-failure-rate", "0.25", *SMALL)
    assert code == 0 and json.loads(out)["failed"] == 2 and "error:" not in err


@pytest.mark.parametrize("error_after, message", [(2, "engine died"), (0, "engine died")])
def test_errors_inside_the_stream_fail_the_request(fake, capsys, error_after, message):
    fake.error_after = error_after
    code, out, err = bench(capsys, "--base-url", fake.url, "--num-prompts", "3", *SMALL)
    assert code == 1
    doc = json.loads(out)
    assert doc["failed"] == 3 and doc["error_samples"] == [{"status": 200, "message": message, "count": 3}]


def test_all_requests_failing_exits_1(fake, capsys):
    fake.fail_every = 1
    code, out, err = bench(capsys, "--base-url", fake.url, "--num-prompts", "5", *SMALL)
    assert code == 1
    assert json.loads(out)["failed"] == 5
    assert "all 5 requests failed" in err and "HTTP 500: boom" in err


def test_slo_gates_save_result_and_plot(fake, capsys, tmp_path):
    saved, png = tmp_path / "result.json", tmp_path / "plot.png"
    code, out, err = bench(capsys, "--base-url", fake.url, "--num-prompts", "6", "--slo", "p99_ttft_ms<0.001",
                           "--slo", "completed>=6", "--save-result", str(saved), "--plot", str(png), *SMALL)
    assert code == 1
    doc = json.loads(out)
    assert json.loads(saved.read_text()) == doc
    assert [(g["gate"], g["passed"]) for g in doc["slo"]] == [("p99_ttft_ms<0.001", False), ("completed>=6", True)]
    assert "llmctl: slo violated: p99_ttft_ms<0.001 (measured " in err
    assert "llmctl: slo passed: completed>=6 (measured 6)\n" in err  # a gate that holds says so too
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and png.stat().st_size > 10_000

    code, out, err = bench(capsys, "--base-url", fake.url, "--num-prompts", "3", "--slo", "p99_ttft_ms<60000", *SMALL)
    assert code == 0 and json.loads(out)["slo"][0]["passed"]
    assert "llmctl: slo passed: p99_ttft_ms<60000 (measured " in err and "violated" not in err


def test_table_output_when_piped(fake, capsys):
    code, out, err = bench(capsys, "--base-url", fake.url, "--num-prompts", "3", "--random-input-len", "5",
                           "--random-output-len", "4", "--percentiles", "90,99.9")
    assert code == 0, err
    assert "Serving Benchmark Result" in out and "Successful requests:" in out
    assert "P99.9 TTFT (ms):" in out and "P90 ITL (ms):" in out and "Mean E2EL (ms):" in out
    assert "\x1b[" not in out  # no colour codes when piped


def test_unknown_slo_key_exits_2_before_any_request(fake, capsys):
    code, out, err = bench(capsys, "--base-url", fake.url, "--num-prompts", "3", "--slo", "p99_latency<5")
    assert code == 2 and out == ""
    assert err.count("\n") == 1 and "unknown metric 'p99_latency'" in err and "p99_ttft_ms" in err
    assert fake.bodies == []


@pytest.mark.parametrize("args, message", [
    (["--slo", "p99_ttft_ms=5"], "expected METRIC OP NUMBER"),
    (["--slo", "request_goodput>1"], "needs --goodput"),
    (["--goodput", "ttft=5"], "expected KEY:MS"),
    (["--percentiles", "0"], "outside (0, 100]"),
    (["--request-rate", "0"], "request rate must be > 0"),
    (["--burstiness", "-1"], "burstiness must be"),
    (["--random-range-ratio", "1"], "must be in [0, 1)"),
    (["--dataset", "file"], "needs --dataset-path"),
    (["--plot", "out.txt"], "must end in one of"),
    (["--base-url", "ftp://x"], "http:// or https://"),
    (["--tokenizer", "."], "no tokenizer.json there"),
    (["--dataset-path", "x.jsonl"], "not read with --dataset-name random"),
])
def test_bad_flags_are_one_line_errors(fake, capsys, args, message):
    code, out, err = bench(capsys, "--base-url", fake.url, "--num-prompts", "2", *args)
    assert code == 2 and out == ""
    assert message in err and err.count("\n") == 1 and "Traceback" not in err
    assert fake.bodies == []


def test_unreachable_server_is_exit_2(capsys):
    with socket.socket() as sock:  # a port nothing listens on
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    code, out, err = bench(capsys, "--base-url", f"http://127.0.0.1:{port}", "--num-prompts", "2")
    assert code == 2 and out == ""
    assert err.startswith("llmctl: error: cannot reach the server") and err.count("\n") == 1


def test_max_concurrency_caps_requests_in_flight(fake, capsys):
    code, out, err = bench(capsys, "--base-url", fake.url, "--num-prompts", "8", "--max-concurrency", "2", *SMALL)
    assert code == 0, err
    assert json.loads(out)["max_concurrent_requests"] == 2 and fake.peak <= 2


def test_arrivals_follow_the_seeded_schedule(fake, capsys):
    fake.ttft_s = 0.001
    code, out, err = bench(capsys, "--base-url", fake.url, "--num-prompts", "10", "--request-rate", "25",
                           "--seed", "3", "--save-detailed", *SMALL)
    assert code == 0, err
    starts = json.loads(out)["start_times"]
    expected = arrival_offsets(10, 25.0, 1.0, np.random.default_rng([3, 1]))
    assert expected[-1] > 0.1  # a real spread, not all at once
    # Each send waits for its arrival time: never early, in the schedule's order. How late a start runs depends on
    # the host (the event loop shares the process with the test's fake server; 0.1-0.4 s seen in the full suite).
    assert len(starts) == len(expected) and starts == sorted(starts)
    for got, want in zip(starts, expected):
        assert want - 0.002 <= got <= want + 1.0, (starts, list(expected))


def test_warmups_run_first_and_are_not_counted(fake, capsys):
    code, out, err = bench(capsys, "--base-url", fake.url, "--num-prompts", "4", "--num-warmups", "3", *SMALL)
    assert code == 0, err
    assert json.loads(out)["completed"] == 4 and len(fake.bodies) == 7


def test_goodput_counts_requests_within_slos(fake, capsys):
    code, out, _ = bench(capsys, "--base-url", fake.url, "--num-prompts", "4", "--goodput", "ttft:60000 e2el:60000", *SMALL)
    doc = json.loads(out)
    assert doc["goodput_slos_ms"] == {"ttft": 60000.0, "e2el": 60000.0}
    assert doc["request_goodput"] == pytest.approx(doc["request_throughput"])
    code, out, _ = bench(capsys, "--base-url", fake.url, "--num-prompts", "4", "--goodput", "ttft:1", *SMALL)
    assert json.loads(out)["request_goodput"] == 0.0  # every TTFT is >= 30 ms


def test_token_counts_fall_back_without_usage(fake, capsys):
    fake.usage = False
    code, out, _ = bench(capsys, "--base-url", fake.url, "--num-prompts", "3", *SMALL)
    doc = json.loads(out)
    assert doc["token_count_source"] == "chunks" and doc["total_output_tokens"] == 24
    code, out, _ = bench(capsys, "--base-url", fake.url, "--num-prompts", "3", "--tokenizer", str(DEFAULT_MODEL),
                         "--save-detailed", *SMALL)
    doc = json.loads(out)
    from llmctl.engine.tokenizer import Tokenizer

    tok = Tokenizer.from_pretrained(DEFAULT_MODEL)
    expected = sum(len(tok.encode(text, add_special_tokens=False)) for text in doc["generated_texts"])
    assert doc["token_count_source"] == "tokenizer" and doc["total_output_tokens"] == expected != 24
    # Without usage the input count is the client's: prompts built from token ids hit the length.
    prompts = [body["prompt"] for body in fake.bodies[3:]]
    assert doc["input_lens"] == [len(tok.encode(p, add_special_tokens=False)) for p in prompts]
    assert doc["input_lens"] == [12, 12, 12]


def test_file_dataset_api_key_and_no_ignore_eos(fake, capsys, tmp_path, monkeypatch):
    data = tmp_path / "prompts.jsonl"
    data.write_text('{"prompt": "hello there", "output_len": 5}\n\n{"prompt": "second one", "max_tokens": 2}\n')
    monkeypatch.setenv("OPENAI_API_KEY", "sk-env")
    code, out, err = bench(capsys, "--base-url", fake.url, "--dataset", "file", "--dataset-path", str(data),
                           "--num-prompts", "3", "--max-concurrency", "1", "--no-ignore-eos", "--json")
    assert code == 0, err
    assert [b["prompt"] for b in fake.bodies] == ["hello there", "second one", "hello there"]
    assert [b["max_tokens"] for b in fake.bodies] == [5, 2, 5]
    assert all("ignore_eos" not in b for b in fake.bodies)
    assert json.loads(out)["total_output_tokens"] == 3 + 2 + 3  # the server stopped early (no ignore_eos)
    assert fake.headers[0]["authorization"] == "Bearer sk-env"
    bench(capsys, "--base-url", fake.url, "--num-prompts", "1", "--api-key", "sk-flag", *SMALL)
    assert fake.headers[-1]["authorization"] == "Bearer sk-flag"


# ---- against our own server ---------------------------------------------------------------------

def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _server_counter(url: str, name: str) -> float:
    import httpx

    for line in httpx.get(url + "/metrics", timeout=10).text.splitlines():
        if line.startswith(name + "{") or line.startswith(name + " "):
            return float(line.rsplit(" ", 1)[1])
    return 0.0  # a labelled counter appears with its first sample


@pytest.fixture(scope="module")
def llmctl_server():
    """`llmctl serve` with the default model on a free loopback port, as a subprocess."""
    import httpx

    port = _free_port()
    env = {**os.environ, "NO_COLOR": "1"}
    proc = subprocess.Popen([sys.executable, "-m", "llmctl.cli", "serve", "--host", "127.0.0.1", "--port", str(port)],
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, env=env)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 180
        while True:
            if proc.poll() is not None:
                raise RuntimeError(f"llmctl serve exited {proc.returncode}: {proc.stderr.read()[-2000:]}")
            try:
                if httpx.get(url + "/health", timeout=2).status_code == 200:
                    break
            except httpx.TransportError:
                pass
            if time.monotonic() > deadline:
                raise RuntimeError("llmctl serve did not become healthy within 180 s")
            time.sleep(0.2)
        yield url
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def test_bench_serve_against_llmctl_serve(llmctl_server, capsys):
    url = llmctl_server
    prompt_before = _server_counter(url, "llmctl:prompt_tokens_total")
    generated_before = _server_counter(url, "llmctl:generation_tokens_total")
    code, out, err = bench(capsys, "--base-url", url, "--num-prompts", "20", "--request-rate", "10", "--json",
                           "--random-input-len", "32", "--random-output-len", "16")
    assert code == 0, err
    doc = json.loads(out)
    assert (doc["completed"], doc["failed"]) == (20, 0), doc["error_samples"]
    assert doc["token_count_source"] == "usage"
    assert doc["total_output_tokens"] == 20 * 16  # ignore_eos: exactly max_tokens each
    # The server's own accounting agrees with what its usage reports told the client.
    assert _server_counter(url, "llmctl:generation_tokens_total") - generated_before == doc["total_output_tokens"]
    assert _server_counter(url, "llmctl:prompt_tokens_total") - prompt_before == doc["total_input_tokens"]
    assert doc["model_id"] and doc["request_rate"] == 10.0
    assert 0 < doc["median_ttft_ms"] <= doc["p99_ttft_ms"] and doc["mean_tpot_ms"] > 0 and doc["mean_itl_ms"] > 0
    assert 1 <= doc["max_concurrent_requests"] <= 20

    code, out, err = bench(capsys, "--base-url", url, "--num-prompts", "4", "--endpoint", "chat", "--json",
                           "--random-input-len", "8", "--random-output-len", "4", "--slo", "p99_ttft_ms<0.001")
    assert code == 1
    doc = json.loads(out)
    assert doc["completed"] == 4 and doc["total_output_tokens"] == 16
    assert doc["slo"][0]["passed"] is False and "slo violated: p99_ttft_ms<0.001" in err


def test_default_lengths_fit_llmctl_serve_defaults(llmctl_server, capsys):
    """`llmctl serve` and `llmctl bench serve` with their defaults: 1024 + 128 tokens do not fit the
    default model's 512; the client reads max_model_len from /v1/models, finds the embedded model's
    tokenizer by its id, and sends exact 384-token prompts (before: 1024 words, every request a 400)."""
    code, out, err = bench(capsys, "--base-url", llmctl_server, "--num-prompts", "2", "--json")
    assert code == 0, err
    doc = json.loads(out)
    assert (doc["completed"], doc["failed"]) == (2, 0), doc["error_samples"]
    assert doc["max_model_len"] == 512 and doc["tokenizer"] == str(DEFAULT_MODEL)
    assert (doc["total_input_tokens"], doc["total_output_tokens"]) == (2 * 384, 2 * 128)
    assert ("llmctl: warning: --random-input-len 1024 + --random-output-len 128 do not fit the server's "
            "max_model_len of 512: sending 384 prompt and 128 output tokens") in err


def test_lengths_fit_the_context_a_server_lists(capsys):
    behaviour = FakeOpenAI(max_model_len=64)
    with ThreadServer(behaviour.app()) as url:
        code, out, err = bench(capsys, "--base-url", url, "--num-prompts", "3", "--json")
    assert code == 0, err
    assert [len(b["prompt"].split()) for b in behaviour.bodies] == [32, 32, 32]
    assert [b["max_tokens"] for b in behaviour.bodies] == [32, 32, 32]
    assert "sending 32 prompt and 32 output words (no --tokenizer: they may tokenize longer)" in err
    assert json.loads(out)["max_model_len"] == 64


def test_config_file_env_and_flag_precedence(fake, capsys, tmp_path, monkeypatch):
    cfg = tmp_path / "bench.yaml"
    cfg.write_text(f"base-url: {fake.url}\nnum-prompts: 2\nrandom-output-len: 3\nrandom-input-len: 4\nslo: ['completed>=2']\n")
    code, out, err = bench(capsys, "--config", str(cfg), "--json")
    assert code == 0, err
    doc = json.loads(out)
    assert (doc["num_prompts"], doc["total_output_tokens"], doc["slo"][0]["gate"]) == (2, 6, "completed>=2")
    monkeypatch.setenv("LLMCTL_NUM_PROMPTS", "3")
    assert json.loads(bench(capsys, "--config", str(cfg), "--json")[1])["num_prompts"] == 3
    assert json.loads(bench(capsys, "--config", str(cfg), "--json", "--num-prompts", "1")[1])["num_prompts"] == 1


def test_rate_sweep_against_llmctl_serve_writes_rows_csv_and_plot(llmctl_server, capsys, tmp_path):
    import csv

    from PIL import Image

    table, png = tmp_path / "sweep.csv", tmp_path / "curve.png"
    code, out, err = bench(capsys, "--base-url", llmctl_server, "--num-prompts", "2", "--request-rate", "2,4,8,inf",
                           "--sweep-cooldown", "0", "--random-input-len", "8", "--random-output-len", "3",
                           "--slo", "p99_ttft_ms<60000", "--csv", str(table), "--plot", str(png), "--json")
    assert code == 0, err
    doc = json.loads(out)
    assert doc["request_rates"] == [2.0, 4.0, 8.0, "inf"] and len(doc["sweep"]) == 4
    assert all((row["completed"], row["failed"], row["total_output_tokens"]) == (2, 0, 6) for row in doc["sweep"])
    assert doc["best_point"] is not None and doc["best_point"]["request_rate"] in doc["request_rates"]
    rows = list(csv.DictReader(table.open()))
    assert [row["request_rate"] for row in rows] == ["2.0", "4.0", "8.0", "inf"]
    assert all(float(row["mean_ttft_ms"]) > 0 for row in rows)
    with Image.open(png) as image:
        assert image.format == "PNG" and image.size == (1200, 500)
        assert len(image.convert("L").getcolors(maxcolors=1 << 16)) > 16  # drawn, not blank


def test_multi_turn_history_reaches_llmctl_serve(llmctl_server, capsys, tmp_path):
    """Turn 2's prompt, as the server counted it, is the chat template over turn 1 and the server's own answer."""
    from llmctl.engine.tokenizer import Tokenizer

    data = tmp_path / "chat.jsonl"
    data.write_text(json.dumps({"messages": [{"role": "user", "content": "tell me a story"},
                                             {"role": "assistant", "content": "once upon a time"},
                                             {"role": "user", "content": "and then"}]}) + "\n")
    code, out, err = bench(capsys, "--base-url", llmctl_server, "--dataset-name", "conversation", "--dataset-path",
                           str(data), "--num-prompts", "1", "--random-output-len", "3", "--save-detailed", "--json")
    assert code == 0, err
    doc = json.loads(out)
    tok = Tokenizer.from_pretrained(DEFAULT_MODEL)
    recorded = len(tok.encode("once upon a time", add_special_tokens=False))
    assert doc["completed"] == 2 and doc["output_lens"] == [recorded, 3]  # turn 1 asks the recorded answer's length
    history = [{"role": "user", "content": "tell me a story"},
               {"role": "assistant", "content": doc["generated_texts"][0]}, {"role": "user", "content": "and then"}]
    assert doc["input_lens"] == [len(tok.encode_chat(history[:1])), len(tok.encode_chat(history))]
