"""Reading deploy/: the alert rules, the Grafana dashboard's queries, and the metric names a PromQL
expression uses (shared by the static deploy tests and the real-Prometheus test)."""

from __future__ import annotations

import json
import re
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parents[1]
RULES = ROOT / "deploy" / "prometheus" / "alerts.yaml"
RULE_TESTS = ROOT / "deploy" / "prometheus" / "alerts_test.yaml"
DASHBOARD = ROOT / "deploy" / "grafana" / "llmctl.json"
METRICS_DOC = ROOT / "docs" / "metrics.md"
# Names PromQL resolves that are not llmctl's: Prometheus's own scrape health and DCGM's GPU gauge.
FOREIGN_METRICS = {"up", "DCGM_FI_DEV_GPU_UTIL"}
_NOT_METRICS = {"and", "or", "unless", "bool", "offset", "le", "Inf", "NaN", "inf", "nan"}


def alert_rules() -> list[dict]:
    return [rule for group in yaml.safe_load(RULES.read_text())["groups"] for rule in group["rules"] if "alert" in rule]


def dashboard() -> dict:
    return json.loads(DASHBOARD.read_text())


def dashboard_queries(variables: dict[str, str]) -> list[tuple[str, str]]:
    """(panel title, PromQL) for every panel target and query variable, Grafana variables replaced."""
    board = dashboard()
    found = [(panel["title"], target["expr"]) for panel in board["panels"] for target in panel.get("targets", [])]
    for variable in board["templating"]["list"]:
        if variable["type"] == "query":
            query = variable["query"]["query"]
            inner = re.fullmatch(r"label_values\((.+),\s*\w+\)", query)
            found.append((f"${variable['name']}", inner.group(1) if inner else query))
    return [(title, _substitute(expr, variables)) for title, expr in found]


def _substitute(expr: str, variables: dict[str, str]) -> str:
    return re.sub(r"\$(\w+)", lambda m: variables.get(m.group(1), m.group(0)), expr)


def metric_names(expr: str) -> set[str]:
    """Metric names in a PromQL expression: identifiers that are not functions, label names,
    keywords or durations (enough for the rules' and the dashboard's style)."""
    text = re.sub(r'"[^"]*"', '""', expr)
    text = re.sub(r"\b(by|without|on|ignoring|group_left|group_right)\s*\([^)]*\)", " ", text)
    text = re.sub(r"\[[^\]]*\]", "", text)
    text = re.sub(r"\{[^}]*\}", "", text)
    names = set(re.findall(r"[A-Za-z_:][A-Za-z0-9_:]*(?![A-Za-z0-9_:]*\s*\()", text))
    return {n for n in names - _NOT_METRICS if not re.fullmatch(r"\d.*", n)}


def base_name(name: str) -> str:
    return re.sub(r"_(bucket|sum|count)$", "", name)


def documented_metrics() -> set[str]:
    return set(re.findall(r"^\| `(llmctl:[a-z0-9_:]+)` \|", METRICS_DOC.read_text(), re.MULTILINE))


def without_thresholds(expr: str) -> str:
    """The expression with its comparisons against numbers dropped (`a > 3 and b > 0` -> `a and b`):
    what it compares, which must return series whenever the metrics exist."""
    return re.sub(r"\s*(?:>=|<=|==|!=|>|<)\s*-?[0-9.]+(?:e-?[0-9]+)?", "", expr)
