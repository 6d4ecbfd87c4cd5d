"""Cost figures (`--price-per-hour`): the arithmetic on fixed input, and the `cost` block of
`bench serve --json` (against a real `llmctl serve`) and `bench throughput --json`, computed from
the throughput the same document reports."""

from __future__ import annotations

import json

import pytest

from llmctl.bench.cost import HOURS_PER_MONTH, cost_figures
from llmctl.cli import run
from tests.server_helpers import running_server


def test_cost_per_million_tokens_and_per_month_on_fixed_input():
    # $3.60/h = $0.001/s; 1000 output tok/s -> 1M tokens in 1000 s -> $1.00.
    cost = cost_figures(3.6, requests_per_s=2.0, output_tokens_per_s=1000.0, total_tokens_per_s=4000.0,
                        monthly_request_rate=5.0)
    assert cost["usd_per_1m_output_tokens"] == pytest.approx(1.0)
    assert cost["usd_per_1m_total_tokens"] == pytest.approx(0.25)
    assert cost["instances_needed"] == 3  # 5 req/s at 2 req/s per instance
    assert cost["monthly_usd"] == pytest.approx(3 * 3.6 * 730)
    assert HOURS_PER_MONTH == 730


def test_monthly_cost_defaults_to_the_measured_rate_and_nothing_measured_gives_none():
    cost = cost_figures(2.0, requests_per_s=4.0, output_tokens_per_s=100.0, total_tokens_per_s=200.0)
    assert (cost["monthly_request_rate"], cost["instances_needed"], cost["monthly_usd"]) == (4.0, 1, 2.0 * 730)
    assert cost_figures(2.0, requests_per_s=4.0, output_tokens_per_s=100.0, total_tokens_per_s=200.0,
                        monthly_request_rate=8.0)["instances_needed"] == 2  # exactly twice: no spare instance
    empty = cost_figures(2.0, requests_per_s=0.0, output_tokens_per_s=0.0, total_tokens_per_s=0.0)
    assert empty["usd_per_1m_output_tokens"] is None and empty["monthly_usd"] is None


def _json_run(capsys, *args: str) -> tuple[int, dict, str]:
    capsys.readouterr()
    code = run(list(args))
    out, err = capsys.readouterr()
    return code, (json.loads(out) if out.strip() else {}), err


def test_bench_serve_json_reports_cost_from_its_own_throughput(capsys):
    with running_server() as server:
        code, doc, err = _json_run(capsys, "bench", "serve", "--base-url", server.base_url, "--num-prompts", "4",
                                   "--random-input-len", "16", "--random-output-len", "8", "--json",
                                   "--price-per-hour", "2.5", "--monthly-request-rate", "100")
    assert code == 0, err
    cost = doc["cost"]
    expected = cost_figures(2.5, requests_per_s=doc["request_throughput"], output_tokens_per_s=doc["output_throughput"],
                            total_tokens_per_s=doc["total_token_throughput"], monthly_request_rate=100.0)
    assert cost == expected
    assert cost["usd_per_1m_output_tokens"] == pytest.approx(2.5 / (doc["output_throughput"] * 3600) * 1e6)
    assert cost["instances_needed"] >= 1 and cost["monthly_usd"] == pytest.approx(cost["instances_needed"] * 2.5 * 730)


def test_bench_throughput_json_reports_cost_with_the_price_from_yaml(capsys, tmp_path):
    config = tmp_path / "bench.yaml"
    config.write_text("price-per-hour: 1.2\n")
    code, doc, err = _json_run(capsys, "bench", "throughput", "--num-prompts", "4", "--input-len", "8",
                               "--output-len", "4", "--device", "cpu", "--json", "--config", str(config))
    assert code == 0, err
    rate = doc["output_tokens_per_second"]["mean"]
    assert doc["cost"]["usd_per_1m_output_tokens"] == pytest.approx(1.2 / (rate * 3600) * 1e6)
    assert doc["cost"]["monthly_request_rate"] == doc["requests_per_second"]["mean"]


@pytest.mark.parametrize("args, message", [
    (["--price-per-hour", "0"], "--price-per-hour must be a positive number of USD, got 0"),
    (["--price-per-hour", "-1"], "--price-per-hour must be a positive number of USD, got -1"),
    (["--monthly-request-rate", "5"], "--monthly-request-rate needs --price-per-hour"),
    (["--price-per-hour", "2", "--monthly-request-rate", "0"], "--monthly-request-rate must be a positive number"),
])
@pytest.mark.parametrize("command", [["bench", "serve", "--base-url", "http://127.0.0.1:9"], ["bench", "throughput"]])
def test_bad_cost_flags_are_usage_errors_before_anything_runs(capsys, command, args, message):
    code, _, err = _json_run(capsys, *command, *args)
    assert code == 2 and err.count("\n") == 1 and err.startswith("llmctl: error: ") and message in err
