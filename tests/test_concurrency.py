"""The concurrency controllers and the admission limiter, driven by a fake clock and synthetic
latencies (no engine, no server)."""

from __future__ import annotations

import asyncio

import pytest

from llmctl.server.concurrency import (AIMDLimit, ConcurrencyLimiter, ConcurrencySettings, FixedLimit,
                                       controller_for)
from llmctl.server.errors import APIError


class FakeClock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def _run_windows(controller: AIMDLimit, clock: FakeClock, windows: int, ttft_s: float, load: float = 0.1,
                 busy: bool = True) -> list[int]:
    """`windows` windows of finished requests at `ttft_s`; returns the limit after each."""
    limits = []
    for _ in range(windows):
        if busy:
            controller.note_in_flight(controller.limit)  # the limit was used
        for _ in range(2):  # halves add up to the window exactly
            clock.now += controller.settings.window_s / 2
            controller.observe(ttft_s, load)
        limits.append(controller.limit)
    return limits


def _aimd(**overrides) -> tuple[AIMDLimit, FakeClock]:
    clock = FakeClock()
    settings = ConcurrencySettings(**{"min_limit": 2, "max_limit": 40, "initial_limit": 10, "target_ttft_s": 0.5,
                                      "window_s": 1.0, **overrides})
    return AIMDLimit(settings, clock), clock


def test_limit_rises_by_one_per_window_while_latency_stays_under_target():
    controller, clock = _aimd()
    assert _run_windows(controller, clock, 5, ttft_s=0.1) == [11, 12, 13, 14, 15]
    assert controller.last_decision == "increase"


def test_limit_falls_multiplicatively_when_latency_rises_and_stops_at_the_floor():
    controller, clock = _aimd(initial_limit=40)
    assert _run_windows(controller, clock, 4, ttft_s=2.0) == [36, 32, 28, 25]  # x0.9, floored
    assert _run_windows(controller, clock, 40, ttft_s=2.0)[-1] == 2  # --concurrency-min
    assert _run_windows(controller, clock, 60, ttft_s=0.1)[-1] == 40  # --concurrency-max


def test_small_limits_still_fall_by_at_least_one():
    controller, clock = _aimd(initial_limit=5)
    assert _run_windows(controller, clock, 3, ttft_s=2.0) == [4, 3, 2]


def test_a_high_load_signal_lowers_the_limit_even_with_fast_first_tokens():
    controller, clock = _aimd(target_load=0.9)
    assert _run_windows(controller, clock, 2, ttft_s=0.1, load=1.0) == [9, 8]


def test_the_decision_uses_the_window_median_not_one_outlier():
    controller, clock = _aimd()
    controller.note_in_flight(10)
    for ttft in (0.1, 9.0, 0.2):  # one slow request among fast ones
        clock.now += 0.34
        controller.observe(ttft, 0.1)
    assert controller.limit == 11


def test_an_unused_limit_does_not_grow():
    controller, clock = _aimd()
    controller.note_in_flight(3)  # a peak of 3 under a limit of 10: the server is not using it
    assert _run_windows(controller, clock, 3, ttft_s=0.1, busy=False) == [10, 10, 10]
    assert controller.last_decision == "hold"


def test_no_decision_before_the_window_has_passed():
    controller, clock = _aimd(window_s=5.0)
    controller.note_in_flight(10)
    for _ in range(20):
        clock.now += 0.1
        controller.observe(9.0, 1.0)
    assert controller.limit == 10 and controller.last_decision == "start"


@pytest.mark.parametrize("overrides, message", [
    ({"max_concurrency": "0"}, "--max-concurrency"), ({"max_concurrency": "lots"}, "--max-concurrency"),
    ({"min_limit": 0}, "--concurrency-min"), ({"min_limit": 5, "max_limit": 4, "initial_limit": 5}, "--concurrency-max"),
    ({"initial_limit": 1000}, "--concurrency-initial"), ({"backoff": 1.0}, "--concurrency-backoff"),
    ({"target_load": 0.0}, "--concurrency-target-load"), ({"queue_size": -1}, "--concurrency-queue"),
])
def test_settings_out_of_range_are_refused_by_flag_name(overrides, message):
    with pytest.raises(ValueError, match=message):
        ConcurrencySettings(**overrides).validate()


def test_a_number_gives_a_fixed_limit():
    controller = controller_for(ConcurrencySettings(max_concurrency="3"))
    assert isinstance(controller, FixedLimit) and controller.limit == 3
    controller.observe(99.0, 1.0)
    assert controller.limit == 3


def test_limiter_refuses_past_the_limit_with_a_503_and_retry_after():
    async def scenario() -> None:
        rejected = []
        limiter = ConcurrencyLimiter(FixedLimit(2), on_rejected=lambda: rejected.append(1))
        await limiter.acquire()
        await limiter.acquire()
        with pytest.raises(APIError) as refusal:
            await limiter.acquire()
        assert refusal.value.status == 503 and refusal.value.headers["Retry-After"] == "1"
        assert refusal.value.code == "concurrency_limit_exceeded" and rejected == [1]
        limiter.release()
        await limiter.acquire()
        assert limiter.in_flight == 2

    asyncio.run(scenario())


def test_limiter_queue_is_fifo_bounded_and_times_out():
    async def scenario() -> None:
        limiter = ConcurrencyLimiter(FixedLimit(1), queue_size=2, queue_timeout_s=0.2)
        await limiter.acquire()
        order: list[str] = []

        async def waiter(name: str) -> None:
            await limiter.acquire()
            order.append(name)

        tasks = [asyncio.create_task(waiter(name)) for name in ("a", "b")]
        await asyncio.sleep(0)
        assert limiter.queued == 2
        with pytest.raises(APIError):  # the queue is full
            await limiter.acquire()
        limiter.release()
        await asyncio.sleep(0.05)
        assert order == ["a"] and limiter.in_flight == 1
        with pytest.raises(APIError, match="waited 0.2 s"):
            await tasks[1]  # "a" never releases: "b" times out
        assert limiter.queued == 0 and limiter.in_flight == 1

    asyncio.run(scenario())


def test_a_cancelled_waiter_leaves_the_queue_without_taking_a_slot():
    async def scenario() -> None:
        limiter = ConcurrencyLimiter(FixedLimit(1), queue_size=1)
        await limiter.acquire()
        task = asyncio.create_task(limiter.acquire())
        await asyncio.sleep(0)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        assert limiter.queued == 0
        limiter.release()
        assert limiter.in_flight == 0

    asyncio.run(scenario())


def test_a_rising_limit_admits_queued_requests_at_once():
    async def scenario() -> None:
        controller = FixedLimit(1)
        limiter = ConcurrencyLimiter(controller, queue_size=1)
        await limiter.acquire()
        task = asyncio.create_task(limiter.acquire())
        await asyncio.sleep(0)
        controller.limit = 2
        limiter.wake()
        await asyncio.wait_for(task, 1)
        assert limiter.in_flight == 2

    asyncio.run(scenario())
