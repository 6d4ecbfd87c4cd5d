"""Malformed and hostile requests get the right status and an OpenAI error body, and the server
stays healthy; plus rate limiting, capacity refusal, request timeouts, CORS and /metrics."""

from __future__ import annotations

import asyncio
import json
import threading
import time

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from server_helpers import rss_mib, running_server

KEY = "sk-errors"
AUTH = {"Authorization": f"Bearer {KEY}"}
JSON = {"Content-Type": "application/json"}


@pytest.fixture(scope="module")
def server():
    with running_server(api_key=KEY, max_output_tokens=64, max_body_bytes=64 * 1024) as srv:
        yield srv


@pytest.fixture(scope="module")
def baseline(server):
    return rss_mib()


def _post(path, body=None, *, raw=None, headers=None, method="POST"):
    return ("POST" if method == "POST" else method, path, body, raw, {**AUTH, **JSON} if headers is None else headers)


CASES = [
    # (name, request, status, error type, param)
    ("malformed JSON", _post("/v1/completions", raw=b'{"prompt": "x",'), 400, "invalid_request_error", None),
    ("body is an array", _post("/v1/completions", raw=b"[1, 2]"), 400, "invalid_request_error", None),
    ("missing prompt", _post("/v1/completions", {"max_tokens": 3}), 400, "invalid_request_error", "prompt"),
    ("prompt is a number", _post("/v1/completions", {"prompt": 42}), 400, "invalid_request_error", "prompt"),
    ("empty prompt", _post("/v1/completions", {"prompt": ""}), 400, "invalid_request_error", "prompt"),
    ("max_tokens is a string", _post("/v1/completions", {"prompt": "x", "max_tokens": "5"}), 400,
     "invalid_request_error", "max_tokens"),
    ("negative max_tokens", _post("/v1/completions", {"prompt": "x", "max_tokens": -3}), 400,
     "invalid_request_error", "max_tokens"),
    ("max_tokens over the server cap", _post("/v1/completions", {"prompt": "x", "max_tokens": 65}), 400,
     "invalid_request_error", "max_tokens"),
    ("prompt longer than max-model-len", _post("/v1/completions", {"prompt": [5] * 600}), 400,
     "invalid_request_error", "max_tokens"),
    ("token id outside the vocabulary", _post("/v1/completions", {"prompt": [1, 2, 10**6]}), 400,
     "invalid_request_error", "prompt"),
    ("negative temperature", _post("/v1/completions", {"prompt": "x", "temperature": -0.5}), 400,
     "invalid_request_error", "temperature"),
    ("top_p zero", _post("/v1/completions", {"prompt": "x", "top_p": 0.0}), 400, "invalid_request_error", "top_p"),
    ("n too large", _post("/v1/completions", {"prompt": "x", "n": 1000}), 400, "invalid_request_error", "n"),
    ("logprobs too large", _post("/v1/completions", {"prompt": "x", "logprobs": 99}), 400,
     "invalid_request_error", "logprobs"),
    # Values SamplingParams refuses: the engine's InvalidRequestError names the field (no message parsing).
    ("n zero", _post("/v1/completions", {"prompt": "x", "n": 0}), 400, "invalid_request_error", "n"),
    ("negative stop token id", _post("/v1/completions", {"prompt": "x", "stop_token_ids": [-1]}), 400,
     "invalid_request_error", "stop_token_ids"),
    ("min_tokens over max_tokens", _post("/v1/completions", {"prompt": "x", "min_tokens": 5, "max_tokens": 2}), 400,
     "invalid_request_error", "min_tokens"),
    ("negative prompt_logprobs with echo", _post("/v1/completions", {"prompt": "x", "echo": True, "logprobs": 1,
                                                                      "prompt_logprobs": -1}),
     400, "invalid_request_error", "prompt_logprobs"),
    ("top_logprobs too large", _post("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}],
                                                              "logprobs": True, "top_logprobs": 99}),
     400, "invalid_request_error", "top_logprobs"),
    ("an empty prompt of token ids", _post("/v1/completions", {"prompt": [[]]}), 400, "invalid_request_error",
     "prompt"),
    ("bad logit_bias key", _post("/v1/completions", {"prompt": "x", "logit_bias": {"abc": 1}}), 400,
     "invalid_request_error", "logit_bias"),
    ("too many stop strings", _post("/v1/completions", {"prompt": "x", "stop": ["a"] * 40}), 400,
     "invalid_request_error", "stop"),
    ("empty messages", _post("/v1/chat/completions", {"messages": []}), 400, "invalid_request_error", "messages"),
    ("unknown role", _post("/v1/chat/completions", {"messages": [{"role": "wizard", "content": "x"}]}), 400,
     "invalid_request_error", "messages"),
    ("top_logprobs without logprobs", _post("/v1/chat/completions",
                                            {"messages": [{"role": "user", "content": "x"}], "top_logprobs": 2}),
     400, "invalid_request_error", "top_logprobs"),
    ("auto tool choice without the server's flags", _post("/v1/chat/completions", {
        "messages": [{"role": "user", "content": "x"}], "tools": [{"type": "function", "function": {"name": "f"}}]}),
     400, "invalid_request_error", "tool_choice"),
    ("unknown model", _post("/v1/completions", {"prompt": "x", "model": "gpt-9"}), 404, "not_found_error", "model"),
    ("unknown route", _post("/v1/engines", {"prompt": "x"}), 404, "not_found_error", None),
    ("wrong method", _post("/v1/completions", method="GET"), 405, "invalid_request_error", None),
    ("missing API key", _post("/v1/completions", {"prompt": "x"}, headers=JSON), 401, "authentication_error", None),
    ("wrong API key", _post("/v1/completions", {"prompt": "x"}, headers={"Authorization": "Bearer nope", **JSON}),
     401, "authentication_error", None),
    ("wrong auth scheme", _post("/v1/completions", {"prompt": "x"}, headers={"Authorization": f"Basic {KEY}", **JSON}),
     401, "authentication_error", None),
    ("body over the size limit", _post("/v1/completions", {"prompt": "x" * 70_000}), 413,
     "invalid_request_error", None),
    ("chunked body over the size limit", _post("/v1/completions", raw=iter([b'{"prompt": "', b"y" * 70_000, b'"}'])),
     413, "invalid_request_error", None),
    # Issue 12 (hostile callers); the raw-socket attacks are in test_server_attacks.py.
    ("logit_bias key '--1' (6)", _post("/v1/completions", {"prompt": "x", "logit_bias": {"--1": 1}}), 400,
     "invalid_request_error", "logit_bias"),
    ("logit_bias key superscript two (6)", _post("/v1/completions", {"prompt": "x", "logit_bias": {"\u00b2": 1}}),
     400, "invalid_request_error", "logit_bias"),
    ("NaN literal (10)", _post("/v1/completions", raw=b'{"prompt": "x", "temperature": NaN}'), 400,
     "invalid_request_error", None),
    ("Infinity literal (10)", _post("/v1/completions", raw=b'{"prompt": "x", "repetition_penalty": Infinity}'), 400,
     "invalid_request_error", None),
    ("temperature Infinity (10)", _post("/v1/completions", raw=b'{"prompt": "x", "temperature": Infinity}'), 400,
     "invalid_request_error", None),
    ("prompts x n over the cap (10)", _post("/v1/completions", {"prompt": ["x"] * 17, "n": 16, "max_tokens": 1}),
     400, "invalid_request_error", "n"),
    ("lone surrogate in a prompt (6)", _post("/v1/completions", raw=b'{"prompt": "a\\ud800b"}'), 400,
     "invalid_request_error", "prompt"),
    ("lone surrogate in a prompt list (6)", _post("/v1/completions", raw=b'{"prompt": ["ok", "\\udfff"]}'), 400,
     "invalid_request_error", "prompt"),
    ("lone surrogate in chat content (6)",
     _post("/v1/chat/completions", raw=b'{"messages": [{"role": "user", "content": "\\ud800"}]}'), 400,
     "invalid_request_error", "messages"),
    ("lone surrogate in a chat name (7)",
     _post("/v1/chat/completions", raw=b'{"messages": [{"role": "user", "content": "hi", "name": "\\ud800"}]}'), 400,
     "invalid_request_error", "messages"),
    ("temperature 1e999 overflows to inf (10)", _post("/v1/completions", raw=b'{"prompt": "x", "temperature": 1e999}'),
     400, "invalid_request_error", "temperature"),
    ("trailing slash is not redirected to the Host header (10)",
     _post("/v1/models/", method="GET", headers={**AUTH, "Host": "evil.example"}), 404, "not_found_error", None),
]


@pytest.mark.parametrize("name, request_spec, status, error_type, param", CASES, ids=[c[0] for c in CASES])
def test_bad_request_gets_openai_error(server, baseline, name, request_spec, status, error_type, param):
    method, path, body, raw, headers = request_spec
    with httpx.Client(base_url=server.base_url, timeout=30) as http:
        if raw is not None:
            response = http.request(method, path, content=raw, headers=headers)
        else:
            response = http.request(method, path, json=body, headers=headers)
        assert response.status_code == status, response.text
        assert "location" not in response.headers
        error = response.json()["error"]
        assert set(error) == {"message", "type", "param", "code"}
        assert error["type"] == error_type and error["message"]
        if param is not None:
            assert error["param"] == param, error
        assert "Traceback" not in response.text
    server.assert_recovered(baseline)  # /health 200, every KV block free, RSS within the bound


def test_an_invalid_request_is_answered_with_the_param_it_names():
    from llmctl.engine.errors import InvalidRequestError
    from llmctl.server.errors import from_exception

    # The message starts with another field's name: the param comes from the error, not its words.
    error = from_exception(InvalidRequestError("stop strings need a tokenizer", param="stop")).body()["error"]
    assert error["param"] == "stop" and error["code"] == "invalid_value"
    assert from_exception(InvalidRequestError("prompt-free failure")).body()["error"]["param"] is None


def test_server_still_serves_after_the_bad_requests(server):
    response = httpx.post(server.base_url + "/v1/completions", headers=AUTH, timeout=30,
                          json={"prompt": "ROMEO:", "max_tokens": 4, "ignore_eos": True})
    assert response.status_code == 200 and response.json()["usage"]["completion_tokens"] == 4
    assert response.headers["x-request-id"]
    server.wait_idle()


def test_health_and_metrics_need_no_key_but_v1_does(server):
    assert httpx.get(server.base_url + "/health").status_code == 200
    assert httpx.get(server.base_url + "/metrics").status_code == 200
    assert httpx.get(server.base_url + "/v1/models").status_code == 401


def test_rate_limit_answers_429_with_retry_after():
    with running_server(rate_limit="3/minute") as srv:
        codes = [httpx.get(srv.base_url + "/v1/models").status_code for _ in range(4)]
        assert codes == [200, 200, 200, 429]
        refused = httpx.get(srv.base_url + "/v1/models")
        assert refused.json()["error"]["type"] == "rate_limit_error"
        assert int(refused.headers["retry-after"]) >= 1
        assert httpx.get(srv.base_url + "/health").status_code == 200  # health is not rate limited


def test_full_waiting_queue_refuses_with_503_and_retry_after():
    with running_server(max_waiting_requests=2, engine_options={"max_num_seqs": 1}) as srv:
        # Freeze the engine thread (a step listener) once two requests wait behind the running one,
        # so the refusal does not race against the first request finishing.
        frozen, release = threading.Event(), threading.Event()

        def hold_when_queue_is_full(_step, stats):
            if stats.get("num_waiting", 0) >= 2 and not release.is_set():
                frozen.set()
                release.wait(30)

        srv.engine.add_step_listener(hold_when_queue_is_full)

        async def main():
            async with httpx.AsyncClient(base_url=srv.base_url, timeout=60) as http:
                long = {"prompt": "A tale", "max_tokens": 400, "ignore_eos": True}
                first = asyncio.create_task(http.post("/v1/completions", json=long))
                while srv.engine.get_stats().get("num_running", 0) < 1:
                    await asyncio.sleep(0.01)
                queued = [asyncio.create_task(http.post("/v1/completions", json={**long, "max_tokens": 2}))
                          for _ in range(2)]
                assert await asyncio.to_thread(frozen.wait, 30)
                try:
                    refused = await http.post("/v1/completions", json={"prompt": "x", "max_tokens": 2})
                finally:
                    release.set()
                done = await asyncio.gather(first, *queued)
                return refused, done

        refused, done = asyncio.run(main())
        assert refused.status_code == 503 and refused.headers["retry-after"]
        assert refused.json()["error"]["code"] == "server_overloaded"
        assert [r.status_code for r in done] == [200, 200, 200]
        srv.wait_idle()


def test_request_timeout_aborts_and_answers_504_that_the_openai_sdk_does_not_retry():
    import openai

    with running_server(request_timeout_s=0.05) as srv:  # 500 tokens take ~0.3 s idle now
        started = time.monotonic()
        response = httpx.post(srv.base_url + "/v1/completions", timeout=30,
                              json={"prompt": "A tale", "max_tokens": 500, "ignore_eos": True})
        assert response.status_code == 504 and time.monotonic() - started < 5
        assert response.headers["x-should-retry"] == "false"
        assert response.json()["error"]["code"] == "request_timeout"
        srv.wait_idle()
        client = openai.OpenAI(base_url=srv.base_url + "/v1", api_key="none", max_retries=2)
        with pytest.raises(openai.APIStatusError) as raised:
            client.completions.create(model="llmctl-default", prompt="A tale", max_tokens=500,
                                      extra_body={"ignore_eos": True})
        assert raised.value.status_code == 504
        srv.wait_idle()  # the abort reaches the engine after the 504 is sent: CI caught it still running
        served = [line for line in httpx.get(srv.base_url + "/metrics").text.splitlines()
                  if line.startswith("llmctl:http_requests_total{") and 'status="504"' in line]
        assert served and float(served[0].rsplit(" ", 1)[1]) == 2.0  # the httpx call and one SDK call: no retries
        srv.wait_idle()
        stream = httpx.post(srv.base_url + "/v1/completions", timeout=30,
                            json={"prompt": "A tale", "max_tokens": 500, "ignore_eos": True, "stream": True})
        assert stream.status_code == 200
        events = [line for line in stream.text.splitlines() if line.startswith("data: ")]
        assert '"request_timeout"' in events[-2] and events[-1] == "data: [DONE]"
        srv.wait_idle()


def test_cors_only_with_allowed_origins():
    origin = {"Origin": "https://app.example"}
    with running_server() as srv:
        assert "access-control-allow-origin" not in httpx.get(srv.base_url + "/v1/models", headers=origin).headers
    with running_server(allowed_origins=["https://app.example"]) as srv:
        headers = httpx.get(srv.base_url + "/v1/models", headers=origin).headers
        assert headers["access-control-allow-origin"] == "https://app.example"


def test_metrics_parse_and_histograms_count_the_requests():
    with running_server(served_model_name="m") as srv:
        usages = []
        for i in range(3):
            response = httpx.post(srv.base_url + "/v1/completions", timeout=30,
                                  json={"prompt": "ROMEO:" * (i + 1), "max_tokens": 5 + i, "ignore_eos": True})
            usages.append(response.json()["usage"])
        httpx.post(srv.base_url + "/v1/completions", json={"prompt": "x", "max_tokens": -1})
        families = {f.name: f for f in text_string_to_metric_families(httpx.get(srv.base_url + "/metrics").text)}

        def value(family: str, sample: str, **labels) -> float:
            return next(s.value for s in families[family].samples
                        if s.name == sample and all(s.labels.get(k) == v for k, v in labels.items()))

        for histogram in ("llmctl:time_to_first_token_seconds", "llmctl:e2e_request_latency_seconds",
                          "llmctl:request_queue_time_seconds", "llmctl:time_per_output_token_seconds"):
            assert value(histogram, histogram + "_count", model_name="m") == 3
        assert value("llmctl:prompt_tokens", "llmctl:prompt_tokens_total") == sum(u["prompt_tokens"] for u in usages)
        assert value("llmctl:generation_tokens", "llmctl:generation_tokens_total") == 5 + 6 + 7
        assert value("llmctl:http_requests", "llmctl:http_requests_total", endpoint="/v1/completions",
                     status="200") == 3
        assert value("llmctl:http_requests", "llmctl:http_requests_total", endpoint="/v1/completions",
                     status="400") == 1
        assert value("llmctl:request_success", "llmctl:request_success_total", finished_reason="length") == 3
        assert value("llmctl:batch_efficiency", "llmctl:batch_efficiency_count") > 0
        for gauge in ("llmctl:num_requests_running", "llmctl:num_requests_waiting", "llmctl:kv_cache_usage_perc",
                      "llmctl:kv_cache_fragmentation_perc", "llmctl:prefix_cache_hit_rate"):
            assert 0.0 <= value(gauge, gauge) <= 1.0
        assert value("llmctl:num_preemptions", "llmctl:num_preemptions_total") == 0


def test_audit_log_records_prompts_only_when_asked(tmp_path):
    log = tmp_path / "audit.jsonl"
    with running_server(audit_log=log, audit_log_prompts=True) as srv:
        httpx.post(srv.base_url + "/v1/completions", json={"prompt": "VISIBLE PROMPT", "max_tokens": 2}, timeout=30)
        httpx.post(srv.base_url + "/v1/completions", json={"prompt": "x", "max_tokens": -1}, timeout=30)
    first, second = [json.loads(line) for line in log.read_text().splitlines()]
    assert first["prompt"] == ["VISIBLE PROMPT"] and first["status"] == 200
    assert second["status"] == 400 and "completion_tokens" not in second
