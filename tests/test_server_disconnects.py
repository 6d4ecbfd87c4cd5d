"""A client that leaves before its answer: the server aborts its request and records a client
disconnect (one log line, status 499 in the metrics and the audit log, request_success with
finished_reason "abort"), not a server error with a traceback."""

from __future__ import annotations

import json
import logging
import socket

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from server_helpers import injected_step_latency, running_server, wait_for


def _samples(base_url: str, name: str) -> dict[tuple, float]:
    text = httpx.get(base_url + "/metrics", timeout=10).text
    return {tuple(sorted(s.labels.items())): s.value for family in text_string_to_metric_families(text)
            for s in family.samples if s.name == name}


def _aborted(base_url: str) -> float:
    return sum(v for labels, v in _samples(base_url, "llmctl:request_success_total").items()
               if ("finished_reason", "abort") in labels)


@pytest.fixture()
def server(tmp_path):
    with running_server(audit_log=tmp_path / "audit.jsonl") as srv:
        yield srv


def _send_and_leave(srv, body: dict) -> None:
    """POST `body` on a raw connection and close it once the engine runs the request."""
    payload = json.dumps(body).encode()
    with socket.create_connection(("127.0.0.1", srv.port), timeout=10) as sock:
        sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                     b"Content-Length: %d\r\n\r\n%s" % (len(payload), payload))
        wait_for(lambda: srv.engine.get_stats()["num_running_requests"] == 1, timeout_s=20, what="the request runs")


def test_a_dropped_non_streaming_request_is_a_client_disconnect_not_a_500(server, tmp_path, caplog):
    uvicorn_log = logging.getLogger("uvicorn.error")
    uvicorn_log.addHandler(caplog.handler)  # uvicorn's loggers do not propagate to the root
    try:
        with caplog.at_level(logging.INFO), injected_step_latency(server.engine, 0.05):
            _send_and_leave(server, {"prompt": "ROMEO:", "max_tokens": 300, "n": 2, "ignore_eos": True})
            wait_for(lambda: _aborted(server.base_url) == 2, timeout_s=20, what="the request counted as aborted")
    finally:
        uvicorn_log.removeHandler(caplog.handler)
    server.wait_idle()  # aborted: every KV block back
    statuses = {dict(labels)["status"]: v for labels, v in _samples(server.base_url, "llmctl:http_requests_total").items()
                if dict(labels)["endpoint"] == "/v1/completions"}
    assert statuses == {"499": 1.0}
    audit = [json.loads(line) for line in (tmp_path / "audit.jsonl").read_text().splitlines()]
    assert [(line["path"], line["status"]) for line in audit if line["path"] == "/v1/completions"] == [
        ("/v1/completions", 499)]
    disconnects = [r for r in caplog.records if "client disconnected" in r.getMessage()]
    assert len(disconnects) == 1 and disconnects[0].levelno == logging.INFO
    assert not [r for r in caplog.records if r.levelno >= logging.ERROR or r.exc_info], caplog.text[:2000]


def test_a_stream_the_client_drops_counts_as_aborted(server):
    with injected_step_latency(server.engine, 0.05):
        with httpx.stream("POST", server.base_url + "/v1/completions", timeout=30,
                          json={"prompt": "ROMEO:", "max_tokens": 300, "stream": True, "ignore_eos": True}) as answer:
            next(answer.iter_lines())  # the first event came: the request runs; then the client leaves
        wait_for(lambda: _aborted(server.base_url) == 1, timeout_s=20, what="the dropped stream counted as aborted")
    server.wait_idle()
