"""The admission limit against a real server on loopback: `--max-concurrency auto` raises the
limit while first tokens come fast and lowers it when latency is injected into the engine's steps;
a fixed limit refuses the excess with an OpenAI-shaped 503 and Retry-After, or queues it; every
slot and KV block is given back."""

from __future__ import annotations

import threading
import time

import httpx
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

from llmctl.server.concurrency import ConcurrencySettings
from tests.server_helpers import injected_step_latency, running_server, wait_for


def _gauge(base_url: str, name: str) -> float:
    for family in text_string_to_metric_families(httpx.get(base_url + "/metrics", timeout=10).text):
        if family.name == name:
            return sum(sample.value for sample in family.samples)
    raise AssertionError(f"/metrics has no {name}")


class _Load:
    """`clients` threads sending small completions back to back until stopped."""

    def __init__(self, base_url: str, clients: int, max_tokens: int):
        self.base_url, self.max_tokens = base_url, max_tokens
        self.statuses: list[int] = []
        self.stopped = threading.Event()
        self.threads = [threading.Thread(target=self._loop, daemon=True) for _ in range(clients)]

    def _loop(self) -> None:
        body = {"prompt": "To be, or not to be", "max_tokens": self.max_tokens, "ignore_eos": True}
        with httpx.Client(base_url=self.base_url, timeout=120) as client:
            while not self.stopped.is_set():
                status = client.post("/v1/completions", json=body).status_code
                self.statuses.append(status)
                if status == 503:
                    time.sleep(0.05)

    def __enter__(self) -> "_Load":
        for thread in self.threads:
            thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self.stopped.set()
        for thread in self.threads:
            thread.join(120)


def test_auto_limit_rises_under_fast_first_tokens_and_falls_with_injected_latency():
    # One-token requests: each is one prefill step, so time to first token is the whole request and
    # every step that runs finishes its batch (a sample per request, soon after the latency changes).
    settings = ConcurrencySettings("auto", min_limit=1, max_limit=32, initial_limit=3, target_ttft_s=2.5,
                                   window_s=0.3)
    with running_server(concurrency=settings) as srv:
        assert _gauge(srv.base_url, "llmctl:concurrency_limit") == 3
        with _Load(srv.base_url, clients=8, max_tokens=1) as load:
            wait_for(lambda: _gauge(srv.base_url, "llmctl:concurrency_limit") >= 6, 90, "the limit to rise to 6")
            peak = _gauge(srv.base_url, "llmctl:concurrency_limit")
            with injected_step_latency(srv.engine, 4.0):  # first tokens now miss the 2.5 s target
                wait_for(lambda: _gauge(srv.base_url, "llmctl:concurrency_limit") <= peak - 2, 120,
                          "the limit to fall")
        assert 200 in load.statuses and set(load.statuses) <= {200, 503}
        assert _gauge(srv.base_url, "llmctl:concurrency_rejected") == load.statuses.count(503)
        wait_for(lambda: _gauge(srv.base_url, "llmctl:concurrency_in_flight") == 0, 30, "no request in flight")
        srv.wait_idle()


@pytest.fixture()
def one_slot_server():
    with running_server(concurrency=ConcurrencySettings("1")) as srv:
        yield srv


def test_a_fixed_limit_refuses_the_excess_with_an_openai_503_and_retry_after(one_slot_server):
    srv = one_slot_server
    client = openai.OpenAI(base_url=srv.base_url + "/v1", api_key="unused", max_retries=0)
    with injected_step_latency(srv.engine, 0.05):  # the stream below lasts at least 20 s on any machine
        stream = client.completions.create(model="llmctl-default", prompt="A long tale", max_tokens=400,
                                           stream=True, extra_body={"ignore_eos": True})
        next(iter(stream))  # the stream holds the one slot
        with pytest.raises(openai.InternalServerError) as refused:
            client.completions.create(model="llmctl-default", prompt="x", max_tokens=2)
        assert httpx.get(srv.base_url + "/v1/models").status_code == 200  # only completions are limited
        stream.close()
    assert refused.value.status_code == 503
    assert refused.value.response.headers["Retry-After"] == "1"
    assert refused.value.body["code"] == "concurrency_limit_exceeded"
    assert refused.value.body["type"] == "service_unavailable"
    wait_for(lambda: _gauge(srv.base_url, "llmctl:concurrency_in_flight") == 0, 30, "the slot to come back")
    assert client.completions.create(model="llmctl-default", prompt="x", max_tokens=2).choices
    assert _gauge(srv.base_url, "llmctl:concurrency_rejected") == 1
    srv.wait_idle()


def test_a_queued_request_waits_for_the_slot_instead_of_a_503():
    with running_server(concurrency=ConcurrencySettings("1", queue_size=1, queue_timeout_s=60)) as srv:
        queued: list[httpx.Response] = []
        waiter = threading.Thread(target=lambda: queued.append(httpx.post(
            srv.base_url + "/v1/completions", json={"prompt": "x", "max_tokens": 2}, timeout=120)))
        with injected_step_latency(srv.engine, 0.05):
            with httpx.stream("POST", srv.base_url + "/v1/completions", timeout=60,
                              json={"prompt": "A long tale", "max_tokens": 400, "ignore_eos": True,
                                    "stream": True}) as holder:
                lines = holder.iter_lines()  # kept: a dropped line iterator closes the connection
                next(lines)  # the stream holds the one slot
                waiter.start()
                wait_for(lambda: _gauge(srv.base_url, "llmctl:concurrency_queued") == 1, 30, "a queued request")
                assert not queued  # still waiting, not refused
        waiter.join(120)  # the holder left: its slot goes to the queued request
        assert queued[0].status_code == 200
        assert _gauge(srv.base_url, "llmctl:concurrency_rejected") == 0
        assert _gauge(srv.base_url, "llmctl:concurrency_queued") == 0
        srv.wait_idle()


def _bench(capsys, *args: str) -> tuple[int, dict]:
    import json

    from llmctl.cli import run

    capsys.readouterr()
    code = run(["bench", "serve", *args, "--json"])
    return code, json.loads(capsys.readouterr().out)


def test_bench_serve_against_a_fixed_limit_with_and_without_a_queue(capsys):
    load = ("--num-prompts", "12", "--request-rate", "inf", "--random-input-len", "16", "--random-output-len", "8")
    with running_server(concurrency=ConcurrencySettings("2", queue_size=16, queue_timeout_s=120)) as srv:
        code, doc = _bench(capsys, "--base-url", srv.base_url, *load)
        assert code == 0 and (doc["completed"], doc["failed"]) == (12, 0), doc["error_samples"]
        assert _gauge(srv.base_url, "llmctl:concurrency_rejected") == 0
        srv.wait_idle()
    with running_server(concurrency=ConcurrencySettings("2")) as srv:
        with injected_step_latency(srv.engine, 0.05):  # the first two outlast the other ten's arrival
            code, doc = _bench(capsys, "--base-url", srv.base_url, *load)
        assert doc["completed"] >= 2 and doc["failed"] >= 1 and doc["completed"] + doc["failed"] == 12
        assert _gauge(srv.base_url, "llmctl:concurrency_rejected") == doc["failed"]
        assert any("concurrency limit" in sample for sample in map(str, doc["error_samples"]))
        srv.wait_idle()
