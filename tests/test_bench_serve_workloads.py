"""`llmctl bench serve`'s workloads, request shaping, failure handling and outputs against the in-process
FastAPI server of test_bench_serve.py, which records every body and header it receives."""

from __future__ import annotations

import csv
import json
import shutil
from pathlib import Path

import pytest

from test_bench_serve import DEFAULT_MODEL, SMALL, FakeOpenAI, ThreadServer, bench, fake  # noqa: F401 - fixture


def test_401_names_api_key_and_stops_after_the_first_requests(capsys):
    behaviour = FakeOpenAI(api_key="sk-right")
    with ThreadServer(behaviour.app()) as url:
        code, out, err = bench(capsys, "--base-url", url, "--num-prompts", "3", *SMALL)
        assert code == 2 and out == ""
        assert "answered HTTP 401" in err and "pass --api-key" in err and "--model" not in err
        # With --model the models check is skipped: the requests themselves meet the 401.
        behaviour.refused.clear()
        code, out, err = bench(capsys, "--base-url", url, "--model", "fake-model", "--num-prompts", "40",
                               "--max-concurrency", "1", *SMALL)
        assert code == 2 and out == ""
        assert "the first 4 request(s) all got HTTP 401 (Unauthorized)" in err and "pass --api-key" in err
        # Not 40: a misconfigured endpoint is not hammered.
        assert behaviour.refused == ["GET /v1/models"] + ["POST /v1/completions"] * 4
        code, out, err = bench(capsys, "--base-url", url + "/wrong", "--model", "fake-model", "--num-prompts", "9",
                               "--api-key", "sk-right", *SMALL)
        assert code == 2 and "the first 4 request(s) all got HTTP 404" in err and "check --base-url" in err
        code, out, err = bench(capsys, "--base-url", url, "--num-prompts", "2", "--api-key", "sk-right", *SMALL)
        assert code == 0, err


def test_server_dying_mid_run_exits_1_with_failures_by_cause(capsys):
    behaviour = FakeOpenAI()
    server = ThreadServer(behaviour.app())
    with server as url:
        def die_after_8(request):  # the 8th request is answered, then the server goes away
            if len(behaviour.bodies) == 8:
                server.server.should_exit = True
        behaviour.on_request = die_after_8
        code, out, err = bench(capsys, "--base-url", url, "--num-prompts", "20", "--max-concurrency", "1", *SMALL)
    assert code == 1
    doc = json.loads(out)
    assert 8 <= doc["completed"] <= 10 and doc["completed"] + doc["failed"] == 20  # a request may slip in during shutdown
    assert sum(doc["failures_by_cause"].values()) == doc["failed"] and "HTTP" not in "".join(doc["failures_by_cause"])
    assert f"llmctl: error: {doc['failed']} of 20 requests failed" in err


def test_slo_percentile_outside_percentiles_is_computed(fake, capsys):
    code, out, err = bench(capsys, "--base-url", fake.url, "--num-prompts", "3", "--percentiles", "50,95,99.9",
                           "--slo", "p99_ttft_ms<60000", "--slo", "p97.5_e2el_ms<60000", *SMALL)
    assert code == 0, err
    doc = json.loads(out)
    assert [gate["passed"] for gate in doc["slo"]] == [True, True]
    assert doc["p99_ttft_ms"] >= doc["p95_ttft_ms"] and "p97.5_e2el_ms" in doc and "p99.9_itl_ms" in doc
    code, out, err = bench(capsys, "--base-url", fake.url, "--num-prompts", "2", "--percentiles", "90",
                           "--slo", "p99_ttft_ms<60000", "--random-input-len", "4", "--random-output-len", "2")
    assert code == 0 and "P90 TTFT" in out and "P99 TTFT" not in out  # the table shows --percentiles only


def test_percentile_metrics_choose_the_latency_metrics(fake, capsys):
    code, out, err = bench(capsys, "--base-url", fake.url, "--num-prompts", "2", "--percentile-metrics", "ttft,itl",
                           "--metric-percentiles", "99", "--slo", "mean_e2el_ms<60000", *SMALL)
    assert code == 0, err
    doc = json.loads(out)
    assert "p99_ttft_ms" in doc and "mean_itl_ms" in doc and "mean_tpot_ms" not in doc
    assert "mean_e2el_ms" in doc and doc["slo"][0]["passed"]  # gated, so computed
    code, out, err = bench(capsys, "--base-url", fake.url, "--percentile-metrics", "ttft,latency", *SMALL)
    assert code == 2 and "latency: expected a comma list of ttft, tpot, itl, e2el" in err


def test_sweep_over_rates_and_concurrency_makes_one_document(fake, capsys, tmp_path):
    table, png = tmp_path / "sweep.csv", tmp_path / "curve.png"
    code, out, err = bench(capsys, "--base-url", fake.url, "--num-prompts", "4", "--request-rate", "50,inf",
                           "--max-concurrency", "1,4", "--sweep-cooldown", "0", "--slo", "p99_ttft_ms<60000",
                           "--csv", str(table), "--plot", str(png), *SMALL)
    assert code == 0, err
    doc = json.loads(out)
    points = [(row["request_rate"], row["max_concurrency"]) for row in doc["sweep"]]
    assert points == [(50.0, 1), ("inf", 1), (50.0, 4), ("inf", 4)]
    assert all(row["completed"] == 4 and row["meets_targets"] for row in doc["sweep"])
    assert len(fake.bodies) == 16 and max(row["max_concurrent_requests"] for row in doc["sweep"]) == 4
    assert doc["best_point"]["request_throughput"] == max(row["request_throughput"] for row in doc["sweep"])
    rows = list(csv.DictReader(table.open()))
    assert [(r["request_rate"], r["max_concurrency"]) for r in rows] == [("50.0", "1"), ("inf", "1"), ("50.0", "4"), ("inf", "4")]
    assert float(rows[0]["p99_ttft_ms"]) == pytest.approx(doc["sweep"][0]["p99_ttft_ms"])
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_sweep_frontier_is_the_highest_rate_meeting_the_slo(fake, capsys):
    # Steady arrivals 0.2 s apart never overlap 60 ms requests; all at once, the 4 overlap.
    code, out, err = bench(capsys, "--base-url", fake.url, "--num-prompts", "4", "--request-rate", "5,inf",
                           "--burstiness", "100", "--sweep-cooldown", "0", "--slo", "max_concurrent_requests<=1",
                           *SMALL)
    doc = json.loads(out)
    assert [row["meets_targets"] for row in doc["sweep"]] == [True, False]
    assert doc["best_point"]["request_rate"] == 5.0 and code == 0
    assert "[rate inf, concurrency unlimited] slo violated: max_concurrent_requests<=1 (measured 4)" in err
    code, out, err = bench(capsys, "--base-url", fake.url, "--num-prompts", "2", "--request-rate", "5,inf",
                           "--sweep-cooldown", "0", "--slo", "completed>2", *SMALL)
    assert code == 1 and json.loads(out)["best_point"] is None


def test_duration_and_ramp_up_bound_the_run(fake, capsys):
    fake.ttft_s = 0.001
    code, out, err = bench(capsys, "--base-url", fake.url, "--num-prompts", "3", "--duration", "0.6",
                           "--request-rate", "40", "--save-detailed", *SMALL)
    assert code == 0, err
    doc = json.loads(out)
    assert 12 <= doc["completed"] <= 40 and max(doc["start_times"]) < 0.6  # ~24 sent, prompts cycled
    code, out, err = bench(capsys, "--base-url", fake.url, "--num-prompts", "20", "--request-rate", "40",
                           "--ramp-up", "1", "--save-detailed", *SMALL)
    starts = json.loads(out)["start_times"]
    # Ramping from 0 to 40 req/s over 1 s: the first 20 requests take about 1 s, not 0.5 s.
    assert code == 0 and 0.7 < starts[-1] < 1.4
    code, out, err = bench(capsys, "--base-url", fake.url, "--duration", "1", *SMALL)
    assert code == 2 and "needs --max-concurrency" in err


def test_sharegpt_file_is_read(fake, capsys, tmp_path):
    data = tmp_path / "sharegpt.json"
    data.write_text(json.dumps([
        {"id": "a", "conversations": [{"from": "human", "value": "what is two plus two"},
                                      {"from": "gpt", "value": "it is four"}]},
        {"id": "b", "conversations": [{"from": "human", "value": "only a question"}]},  # no reply: skipped
        {"id": "c", "conversations": [{"from": "system", "value": "be brief"}, {"from": "human", "value": "hi"},
                                      {"from": "gpt", "value": "hello there friend"}]},
    ]))
    code, out, err = bench(capsys, "--base-url", fake.url, "--dataset-name", "sharegpt", "--dataset-path", str(data),
                           "--num-prompts", "3", "--max-concurrency", "1", "--json")
    assert code == 0, err
    assert [b["prompt"] for b in fake.bodies] == ["what is two plus two", "hi", "what is two plus two"]
    assert [b["max_tokens"] for b in fake.bodies] == [3, 3, 3]  # the reply's length in words (no tokenizer)
    assert json.loads(out)["dataset_name"] == "sharegpt"


def test_messages_jsonl_goes_to_chat_completions(fake, capsys, tmp_path):
    data = tmp_path / "messages.jsonl"
    convo = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "name a colour"}]
    data.write_text(json.dumps({"messages": convo, "max_tokens": 5}) + "\n")
    code, out, err = bench(capsys, "--base-url", fake.url, "--dataset-name", "messages", "--dataset-path", str(data),
                           "--num-prompts", "2", "--json")
    assert code == 0, err
    assert json.loads(out)["endpoint"] == "/v1/chat/completions"
    assert [b["messages"] for b in fake.bodies] == [convo, convo] and fake.bodies[0]["max_tokens"] == 5
    code, out, err = bench(capsys, "--base-url", fake.url, "--dataset-name", "messages", "--dataset-path", str(data),
                           "--endpoint", "completions")
    assert code == 2 and "use --endpoint chat" in err


def test_multi_turn_sends_the_history_with_the_servers_answers(fake, capsys, tmp_path):
    data = tmp_path / "conversations.jsonl"
    turns = [{"role": "user", "content": "first question"}, {"role": "assistant", "content": "one two"},
             {"role": "user", "content": "second question"}, {"role": "assistant", "content": "a b c d"},
             {"role": "user", "content": "third question"}]
    data.write_text(json.dumps({"messages": turns}) + "\n")
    code, out, err = bench(capsys, "--base-url", fake.url, "--dataset-name", "conversation", "--dataset-path",
                           str(data), "--num-prompts", "1", "--random-output-len", "3", "--save-detailed", "--json")
    assert code == 0, err
    doc = json.loads(out)
    assert doc["completed"] == 3
    answer = [" w0 w1", " w0 w1 w2 w3", " w0 w1 w2"]  # the fake server's texts, not the recorded ones
    assert [b["max_tokens"] for b in fake.bodies] == [2, 4, 3]
    assert fake.bodies[2]["messages"] == [
        {"role": "user", "content": "first question"}, {"role": "assistant", "content": answer[0]},
        {"role": "user", "content": "second question"}, {"role": "assistant", "content": answer[1]},
        {"role": "user", "content": "third question"}]
    assert doc["generated_texts"] == answer
    assert [h["x-request-id"] for h in fake.headers] == ["bench-bench-0-0", "bench-bench-0-1", "bench-bench-0-2"]


def test_trace_sends_at_timestamps_and_shares_hashed_blocks(fake, capsys, tmp_path):
    fake.ttft_s = 0.001
    data = tmp_path / "trace.jsonl"
    records = [{"timestamp": 1000, "input_length": 600, "output_length": 2, "hash_ids": [7, 8]},
               {"timestamp": 1300, "input_length": 520, "output_length": 3, "hash_ids": [7, 9]},
               {"timestamp": 1500, "input_length": 40, "output_length": 1}]
    data.write_text("\n".join(json.dumps(r) for r in records) + "\n")
    code, out, err = bench(capsys, "--base-url", fake.url, "--dataset-name", "trace", "--dataset-path", str(data),
                           "--num-prompts", "3", "--save-detailed", "--json")
    assert code == 0, err
    starts = json.loads(out)["start_times"]
    assert starts[0] < 0.1 and 0.3 <= starts[1] < 0.4 and 0.5 <= starts[2] < 0.6
    words = [b["prompt"].split() for b in fake.bodies]
    assert [len(w) for w in words] == [600, 520, 40] and [b["max_tokens"] for b in fake.bodies] == [2, 3, 1]
    assert words[0][:512] == words[1][:512] and words[0][512:520] != words[1][512:520]  # block 7 shared
    code, out, err = bench(capsys, "--base-url", fake.url, "--dataset-name", "trace", "--dataset-path", str(data),
                           "--request-rate", "4")
    assert code == 2 and "drop --request-rate" in err


def test_headers_extra_body_no_stream_and_request_ids(fake, capsys):
    code, out, err = bench(capsys, "--base-url", fake.url, "--num-prompts", "2", "--header", "X-Team=bench",
                           "--header", "X-Trace=a=b", "--extra-body", '{"top_p": 0.5, "ignore_eos": false}',
                           "--no-stream", "--request-id-prefix", "run7-", "--save-detailed", *SMALL)
    assert code == 0, err
    doc = json.loads(out)
    assert doc["completed"] == 2 and doc["stream"] is False and doc["total_output_tokens"] == 6
    assert doc["ttfts"] == doc["e2els"]  # one answer: the first token arrives with the last
    body = fake.bodies[0]
    assert body["stream"] is False and "stream_options" not in body
    assert body["top_p"] == 0.5 and body["ignore_eos"] is False  # --extra-body wins over the defaults
    assert fake.headers[0]["x-team"] == "bench" and fake.headers[0]["x-trace"] == "a=b"
    assert sorted(doc["request_ids"]) == ["run7-bench-0", "run7-bench-1"]
    assert sorted(h["x-request-id"] for h in fake.headers) == ["run7-bench-0", "run7-bench-1"]
    for args, message in ((["--header", "nokey"], "expected KEY=VALUE"), (["--extra-body", "[1]"], "JSON object"),
                          (["--extra-body", "{x"], "not valid JSON")):
        code, out, err = bench(capsys, "--base-url", fake.url, *args, *SMALL)
        assert code == 2 and message in err


def test_save_result_appends_jsonl_with_label_and_metadata(fake, capsys, tmp_path):
    saved = tmp_path / "runs.jsonl"
    for label in ("before", "after"):
        code, _, err = bench(capsys, "--base-url", fake.url, "--num-prompts", "2", "--save-result", str(saved),
                             "--label", label, "--metadata", "gpu=none", "--metadata", "commit=abc", *SMALL)
        assert code == 0, err
    lines = [json.loads(line) for line in saved.read_text().splitlines()]
    assert [line["label"] for line in lines] == ["before", "after"]
    assert lines[0]["metadata"] == {"gpu": "none", "commit": "abc"} and lines[1]["completed"] == 2
    code, out, err = bench(capsys, "--base-url", fake.url, "--num-prompts", "1", "--result-dir", str(tmp_path),
                           "--label", "nightly", *SMALL)
    written = list(tmp_path.glob("nightly-infqps-fake-model-*.json"))
    assert code == 0 and len(written) == 1 and json.loads(written[0].read_text()) == json.loads(out)


def test_tokenizer_from_the_hugging_face_cache(fake, capsys, tmp_path, monkeypatch):
    from huggingface_hub import constants

    snapshot = tmp_path / "models--acme--tiny" / "snapshots" / "0123abcd"
    snapshot.mkdir(parents=True)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(DEFAULT_MODEL / name, snapshot / name)
    (tmp_path / "models--acme--tiny" / "refs").mkdir()
    (tmp_path / "models--acme--tiny" / "refs" / "main").write_text("0123abcd")
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path))
    code, out, err = bench(capsys, "--base-url", fake.url, "--num-prompts", "1", "--tokenizer", "acme/tiny", *SMALL)
    assert code == 0, err
    assert json.loads(out)["tokenizer"] == str(snapshot)
    code, out, err = bench(capsys, "--base-url", fake.url, "--num-prompts", "1", "--tokenizer", "acme/absent", *SMALL)
    assert code == 2 and "no tokenizer.json for the Hugging Face model 'acme/absent' in the local cache" in err
