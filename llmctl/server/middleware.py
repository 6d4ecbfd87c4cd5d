"""ASGI middleware in front of the API: request ids, audit log and HTTP metrics, per-client rate
limiting, Bearer-token auth (API keys with per-key rate limits, and a failed-attempt limit of its
own) and the body guard (size counted on the bytes received, a read deadline, no Content-Length +
Transfer-Encoding).

Each is a small pure-ASGI wrapper (streaming responses pass through untouched) that answers
refusals itself with an OpenAI error body, before any handler runs. The order matters and is set
in `app.py`: rate limit and auth come before the body is read, so an unauthenticated or throttled
caller never makes the server read its body; CORS wraps them all, so their refusals carry CORS
headers too.
"""

from __future__ import annotations

import asyncio
import json
import logging
import re
import threading
import time
import uuid
from collections import OrderedDict
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path
from typing import Any, Callable, Optional

from llmctl.server.errors import APIError, ClientDisconnectedError, StreamStalledError, from_exception

ASGIApp = Callable[..., Any]
PROTECTED_PREFIXES = ("/v1/", "/start_profile", "/stop_profile", "/tokenize", "/detokenize")
AUDIT_KEY = "llmctl.audit"
# The status recorded (metrics, audit log; never sent) for a request whose client left first: nginx's 499.
CLIENT_CLOSED_REQUEST = 499
logger = logging.getLogger(__name__)


def is_protected(path: str) -> bool:
    return path.startswith(PROTECTED_PREFIXES)


async def send_error(send: Callable, error: APIError, *, close: bool = False) -> None:
    """Answer `error`; `close` ends the connection after it (a body we did not read may follow)."""
    body = json.dumps(error.body()).encode()
    headers = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]
    headers += [(k.lower().encode(), v.encode()) for k, v in error.headers.items()]
    if close:
        headers.append((b"connection", b"close"))
    await send({"type": "http.response.start", "status": error.status, "headers": headers})
    await send({"type": "http.response.body", "body": body})


def client_of(scope: dict) -> str:
    client = scope.get("client")
    return client[0] if client else "unknown"


# ---- request context: id, audit log, HTTP metrics ------------------------------------------------
class AuditLog:
    """Append-only JSON lines; one line per API request, written after its response ended."""

    def __init__(self, path: Path, include_prompts: bool):
        self.include_prompts = include_prompts
        self._lock = threading.Lock()
        # backslashreplace: a line is written whatever text a request carried (a lone surrogate would raise).
        self._file = open(path, "a", buffering=1, encoding="utf-8",  # noqa: SIM115 - lives as long as the server
                          errors="backslashreplace")

    def write(self, record: dict[str, Any]) -> None:
        line = json.dumps(record, ensure_ascii=False)
        with self._lock:
            self._file.write(line + "\n")

    def close(self) -> None:
        with self._lock:
            self._file.close()


class RequestContext:
    """Gives each request an id (`X-Request-Id`), times it, and records metrics and the audit line.

    Handlers add model and token counts to `scope[AUDIT_KEY]`; prompt text is kept only when the
    audit log was asked to include prompts.
    """

    def __init__(self, app: ASGIApp, *, on_finished: Callable[[dict[str, Any]], None]):
        self.app = app
        self.on_finished = on_finished

    async def __call__(self, scope: dict, receive: Callable, send: Callable) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        request_id = _header(scope, b"x-request-id") or uuid.uuid4().hex
        request_id = re.sub(r"[^A-Za-z0-9._:-]", "", request_id)[:128] or uuid.uuid4().hex
        record: dict[str, Any] = {"request_id": request_id, "client": client_of(scope), "method": scope["method"],
                                  "path": scope["path"], "status": 500}
        scope[AUDIT_KEY] = record
        start = time.monotonic()

        async def send_wrapper(message: dict) -> None:
            if message["type"] == "http.response.start":
                record["status"] = message["status"]
                message.setdefault("headers", [])
                message["headers"] = list(message["headers"]) + [(b"x-request-id", request_id.encode())]
            await send(message)

        try:
            await self.app(scope, receive, send_wrapper)
        finally:
            record["latency_ms"] = round((time.monotonic() - start) * 1000.0, 3)
            try:
                self.on_finished(record)
            except Exception:  # noqa: BLE001 - a metrics/audit failure must not turn into a failed response
                logger.exception("could not record request %s in the metrics or the audit log", request_id)


class DrainCutoff:
    """Answers the requests uvicorn cancels when a drain outlasts `--shutdown-timeout`: an
    OpenAI-shaped 503 if nothing was sent yet, an error event and `[DONE]` for a cut stream, and
    one log line each. (Left alone, the cancellation reaches uvicorn, which logs a traceback,
    answers text/plain 500 and cuts streams without an end.)"""

    def __init__(self, app: ASGIApp):
        self.app = app

    async def __call__(self, scope: dict, receive: Callable, send: Callable) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        sent = {"start": False, "stream": False, "end": False}

        async def send_wrapper(message: dict) -> None:
            if message["type"] == "http.response.start":
                sent["start"] = True
                sent["stream"] = any(k.lower() == b"content-type" and v.startswith(b"text/event-stream")
                                     for k, v in message.get("headers", []))
            elif message["type"] == "http.response.body" and not message.get("more_body", False):
                sent["end"] = True
            await send(message)

        try:
            await self.app(scope, receive, send_wrapper)
        except asyncio.CancelledError:
            task = asyncio.current_task()
            # Only a cancellation from outside (uvicorn's, at the end of a drain) is answered; the
            # CancelledError a handler raises itself for a client that left has nobody to answer.
            if sent["end"] or task is None or not task.cancelling():
                raise
            task.uncancel()
            await self._answer(scope, send, sent)

    @staticmethod
    async def _answer(scope: dict, send: Callable, sent: dict[str, bool]) -> None:
        logger.warning("%s %s cut off: still running when the drain ended (--shutdown-timeout)",
                       scope["method"], scope["path"])
        error = APIError(503, "the server shut down before this request finished (--shutdown-timeout)",
                         code="server_shutting_down", headers={"Retry-After": "1"})
        if not sent["start"]:
            await send_error(send, error, close=True)
        elif sent["stream"]:
            tail = f"data: {json.dumps(error.body())}\n\ndata: [DONE]\n\n".encode()
            await send({"type": "http.response.body", "body": tail, "more_body": False})


def audit_line(record: dict[str, Any], include_prompts: bool) -> dict[str, Any]:
    line = {"time": datetime.now(timezone.utc).isoformat(timespec="milliseconds"), **record}
    if not include_prompts:
        line.pop("prompt", None)
    return line


def _header(scope: dict, name: bytes) -> Optional[str]:
    for key, value in scope.get("headers", ()):
        if key.lower() == name:
            return value.decode("latin-1")
    return None


# ---- unexpected errors ---------------------------------------------------------------------------
class InternalErrors:
    """Innermost: a bug in a handler becomes one logged traceback and an OpenAI-shaped 500, on a
    connection that stays open. (Left to Starlette, the error is re-raised to uvicorn, which logs
    it a second time and drops the keep-alive connection.)"""

    def __init__(self, app: ASGIApp):
        self.app = app

    async def __call__(self, scope: dict, receive: Callable, send: Callable) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        started = False

        async def send_wrapper(message: dict) -> None:
            nonlocal started
            started = started or message["type"] == "http.response.start"
            await send(message)

        try:
            await self.app(scope, receive, send_wrapper)
        except StreamStalledError as exc:  # not a bug: a reader that stopped reading was cut off
            logger.warning("%s %s: stream cancelled and its request aborted: %s (--timeout-stream-write)",
                           scope["method"], scope["path"], exc)
        except ClientDisconnectedError:  # not a server error: nobody is left to answer
            scope.get(AUDIT_KEY, {})["status"] = CLIENT_CLOSED_REQUEST
            logger.info("%s %s: the client disconnected before its answer; its request was aborted",
                        scope["method"], scope["path"])
        except Exception as exc:  # noqa: BLE001 - this is the last place to turn it into an answer
            error = from_exception(exc)  # logs the traceback once
            if not started:
                await send_error(send, error)


# ---- body guard ------------------------------------------------------------------------------------
class BodyGuard:
    """Reads the whole request body before the app sees any of it, counting the bytes actually
    received (a Content-Length is only a claim: h11 frames a message by Transfer-Encoding when both
    are sent), within `timeout_s` of the headers. Refusals close the connection so the unread rest
    of a body can never be parsed as another request:
    400 for Content-Length together with Transfer-Encoding (the request-smuggling shape),
    413 past `max_bytes` (at most that many bytes are buffered), 408 for a body slower than the deadline.
    """

    def __init__(self, app: ASGIApp, *, max_bytes: int, timeout_s: Optional[float]):
        self.app = app
        self.max_bytes = max_bytes
        self.timeout_s = timeout_s

    async def __call__(self, scope: dict, receive: Callable, send: Callable) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        declared = _header(scope, b"content-length")
        if declared is not None and _header(scope, b"transfer-encoding") is not None:
            await send_error(send, APIError(400, "a request must not carry both Content-Length and "
                                                 "Transfer-Encoding", code="invalid_framing"), close=True)
            return
        if declared is not None and declared.isdigit() and int(declared) > self.max_bytes:
            await send_error(send, self._too_large(), close=True)
            return
        try:
            buffered = await asyncio.wait_for(self._read(receive), self.timeout_s)
        except asyncio.TimeoutError:
            await send_error(send, APIError(408, f"the request body did not arrive within {self.timeout_s:g} s "
                                                 "(--timeout-body)", code="body_timeout"), close=True)
            return
        if buffered is None:
            await send_error(send, self._too_large(), close=True)
            return

        async def replay() -> dict:
            return buffered.pop(0) if buffered else await receive()

        await self.app(scope, replay, send)

    async def _read(self, receive: Callable) -> Optional[list[dict]]:
        """The body's messages, or None once more than `max_bytes` arrived."""
        buffered, size = [], 0
        while True:
            message = await receive()
            buffered.append(message)
            if message["type"] != "http.request":
                return buffered
            size += len(message.get("body", b""))
            if size > self.max_bytes:
                return None
            if not message.get("more_body", False):
                return buffered

    def _too_large(self) -> APIError:
        return APIError(413, f"the request body is larger than this server's limit of {self.max_bytes} bytes",
                        code="request_too_large")


def _may_have_body(scope: dict) -> bool:
    length = _header(scope, b"content-length")
    return _header(scope, b"transfer-encoding") is not None or (length is not None and length.strip() != "0")


# ---- auth -----------------------------------------------------------------------------------------
API_KEY_SCOPE = "llmctl.api_key"  # the caller's `api_keys.ApiKey`, for the handlers' attribute checks


class BearerAuth:
    """Require `Authorization: Bearer <key>` on API routes, the key one of `keys` (an
    `api_keys.KeyRing`: hash-keyed lookup, constant-time confirmation).

    Failed attempts draw on a per-client bucket of their own (`failure_limit`, stricter than the
    request rate limit): a client that used it up gets 429 without its key being looked at, so keys
    cannot be guessed at line rate. A key found is put in the scope (`API_KEY_SCOPE`) and its name in
    the audit record; its own request and token rate limits apply (429). Tokens are counted when
    the response ended (prompt + delivered completion tokens): a key over its token budget is
    refused until the budget refilled.
    """

    def __init__(self, app: ASGIApp, *, keys: Any, failure_limit: "RateLimit"):
        self.app = app
        self.keys = keys
        self.failures = TokenBuckets(failure_limit)
        self.requests = {k.name: TokenBuckets(k.rate_limit) for k in keys.keys if k.rate_limit is not None}
        self.tokens = {k.name: TokenBuckets(k.token_rate_limit) for k in keys.keys if k.token_rate_limit is not None}

    async def __call__(self, scope: dict, receive: Callable, send: Callable) -> None:
        if scope["type"] != "http" or not is_protected(scope["path"]) or scope["method"] == "OPTIONS":
            await self.app(scope, receive, send)
            return
        client = client_of(scope)
        wait = self.failures.wait(client)
        if wait > 0:
            await send_error(send, _rate_limited(wait, f"too many failed authentications "
                                                       f"({self.failures.limit} per client)"),
                             close=_may_have_body(scope))
            return
        header = _header(scope, b"authorization") or ""
        scheme, _, token = header.partition(" ")
        key = self.keys.find(token.strip()) if scheme.lower() == "bearer" else None
        if key is None:
            self.failures.take(client)
            message = "missing API key: send 'Authorization: Bearer <key>'" if not header else "invalid API key"
            await send_error(send, APIError(401, message, code="invalid_api_key",
                                            headers={"WWW-Authenticate": "Bearer"}), close=_may_have_body(scope))
            return
        record = scope.setdefault(AUDIT_KEY, {})
        record["api_key_name"] = key.name
        refusal = self._over_limit(key)
        if refusal is not None:
            await send_error(send, refusal, close=_may_have_body(scope))
            return
        scope[API_KEY_SCOPE] = key
        try:
            await self.app(scope, receive, send)
        finally:
            if not key.audit_prompts:  # the audit line is written after this, by RequestContext
                record.pop("prompt", None)
            if key.name in self.tokens:
                used = int(record.get("prompt_tokens") or 0) + int(record.get("completion_tokens") or 0)
                self.tokens[key.name].take(key.name, float(used))

    def _over_limit(self, key: Any) -> Optional[APIError]:
        tokens = self.tokens.get(key.name)
        if tokens is not None and (wait := tokens.wait(key.name)) > 0:
            return _rate_limited(wait, f"the API key {key.name!r} used its token budget ({tokens.limit.requests} "
                                       f"tokens per {tokens.limit.period_s:g} s)")
        requests = self.requests.get(key.name)
        if requests is not None and (wait := requests.take(key.name)) > 0:
            return _rate_limited(wait, f"rate limit exceeded for the API key {key.name!r} "
                                       f"({requests.limit.requests} requests per {requests.limit.period_s:g} s)")
        return None


# ---- rate limit -----------------------------------------------------------------------------------
@dataclass(frozen=True)
class RateLimit:
    requests: int
    period_s: float

    _UNITS = {"second": 1.0, "sec": 1.0, "s": 1.0, "minute": 60.0, "min": 60.0, "m": 60.0,
              "hour": 3600.0, "h": 3600.0, "day": 86400.0, "d": 86400.0}

    @classmethod
    def parse(cls, text: str) -> "RateLimit":
        """'100/minute', '5/second', '1000/hour' (also '/s', '/m', '/h', '/d')."""
        match = re.fullmatch(r"\s*(\d+)\s*/\s*([a-z]+)\s*", text.lower())
        if not match or match.group(2) not in cls._UNITS or int(match.group(1)) < 1:
            raise ValueError(f"invalid rate limit {text!r}: use N/second, N/minute, N/hour or N/day with N >= 1")
        return cls(int(match.group(1)), cls._UNITS[match.group(2)])

    def __str__(self) -> str:
        return f"{self.requests}/{self.period_s:g}s"


class TokenBuckets:
    """One token bucket per client: bursts up to `requests`, refilled at `requests / period`."""

    def __init__(self, limit: RateLimit, max_clients: int = 10_000, clock: Callable[[], float] = time.monotonic):
        self.limit = limit
        self._rate = limit.requests / limit.period_s
        self._buckets: OrderedDict[str, tuple[float, float]] = OrderedDict()
        self._max_clients = max_clients
        self._clock = clock

    def take(self, client: str, amount: Optional[float] = None) -> float:
        """0 when the request may pass (and it is counted), else the seconds until it would.
        With `amount` (tokens a finished request used), that much is drawn whatever is left: the
        bucket may go below zero, and `wait` then says how long until it is back at one."""
        return self._draw(client, consume=True, amount=amount)

    def wait(self, client: str) -> float:
        """As `take`, without counting anything."""
        return self._draw(client, consume=False)

    def _draw(self, client: str, consume: bool, amount: Optional[float] = None) -> float:
        now = self._clock()
        tokens, last = self._buckets.pop(client, (float(self.limit.requests), now))
        tokens = min(float(self.limit.requests), tokens + (now - last) * self._rate)
        wait = 0.0
        if amount is not None:
            tokens -= amount
        elif tokens >= 1.0:
            tokens -= 1.0 if consume else 0.0
        else:
            wait = (1.0 - tokens) / self._rate
        self._buckets[client] = (tokens, now)
        while len(self._buckets) > self._max_clients:
            self._buckets.popitem(last=False)
        return wait


class RateLimiter:
    def __init__(self, app: ASGIApp, *, limit: RateLimit):
        self.app = app
        self.buckets = TokenBuckets(limit)

    async def __call__(self, scope: dict, receive: Callable, send: Callable) -> None:
        if scope["type"] == "http" and is_protected(scope["path"]) and scope["method"] != "OPTIONS":
            wait = self.buckets.take(client_of(scope))
            if wait > 0:
                limit = self.buckets.limit
                await send_error(send, _rate_limited(wait, f"rate limit exceeded ({limit.requests} requests per "
                                                           f"{limit.period_s:g} s per client)"),
                                 close=_may_have_body(scope))
                return
        await self.app(scope, receive, send)


def _rate_limited(wait: float, why: str) -> APIError:
    retry = max(1, int(wait + 0.999))
    return APIError(429, f"{why}; retry in {retry} s", code="rate_limit_exceeded", headers={"Retry-After": str(retry)})
