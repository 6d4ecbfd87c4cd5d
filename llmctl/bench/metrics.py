"""Serving-benchmark metric math with vLLM's definitions and JSON key names; SLO gates over them.

Per request (times in seconds, from the moment the request is sent):
- TTFT: arrival of the first chunk that carries generated content;
- E2E latency (`e2el`): arrival of the last content chunk;
- TPOT: (E2E - TTFT) / (n - 1) for a request with n > 1 output tokens (vLLM leaves n <= 1 out of the
  TPOT statistics and counts its TPOT as 0 for goodput);
- ITL: the gaps between consecutive content chunks, pooled over all requests.
Aggregates: mean, median, std (numpy, population) and numpy's default (linear) percentiles, reported
in milliseconds under `mean_ttft_ms`, `median_ttft_ms`, `std_ttft_ms`, `p99_ttft_ms`, ...; throughputs
divide by the benchmark duration (first send to last completion). Goodput counts the completed requests
meeting every given SLO (`ttft`, `tpot`, `e2el` in ms) per second.

`max_concurrent_requests` is the most requests ever in flight at once, observed by the driver
(vLLM approximates it from one-second buckets); `max_output_tokens_per_s` is the busiest one-second
bucket of output tokens, each content chunk weighted by the request's tokens per chunk.
"""

from __future__ import annotations

import math
import operator
import re
from dataclasses import dataclass, field
from typing import Any, Iterable, Optional

import numpy as np

PERCENTILE_METRICS = ("ttft", "tpot", "itl", "e2el")
GOODPUT_METRICS = ("ttft", "tpot", "e2el")
MAX_ERROR_SAMPLES = 5


@dataclass
class RequestOutcome:
    """What one benchmark request did; failures keep their HTTP status (None: no response) and message."""

    success: bool
    prompt_len: int = 0
    output_tokens: int = 0
    token_source: str = ""  # "usage", "tokenizer" or "chunks"
    ttft: float = 0.0
    latency: float = 0.0
    itl: list[float] = field(default_factory=list)
    start: float = 0.0  # seconds after the benchmark start
    status: Optional[int] = None
    error: str = ""
    generated_text: str = ""
    request_id: str = ""

    @property
    def cause(self) -> str:
        """Why a failed request failed, coarse enough to count: 'HTTP 500', 'stream error', 'ReadTimeout'."""
        if self.status is not None and self.status != 200:
            return f"HTTP {self.status}"
        if self.status == 200:
            return "stream error"
        return self.error.split(":", 1)[0].strip() or "no response"

    @property
    def tpot(self) -> Optional[float]:
        if self.output_tokens <= 1:
            return None
        return (self.latency - self.ttft) / (self.output_tokens - 1)

    def chunk_times(self) -> list[float]:
        """Arrival of each content chunk, in seconds after the benchmark start."""
        times = [self.start + self.ttft]
        for gap in self.itl:
            times.append(times[-1] + gap)
        return times


# ---- parsing of --percentiles and --goodput ----------------------------------------------------

def parse_percentiles(text: str) -> list[float]:
    """'50,90,99' -> [50.0, 90.0, 99.0]; each in (0, 100], duplicates dropped."""
    values: list[float] = []
    for part in str(text).replace(" ", ",").split(","):
        if not part:
            continue
        try:
            value = float(part)
        except ValueError:
            raise ValueError(f"{part!r} is not a number (expected e.g. 50,90,99)") from None
        if not 0 < value <= 100:
            raise ValueError(f"percentile {part} is outside (0, 100]")
        if value not in values:
            values.append(value)
    if not values:
        raise ValueError("give at least one percentile, e.g. 50,90,99")
    return values


def percentile_key(p: float) -> str:
    """vLLM's spelling: 99 -> 'p99', 99.9 -> 'p99.9'."""
    return f"p{int(p)}" if int(p) == p else f"p{p}"


def parse_goodput(values: Iterable[str]) -> dict[str, float]:
    """['ttft:500 tpot:50', 'e2el:3000'] -> {'ttft': 500.0, 'tpot': 50.0, 'e2el': 3000.0} (ms)."""
    slos: dict[str, float] = {}
    for value in values:
        for item in re.split(r"[\s,]+", value.strip()):
            if not item:
                continue
            name, sep, number = item.partition(":")
            if not sep or name not in GOODPUT_METRICS:
                raise ValueError(f"{item!r}: expected KEY:MS with KEY one of {', '.join(GOODPUT_METRICS)}")
            try:
                ms = float(number)
            except ValueError:
                raise ValueError(f"{item!r}: {number!r} is not a number of milliseconds") from None
            if not ms >= 0:
                raise ValueError(f"{item!r}: the SLO must be >= 0 ms")
            slos[name] = ms
    return slos


# ---- the metrics ------------------------------------------------------------------------------

def _ms_stats(name: str, values: list[float], percentiles: list[float]) -> dict[str, float]:
    data = np.asarray(values if values else [0.0], dtype=float) * 1000.0  # vLLM reports 0 when empty
    stats = {f"mean_{name}_ms": float(np.mean(data)), f"median_{name}_ms": float(np.median(data)),
             f"std_{name}_ms": float(np.std(data))}
    for p in percentiles:
        stats[f"{percentile_key(p)}_{name}_ms"] = float(np.percentile(data, p))
    return stats


def good_requests(outcomes: list[RequestOutcome], goodput: dict[str, float]) -> int:
    """Completed requests within every SLO (ms); a request with one output token has TPOT 0."""
    count = 0
    for out in outcomes:
        if not out.success:
            continue
        observed = {"ttft": out.ttft, "tpot": out.tpot or 0.0, "e2el": out.latency}
        if all(observed[name] <= ms / 1000.0 for name, ms in goodput.items()):
            count += 1
    return count


def output_timeline(outcomes: list[RequestOutcome], bucket_s: float = 1.0) -> list[float]:
    """Output tokens per bucket since the benchmark start; each chunk weighs tokens/chunks of its request."""
    tokens: list[float] = []
    for out in outcomes:
        if not out.success or out.output_tokens <= 0:
            continue
        times = out.chunk_times()
        weight = out.output_tokens / len(times)
        for moment in times:
            index = max(0, int(moment // bucket_s))
            if index >= len(tokens):
                tokens.extend([0.0] * (index + 1 - len(tokens)))
            tokens[index] += weight
    return tokens


def token_count_source(outcomes: list[RequestOutcome]) -> Optional[str]:
    sources = {out.token_source for out in outcomes if out.success}
    if not sources:
        return None
    return sources.pop() if len(sources) == 1 else "mixed"


def error_samples(outcomes: list[RequestOutcome], limit: int = MAX_ERROR_SAMPLES) -> list[dict[str, Any]]:
    """Up to `limit` distinct (status, message) failures in the order first seen, with their counts."""
    samples: dict[tuple, dict[str, Any]] = {}
    for out in outcomes:
        if out.success:
            continue
        key = (out.status, out.error)
        if key in samples:
            samples[key]["count"] += 1
        elif len(samples) < limit:
            samples[key] = {"status": out.status, "message": out.error, "count": 1}
    return list(samples.values())


def failures_by_cause(outcomes: list[RequestOutcome]) -> dict[str, int]:
    """Failed requests counted by cause, most frequent first."""
    counts: dict[str, int] = {}
    for out in outcomes:
        if not out.success:
            counts[out.cause] = counts.get(out.cause, 0) + 1
    return dict(sorted(counts.items(), key=lambda item: -item[1]))


def compute_metrics(outcomes: list[RequestOutcome], duration_s: float, percentiles: list[float],
                    goodput: Optional[dict[str, float]] = None, peak_concurrency: int = 0,
                    latency_metrics: Iterable[str] = PERCENTILE_METRICS) -> dict[str, Any]:
    """The result document's metric section (vLLM key names), from per-request outcomes."""
    done = [out for out in outcomes if out.success]
    total_input = sum(out.prompt_len for out in done)
    total_output = sum(out.output_tokens for out in done)
    dur = duration_s if duration_s > 0 else math.inf  # an empty run has rates of 0, not a division error
    timeline = output_timeline(outcomes)
    metrics: dict[str, Any] = {
        "completed": len(done),
        "failed": len(outcomes) - len(done),
        "duration": duration_s,
        "total_input_tokens": total_input,
        "total_output_tokens": total_output,
        "request_throughput": len(done) / dur,
        "request_goodput": good_requests(outcomes, goodput) / dur if goodput else None,
        "output_throughput": total_output / dur,
        "total_token_throughput": (total_input + total_output) / dur,
        "max_output_tokens_per_s": max(timeline, default=0.0),
        "max_concurrent_requests": peak_concurrency,
    }
    series = {
        "ttft": [out.ttft for out in done],
        "tpot": [out.tpot for out in done if out.tpot is not None],
        "itl": [gap for out in done for gap in out.itl],
        "e2el": [out.latency for out in done],
    }
    for name in PERCENTILE_METRICS:
        if name in latency_metrics:
            metrics.update(_ms_stats(name, series[name], percentiles))
    metrics["token_count_source"] = token_count_source(outcomes)
    metrics["failure_rate"] = metrics["failed"] / len(outcomes) if outcomes else 0.0
    metrics["failures_by_cause"] = failures_by_cause(outcomes)
    metrics["error_samples"] = error_samples(outcomes)
    return metrics


def metric_keys(percentiles: list[float], with_goodput: bool,
                latency_metrics: Iterable[str] = PERCENTILE_METRICS) -> list[str]:
    """Every numeric key of the metric section (what --slo may gate on)."""
    sample = compute_metrics([], 1.0, percentiles, {"ttft": 1.0} if with_goodput else None,
                             latency_metrics=latency_metrics)
    return [key for key, value in sample.items() if isinstance(value, (int, float)) and not isinstance(value, bool)]


def parse_metric_names(text: str) -> tuple[str, ...]:
    """--percentile-metrics 'ttft,tpot' -> ('ttft', 'tpot'), each one of PERCENTILE_METRICS."""
    names = tuple(dict.fromkeys(part.strip() for part in str(text).split(",") if part.strip()))
    unknown = [name for name in names if name not in PERCENTILE_METRICS]
    if unknown or not names:
        raise ValueError(f"{', '.join(unknown) or 'nothing'}: expected a comma list of {', '.join(PERCENTILE_METRICS)}")
    return names


# ---- SLO gates --------------------------------------------------------------------------------

_LATENCY_KEY = re.compile(r"^(mean|median|std|p(\d+(?:\.\d+)?))_(%s)_ms$" % "|".join(PERCENTILE_METRICS))


def slo_needs(texts: Iterable[str]) -> tuple[list[float], list[str]]:
    """The percentiles and latency metrics --slo gates name ('p99.5_ttft_ms<500' -> [99.5], ['ttft']),
    so they get computed even when --metric-percentiles / --percentile-metrics leave them out."""
    percentiles: list[float] = []
    names: list[str] = []
    for text in texts:
        match = _SLO.match(text)
        key = _LATENCY_KEY.match(match.group(1)) if match else None
        if key is None:
            continue
        if key.group(3) not in names:
            names.append(key.group(3))
        if key.group(2) and 0 < float(key.group(2)) <= 100 and float(key.group(2)) not in percentiles:
            percentiles.append(float(key.group(2)))
    return percentiles, names


_OPS = {"<": operator.lt, "<=": operator.le, ">": operator.gt, ">=": operator.ge}
_SLO = re.compile(r"^\s*([A-Za-z0-9_.]+)\s*(<=|>=|<|>)\s*(\S+)\s*$")


@dataclass(frozen=True)
class SloGate:
    key: str
    op: str
    threshold: float

    @property
    def text(self) -> str:
        return f"{self.key}{self.op}{self.threshold:g}"

    def check(self, result: dict[str, Any]) -> dict[str, Any]:
        value = result.get(self.key)
        passed = isinstance(value, (int, float)) and _OPS[self.op](value, self.threshold)
        return {"gate": self.text, "key": self.key, "op": self.op, "threshold": self.threshold,
                "value": value, "passed": bool(passed)}


def parse_slo(text: str, valid_keys: list[str]) -> SloGate:
    """'p99_ttft_ms<500' -> SloGate; ValueError naming the valid keys when the key is unknown."""
    match = _SLO.match(text)
    if not match:
        raise ValueError(f"{text!r}: expected METRIC OP NUMBER with OP one of <, <=, >, >= (e.g. 'p99_ttft_ms<500')")
    key, op, number = match.groups()
    if key not in valid_keys:
        raise ValueError(f"{text!r}: unknown metric {key!r}; valid keys: {', '.join(valid_keys)}")
    try:
        threshold = float(number)
    except ValueError:
        raise ValueError(f"{text!r}: {number!r} is not a number") from None
    if math.isnan(threshold):
        raise ValueError(f"{text!r}: the threshold must be a number")
    return SloGate(key, op, threshold)


def check_slos(gates: list[SloGate], result: dict[str, Any]) -> list[dict[str, Any]]:
    return [gate.check(result) for gate in gates]


# ---- the human-readable summary ---------------------------------------------------------------

_TITLES = {
    "ttft": ("Time to First Token", "TTFT"),
    "tpot": ("Time per Output Token (excl. 1st token)", "TPOT"),
    "itl": ("Inter-token Latency", "ITL"),
    "e2el": ("End-to-end Latency", "E2EL"),
}


def summary_rows(result: dict[str, Any], percentiles: list[float]) -> list[tuple[str, Optional[str]]]:
    """vLLM's 'Serving Benchmark Result' block as (label, value) rows; a value of None starts a section."""
    rows: list[tuple[str, Optional[str]]] = [
        ("Successful requests", f"{result['completed']}"),
        ("Failed requests", f"{result['failed']}"),
        ("Maximum request concurrency", f"{result.get('max_concurrency') or 'unlimited'}"),
        ("Benchmark duration (s)", f"{result['duration']:.2f}"),
        ("Total input tokens", f"{result['total_input_tokens']}"),
        ("Total generated tokens", f"{result['total_output_tokens']} ({result['token_count_source'] or 'none'})"),
        ("Request throughput (req/s)", f"{result['request_throughput']:.2f}"),
    ]
    if result.get("request_goodput") is not None:
        rows.append(("Request goodput (req/s)", f"{result['request_goodput']:.2f}"))
    rows += [
        ("Output token throughput (tok/s)", f"{result['output_throughput']:.2f}"),
        ("Peak output token throughput (tok/s)", f"{result['max_output_tokens_per_s']:.2f}"),
        ("Peak concurrent requests", f"{result['max_concurrent_requests']}"),
        ("Total token throughput (tok/s)", f"{result['total_token_throughput']:.2f}"),
    ]
    for name in PERCENTILE_METRICS:
        if f"mean_{name}_ms" not in result:
            continue  # left out by --percentile-metrics
        title, short = _TITLES[name]
        rows.append((title, None))
        rows.append((f"Mean {short} (ms)", f"{result[f'mean_{name}_ms']:.2f}"))
        rows.append((f"Median {short} (ms)", f"{result[f'median_{name}_ms']:.2f}"))
        rows.append((f"Std {short} (ms)", f"{result[f'std_{name}_ms']:.2f}"))
        for p in percentiles:
            key = percentile_key(p)
            rows.append((f"{key.upper()} {short} (ms)", f"{result[f'{key}_{name}_ms']:.2f}"))
    return rows
