"""Prometheus metrics for `/metrics`, named `llmctl:*` after vLLM's `vllm:*` so dashboards port.

Owns one `CollectorRegistry` per server (no process-global state): request counters and latency
histograms observed by the handlers, per-step batch efficiency observed on the engine thread, and
gauges/counters read from the engine's stats snapshot at scrape time. With data-parallel replicas
every per-model series also carries an `engine` label (the replica's index, as vLLM labels its
data-parallel engines); totals are their sum (`sum without (engine) (...)`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Iterator, Optional

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, disable_created_metrics, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

from llmctl.engine.llm_engine import StepInfo
from llmctl.engine.outputs import RequestOutput

LATENCY_BUCKETS = (0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
                   20.0, 40.0, 80.0, 160.0)
TOKEN_LATENCY_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75,
                         1.0, 2.5, 5.0)
RATIO_BUCKETS = (0.01, 0.05, 0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9, 0.95, 1.0)


def _one_two_five(limit: int) -> tuple[float, ...]:
    """1, 2, 5, 10, 20, 50, ... up to `limit` (vLLM's token-count buckets)."""
    buckets, scale = [], 1
    while scale <= limit:
        buckets.extend(b for b in (scale, 2 * scale, 5 * scale) if b <= limit)
        scale *= 10
    return tuple(float(b) for b in buckets)


# Tokens per request and per engine step; 1-2-5 steps up to 1M tokens (longer than any context).
TOKEN_COUNT_BUCKETS = _one_two_five(1_000_000)


# The engine's stats carry one `spec_decode_num_accepted_tokens_pos_<j>` per draft position.
SPEC_PER_POS = "llmctl:spec_decode_num_accepted_tokens_per_pos"
SPEC_POS_PREFIX = "spec_decode_num_accepted_tokens_pos_"


@dataclass
class _EngineSource:
    labels: tuple[str, ...]  # model_name, plus the replica index with data parallelism
    stats: Callable[[], dict[str, float]]
    healthy: Callable[[], bool]
    load: Callable[[dict[str, float]], float]


class _EngineStatsCollector(Collector):
    """Reads each engine's latest snapshot when Prometheus scrapes (one series per served model)."""

    def __init__(self, label_names: list[str]) -> None:
        self.label_names = label_names
        self.engines: list[_EngineSource] = []

    def collect(self) -> Iterator:
        families: dict[str, Any] = {}
        per_pos = CounterMetricFamily(SPEC_PER_POS, "Draft tokens accepted, by their position in the draft.",
                                      labels=self.label_names + ["position"])
        for engine in self.engines:
            stats = engine.stats()
            for family_type, name, doc, value in self._rows(engine, stats):
                family = families.get(name)
                if family is None:
                    family = families[name] = family_type(name, doc, labels=self.label_names)
                family.add_metric(list(engine.labels), float(value))
            for key, value in stats.items():
                if key.startswith(SPEC_POS_PREFIX):
                    per_pos.add_metric([*engine.labels, key[len(SPEC_POS_PREFIX):]], float(value))
        yield from families.values()
        yield per_pos

    @staticmethod
    def _rows(engine: _EngineSource, stats: dict[str, float]) -> Iterator[tuple[Any, str, str, float]]:
        gauges = [
            ("llmctl:num_requests_running", "Requests with a sequence in the running batch.",
             stats.get("num_running_requests", 0)),
            ("llmctl:num_requests_waiting", "Requests waiting to be scheduled (queued, preempted or not yet "
             "admitted).", stats.get("num_waiting_requests", 0) + stats.get("num_pending", 0)),
            ("llmctl:kv_cache_usage_perc", "Fraction of KV-cache blocks in use (1 = full).",
             stats.get("kv_cache_usage", 0.0)),
            ("llmctl:kv_cache_fragmentation_perc", "Fraction of the running sequences' allocated KV slots "
             "that hold no token.", stats.get("kv_cache_fragmentation", 0.0)),
            ("llmctl:prefix_cache_hit_rate", "Share of prefix-cache block queries that hit, since start.",
             stats.get("prefix_cache_hit_rate", 0.0)),
            ("llmctl:kv_cache_free_blocks", "Free KV-cache blocks.", stats.get("num_free_blocks", 0)),
            ("llmctl:step_token_budget", "Tokens a step may compute now (below --max-num-batched-tokens for "
             "a while after a step ran out of memory).", stats.get("token_budget", 0)),
            ("llmctl:engine_healthy", "1 while the engine thread runs (warming up or serving), 0 once it died.",
             1.0 if engine.healthy() else 0.0),
            ("llmctl:load_signal", "The engine's load, 0..1: the largest of KV-cache usage, running requests / "
             "max_num_seqs and waiting requests / the admission limit (what --fallback-at compares).",
             engine.load(stats)),
        ]
        counters = [
            ("llmctl:num_preemptions", "Sequences preempted (KV cache full).", stats.get("num_preemptions", 0)),
            ("llmctl:num_oom_retries", "Engine steps that ran out of memory and were retried smaller.",
             stats.get("num_oom_retries", 0)),
            ("llmctl:num_draft_oom_skips", "Draft-model rounds dropped (those sequences decoded without drafts) "
             "because the draft's forward ran out of memory.", stats.get("num_draft_oom_skips", 0)),
            ("llmctl:num_capacity_errors", "Requests finished with a capacity error (503): out of memory "
             "even alone at the smallest chunk.", stats.get("num_capacity_errors", 0)),
            ("llmctl:prefix_cache_queries", "Prompt tokens looked up in the prefix cache (whole blocks).",
             stats.get("prefix_cache_queries", 0)),
            ("llmctl:prefix_cache_hits", "Prompt tokens found in the prefix cache (whole blocks).",
             stats.get("prefix_cache_hits", 0)),
            ("llmctl:spec_decode_num_drafts", "Verify rows run (sequences that carried draft tokens into a step).",
             stats.get("spec_decode_num_drafts", 0)),
            ("llmctl:spec_decode_num_draft_tokens", "Draft tokens verified.",
             stats.get("spec_decode_num_draft_tokens", 0)),
            ("llmctl:spec_decode_num_accepted_tokens", "Draft tokens accepted.",
             stats.get("spec_decode_num_accepted_tokens", 0)),
        ]
        for family_type, rows in ((GaugeMetricFamily, gauges), (CounterMetricFamily, counters)):
            for name, doc, value in rows:
                yield family_type, name, doc, value


class ServerMetrics:
    """`engine_labelled`: data parallelism, where each model's series are per replica (`engine` label);
    the engine given here is then replica 0 and `add_engine` adds the others."""

    def __init__(self, model_name: str, engine_stats: Callable[[], dict[str, float]],
                 engine_healthy: Callable[[], bool], engine_load: Callable[[dict[str, float]], float],
                 engine_labelled: bool = False):
        disable_created_metrics()  # the *_created samples double every series for no dashboard use
        self.registry = CollectorRegistry(auto_describe=True)
        self.model_name = model_name
        self.engine_labelled = engine_labelled
        labels = ["model_name"] + (["engine"] if engine_labelled else [])
        r = self.registry
        self.http_requests = Counter("llmctl:http_requests", "HTTP requests by endpoint and status code.",
                                     ["endpoint", "status"], registry=r)
        self.request_success = Counter("llmctl:request_success", "Finished requests by finish reason.",
                                       labels + ["finished_reason"], registry=r)
        self.prompt_tokens = Counter("llmctl:prompt_tokens", "Prompt tokens processed.", labels, registry=r)
        self.generation_tokens = Counter("llmctl:generation_tokens", "Tokens generated.", labels, registry=r)
        self.ttft = Histogram("llmctl:time_to_first_token_seconds", "Time to first token.", labels,
                              buckets=LATENCY_BUCKETS, registry=r)
        self.tpot = Histogram("llmctl:time_per_output_token_seconds", "Mean time per output token after the "
                              "first, per request.", labels, buckets=TOKEN_LATENCY_BUCKETS, registry=r)
        self.e2e = Histogram("llmctl:e2e_request_latency_seconds", "End-to-end request latency.", labels,
                             buckets=LATENCY_BUCKETS, registry=r)
        self.queue_time = Histogram("llmctl:request_queue_time_seconds", "Time from arrival to first schedule.",
                                    labels, buckets=LATENCY_BUCKETS, registry=r)
        self.batch_efficiency = Histogram("llmctl:batch_efficiency", "Tokens computed per engine step over the "
                                          "step's token budget.", labels, buckets=RATIO_BUCKETS, registry=r)
        self.step_tokens = Counter("llmctl:step_tokens", "Tokens computed by engine steps.", labels, registry=r)
        self.iteration_tokens = Histogram("llmctl:iteration_tokens_total", "Tokens computed per engine step.",
                                          labels, buckets=TOKEN_COUNT_BUCKETS, registry=r)
        self.inter_token_latency = Histogram("llmctl:inter_token_latency_seconds", "Time between two "
                                             "consecutive tokens of a sequence, per token.", labels,
                                             buckets=TOKEN_LATENCY_BUCKETS, registry=r)
        self.request_prompt_tokens = Histogram("llmctl:request_prompt_tokens", "Prompt tokens per finished "
                                               "request.", labels, buckets=TOKEN_COUNT_BUCKETS, registry=r)
        self.request_generation_tokens = Histogram("llmctl:request_generation_tokens", "Tokens generated per "
                                                   "finished request (all its choices).", labels,
                                                   buckets=TOKEN_COUNT_BUCKETS, registry=r)
        self._engines = _EngineStatsCollector(labels)
        self.add_engine(model_name, engine_stats, engine_healthy, engine_load)
        r.register(self._engines)

    def add_engine(self, model_name: str, stats: Callable[[], dict[str, float]], healthy: Callable[[], bool],
                   load: Callable[[dict[str, float]], float], replica: int = 0) -> "ModelMetrics":
        """Another engine (the fallback's, or a data-parallel replica): its snapshot series carry its own
        model_name (and replica index)."""
        self._engines.engines.append(_EngineSource(self._labels(model_name, replica), stats, healthy, load))
        return self.for_model(model_name, replica)

    def for_model(self, model_name: str, replica: int = 0) -> "ModelMetrics":
        return ModelMetrics(self, model_name, self._labels(model_name, replica))

    def _labels(self, model_name: str, replica: int) -> tuple[str, ...]:
        return (model_name, str(replica)) if self.engine_labelled else (model_name,)

    def track_fallback(self, primary: str, fallback: str, active: Callable[[], bool]) -> Counter:
        """Routing series (only with --fallback-model); returns the counter of degraded requests."""
        gauge = Gauge("llmctl:fallback_active", "1 while new requests for the primary go to the fallback "
                      "(its load signal reached --fallback-at), else 0.", ["model_name"], registry=self.registry)
        gauge.labels(primary).set_function(lambda: 1.0 if active() else 0.0)
        degraded = Counter("llmctl:num_requests_degraded", "Requests for the primary that its load sent to the "
                           "fallback model (labelled with the fallback, which answered them).", ["model_name"],
                           registry=self.registry)
        return degraded.labels(fallback)

    def track_concurrency(self, limit: Callable[[], float], in_flight: Callable[[], float],
                          queued: Callable[[], float]) -> Counter:
        """Admission-limit series (only with --max-concurrency); returns the counter of refusals."""
        rows = (("llmctl:concurrency_limit", "Requests the server admits at once now (--max-concurrency; "
                 "moved by the adaptive controller with auto).", limit),
                ("llmctl:concurrency_in_flight", "Completion requests admitted and not yet answered.", in_flight),
                ("llmctl:concurrency_queued", "Completion requests waiting for an admission slot.", queued))
        for name, doc, read in rows:
            Gauge(name, doc, ["model_name"], registry=self.registry).labels(self.model_name).set_function(read)
        rejected = Counter("llmctl:concurrency_rejected", "Completion requests refused with 503 because the "
                           "admission limit and its queue were full (or the queue wait timed out).",
                           ["model_name"], registry=self.registry)
        return rejected.labels(self.model_name)

    def observe_http(self, endpoint: str, status: int) -> None:
        self.http_requests.labels(endpoint, str(status)).inc()

    def observe_step(self, step: StepInfo, _stats: dict[str, float], labels: Optional[tuple[str, ...]] = None) -> None:
        """Engine-thread listener (prometheus_client is thread-safe)."""
        labels = labels or self._labels(self.model_name, 0)
        self.batch_efficiency.labels(*labels).observe(step.batch_efficiency)
        self.step_tokens.labels(*labels).inc(step.num_batched_tokens)
        self.iteration_tokens.labels(*labels).observe(step.num_batched_tokens)
        inter_token = self.inter_token_latency.labels(*labels)
        for latency in step.inter_token_latencies:
            inter_token.observe(latency)

    def observe_finished(self, output: RequestOutput, tokens_per_choice: list[int],
                         finish_reasons: list[Optional[str]], labels: Optional[tuple[str, ...]] = None) -> None:
        """A finished request: `output` for its prompt and timings; what each choice generated and
        why it stopped, counted by the caller over the request's outputs (deltas carry only news)."""
        labels = labels or self._labels(self.model_name, 0)
        metrics = output.metrics
        generated = sum(tokens_per_choice)
        self.prompt_tokens.labels(*labels).inc(len(output.prompt_token_ids))
        self.generation_tokens.labels(*labels).inc(generated)
        self.request_prompt_tokens.labels(*labels).observe(len(output.prompt_token_ids))
        self.request_generation_tokens.labels(*labels).observe(generated)
        for reason in finish_reasons:
            self.request_success.labels(*labels, reason or "unknown").inc()
        if metrics.time_to_first_token is not None:
            self.ttft.labels(*labels).observe(metrics.time_to_first_token)
        if metrics.queue_time is not None:
            self.queue_time.labels(*labels).observe(metrics.queue_time)
        if metrics.finished_time is not None:
            self.e2e.labels(*labels).observe(metrics.finished_time - metrics.arrival_time)
            per_seq = max(tokens_per_choice, default=0)
            if per_seq > 1 and metrics.first_token_time is not None:
                self.tpot.labels(*labels).observe((metrics.finished_time - metrics.first_token_time) / (per_seq - 1))

    def observe_cut_off(self, delivered_tokens: int, labels: Optional[tuple[str, ...]] = None) -> None:
        """Tokens streamed for choices that never finished (the client left): generated all the same."""
        if delivered_tokens > 0:
            self.generation_tokens.labels(*(labels or self._labels(self.model_name, 0))).inc(delivered_tokens)

    def observe_aborted(self, choices: int, model: Optional[str] = None) -> None:
        """Choices whose request was aborted before it finished (the client left, or it failed):
        `request_success` with finished_reason "abort", as vLLM counts them."""
        if choices > 0:
            self.request_success.labels(model or self.model_name, "abort").inc(choices)

    def render(self) -> bytes:
        return generate_latest(self.registry)


class ModelMetrics:
    """The observers of one served model (what `OpenAIServing` and the engine's step listener call),
    plus listeners told of every finished request (the adaptive concurrency controller's samples)."""

    def __init__(self, metrics: ServerMetrics, model_name: str, labels: tuple[str, ...]):
        self.metrics = metrics
        self.model_name = model_name
        self.labels = labels
        self.finished_listeners: list[Callable[[RequestOutput], None]] = []

    def observe_step(self, step: StepInfo, stats: dict[str, float]) -> None:
        self.metrics.observe_step(step, stats, self.labels)

    def observe_finished(self, output: RequestOutput, tokens_per_choice: list[int],
                         finish_reasons: list[Optional[str]]) -> None:
        self.metrics.observe_finished(output, tokens_per_choice, finish_reasons, self.labels)
        for listener in self.finished_listeners:
            listener(output)

    def observe_cut_off(self, delivered_tokens: int) -> None:
        self.metrics.observe_cut_off(delivered_tokens, self.labels)

    def observe_aborted(self, choices: int) -> None:
        self.metrics.observe_aborted(choices, self.model_name)


def endpoint_label(path: str, known: Optional[set[str]] = None) -> str:
    """Route paths as labels; unknown paths collapse into one label (no cardinality explosion)."""
    return path if known is None or path in known else "other"
