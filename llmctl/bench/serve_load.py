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
import contextlib
import itertools
import json
import math
import time
from dataclasses import dataclass
from typing import Any, Callable, Optional

import numpy as np

from llmctl.bench.arrivals import arrival_times
from llmctl.bench.client import API_KEY_ENV, ENDPOINT_PATHS, auth_headers
from llmctl.bench.datasets import BenchRequest, Conversation, TextTokenizer
from llmctl.bench.metrics import PERCENTILE_METRICS, RequestOutcome
from llmctl.errors import UserError

MAX_ERROR_CHARS = 300


@dataclass(frozen=True)
class Target:
    base_url: str  # scheme://host:port, without /v1
    endpoint: str  # "completions" or "chat"
    model: str
    api_key: Optional[str] = None
    timeout_s: float = 600.0
    headers: tuple[tuple[str, str], ...] = ()  # --header K=V, sent with every request
    extra_body: Optional[dict[str, Any]] = None  # --extra-body, merged into every request body
    stream: bool = True

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
    duration_s: Optional[float] = None  # send requests until then (cycling the prompts) instead of each once
    ramp_up_s: float = 0.0  # the request rate grows linearly from 0 over this long
    request_id_prefix: str = "bench-"

    def __post_init__(self) -> None:
        if self.duration_s is not None and not self.duration_s > 0:
            raise UserError(f"--duration must be > 0 seconds, got {self.duration_s:g}")
        if self.duration_s is not None and math.isinf(self.request_rate) and not self.max_concurrency:
            raise UserError("--duration with --request-rate inf needs --max-concurrency (else it never stops sending)")
        if self.ramp_up_s and (self.ramp_up_s < 0 or math.isinf(self.request_rate)):
            raise UserError("--ramp-up needs a finite --request-rate and a number of seconds >= 0")


@dataclass
class LoadRun:
    outcomes: list[RequestOutcome]
    duration_s: float
    peak_concurrency: int


# The first requests all failing with one of these means a misconfigured client, not an overloaded server.
CONFIG_ERRORS = {401: ("the server wants an API key", f"pass --api-key (or set ${API_KEY_ENV})"),
                 403: ("the server refused the API key", "check --api-key"),
                 404: ("no such endpoint or model", "check --base-url, --endpoint and --model")}
EARLY_ABORT_REQUESTS = 4


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
        fix = CONFIG_ERRORS[response.status_code][1] if response.status_code in (401, 403) else "pass --model"
        raise UserError(f"GET {url} answered HTTP {response.status_code}: {_error_message(response.text)}; {fix}")
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


def request_body(target: Target, plan: LoadPlan, request: BenchRequest,
                 messages: Optional[list[dict]] = None) -> dict[str, Any]:
    """The JSON body of one request; `messages` (a conversation's history) overrides the request's own."""
    body: dict[str, Any] = {"model": target.model, "max_tokens": request.output_len, "temperature": plan.temperature,
                            "stream": target.stream}
    if target.stream:
        body["stream_options"] = {"include_usage": True}
    if plan.ignore_eos:
        body["ignore_eos"] = True  # vLLM extension: generate exactly max_tokens
    if target.endpoint == "chat":
        body["messages"] = messages or list(request.messages or [{"role": "user", "content": request.prompt}])
    else:
        body["prompt"] = request.prompt
    body.update(target.extra_body or {})
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
                       tokenizer: Optional[TextTokenizer] = None, request_id: str = "") -> RequestOutcome:
    """Send one request; every failure (HTTP status, transport, malformed or empty stream) is an outcome."""
    import httpx

    started = time.perf_counter()
    outcome = RequestOutcome(success=False, prompt_len=request.prompt_len, start=started - t0, request_id=request_id)
    stream = _Stream(target.endpoint, started)
    headers = {"X-Request-Id": request_id} if request_id else None
    try:
        async with client.stream("POST", target.url, json=body, headers=headers) as response:
            if response.status_code != 200:
                outcome.status = response.status_code
                outcome.error = _error_message((await response.aread()).decode("utf-8", "replace"))
            elif target.stream:
                outcome.status = 200
                outcome.error = await _read_events(response, stream) or ""
            else:
                outcome.status = 200
                outcome.error = _read_whole(await response.aread(), stream) or ""
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


def _json_object(text: str, what: str):
    """The decoded JSON object, or an error message (a str) when `text` is not one."""
    try:
        data = json.loads(text)
    except ValueError:
        return f"malformed {what}: {text[:80]!r}"
    return data if isinstance(data, dict) else f"unexpected {what}: {text[:80]!r}"


def _read_whole(raw: bytes, stream: _Stream) -> Optional[str]:
    """A non-streamed answer: one 'chunk' holding the whole text, so TTFT = E2E latency (as vLLM counts it)."""
    data = _json_object(raw.decode("utf-8", "replace"), "JSON answer")
    if isinstance(data, str):
        return data
    choices = data.get("choices") or []
    if choices and isinstance(choices[0], dict):
        first = choices[0]
        text = first.get("text") if stream.endpoint != "chat" else (first.get("message") or {}).get("content")
        piece = {"delta": {"content": text or ""}} if stream.endpoint == "chat" else {"text": text or ""}
        choices = [{**piece, "finish_reason": None}]
    return stream.feed({**data, "choices": choices}, time.perf_counter())


async def _read_events(response, stream: _Stream) -> Optional[str]:
    async for line in response.aiter_lines():
        line = line.strip()
        if not line.startswith("data:"):
            continue  # blank separators, ': ping' comments, event:/id: fields
        payload = line[len("data:"):].strip()
        if payload == "[DONE]":
            return None
        now = time.perf_counter()
        data = _json_object(payload, "SSE data")
        if isinstance(data, str):
            return data
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


class _Watch:
    """Stops the run when the first requests all fail with one configuration error (401, 403, 404):
    the rest would fail the same way, and a misconfigured endpoint should not be hammered."""

    def __init__(self, expected: Optional[int]) -> None:
        self.sample = min(EARLY_ABORT_REQUESTS, expected) if expected else EARLY_ABORT_REQUESTS
        self.first: list[RequestOutcome] = []
        self.stop = asyncio.Event()
        self.reason: Optional[str] = None

    def see(self, outcome: RequestOutcome) -> None:
        if len(self.first) >= self.sample:
            return
        self.first.append(outcome)
        statuses = {out.status for out in self.first}
        status = statuses.pop() if len(statuses) == 1 else None
        if len(self.first) == self.sample and status in CONFIG_ERRORS:
            what, fix = CONFIG_ERRORS[status]
            self.reason = f"the first {self.sample} request(s) all got HTTP {status} ({outcome.error}): {what}: {fix}"
            self.stop.set()


def _send_times(plan: LoadPlan, items: list, timed: bool):
    """Send offsets: a trace's own timestamps, else the (ramped) gamma schedule; endless for --duration."""
    if timed and items and isinstance(items[0], BenchRequest) and items[0].arrival_s is not None:
        return iter([item.arrival_s - items[0].arrival_s for item in items])  # after warm-ups, start at once
    if not timed:
        return iter([0.0] * len(items))  # warm-ups: all at once (within --max-concurrency)
    rng = np.random.default_rng([plan.seed, 1])  # its own stream: the datasets draw from [seed, 0]
    times = arrival_times(plan.request_rate, plan.burstiness, rng, plan.ramp_up_s)
    count = None if plan.duration_s is not None else len(items)
    return itertools.islice(times, count)


class _Driver:
    """One load run's shared state: the HTTP client, the concurrency limit and the observers."""

    def __init__(self, client, target: Target, plan: LoadPlan, tokenizer, observe, watch: _Watch):
        self.client, self.target, self.plan, self.tokenizer = client, target, plan, tokenizer
        self.observe, self.watch = observe, watch
        limit = plan.max_concurrency
        self.semaphore = asyncio.Semaphore(limit) if limit else None
        self.in_flight = _InFlight()

    async def one(self, phase: str, request: BenchRequest, t0: float, request_id: str,
                  messages: Optional[list[dict]] = None) -> RequestOutcome:
        self.in_flight.enter()
        try:
            body = request_body(self.target, self.plan, request, messages)
            outcome = await send_request(self.client, self.target, body, request, t0, self.tokenizer, request_id)
        finally:
            self.in_flight.leave()
        self.watch.see(outcome)
        if self.observe is not None:
            self.observe(phase, outcome)
        return outcome

    async def conversation(self, phase: str, conversation: Conversation, t0: float, request_id: str):
        """Each user turn after the history so far, with the server's real answers; stops at a failure."""
        history = [{"role": "system", "content": conversation.system}] if conversation.system else []
        outcomes = []
        for number, turn in enumerate(conversation.turns):
            if self.watch.stop.is_set():
                break
            messages = history + [{"role": "user", "content": turn.prompt}]
            outcome = await self.one(phase, turn, t0, f"{request_id}-{number}", messages)
            outcomes.append(outcome)
            if not outcome.success:
                break
            history = messages + [{"role": "assistant", "content": outcome.generated_text}]
        return outcomes

    async def launch(self, phase: str, index: int, item, t0: float) -> list[RequestOutcome]:
        request_id = f"{self.plan.request_id_prefix}{phase}-{index}"
        try:
            if isinstance(item, Conversation):
                return await self.conversation(phase, item, t0, request_id)
            return [await self.one(phase, item, t0, request_id)]
        finally:
            if self.semaphore is not None:
                self.semaphore.release()

    async def run(self, phase: str, items: list, timed: bool) -> tuple[list[RequestOutcome], float]:
        """Send `items` on the schedule (cycled until --duration when timed); (outcomes, seconds)."""
        duration = self.plan.duration_s if timed else None
        t0 = time.perf_counter()
        tasks = []
        for index, offset in enumerate(_send_times(self.plan, items, timed)):
            if duration is not None and offset >= duration:
                break
            delay = t0 + offset - time.perf_counter()
            if delay > 0:
                with contextlib.suppress(asyncio.TimeoutError):
                    await asyncio.wait_for(self.watch.stop.wait(), delay)
            if self.semaphore is not None:
                await self.semaphore.acquire()
            if self.watch.stop.is_set() or (duration is not None and time.perf_counter() - t0 >= duration):
                if self.semaphore is not None:
                    self.semaphore.release()
                break
            tasks.append(asyncio.create_task(self.launch(phase, index, items[index % len(items)], t0)))
        done = await asyncio.gather(*tasks)
        return [outcome for outcomes in done for outcome in outcomes], time.perf_counter() - t0


async def _drive(target: Target, plan: LoadPlan, requests: list, warmups: list,
                 tokenizer: Optional[TextTokenizer], observe: Optional[Observer]) -> LoadRun:
    import httpx

    limit = plan.max_concurrency
    timeout = httpx.Timeout(target.timeout_s, connect=min(target.timeout_s, 30.0))
    # httpx pools 100 connections by default: without a limit, queueing there would add to TTFT.
    limits = httpx.Limits(max_connections=limit, max_keepalive_connections=limit)
    headers = {**dict(target.headers), **auth_headers(target.api_key)}
    watch = _Watch(None if plan.duration_s is not None else len(warmups) + len(requests))
    async with httpx.AsyncClient(timeout=timeout, limits=limits, headers=headers) as client:
        driver = _Driver(client, target, plan, tokenizer, observe, watch)
        if warmups:
            await driver.run("warmup", warmups, timed=False)
        driver.in_flight.peak = 0
        outcomes, duration_s = await driver.run("bench", requests, timed=True) if not watch.reason else ([], 0.0)
    if watch.reason:
        raise UserError(watch.reason)
    return LoadRun(outcomes, duration_s, driver.in_flight.peak)


def run_load(target: Target, plan: LoadPlan, requests: list, warmups: list = (),
             tokenizer: Optional[TextTokenizer] = None, observe: Optional[Observer] = None) -> LoadRun:
    """Run warm-ups, then the timed benchmark; returns every timed request's outcome (each turn of a
    Conversation is one). UserError when the first requests all hit a configuration error."""
    return asyncio.run(_drive(target, plan, list(requests), list(warmups), tokenizer, observe))


def result_document(settings: dict[str, Any], run: LoadRun, percentiles: list[float],
                    goodput: Optional[dict[str, float]], detailed: bool = False,
                    latency_metrics: tuple[str, ...] = PERCENTILE_METRICS) -> dict[str, Any]:
    """The `--json` / `--save-result` document: run settings, then vLLM-named metrics (+ per-request data)."""
    from llmctl.bench.metrics import compute_metrics

    document = dict(settings)
    document.update(compute_metrics(run.outcomes, run.duration_s, percentiles, goodput, run.peak_concurrency,
                                    latency_metrics))
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
            "request_ids": [out.request_id for out in outcomes],
        })
    return document
