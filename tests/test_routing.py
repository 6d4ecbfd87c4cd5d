"""The fallback routing policy and the load signal, as pure functions: no engine, no server."""

from __future__ import annotations

import pytest

from llmctl.server.errors import APIError
from llmctl.server.routing import FallbackPolicy, ModelRouter, load_signal


def _stats(**values: float) -> dict[str, float]:
    return {"kv_cache_usage": 0.0, "max_num_seqs": 10, "num_running_requests": 0, "num_waiting_requests": 0,
            "num_pending": 0, **values}


def test_load_signal_is_the_largest_pressure_in_zero_one():
    assert load_signal(_stats()) == 0.0
    assert load_signal(_stats(kv_cache_usage=0.85, num_running_requests=3)) == pytest.approx(0.85)
    assert load_signal(_stats(kv_cache_usage=0.2, num_running_requests=9)) == pytest.approx(0.9)
    # waiting counts against the admission limit when there is one, else against max_num_seqs
    assert load_signal(_stats(num_waiting_requests=2, num_pending=1), admission_limit=4) == pytest.approx(0.75)
    assert load_signal(_stats(num_waiting_requests=3)) == pytest.approx(0.3)
    assert load_signal(_stats(num_waiting_requests=50)) == 1.0  # clipped


def test_policy_degrades_at_the_threshold_and_recovers_only_below_the_hysteresis_band():
    policy = FallbackPolicy(threshold=0.8, hysteresis=0.1)
    trace = [policy.update(load) for load in (0.5, 0.79, 0.8, 0.75, 0.71, 0.7, 0.69, 0.75, 0.79, 0.8)]
    assert trace == [False, False, True, True, True, True, False, False, False, True]


@pytest.mark.parametrize("threshold, hysteresis", [(0.0, 0.0), (1.5, 0.1), (0.8, 0.8), (0.8, -0.1)])
def test_policy_refuses_settings_outside_their_range(threshold, hysteresis):
    with pytest.raises(ValueError, match="--fallback"):
        FallbackPolicy(threshold, hysteresis)


def test_router_sends_the_primary_name_by_load_and_the_fallback_name_always_to_the_fallback():
    load = [0.0]
    router = ModelRouter(("big", "B"), lambda unseen: load[0], ("small", "S"), FallbackPolicy(0.8, 0.1))
    assert router.model_names == ["big", "small"]
    assert (router.route("big").target, router.route(None).target, router.route("small").target) == ("B", "B", "S")
    load[0] = 0.9
    route = router.route("big")
    assert (route.target, route.model, route.degraded) == ("S", "small", True)
    assert router.route("small").degraded is False  # asked for by name: not a degraded request
    assert router.num_degraded == 1 and router.degraded
    kept = router.route("big", may_degrade=False)  # e.g. token ids of the primary's vocabulary
    assert (kept.target, kept.degraded, router.num_degraded) == ("B", False, 1) and router.degraded
    load[0] = 0.6
    assert router.route(None).target == "B" and not router.degraded
    with pytest.raises(APIError) as missing:
        router.route("other")
    assert missing.value.status == 404 and missing.value.code == "model_not_found"


def test_router_without_a_fallback_never_degrades():
    router = ModelRouter(("big", "B"), lambda unseen: 1.0)
    assert router.route("big").target == "B" and not router.route(None).degraded
    assert router.model_names == ["big"] and not router.degraded
    with pytest.raises(APIError):
        router.route("small")


def test_a_burst_is_counted_as_it_is_routed_not_at_the_next_snapshot():
    """24 requests arrive before the engine publishes a snapshot (it still shows an idle primary with
    max_num_seqs 4): those routed to the primary count until its engine has them, so the burst degrades."""
    router = ModelRouter(("big", "B"), lambda unseen: load_signal(_stats(max_num_seqs=4), unseen=unseen),
                         ("small", "S"), FallbackPolicy(0.8, 0.1))
    routes = [router.route(None) for _ in range(24)]
    to_primary = [route for route in routes if route.target == "B"]
    assert len(to_primary) == 4 and router.num_degraded == 20 and router.degraded  # 4 of 4 seats, then 1.0 >= 0.8
    assert router.num_unseen == 4
    for route in to_primary:  # e.g. refused while tokenising: they never reach the engine
        route.release()
        route.release()  # counted once
    assert router.num_unseen == 0
    # The load fell (nothing in flight): the gauge's answer follows it without a new request.
    assert not router.degraded


def test_the_engines_submission_listener_hands_over_the_request_of_its_own_task():
    import asyncio

    router = ModelRouter(("big", "B"), lambda unseen: unseen / 10, ("small", "S"))

    async def handler() -> int:
        router.route("big")
        await asyncio.sleep(0)
        router.handed_over()  # what the primary engine's listener calls on submission
        return router.num_unseen

    async def burst() -> list[int]:
        return await asyncio.gather(*(handler() for _ in range(3)))

    asyncio.run(burst())
    assert router.num_unseen == 0
