"""`server-ready` (`llmctl doctor --server URL`): is a running `llmctl serve` ready for traffic and for
the shipped monitoring? Reads /health, /metrics and /v1/models; sends no completion."""

from __future__ import annotations

from typing import Any

from llmctl.checks.model import Finding, Result, Status, fold
from llmctl.checks.settings import Plan

# The llmctl metrics deploy/prometheus/alerts.yaml queries (tests/test_doctor_server.py keeps the two
# in step): a server without one of them leaves an alert that can never fire.
ALERTED_METRICS = (
    "llmctl:batch_efficiency", "llmctl:e2e_request_latency_seconds", "llmctl:engine_healthy",
    "llmctl:http_requests", "llmctl:kv_cache_fragmentation_perc", "llmctl:kv_cache_usage_perc",
    "llmctl:num_preemptions", "llmctl:num_requests_running", "llmctl:num_requests_waiting",
    "llmctl:time_to_first_token_seconds",
)
TIMEOUT_S = 5.0


def server_ready(_host: Any, plan: Plan) -> Result:
    """The server at --server URL: GET /health answers 200 (not 503 "starting" while the model
    loads and warms up, nor 503 "unhealthy" once the engine died); GET /metrics exposes every
    llmctl metric the shipped alert rules query, with llmctl:engine_healthy at 1; GET /v1/models
    lists the served model, or answers 401 because an API key is required (a /v1 open to anyone
    who reaches the port warns). Nothing is generated."""
    import httpx

    url = plan.server.rstrip("/")
    findings: list[Finding] = []
    observed: dict[str, Any] = {"url": url}
    with httpx.Client(base_url=url, timeout=TIMEOUT_S) as client:
        try:
            health = client.get("/health")
        except httpx.HTTPError as exc:
            fix = "start it (llmctl serve --host 0.0.0.0 ...) or correct --server"
            return fold("server-ready", [Finding(Status.FAIL, f"cannot reach {url}: {type(exc).__name__}: {exc}",
                                                 fix)], observed, "a reachable llmctl serve")
        findings.append(_health(health, observed))
        findings.append(_metrics(client, observed))
        findings.append(_models(client, observed))
    return fold("server-ready", findings, observed, {"health": 200, "metrics": list(ALERTED_METRICS),
                                                     "v1": "401 without a key, or models listed"})


def _json(response: Any) -> dict:
    try:
        body = response.json()
    except ValueError:
        return {}
    return body if isinstance(body, dict) else {}


def _health(response: Any, observed: dict[str, Any]) -> Finding:
    status = _json(response).get("status")
    observed["health"] = {"code": response.status_code, "status": status}
    if response.status_code == 200:
        return Finding(Status.PASS, "/health 200: serving")
    if response.status_code == 503 and status == "starting":
        return Finding(Status.FAIL, "/health 503 starting: the model is still loading or warming up",
                       "wait for the readiness probe; a pod stuck here needs a longer startupProbe")
    if response.status_code == 503 and status == "unhealthy":
        return Finding(Status.FAIL, f"/health 503 unhealthy: {_json(response).get('error', 'engine stopped')}",
                       "restart the server and read its log for why the engine died")
    return Finding(Status.FAIL, f"/health answered {response.status_code}, not llmctl's 200/503",
                   "check that --server points at llmctl serve, not a proxy or another service")


def _metrics(client: Any, observed: dict[str, Any]) -> Finding:
    from prometheus_client.parser import text_string_to_metric_families

    response = client.get("/metrics")
    if response.status_code != 200:
        return Finding(Status.FAIL, f"/metrics answered {response.status_code}", "expose /metrics to the scraper")
    try:
        families = {f.name: f for f in text_string_to_metric_families(response.text)}
    except ValueError as exc:
        return Finding(Status.FAIL, f"/metrics is not Prometheus text: {exc}", None)
    missing = [name for name in ALERTED_METRICS if name not in families]
    observed["metrics_missing"] = missing
    if missing:
        return Finding(Status.WARN, f"/metrics lacks {', '.join(missing)}: alerts on them can never fire",
                       "upgrade llmctl on the server to the version whose alert rules you load")
    healthy = [s.value for s in families["llmctl:engine_healthy"].samples]
    if healthy and min(healthy) < 1:
        return Finding(Status.FAIL, "llmctl:engine_healthy is 0: the engine died", "restart the server")
    return Finding(Status.PASS, f"/metrics exposes the {len(ALERTED_METRICS)} metrics the alert rules use")


def _models(client: Any, observed: dict[str, Any]) -> Finding:
    response = client.get("/v1/models")
    observed["v1_models"] = response.status_code
    if response.status_code == 401:
        return Finding(Status.PASS, "/v1 requires an API key")
    if response.status_code != 200:
        return Finding(Status.FAIL, f"/v1/models answered {response.status_code}", None)
    models = [m.get("id") for m in _json(response).get("data", []) if isinstance(m, dict)]
    observed["models"] = models
    if not models:
        return Finding(Status.FAIL, "/v1/models lists no model", None)
    return Finding(Status.WARN, f"/v1 answers without an API key (serving {', '.join(map(str, models))}): "
                   "anyone who reaches the port can use it",
                   "serve with --api-key-file (or LLMCTL_API_KEY) unless a gateway authenticates")
