"""deploy/grafana/llmctl.json: a dashboard whose data source is a variable, with the panels the
operations guide promises, querying only metrics docs/metrics.md lists. (That each query returns
data from a real server is tests/test_deploy_prometheus.py.)"""

from __future__ import annotations

import re

from tests.deploy_helpers import base_name, dashboard, dashboard_queries, documented_metrics, metric_names

VARIABLES = {"model_name": ".*", "instance": ".*", "__rate_interval": "1m"}


def test_the_data_source_is_a_variable_every_panel_uses():
    board = dashboard()
    variables = {v["name"]: v for v in board["templating"]["list"]}
    assert variables["datasource"]["type"] == "datasource" and variables["datasource"]["query"] == "prometheus"
    for panel in board["panels"]:
        if panel["type"] == "row":
            continue
        assert panel["datasource"]["uid"] == "${datasource}", panel["title"]
        assert panel["targets"] and all(t["datasource"]["uid"] == "${datasource}" for t in panel["targets"])
        assert len({t["refId"] for t in panel["targets"]}) == len(panel["targets"])
    assert len({p["id"] for p in board["panels"]}) == len(board["panels"])


def test_the_promised_panels_are_there():
    used = {base_name(name) for _, expr in dashboard_queries(VARIABLES) for name in metric_names(expr)}
    promised = {"llmctl:time_to_first_token_seconds", "llmctl:time_per_output_token_seconds",
                "llmctl:inter_token_latency_seconds", "llmctl:e2e_request_latency_seconds",
                "llmctl:generation_tokens_total", "llmctl:num_requests_running", "llmctl:num_requests_waiting",
                "llmctl:kv_cache_usage_perc", "llmctl:kv_cache_fragmentation_perc", "llmctl:batch_efficiency",
                "llmctl:prefix_cache_hits_total", "llmctl:prefix_cache_queries_total", "llmctl:http_requests_total"}
    assert promised <= used


def test_the_dashboard_queries_only_documented_metrics():
    documented = documented_metrics()
    for title, expr in dashboard_queries(VARIABLES):
        names = {base_name(n) for n in metric_names(expr)}
        assert names and names <= documented, (title, names - documented)


def test_queries_use_only_variables_the_dashboard_defines():
    defined = {v["name"] for v in dashboard()["templating"]["list"]} | {"__rate_interval"}  # Grafana's own
    for title, expr in dashboard_queries({}):
        assert set(re.findall(r"\$(\w+)", expr)) <= defined, (title, expr)
