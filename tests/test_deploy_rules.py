"""deploy/prometheus: `promtool check rules` and `promtool test rules` pass, every alert is unit-tested
firing and not firing, says what to do, links a runbook section that exists, and queries only
metrics that docs/metrics.md lists (or DCGM's, for GPU utilisation)."""

from __future__ import annotations

import re
import shutil
import subprocess
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[1]
RULES = ROOT / "deploy" / "prometheus" / "alerts.yaml"
RULE_TESTS = ROOT / "deploy" / "prometheus" / "alerts_test.yaml"
RUNBOOK = ROOT / "docs" / "operations.md"
METRICS_DOC = ROOT / "docs" / "metrics.md"
# Names PromQL resolves that are not llmctl's: Prometheus's own scrape health and DCGM's GPU gauge.
FOREIGN_METRICS = {"up", "DCGM_FI_DEV_GPU_UTIL"}

PROMTOOL = shutil.which("promtool")
needs_promtool = pytest.mark.skipif(PROMTOOL is None, reason="promtool not installed (Debian: apt-get install "
                                                             "prometheus; .ci/run installs it)")


def alert_rules() -> list[dict]:
    return [rule for group in yaml.safe_load(RULES.read_text())["groups"] for rule in group["rules"] if "alert" in rule]


def metric_names(expr: str) -> set[str]:
    """Metric names in a PromQL expression: identifiers not followed by '(' and not label names,
    keywords or durations (good enough for the rules' and dashboard's own style)."""
    without_strings = re.sub(r'"[^"]*"', '""', expr)
    without_groupings = re.sub(r"\b(by|without|on|ignoring|group_left|group_right)\s*\([^)]*\)", " ", without_strings)
    without_ranges = re.sub(r"\[[^\]]*\]", "", without_groupings)
    without_labels = re.sub(r"\{[^}]*\}", "", without_ranges)
    names = set(re.findall(r"[A-Za-z_:][A-Za-z0-9_:]*(?![A-Za-z0-9_:]*\s*\()", without_labels))
    return names - {"and", "or", "unless", "bool", "offset", "le", "Inf", "NaN", "inf", "nan"}


def base_name(name: str) -> str:
    return re.sub(r"_(bucket|sum|count)$", "", name)


def documented_metrics() -> set[str]:
    return set(re.findall(r"^\| `(llmctl:[a-z0-9_:]+)` \|", METRICS_DOC.read_text(), re.MULTILINE))


def runbook_anchors() -> set[str]:
    """GitHub's anchors for the runbook's headings."""
    headings = re.findall(r"^#+ (.+)$", RUNBOOK.read_text(), re.MULTILINE)
    return {re.sub(r"[^a-z0-9 _-]", "", h.strip().lower()).replace(" ", "-") for h in headings}


@needs_promtool
def test_promtool_check_rules_passes():
    proc = subprocess.run([PROMTOOL, "check", "rules", str(RULES)], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert f"SUCCESS: {len(alert_rules())} rules found" in proc.stdout


@needs_promtool
def test_promtool_unit_tests_pass():
    proc = subprocess.run([PROMTOOL, "test", "rules", str(RULE_TESTS)], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stdout + proc.stderr


@needs_promtool
def test_promtool_unit_tests_fail_when_a_threshold_changes(tmp_path):
    """The unit tests pin the thresholds: a rules file with HighP99Latency at 5 s fails them."""
    (tmp_path / "alerts.yaml").write_text(RULES.read_text().replace(
        "(rate(llmctl:e2e_request_latency_seconds_bucket[5m]))) > 3", "(rate(llmctl:e2e_request_latency_seconds_bucket[5m]))) > 5"))
    shutil.copy(RULE_TESTS, tmp_path / "alerts_test.yaml")
    proc = subprocess.run([PROMTOOL, "test", "rules", "alerts_test.yaml"], cwd=tmp_path, capture_output=True,
                          text=True, timeout=120)
    assert proc.returncode != 0 and "HighP99Latency" in proc.stdout + proc.stderr


def test_each_alert_is_unit_tested_firing_and_not_firing():
    tested: dict[str, list[bool]] = {}
    for group in yaml.safe_load(RULE_TESTS.read_text())["tests"]:
        for case in group["alert_rule_test"]:
            tested.setdefault(case["alertname"], []).append(bool(case["exp_alerts"]))
    for rule in alert_rules():
        assert sorted(set(tested.get(rule["alert"], []))) == [False, True], rule["alert"]


def test_each_alert_says_what_to_do_and_links_an_existing_runbook_section():
    anchors = runbook_anchors()
    for rule in alert_rules():
        notes = rule["annotations"]
        assert notes["summary"] and len(notes["description"]) > 80, rule["alert"]
        assert rule["labels"]["severity"] in {"info", "warning", "critical"}
        page, _, anchor = notes["runbook_url"].partition("#")
        assert page == "docs/operations.md" and anchor == rule["alert"].lower() and anchor in anchors, rule["alert"]


def test_alerts_query_only_documented_metrics():
    documented = documented_metrics()
    for rule in alert_rules():
        names = {base_name(n) for n in metric_names(rule["expr"])}
        assert names, rule["alert"]
        assert names - FOREIGN_METRICS <= documented, (rule["alert"], names - FOREIGN_METRICS - documented)


def test_metric_name_extraction_sees_through_promql():
    expr = ('sum by (job, le) (rate(llmctl:x_bucket{status=~"5.."}[5m])) / on (job) llmctl:y > 0.5 '
            'and up{job="llmctl"} == 0')
    assert metric_names(expr) == {"llmctl:x_bucket", "llmctl:y", "up"}
