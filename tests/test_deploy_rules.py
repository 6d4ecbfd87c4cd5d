"""deploy/prometheus: `promtool check rules` and `promtool test rules` pass, every alert is unit-tested
firing and not firing, says what to do, links a runbook section that exists, and queries only
metrics that docs/metrics.md lists (or DCGM's, for GPU utilisation)."""

from __future__ import annotations

import re
import shutil
import subprocess

import pytest
import yaml

from tests.deploy_helpers import (FOREIGN_METRICS, ROOT, RULE_TESTS, RULES, alert_rules, base_name, documented_metrics,
                                  metric_names, without_thresholds)

RUNBOOK = ROOT / "docs" / "operations.md"
PROMTOOL = shutil.which("promtool")
needs_promtool = pytest.mark.skipif(PROMTOOL is None, reason="promtool not installed (Debian: apt-get install "
                                                             "prometheus; .ci/run installs it)")


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
    assert without_thresholds(expr) == ('sum by (job, le) (rate(llmctl:x_bucket{status=~"5.."}[5m])) / on (job) '
                                        'llmctl:y and up{job="llmctl"}')
