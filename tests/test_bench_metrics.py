"""Unit tests of `bench serve`'s math: metrics against hand-computed values, arrivals, datasets, SLO gates."""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np
import pytest

from llmctl.bench.arrivals import arrival_offsets
from llmctl.bench.datasets import (WORDS, BenchRequest, added_tokens, fit_lengths, fit_requests, file_requests, random_requests, random_text, sample_lengths,
                                   shared_prefix_requests)
from llmctl.bench.metrics import (RequestOutcome, check_slos, compute_metrics, error_samples, metric_keys,
                                  output_timeline, parse_goodput, parse_percentiles, parse_slo, percentile_key,
                                  summary_rows)
from llmctl.errors import UserError

DEFAULT_MODEL = Path(__file__).resolve().parents[1] / "llmctl" / "default_model"


def hand_example() -> list[RequestOutcome]:
    """A: 5 tokens, B: 3 tokens, C: 1 token, D: failed. Times in seconds."""
    return [
        RequestOutcome(True, prompt_len=10, output_tokens=5, token_source="usage", ttft=0.1, latency=0.5,
                       itl=[0.1, 0.1, 0.1, 0.1], start=0.0),
        RequestOutcome(True, prompt_len=20, output_tokens=3, token_source="usage", ttft=0.2, latency=1.0,
                       itl=[0.3, 0.5], start=0.5),
        RequestOutcome(True, prompt_len=30, output_tokens=1, token_source="usage", ttft=0.3, latency=0.3,
                       itl=[], start=1.2),
        RequestOutcome(False, prompt_len=40, status=503, error="overloaded", start=1.3, latency=0.01),
    ]


def test_metrics_match_hand_computed_values():
    m = compute_metrics(hand_example(), duration_s=2.0, percentiles=[50, 90, 99], peak_concurrency=3)
    assert (m["completed"], m["failed"]) == (3, 1)
    assert (m["total_input_tokens"], m["total_output_tokens"]) == (60, 9)  # the failed request's prompt is not counted
    assert m["request_throughput"] == pytest.approx(1.5)
    assert m["output_throughput"] == pytest.approx(4.5)
    assert m["total_token_throughput"] == pytest.approx(34.5)
    assert m["max_concurrent_requests"] == 3
    # TTFT 100, 200, 300 ms; numpy linear percentile: p90 at rank 0.9 x 2 = 1.8 -> 200 + 0.8 x 100
    assert m["mean_ttft_ms"] == pytest.approx(200) and m["median_ttft_ms"] == pytest.approx(200)
    assert m["std_ttft_ms"] == pytest.approx(math.sqrt(20000 / 3))  # population std, as np.std
    assert m["p50_ttft_ms"] == pytest.approx(200) and m["p90_ttft_ms"] == pytest.approx(280)
    assert m["p99_ttft_ms"] == pytest.approx(298)
    # TPOT: A (500-100)/4 = 100, B (1000-200)/2 = 400; C has one token and is left out
    assert m["mean_tpot_ms"] == pytest.approx(250) and m["median_tpot_ms"] == pytest.approx(250)
    assert m["std_tpot_ms"] == pytest.approx(150) and m["p99_tpot_ms"] == pytest.approx(397)
    # ITL pooled: 100 x4, 300, 500
    assert m["mean_itl_ms"] == pytest.approx(200) and m["median_itl_ms"] == pytest.approx(100)
    assert m["std_itl_ms"] == pytest.approx(math.sqrt(140000 / 6)) and m["p99_itl_ms"] == pytest.approx(490)
    # E2E 500, 1000, 300
    assert m["mean_e2el_ms"] == pytest.approx(600) and m["median_e2el_ms"] == pytest.approx(500)
    assert m["p90_e2el_ms"] == pytest.approx(900)
    assert m["token_count_source"] == "usage"
    assert m["error_samples"] == [{"status": 503, "message": "overloaded", "count": 1}]
    assert m["request_goodput"] is None


@pytest.mark.parametrize("slos, good", [
    ({"ttft": 250}, 2),                 # A, B
    ({"tpot": 150}, 2),                 # A (100) and C (one token: TPOT counts as 0)
    ({"ttft": 250, "tpot": 150}, 1),    # A only: every SLO must hold
    ({"e2el": 400}, 1),                 # C
    ({"ttft": 100}, 1),                 # A exactly at the limit still counts (<=)
    ({"ttft": 99.9}, 0),
])
def test_goodput_follows_vllm_semantics(slos, good):
    m = compute_metrics(hand_example(), 2.0, [99], goodput=slos)
    assert m["request_goodput"] == pytest.approx(good / 2.0)


def test_empty_run_reports_zeros_not_errors():
    m = compute_metrics([RequestOutcome(False, status=None, error="ConnectError")], 0.0, [99])
    assert m["completed"] == 0 and m["request_throughput"] == 0 and m["mean_ttft_ms"] == 0 and m["p99_itl_ms"] == 0
    assert m["token_count_source"] is None and m["max_output_tokens_per_s"] == 0


def test_percentile_keys_and_parsing():
    assert [percentile_key(p) for p in (50, 99.0, 99.9, 12.5)] == ["p50", "p99", "p99.9", "p12.5"]
    m = compute_metrics(hand_example(), 2.0, [99.9])
    assert m["p99.9_ttft_ms"] == pytest.approx(np.percentile([100, 200, 300], 99.9))
    assert parse_percentiles("50, 90,99,90") == [50.0, 90.0, 99.0]
    for bad in ("", "0", "101", "x"):
        with pytest.raises(ValueError):
            parse_percentiles(bad)


def test_output_timeline_weights_chunks_and_buckets_by_second():
    a = RequestOutcome(True, output_tokens=4, ttft=0.5, latency=1.5, itl=[0.4, 0.4, 0.2], start=0.0)  # 0.5 0.9 1.3 1.5
    b = RequestOutcome(True, output_tokens=6, ttft=0.2, latency=0.4, itl=[0.2], start=2.0)  # 2 chunks x 3 tokens
    assert output_timeline([a, b, RequestOutcome(False)]) == [2.0, 2.0, 6.0]
    assert compute_metrics([a, b], 3.0, [99])["max_output_tokens_per_s"] == 6.0


def test_token_source_mixed_and_error_samples_distinct_and_capped():
    outs = hand_example()
    outs[1].token_source = "tokenizer"
    assert compute_metrics(outs, 1.0, [99])["token_count_source"] == "mixed"
    failures = [RequestOutcome(False, status=500, error=f"e{i % 7}") for i in range(20)]
    samples = error_samples(failures)
    assert [s["message"] for s in samples] == ["e0", "e1", "e2", "e3", "e4"]
    assert samples[0]["count"] == 3  # e0 at 0, 7, 14


def test_goodput_parsing():
    assert parse_goodput(["ttft:500 tpot:50", "e2el:3000"]) == {"ttft": 500.0, "tpot": 50.0, "e2el": 3000.0}
    assert parse_goodput(["ttft:1,tpot:2"]) == {"ttft": 1.0, "tpot": 2.0}
    for bad in ("ttft=5", "itl:5", "ttft:x", "ttft:-1"):
        with pytest.raises(ValueError):
            parse_goodput([bad])


def test_slo_parsing_and_checking():
    keys = metric_keys([50, 99], with_goodput=False)
    assert {"p99_ttft_ms", "p50_e2el_ms", "mean_itl_ms", "completed", "failed", "output_throughput",
            "max_concurrent_requests"} <= set(keys)
    assert "request_goodput" not in keys and "request_goodput" in metric_keys([99], with_goodput=True)
    assert "token_count_source" not in keys and "p90_ttft_ms" not in keys
    gate = parse_slo(" p99_ttft_ms <= 500 ", keys)
    assert (gate.key, gate.op, gate.threshold, gate.text) == ("p99_ttft_ms", "<=", 500.0, "p99_ttft_ms<=500")
    result = {"p99_ttft_ms": 500.0, "failed": 2, "completed": 10}
    checks = check_slos([gate, parse_slo("p99_ttft_ms<500", keys), parse_slo("failed>0", keys),
                         parse_slo("completed>=11", keys)], result)
    assert [c["passed"] for c in checks] == [True, False, True, False]
    assert checks[3] == {"gate": "completed>=11", "key": "completed", "op": ">=", "threshold": 11.0,
                         "value": 10, "passed": False}
    assert parse_slo("mean_tpot_ms>=1e-3", keys).check({})["passed"] is False  # unmeasured never passes
    with pytest.raises(ValueError, match="valid keys: .*p99_ttft_ms"):
        parse_slo("p95_ttft_ms<1", keys)
    for bad in ("p99_ttft_ms=5", "p99_ttft_ms<", "p99_ttft_ms<abc", "p99_ttft_ms<nan", "<5"):
        with pytest.raises(ValueError):
            parse_slo(bad, keys)


def test_summary_rows_follow_the_vllm_block():
    m = compute_metrics(hand_example(), 2.0, [99], goodput={"ttft": 250})
    rows = dict(summary_rows({**m, "max_concurrency": None}, [99]))
    assert rows["Successful requests"] == "3" and rows["Failed requests"] == "1"
    assert rows["Request goodput (req/s)"] == "1.00" and rows["P99 TPOT (ms)"] == "397.00"
    assert rows["Time to First Token"] is None and rows["Maximum request concurrency"] == "unlimited"


# ---- arrivals ---------------------------------------------------------------------------------

@pytest.mark.parametrize("burstiness", [0.25, 1.0, 4.0])
def test_gamma_arrivals_have_the_asked_rate_and_variability(burstiness):
    offsets = arrival_offsets(20001, 10.0, burstiness, np.random.default_rng(7))
    gaps = np.diff(offsets)
    assert offsets[0] == 0.0 and np.all(gaps >= 0)
    assert 1.0 / gaps.mean() == pytest.approx(10.0, rel=0.03)
    assert gaps.std() / gaps.mean() == pytest.approx(1.0 / math.sqrt(burstiness), rel=0.05)


def test_arrivals_are_seeded_and_inf_sends_everything_at_once():
    a = arrival_offsets(50, 3.0, 1.0, np.random.default_rng(1))
    assert a == arrival_offsets(50, 3.0, 1.0, np.random.default_rng(1))
    assert a != arrival_offsets(50, 3.0, 1.0, np.random.default_rng(2))
    assert arrival_offsets(5, float("inf"), 1.0, np.random.default_rng(1)) == [0.0] * 5
    assert arrival_offsets(0, 1.0, 1.0, np.random.default_rng(1)) == []
    for rate, burst in ((0.0, 1.0), (-1.0, 1.0), (float("nan"), 1.0), (1.0, 0.0), (1.0, float("inf"))):
        with pytest.raises(ValueError):
            arrival_offsets(3, rate, burst, np.random.default_rng(1))


# ---- datasets ---------------------------------------------------------------------------------

def test_sample_lengths_use_the_symmetric_range():
    rng = np.random.default_rng(0)
    lens = sample_lengths(rng, 5000, 100, 0.25)
    assert min(lens) == 75 and max(lens) == 125  # both ends reachable, nothing outside
    assert sample_lengths(rng, 10, 7, 0.0) == [7] * 10
    assert min(sample_lengths(rng, 500, 2, 0.9)) == 1  # floor(0.2) -> never below 1
    with pytest.raises(UserError):
        sample_lengths(rng, 1, 10, 1.0)


def test_random_requests_without_tokenizer_are_words():
    reqs = random_requests(200, 40, 16, 0.5, np.random.default_rng(0))
    assert all(20 <= r.prompt_len <= 60 and 8 <= r.output_len <= 24 for r in reqs)
    assert all(len(r.prompt.split()) == r.prompt_len and set(r.prompt.split()) <= set(WORDS) for r in reqs)
    assert len({r.prompt for r in reqs}) == 200
    again = random_requests(200, 40, 16, 0.5, np.random.default_rng(0))
    assert [r.prompt for r in again] == [r.prompt for r in reqs]


def test_random_text_with_a_tokenizer_hits_the_token_length():
    from llmctl.engine.tokenizer import Tokenizer

    tok = Tokenizer.from_pretrained(DEFAULT_MODEL)
    rng = np.random.default_rng(0)
    targets = [length for length in (1, 8, 32, 128, 400) for _ in range(10)]
    counts = [len(tok.encode(random_text(rng, length, tok), add_special_tokens=False)) for length in targets]
    assert counts == targets


def test_shared_prefix_groups_share_their_prefix():
    reqs = shared_prefix_requests(30, 3, 50, 10, 4, 0.0, np.random.default_rng(0))
    groups: dict[int, list] = {}
    for r in reqs:
        groups.setdefault(r.group, []).append(r)
    assert sorted(groups) == [0, 1, 2] and all(len(g) == 10 for g in groups.values())
    prefixes = {}
    for group, members in groups.items():
        heads = {m.prompt.split("\n\n")[0] for m in members}
        assert len(heads) == 1 and len(next(iter(heads)).split()) == 50
        prefixes[group] = heads.pop()
        assert len({m.prompt for m in members}) == 10  # suffixes differ
    assert len(set(prefixes.values())) == 3
    assert all(r.prompt_len == 60 and r.output_len == 4 for r in reqs)
    assert [r.group for r in reqs] != sorted(r.group for r in reqs)  # interleaved, not grouped
    with pytest.raises(UserError, match="--num-prefixes"):
        shared_prefix_requests(2, 3, 5, 5, 5, 0.0, np.random.default_rng(0))


def test_file_requests_cycle_and_validate(tmp_path):
    path = tmp_path / "p.jsonl"
    path.write_text(json.dumps({"prompt": "one two three", "output_len": 9}) + "\n\n"
                    + json.dumps({"prompt": "four", "max_tokens": 3}) + "\n" + json.dumps({"prompt": "five six"}) + "\n")
    reqs = file_requests(path, 5, 64)
    assert [(r.prompt, r.prompt_len, r.output_len) for r in reqs] == [
        ("one two three", 3, 9), ("four", 1, 3), ("five six", 2, 64), ("one two three", 3, 9), ("four", 1, 3)]
    for text, message in (("{bad", ":1: not valid JSON"), ('{"text": "x"}', "non-empty string 'prompt'"),
                          ('{"prompt": "x", "output_len": 0}', "integer >= 1"), ("", "holds no prompts")):
        path.write_text(text)
        with pytest.raises(UserError, match=message):
            file_requests(path, 1, 8)
    with pytest.raises(UserError, match="cannot read"):
        file_requests(tmp_path / "missing.jsonl", 1, 8)


@pytest.mark.parametrize("lengths, ratio, context, prefix, expected", [
    ((1024, 128), 0.0, 512, 0, (384, 128, 0)),     # output kept (under half the context), prompt gets the rest
    ((1024, 128), 0.5, 512, 0, (213, 128, 0)),     # longest output 192 <= 256 kept; longest prompt 320
    ((100, 400), 0.0, 256, 0, (100, 128, 0)),      # output over half: shrinks to half, prompt fits as asked
    ((32, 16), 0.0, 512, 0, (32, 16, 0)),          # fits: unchanged
    ((200, 50), 0.0, 250, 100, (133, 50, 66)),     # shared prefix and suffix shrink in proportion
])
def test_fit_lengths_keeps_the_longest_request_inside_the_context(lengths, ratio, context, prefix, expected):
    import math

    got = fit_lengths(*lengths, ratio, context, prefix)
    assert got == expected
    in_len, out_len, pre = got
    assert pre + math.ceil(in_len * (1 + ratio)) + math.ceil(out_len * (1 + ratio)) <= context


def test_fit_requests_caps_outputs_and_counts_prompts_that_cannot_fit():
    reqs = [BenchRequest("a", 10, 5), BenchRequest("b", 28, 5), BenchRequest("c", 30, 5), BenchRequest("d", 40, 1)]
    fitted, capped, too_long = fit_requests(reqs, 30)
    assert [r.output_len for r in fitted] == [5, 2, 5, 1] and (capped, too_long) == (1, 2)


def test_added_tokens_counts_the_chat_template(tiny_chat_model):
    from llmctl.engine.tokenizer import Tokenizer

    tok = Tokenizer.from_pretrained(tiny_chat_model)
    assert added_tokens(tok, chat=False) == 1  # the BOS of its post-processor
    bare = len(tok.encode("hello", add_special_tokens=False))
    assert added_tokens(tok, chat=True) == len(tok.encode_chat([{"role": "user", "content": "hello"}])) - bare > 1


# ---- sweeps, ramp-up, failure causes, SLO-driven computation --------------------------------------

def test_arrival_times_continue_arrival_offsets_and_ramp_up_is_monotonic():
    import itertools

    from llmctl.bench.arrivals import arrival_times, ramped

    steady = list(itertools.islice(arrival_times(8.0, 1.0, np.random.default_rng([3, 1])), 50))
    assert steady == pytest.approx(arrival_offsets(50, 8.0, 1.0, np.random.default_rng([3, 1])))
    grid = np.linspace(0, 5, 501)
    walls = [ramped(s, 2.0) for s in grid]
    assert all(b > a for a, b in zip(walls, walls[1:]))
    assert ramped(1.0, 2.0) == pytest.approx(2.0) and ramped(3.0, 2.0) == pytest.approx(4.0)  # joins at R
    # Operational time s maps to wall time t with cumulative rate t^2 / 2R: half the steady arrivals by R.
    assert ramped(0.5, 2.0) == pytest.approx(math.sqrt(2.0))


def test_failures_are_counted_by_cause():
    from llmctl.bench.metrics import failures_by_cause

    outs = [RequestOutcome(False, status=500, error="boom"), RequestOutcome(False, status=None, error="ReadTimeout: x"),
            RequestOutcome(False, status=500, error="other"), RequestOutcome(False, status=200, error="engine died"),
            RequestOutcome(True, output_tokens=1)]
    assert failures_by_cause(outs) == {"HTTP 500": 2, "ReadTimeout": 1, "stream error": 1}
    m = compute_metrics(outs, 1.0, [50])
    assert m["failure_rate"] == pytest.approx(0.8) and m["failures_by_cause"]["HTTP 500"] == 2


def test_slo_needs_names_percentiles_and_metrics_to_compute():
    from llmctl.bench.metrics import parse_metric_names, slo_needs

    assert slo_needs(["p99_ttft_ms<500", "p99.5_itl_ms < 3", "mean_e2el_ms<9", "completed>1", "bad"]) == (
        [99.0, 99.5], ["ttft", "itl", "e2el"])
    assert parse_metric_names("ttft, itl,ttft") == ("ttft", "itl")
    with pytest.raises(ValueError, match="latency: expected"):
        parse_metric_names("ttft,latency")
    keys = metric_keys([99], False, ("ttft",))
    assert "p99_ttft_ms" in keys and "mean_tpot_ms" not in keys


def test_sweep_parsing_targets_and_frontier():
    from llmctl.bench.sweep import frontier, meets_targets, parse_concurrencies, parse_rates

    assert parse_rates("1, 2,inf") == [1.0, 2.0, math.inf] and parse_concurrencies(None) == [None]
    assert parse_concurrencies("1,8") == [1, 8]
    for bad in ("0", "x", ""):
        with pytest.raises(ValueError):
            parse_rates(bad)
    with pytest.raises(ValueError, match="integer >= 1"):
        parse_concurrencies("4,0")
    row = {"completed": 5, "request_throughput": 10.0, "request_goodput": 9.0, "slo": [{"passed": True}]}
    assert meets_targets(row) and not meets_targets({**row, "request_goodput": 8.9})  # 90 % attainment
    assert not meets_targets({**row, "slo": [{"passed": False}]}) and not meets_targets({**row, "completed": 0})
    rows = [{**row, "request_rate": r, "max_concurrency": None, "output_throughput": t, "request_throughput": t,
             "request_goodput": None, "meets_targets": ok} for r, t, ok in ((1.0, 1.0, True), (4.0, 3.0, True), ("inf", 5.0, False))]
    assert frontier(rows)["request_rate"] == 4.0 and frontier(rows[2:]) is None


def test_dataset_files_refuse_malformed_records_with_their_place(tmp_path):
    from llmctl.bench import dataset_files

    cases = [
        ("sharegpt", '[{"conversations": [{"from": "robot", "value": "x"}]}]', r"\[0\]: each turn needs a known 'from'"),
        ("sharegpt", '[{"conversations": [{"from": "human", "value": "q"}]}]', "holds no human turn followed by a reply"),
        ("messages", '{"prompt": "x"}\n', r":1: expected an object with a 'messages' or 'conversations' list"),
        ("messages", '{"messages": [{"role": "user", "content": "x"}], "max_tokens": 0}\n', "max_tokens must be"),
        ("trace", '{"timestamp": 1, "input_length": 0, "output_length": 2}\n', "must be integers >= 1"),
        ("trace", '{"timestamp": 1, "input_length": 3, "output_length": 2, "hash_ids": [-1]}\n', "hash_ids"),
        ("trace", '{"timestamp": 1\n', r":1: not valid JSON"),
    ]
    for kind, text, message in cases:
        path = tmp_path / f"{kind}.data"
        path.write_text(text)
        read = {"sharegpt": lambda: dataset_files.sharegpt_requests(path, 2, None),
                "messages": lambda: dataset_files.messages_requests(path, 2, 8, None),
                "trace": lambda: dataset_files.trace_requests(path, 2, 0, None)}[kind]
        with pytest.raises(UserError, match=message):
            read()
