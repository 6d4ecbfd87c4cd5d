"""How many completion requests the server admits at once: a fixed number, or one an AIMD controller moves.

Owns `ConcurrencySettings` (validated in one place), the controllers (pure: a fake clock and
synthetic samples drive them in tests), the asyncio admission limiter with its bounded wait queue,
and the ASGI middleware that holds a slot for a request's whole life (a stream's too) and answers
503 with `Retry-After` when the limit and the queue are full.

The adaptive controller is Netflix concurrency-limits' AIMD inside its windowed aggregation: each
window (at least `window_s` long, at least one sample) yields the p50 time to first token and the
p50 load signal of the finished requests; if either is over its target the limit is multiplied by
`backoff` (at least -1), otherwise it grows by one while the window's peak in-flight count used at
least half of it (a server that is not using its limit learns nothing about a larger one).
"""

from __future__ import annotations

import asyncio
import math
import statistics
import time
from collections import deque
from dataclasses import dataclass
from typing import Any, Callable, Optional, Protocol

from llmctl.server.errors import APIError

LIMITED_PATHS = frozenset({"/v1/completions", "/v1/chat/completions"})


@dataclass
class ConcurrencySettings:
    """`--max-concurrency N` (fixed) or `auto` (adaptive, within [min_limit, max_limit])."""
    max_concurrency: str = "auto"
    min_limit: int = 1
    max_limit: int = 256
    initial_limit: int = 16
    target_ttft_s: float = 1.0
    target_load: float = 0.95
    window_s: float = 1.0
    backoff: float = 0.9  # Netflix's default backoffRatio
    queue_size: int = 0
    queue_timeout_s: float = 5.0

    @property
    def adaptive(self) -> bool:
        return self.max_concurrency == "auto"

    @property
    def fixed_limit(self) -> Optional[int]:
        return None if self.adaptive else int(self.max_concurrency)

    def validate(self) -> None:
        if not self.adaptive and not (self.max_concurrency.isdigit() and int(self.max_concurrency) >= 1):
            raise ValueError(f"--max-concurrency must be 'auto' or a whole number >= 1, got {self.max_concurrency!r}")
        checks = [
            (self.min_limit >= 1, "--concurrency-min must be >= 1"),
            (self.max_limit >= self.min_limit, "--concurrency-max must be >= --concurrency-min"),
            (self.min_limit <= self.initial_limit <= self.max_limit,
             "--concurrency-initial must lie in [--concurrency-min, --concurrency-max]"),
            (self.target_ttft_s > 0, "--concurrency-target-ttft must be > 0"),
            (0 < self.target_load <= 1, "--concurrency-target-load must be in (0, 1]"),
            (self.window_s > 0, "--concurrency-window must be > 0"),
            (0 < self.backoff < 1, "--concurrency-backoff must be in (0, 1)"),
            (self.queue_size >= 0, "--concurrency-queue must be >= 0"),
            (self.queue_timeout_s > 0, "--concurrency-queue-timeout must be > 0"),
        ]
        for ok, message in checks:
            if not ok:
                raise ValueError(message)


class Controller(Protocol):
    limit: int

    def note_in_flight(self, in_flight: int) -> None: ...

    def observe(self, ttft_s: float, load: float) -> None: ...


class FixedLimit:
    """`--max-concurrency N`: the limit never moves."""

    def __init__(self, limit: int):
        self.limit = limit

    def note_in_flight(self, in_flight: int) -> None:
        pass

    def observe(self, ttft_s: float, load: float) -> None:
        pass


class AIMDLimit:
    """Additive increase, multiplicative decrease over windows of finished requests (see the module doc)."""

    def __init__(self, settings: ConcurrencySettings, clock: Callable[[], float] = time.monotonic):
        self.settings = settings
        self.clock = clock
        self.limit = settings.initial_limit
        self._window_start = clock()
        self._ttfts: list[float] = []
        self._loads: list[float] = []
        self._in_flight = 0
        self._peak_in_flight = 0
        self.last_decision = "start"

    def note_in_flight(self, in_flight: int) -> None:
        """The limiter's count after each admission and release."""
        self._in_flight = in_flight
        self._peak_in_flight = max(self._peak_in_flight, in_flight)

    def observe(self, ttft_s: float, load: float) -> None:
        """One finished request: its time to first token, and the load signal when it finished."""
        self._ttfts.append(ttft_s)
        self._loads.append(load)
        now = self.clock()
        if now - self._window_start >= self.settings.window_s:
            self._decide(statistics.median(self._ttfts), statistics.median(self._loads))
            self._window_start = now
            self._ttfts, self._loads = [], []
            self._peak_in_flight = self._in_flight

    def _decide(self, ttft_p50: float, load_p50: float) -> None:
        s = self.settings
        if ttft_p50 > s.target_ttft_s or load_p50 > s.target_load:
            self.limit = max(s.min_limit, min(self.limit - 1, math.floor(self.limit * s.backoff)))
            self.last_decision = "decrease"
        elif 2 * self._peak_in_flight >= self.limit:
            self.limit = min(s.max_limit, self.limit + 1)
            self.last_decision = "increase"
        else:
            self.last_decision = "hold"


def controller_for(settings: ConcurrencySettings, clock: Callable[[], float] = time.monotonic) -> Controller:
    settings.validate()
    fixed = settings.fixed_limit
    return FixedLimit(fixed) if fixed is not None else AIMDLimit(settings, clock)


class ConcurrencyLimiter:
    """Admission slots under the controller's limit, with a bounded FIFO queue of waiters (asyncio)."""

    def __init__(self, controller: Controller, queue_size: int = 0, queue_timeout_s: float = 5.0,
                 on_rejected: Optional[Callable[[], None]] = None):
        self.controller = controller
        self.queue_size = queue_size
        self.queue_timeout_s = queue_timeout_s
        self.on_rejected = on_rejected
        self.in_flight = 0
        self._waiters: deque[asyncio.Future] = deque()

    @property
    def limit(self) -> int:
        return self.controller.limit

    @property
    def queued(self) -> int:
        return len(self._waiters)

    async def acquire(self) -> None:
        """Take a slot, waiting in the queue if there is room there; else raise a 503 `APIError`."""
        if self.in_flight < self.limit and not self._waiters:
            self._take()
            return
        if len(self._waiters) >= self.queue_size:
            raise self._refusal(f"the server is at its concurrency limit ({self.limit} requests in flight"
                                + (f", {self.queue_size} queued" if self.queue_size else "") + ")")
        waiter = asyncio.get_running_loop().create_future()
        self._waiters.append(waiter)
        try:
            await asyncio.wait_for(asyncio.shield(waiter), self.queue_timeout_s)
        except asyncio.TimeoutError:
            self._give_up(waiter)
            raise self._refusal(f"waited {self.queue_timeout_s:g} s for a slot under the concurrency limit "
                                f"({self.limit})") from None
        except BaseException:
            self._give_up(waiter)
            raise

    def release(self) -> None:
        self.in_flight -= 1
        self.controller.note_in_flight(self.in_flight)
        self.wake()

    def wake(self) -> None:
        """Hand free slots to waiters in arrival order (after a release, or when the limit rose)."""
        while self._waiters and self.in_flight < self.limit:
            waiter = self._waiters.popleft()
            if not waiter.done():
                self._take()
                waiter.set_result(None)

    def _take(self) -> None:
        self.in_flight += 1
        self.controller.note_in_flight(self.in_flight)

    def _give_up(self, waiter: asyncio.Future) -> None:
        if waiter in self._waiters:
            self._waiters.remove(waiter)
            waiter.cancel()
        elif waiter.done() and not waiter.cancelled():
            self.release()  # the slot was handed over just as the wait ended: give it back

    def _refusal(self, message: str) -> APIError:
        if self.on_rejected is not None:
            self.on_rejected()
        return APIError(503, f"{message}; retry later", code="concurrency_limit_exceeded",
                        headers={"Retry-After": "1"})


class ConcurrencyLimit:
    """ASGI middleware: one slot per completion request, held until its response (or stream) ends."""

    def __init__(self, app: Any, limiter: ConcurrencyLimiter):
        self.app = app
        self.limiter = limiter

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        if scope["type"] != "http" or scope.get("path") not in LIMITED_PATHS or scope.get("method") != "POST":
            await self.app(scope, receive, send)
            return
        try:
            await self.limiter.acquire()
        except APIError as refusal:
            await refusal.response()(scope, receive, send)
            return
        try:
            await self.app(scope, receive, send)
        finally:
            self.limiter.release()
