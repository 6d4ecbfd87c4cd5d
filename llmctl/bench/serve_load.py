"""The `bench serve` driver: stream requests to an OpenAI-compatible server on a schedule and time them.

Requests go out on the gamma arrival schedule (`arrivals.py`), each waits for a `--max-concurrency`
slot, then streams `/v1/completions` or `/v1/chat/completions` over SSE through one httpx async client.
A chunk counts as content when it carries text (an empty text counts too, as vLLM does, except in a
pure role announcement or a final chunk that only reports the finish reason). Output tokens come from
the server's `usage` (`stream_options.include_usage`), else the client tokenizer, else the number of
content chunks; `token_source` records which. Warm-up requests run first and are not timed.
"""

from __future__ import annotations

import asyncio
import json
import time
from dataclasses import dataclass
from typing import Any, Callable, Optional

import numpy as np

from llmctl.bench.arrivals import arrival_offsets
from llmctl.bench.client import ENDPOINT_PATHS, auth_headers
from llmctl.bench.datasets import BenchRequest, TextTokenizer
from llmctl.bench.metrics import RequestOutcome
from llmctl.errors import UserError

MAX_ERROR_CHARS = 300


@dataclass(frozen=True)
class Target:
    base_url: str  # scheme://host:port, without /v1
    endpoint: str  # "completions" or "chat"
    model: str
    api_key: Optional[str] = None
    timeout_s: float = 600.0

    @property
    def url(self) -> str:
        return self.base_url + ENDPOINT_PATHS[self.endpoint]


@dataclass(frozen=True)
class LoadPlan:
    request_rate: float = float("inf")
    burstiness: float = 1.0
    max_concurrency: Optional[int] = None
    seed: int = 0
    ignore_eos: bool = True
    temperature: float = 0.0


@dataclass
class LoadRun:
    outcomes: list[RequestOutcome]
    duration_s: float
    peak_concurrency: int


# Called with ("warmup" | "bench", outcome) as each request finishes, on the event loop's thread.
Observer = Callable[[str, RequestOutcome], None]


def normalize_base_url(url: str) -> str:
    """'http://h:8000/v1/' -> 'http://h:8000'; refuses anything that is not an http(s) URL."""
    import httpx

    try:
        parsed = httpx.URL(url.strip())
    except Exception:  # noqa: BLE001 - httpx raises several types for malformed URLs
        raise UserError(f"--base-url {url!r} is not a URL (expected e.g. http://127.0.0.1:8000)") from None
    if parsed.scheme not in ("http", "https") or not parsed.host:
        raise UserError(f"--base-url {url!r} must be an http:// or https:// URL with a host")
    text = str(parsed).rstrip("/")
    return text[: -len("/v1")] if text.endswith("/v1") else text


@dataclass(frozen=True)
class ServedModel:
    id: str
    max_model_len: Optional[int] = None  # vLLM's /v1/models field; None when the server does not say


def served_model(base_url: str, api_key: Optional[str], model: Optional[str], timeout_s: float = 10.0) -> ServedModel:
    """Check the server answers (GET /v1/models): `model`, or the first model it lists, and its context length."""
    import httpx

    url = base_url + "/v1/models"
    try:
        response = httpx.get(url, headers=auth_headers(api_key), timeout=timeout_s)
    except httpx.TransportError as exc:
        raise UserError(f"cannot reach the server at {base_url} ({type(exc).__name__}: {exc}); "
                        "is it running, and is --base-url right?") from None
    entries = _model_entries(response)
    if model:  # some servers have no /v1/models; the requests themselves will tell
        entry = next((e for e in entries if e.get("id") == model), {})
        return ServedModel(model, _context_length(entry))
    if response.status_code != 200:
        raise UserError(f"GET {url} answered HTTP {response.status_code}: {_error_message(response.text)}; "
                        "pass --model")
    if not entries or not isinstance(entries[0].get("id"), str):
        raise UserError(f"GET {url} listed no models; pass --model")
    return ServedModel(entries[0]["id"], _context_length(entries[0]))


def resolve_model(base_url: str, api_key: Optional[str], model: Optional[str], timeout_s: float = 10.0) -> str:
    """Check the server answers (GET /v1/models) and return `model`, or the first model it lists."""
    return served_model(base_url, api_key, model, timeout_s).id


def _model_entries(response) -> list[dict]:
    try:
        data = response.json()["data"] if response.status_code == 200 else []
    except (ValueError, KeyError, TypeError):
        return []
    return [e for e in data if isinstance(e, dict)] if isinstance(data, list) else []


def _context_length(entry: dict) -> Optional[int]:
    value = entry.get("max_model_len")
    return value if isinstance(value, int) and not isinstance(value, bool) and value > 0 else None


def request_body(target: Target, plan: LoadPlan, request: BenchRequest) -> dict[str, Any]:
    body: dict[str, Any] = {
        "model": target.model,
        "max_tokens": request.output_len,
        "temperature": plan.temperature,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    if plan.ignore_eos:
        body["ignore_eos"] = True  # vLLM extension: generate exactly max_tokens
    if target.endpoint == "chat":
        body["messages"] = [{"role": "user", "content": request.prompt}]
    else:
        body["prompt"] = request.prompt
    return body


def _error_message(text: str) -> str:
    """The `error.message` (or `detail`) of an OpenAI-style error body, else the body itself, shortened."""
    message = text
    try:
        data = json.loads(text)
    except ValueError:
        data = None
    if isinstance(data, dict):
        error = data.get("error", data.get("detail", data.get("message")))
        if isinstance(error, dict):
            error = error.get("message", error)
        if error is not None:
            message = error if isinstance(error, str) else json.dumps(error)
    message = " ".join(str(message).split())
    return message[:MAX_ERROR_CHARS] or "(empty body)"


def _content(choice: dict[str, Any], endpoint: str) -> Optional[str]:
    """The generated text of a chunk's first choice, or None when the chunk carries no token."""
    finished = choice.get("finish_reason") is not None
    if endpoint == "chat":
        delta = choice.get("delta") or {}
        text = delta.get("content")
        if text is None:
            text = delta.get("reasoning_content")
        if text == "" and ("role" in delta or finished):
            return None
        return text
    text = choice.get("text")
    return None if text == "" and finished else text


class _Stream:
    """Accumulates one streamed response: content chunk times, text and the usage report."""

    def __init__(self, endpoint: str, started: float):
        self.endpoint = endpoint
        self.started = started
        self.first: Optional[float] = None
        self.last = started
        self.itl: list[float] = []
        self.pieces: list[str] = []
        self.completion_tokens: Optional[int] = None
        self.prompt_tokens: Optional[int] = None

    def feed(self, data: dict[str, Any], now: float) -> Optional[str]:
        """Take one decoded SSE event; returns an error message when the server reports one."""
        choices = data.get("choices") or []
        if not choices and isinstance(data.get("error"), (dict, str)):
            return _error_message(json.dumps(data))
        if choices and isinstance(choices[0], dict):
            text = _content(choices[0], self.endpoint)
            if text is not None:
                if self.first is None:
                    self.first = now
                else:
                    self.itl.append(now - self.last)
                self.last = now
                self.pieces.append(text)
        usage = data.get("usage")
        if isinstance(usage, dict):
            if isinstance(usage.get("completion_tokens"), int):
                self.completion_tokens = usage["completion_tokens"]
            if isinstance(usage.get("prompt_tokens"), int):
                self.prompt_tokens = usage["prompt_tokens"]
        return None


def _count_output(stream: _Stream, text: str, tokenizer: Optional[TextTokenizer]) -> tuple[int, str]:
    if stream.completion_tokens is not None:
        return stream.completion_tokens, "usage"
    if tokenizer is not None:
        return len(tokenizer.encode(text, add_special_tokens=False)), "tokenizer"
    return len(stream.pieces), "chunks"


async def send_request(client, target: Target, body: dict[str, Any], request: BenchRequest, t0: float,
                       tokenizer: Optional[TextTokenizer] = None) -> RequestOutcome:
    """Stream one request; every failure (HTTP status, transport, malformed or empty stream) is an outcome."""
    import httpx

    started = time.perf_counter()
    outcome = RequestOutcome(success=False, prompt_len=request.prompt_len, start=started - t0)
    stream = _Stream(target.endpoint, started)
    try:
        async with client.stream("POST", target.url, json=body) as response:
            if response.status_code != 200:
                outcome.status = response.status_code
                outcome.error = _error_message((await response.aread()).decode("utf-8", "replace"))
            else:
                outcome.status = 200
                outcome.error = await _read_events(response, stream) or ""
    except httpx.HTTPError as exc:
        outcome.error = f"{type(exc).__name__}: {exc}"[:MAX_ERROR_CHARS]
    if not outcome.error and stream.first is None:
        outcome.error = "the stream ended without any generated content"
    if outcome.error:
        outcome.latency = time.perf_counter() - started
        return outcome
    text = "".join(stream.pieces)
    outcome.success = True
    outcome.ttft = stream.first - started
    outcome.latency = stream.last - started
    outcome.itl = stream.itl
    outcome.generated_text = text
    outcome.output_tokens, outcome.token_source = _count_output(stream, text, tokenizer)
    if stream.prompt_tokens is not None:
        outcome.prompt_len = stream.prompt_tokens
    return outcome


async def _read_events(response, stream: _Stream) -> Optional[str]:
    async for line in response.aiter_lines():
        line = line.strip()
        if not line.startswith("data:"):
            continue  # blank separators, ': ping' comments, event:/id: fields
        payload = line[len("data:"):].strip()
        if payload == "[DONE]":
            return None
        now = time.perf_counter()
        try:
            data = json.loads(payload)
        except ValueError:
            return f"malformed SSE data: {payload[:80]!r}"
        if not isinstance(data, dict):
            return f"unexpected SSE data: {payload[:80]!r}"
        error = stream.feed(data, now)
        if error:
            return error
    return None


class _InFlight:
    def __init__(self) -> None:
        self.now = 0
        self.peak = 0

    def enter(self) -> None:
        self.now += 1
        self.peak = max(self.peak, self.now)

    def leave(self) -> None:
        self.now -= 1


async def _drive(target: Target, plan: LoadPlan, requests: list[BenchRequest], warmups: list[BenchRequest],
                 tokenizer: Optional[TextTokenizer], observe: Optional[Observer]) -> LoadRun:
    import httpx

    limit = plan.max_concurrency
    semaphore = asyncio.Semaphore(limit) if limit else None
    timeout = httpx.Timeout(target.timeout_s, connect=min(target.timeout_s, 30.0))
    # httpx pools 100 connections by default: without a limit, queueing there would add to TTFT.
    limits = httpx.Limits(max_connections=limit, max_keepalive_connections=limit)
    async with httpx.AsyncClient(timeout=timeout, limits=limits, headers=auth_headers(target.api_key)) as client:
        in_flight = _InFlight()

        async def one(phase: str, request: BenchRequest, t0: float) -> RequestOutcome:
            if semaphore is not None:
                await semaphore.acquire()
            in_flight.enter()
            try:
                outcome = await send_request(client, target, request_body(target, plan, request), request, t0, tokenizer)
            finally:
                in_flight.leave()
                if semaphore is not None:
                    semaphore.release()
            if observe is not None:
                observe(phase, outcome)
            return outcome

        if warmups:
            t0 = time.perf_counter()
            await asyncio.gather(*(one("warmup", request, t0) for request in warmups))
        in_flight.peak = 0
        # A stream of its own: the dataset generators draw from default_rng([seed, 0]).
        offsets = arrival_offsets(len(requests), plan.request_rate, plan.burstiness,
                                  np.random.default_rng([plan.seed, 1]))
        t0 = time.perf_counter()
        tasks = []
        for request, offset in zip(requests, offsets):
            delay = t0 + offset - time.perf_counter()
            if delay > 0:
                await asyncio.sleep(delay)
            tasks.append(asyncio.create_task(one("bench", request, t0)))
        outcomes = await asyncio.gather(*tasks)
        return LoadRun(list(outcomes), time.perf_counter() - t0, in_flight.peak)


def run_load(target: Target, plan: LoadPlan, requests: list[BenchRequest], warmups: list[BenchRequest] = (),
             tokenizer: Optional[TextTokenizer] = None, observe: Optional[Observer] = None) -> LoadRun:
    """Run warm-ups, then the timed benchmark; returns every timed request's outcome."""
    return asyncio.run(_drive(target, plan, list(requests), list(warmups), tokenizer, observe))


def result_document(settings: dict[str, Any], run: LoadRun, percentiles: list[float],
                    goodput: Optional[dict[str, float]], detailed: bool = False) -> dict[str, Any]:
    """The `--json` / `--save-result` document: run settings, then vLLM-named metrics (+ per-request data)."""
    from llmctl.bench.metrics import compute_metrics

    document = dict(settings)
    document.update(compute_metrics(run.outcomes, run.duration_s, percentiles, goodput, run.peak_concurrency))
    if detailed:
        outcomes = run.outcomes
        document.update({
            "input_lens": [out.prompt_len for out in outcomes],
            "output_lens": [out.output_tokens for out in outcomes],
            "start_times": [out.start for out in outcomes],
            "ttfts": [out.ttft for out in outcomes],
            "e2els": [out.latency for out in outcomes],
            "itls": [out.itl for out in outcomes],
            "generated_texts": [out.generated_text for out in outcomes],
            "errors": [out.error for out in outcomes],
        })
    return document
