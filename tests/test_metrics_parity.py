"""The `llmctl:*` metrics that mirror vLLM's: request (not sequence) counts, prefix-cache counters in
tokens, per-token inter-token latency, per-step token histogram, per-request token histograms, and
the names in docs/metrics.md matching what a real server exposes."""

from __future__ import annotations

import re
from pathlib import Path

import httpx
from prometheus_client.parser import text_string_to_metric_families

from llmctl.engine import EngineArgs, SamplingParams
from llmctl.engine.llm_engine import LLMEngine
from tests.server_helpers import kill_engine, running_server

DOC = Path(__file__).resolve().parents[1] / "docs" / "metrics.md"


def _scrape(base_url: str) -> dict[str, float]:
    """Every sample of the model's series, by sample name (labels other than model_name summed)."""
    samples: dict[str, float] = {}
    for family in text_string_to_metric_families(httpx.get(base_url + "/metrics", timeout=10).text):
        for sample in family.samples:
            if "le" not in sample.labels:
                samples[sample.name] = samples.get(sample.name, 0.0) + sample.value
    return samples


def test_running_and_waiting_count_requests_not_sequences(tiny_models):
    engine = LLMEngine(EngineArgs(model=str(tiny_models["llama"]), device="cpu", max_num_seqs=3,
                                  skip_tokenizer_init=True))
    engine.add_request("pair", list(range(5, 13)), SamplingParams(n=2, max_tokens=4, ignore_eos=True))
    engine.add_request("late", list(range(5, 13)), SamplingParams(max_tokens=4, ignore_eos=True))
    trace = []
    while engine.has_unfinished_requests():
        engine.step()
        stats = engine.get_stats()
        trace.append((stats["num_running"], stats["num_running_requests"]))
        assert stats["num_running_requests"] + stats["num_waiting_requests"] == len(engine.requests)
    assert (3, 2) in trace  # both samples of "pair" and "late" in the batch: two requests, not three
    stats = engine.get_stats()
    assert stats["num_running_requests"] == stats["num_waiting_requests"] == 0


def test_step_info_carries_one_inter_token_latency_per_non_first_token(tiny_models):
    engine = LLMEngine(EngineArgs(model=str(tiny_models["llama"]), device="cpu", skip_tokenizer_init=True))
    engine.add_request("a", list(range(5, 13)), SamplingParams(n=2, max_tokens=3, ignore_eos=True))
    latencies = []
    while engine.has_unfinished_requests():
        latencies.extend(engine.step().inter_token_latencies)
    assert len(latencies) == 2 * (3 - 1) and all(latency > 0 for latency in latencies)


def test_vllm_parity_metrics_count_what_the_server_did():
    prompt = "ROMEO: But, soft! what light through yonder window breaks? " * 4
    with running_server(served_model_name="m", engine_options={"block_size": 16}) as srv:
        usages = []
        for max_tokens in (6, 9):
            body = {"prompt": prompt, "max_tokens": max_tokens, "ignore_eos": True}
            usages.append(httpx.post(srv.base_url + "/v1/completions", json=body, timeout=60).json()["usage"])
        m = _scrape(srv.base_url)
    assert m["llmctl:inter_token_latency_seconds_count"] == (6 - 1) + (9 - 1)
    assert m["llmctl:request_prompt_tokens_count"] == 2
    assert m["llmctl:request_prompt_tokens_sum"] == m["llmctl:prompt_tokens_total"] == sum(
        u["prompt_tokens"] for u in usages)
    assert m["llmctl:request_generation_tokens_sum"] == m["llmctl:generation_tokens_total"] == 6 + 9
    assert m["llmctl:iteration_tokens_total_count"] == m["llmctl:batch_efficiency_count"] > 0
    assert m["llmctl:iteration_tokens_total_sum"] == m["llmctl:step_tokens_total"]
    # The second, identical prompt finds the first one's full blocks: counted in tokens, whole blocks.
    full_blocks_tokens = (usages[0]["prompt_tokens"] - 1) // 16 * 16
    assert m["llmctl:prefix_cache_queries_total"] == 2 * full_blocks_tokens
    assert m["llmctl:prefix_cache_hits_total"] == full_blocks_tokens > 0
    assert m["llmctl:num_requests_running"] == m["llmctl:num_requests_waiting"] == 0
    assert m["llmctl:engine_healthy"] == 1


def test_engine_healthy_drops_to_zero_when_the_engine_dies():
    with running_server() as srv:
        assert _scrape(srv.base_url)["llmctl:engine_healthy"] == 1
        kill_engine(srv)
        assert _scrape(srv.base_url)["llmctl:engine_healthy"] == 0


def documented_metrics() -> dict[str, str]:
    """`llmctl:*` name -> type, from the first two columns of docs/metrics.md's tables."""
    rows = re.findall(r"^\| `(llmctl:[a-z0-9_:]+)` \| (counter|gauge|histogram) \|", DOC.read_text(), re.MULTILINE)
    return dict(rows)


# Exposed only by a server with --fallback-model / --max-concurrency.
POLICY_METRICS = {"llmctl:fallback_active", "llmctl:num_requests_degraded_total", "llmctl:concurrency_limit",
                  "llmctl:concurrency_in_flight", "llmctl:concurrency_queued", "llmctl:concurrency_rejected_total"}


def _exposed_as_queried(srv) -> dict[str, str]:
    httpx.post(srv.base_url + "/v1/completions", json={"prompt": "x", "max_tokens": 2}, timeout=60)
    exposed = {f.name: f.type for f in text_string_to_metric_families(httpx.get(srv.base_url + "/metrics").text)
               if f.name.startswith("llmctl:")}
    # The parser strips `_total` from counter family names; the doc writes the names PromQL uses.
    return {name + "_total" if kind == "counter" else name: kind for name, kind in exposed.items()}


def test_docs_metrics_md_lists_exactly_the_metrics_the_server_exposes():
    with running_server() as srv:
        as_queried = _exposed_as_queried(srv)
    documented = documented_metrics()
    assert {name: kind for name, kind in documented.items() if name not in POLICY_METRICS} == as_queried


def test_docs_metrics_md_lists_exactly_the_metrics_a_server_with_both_policies_exposes(tiny_chat_model):
    from llmctl.server.concurrency import ConcurrencySettings
    from llmctl.server.runner import FallbackModel

    with running_server(fallback=FallbackModel(str(tiny_chat_model), num_kv_blocks=80), served_model_name="big",
                        fallback_served_model_name="small", concurrency=ConcurrencySettings("auto")) as srv:
        assert documented_metrics() == _exposed_as_queried(srv)
