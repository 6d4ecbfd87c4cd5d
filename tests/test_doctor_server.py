"""`llmctl doctor --server URL` (the `server-ready` deployment check) against real `llmctl serve`
servers on loopback: ready with a key, ready but open, dead engine, nothing listening; and its list
of alerted metrics matches the shipped alert rules."""

from __future__ import annotations

import json


from llmctl.checks.deployment import ALERTED_METRICS
from llmctl.cli import run
from tests.deploy_helpers import alert_rules, base_name, metric_names
from tests.server_helpers import free_port, kill_engine, running_server


def doctor_server(capsys, url: str, *extra: str) -> tuple[int, dict]:
    capsys.readouterr()
    code = run(["doctor", "--server", url, "--only", "server-ready", "--json", *extra])
    report = json.loads(capsys.readouterr().out)
    (result,) = report["results"]
    assert result["id"] == "server-ready" and result["area"] == "Deployment"
    return code, result


def test_alerted_metrics_are_the_ones_the_shipped_rules_query():
    used = {base_name(n) for rule in alert_rules() for n in metric_names(rule["expr"]) if n.startswith("llmctl:")}
    counters_as_families = {n.removesuffix("_total") for n in used}
    assert set(ALERTED_METRICS) == counters_as_families


def test_a_ready_server_with_an_api_key_passes(capsys):
    with running_server(api_key="secret") as srv:
        code, result = doctor_server(capsys, srv.base_url)
    assert code == 0 and result["status"] == "pass", result
    assert result["observed"]["health"] == {"code": 200, "status": "ok"} and result["observed"]["v1_models"] == 401


def test_a_server_open_to_anyone_warns(capsys):
    with running_server() as srv:
        code, result = doctor_server(capsys, srv.base_url)
        assert code == 0 and result["status"] == "warn" and "without an API key" in result["summary"]
        assert result["fix"].startswith("serve with --api-key-file")
        strict_code, _ = doctor_server(capsys, srv.base_url, "--strict")
    assert strict_code == 1


def test_a_dead_engine_fails(capsys):
    with running_server(api_key="secret") as srv:
        kill_engine(srv)
        code, result = doctor_server(capsys, srv.base_url)
    assert code == 1 and result["status"] == "fail"
    assert "/health 503 unhealthy" in result["summary"] and "engine_healthy is 0" in result["summary"]


def test_nothing_listening_fails_with_the_url(capsys):
    url = f"http://127.0.0.1:{free_port()}"
    code, result = doctor_server(capsys, url)
    assert code == 1 and result["status"] == "fail" and f"cannot reach {url}" in result["summary"]


def test_server_ready_needs_a_server_url(capsys):
    assert run(["doctor", "--only", "server-ready"]) == 2
    assert "needs --server URL" in capsys.readouterr().err
    assert run(["doctor", "--server", "10.0.0.5:8000"]) == 2
    assert "give the server's URL" in capsys.readouterr().err
