"""A real Prometheus (Debian's `prometheus`) on loopback scrapes a real `llmctl serve` under a short
`llmctl bench serve` load, with deploy/prometheus/alerts.yaml loaded: every query of the Grafana
dashboard and every alert expression (its comparisons dropped) returns series, every metric name
they use exists, and a copy of HighP99Latency with its threshold lowered to 0 fires.

Prometheus listens on 127.0.0.1 only, keeps its data in the test's tmp dir, and is stopped at the
end (and by `timeout` should the test process die first)."""

from __future__ import annotations

import shutil
import subprocess
import time
from pathlib import Path
from typing import Iterator

import httpx
import pytest
import yaml

from llmctl.cli import run
from tests.deploy_helpers import (FOREIGN_METRICS, RULES, alert_rules, dashboard_queries, metric_names,
                                  without_thresholds)
from tests.server_helpers import free_port, running_server

PROMETHEUS = shutil.which("prometheus")
pytestmark = [pytest.mark.slow,
              pytest.mark.skipif(PROMETHEUS is None, reason="prometheus not installed (Debian: apt-get install "
                                                            "prometheus; .ci/run installs it)")]
PROMETHEUS_LIFETIME_S = 300  # hard stop of the Prometheus process, whatever happens to the test
LOWERED = "HighP99LatencyLowered"


def lowered_rule() -> dict:
    """HighP99Latency exactly as shipped, but firing on any latency and at once."""
    rule = dict(next(r for r in alert_rules() if r["alert"] == "HighP99Latency"))
    assert rule["expr"].rstrip().endswith("> 3")
    rule.update(alert=LOWERED, expr=rule["expr"].rstrip()[: -len("> 3")] + "> 0", **{"for": "0s"})
    return rule


class Prometheus:
    def __init__(self, folder: Path, target: str):
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        shutil.copy(RULES, folder / "alerts.yaml")
        (folder / "lowered.yaml").write_text(yaml.safe_dump({"groups": [{"name": "lowered", "rules": [lowered_rule()]}]}))
        config = {
            "global": {"scrape_interval": "1s", "evaluation_interval": "1s", "scrape_timeout": "1s"},
            "rule_files": [str(folder / "alerts.yaml"), str(folder / "lowered.yaml")],
            "scrape_configs": [{"job_name": "llmctl", "static_configs": [{"targets": [target]}]}],
        }
        (folder / "prometheus.yml").write_text(yaml.safe_dump(config))
        self.log = (folder / "prometheus.log").open("w")
        command = [PROMETHEUS, f"--config.file={folder / 'prometheus.yml'}", f"--storage.tsdb.path={folder / 'data'}",
                   f"--web.listen-address=127.0.0.1:{self.port}", "--log.level=warn"]
        if shutil.which("timeout"):
            command = ["timeout", str(PROMETHEUS_LIFETIME_S), *command]
        self.proc = subprocess.Popen(command, stdout=self.log, stderr=subprocess.STDOUT, cwd=folder)
        self.log_path = folder / "prometheus.log"

    def wait_ready(self, timeout_s: float = 30) -> None:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"prometheus exited {self.proc.returncode}: {self.log_path.read_text()[-2000:]}")
            try:
                if httpx.get(self.url + "/-/ready", timeout=1).status_code == 200:
                    return
            except httpx.TransportError:
                pass
            time.sleep(0.1)
        raise RuntimeError("prometheus did not become ready")

    def api(self, path: str, **params) -> dict:
        response = httpx.get(self.url + "/api/v1/" + path, params=params, timeout=10)
        body = response.json()
        assert body["status"] == "success", (path, params, body)
        return body["data"]

    def query(self, expr: str) -> list[dict]:
        return self.api("query", query=expr)["result"]

    def stop(self) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        self.log.close()


@pytest.fixture(scope="module")
def scraped_server(tmp_path_factory) -> Iterator[tuple[Prometheus, str]]:
    # Few sequences at a time, so the load queues and the waiting/preemption series move.
    with running_server(engine_options={"max_num_seqs": 4}) as server:
        prometheus = Prometheus(tmp_path_factory.mktemp("prometheus"), server.base_url.removeprefix("http://"))
        try:
            prometheus.wait_ready()
            yield prometheus, server.base_url
        finally:
            prometheus.stop()


def wait_for(check, timeout_s: float, what: str):
    deadline = time.monotonic() + timeout_s
    while True:
        result = check()
        if result:
            return result
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.5)


def test_dashboard_and_alert_queries_return_data_and_a_lowered_rule_fires(scraped_server, capsys):
    prometheus, base_url = scraped_server
    # One request first, scraped before the load: Prometheus's rate() counts no increase into a
    # series' first sample, so histograms born during a load shorter than a scrape would read 0.
    httpx.post(base_url + "/v1/completions", json={"prompt": "ROMEO:", "max_tokens": 2}, timeout=60)
    wait_for(lambda: prometheus.query("llmctl:e2e_request_latency_seconds_count > 0"), 30, "the first scrape")
    code = run(["bench", "serve", "--base-url", base_url, "--num-prompts", "24", "--request-rate", "inf",
                "--random-input-len", "48", "--random-output-len", "12", "--json"])
    assert code == 0, capsys.readouterr().err
    # A few more scrapes and rule evaluations after the load, so every window holds it.
    time.sleep(3)

    firing = wait_for(lambda: [a for a in prometheus.api("alerts")["alerts"]
                               if a["labels"]["alertname"] == LOWERED and a["state"] == "firing"], 30,
                      f"{LOWERED} to fire")
    assert firing[0]["labels"]["model_name"] == "llmctl-default" and float(firing[0]["value"]) > 0

    names = set(prometheus.api("label/__name__/values"))
    rules = {r["name"]: r for g in prometheus.api("rules")["groups"] for r in g["rules"]}
    assert {r["alert"] for r in alert_rules()} <= set(rules)
    assert all(r["health"] == "ok" for r in rules.values()), {n: r.get("lastError") for n, r in rules.items()}

    queries = [(f"alert {r['alert']}", r["expr"]) for r in alert_rules()]
    queries += dashboard_queries({"model_name": ".*", "instance": ".*", "__rate_interval": "30s"})
    for label, expr in queries:
        used = metric_names(expr)
        assert used - FOREIGN_METRICS <= names, (label, used - FOREIGN_METRICS - names)
        if used & FOREIGN_METRICS - {"up"}:
            continue  # GPU utilisation comes from the DCGM exporter, which no CPU host runs
        assert prometheus.query(without_thresholds(expr)), (label, without_thresholds(expr))
