"""When each benchmark request is sent: a gamma arrival process, as in vLLM's `bench serve`.

Inter-arrival gaps are gamma distributed with shape = burstiness and scale = 1 / (rate x burstiness),
so the mean gap is always 1 / rate while the coefficient of variation is 1 / sqrt(burstiness):
burstiness 1 is a Poisson process, below 1 burstier, above 1 more regular. An infinite rate sends
everything at once. Offsets are computed up front (seconds after the benchmark start) so the driver
sleeps to absolute deadlines and per-request overhead never stretches the schedule.

With a ramp-up of R seconds the rate grows linearly from 0 to the target over R seconds: the
steady-rate schedule is read as "operational time" s and mapped to wall time t, where the
cumulative rate r t^2 / 2R (t < R), r (t - R/2) after, equals r s; a gamma process stays gamma.
"""

from __future__ import annotations

import itertools
import math
from typing import Iterator

import numpy as np


def validate_rate(request_rate: float, burstiness: float) -> None:
    if math.isnan(request_rate) or request_rate <= 0:
        raise ValueError("request rate must be > 0 (requests per second, or inf for all at once)")
    if math.isnan(burstiness) or math.isinf(burstiness) or burstiness <= 0:
        raise ValueError("burstiness must be a finite number > 0 (1 = Poisson)")


def arrival_offsets(num_requests: int, request_rate: float, burstiness: float,
                    rng: np.random.Generator) -> list[float]:
    """Send time of each request in seconds after the start; the first goes at 0 (as vLLM does)."""
    validate_rate(request_rate, burstiness)
    if num_requests <= 0:
        return []
    if math.isinf(request_rate):
        return [0.0] * num_requests
    scale = 1.0 / (request_rate * burstiness)
    gaps = rng.gamma(shape=burstiness, scale=scale, size=num_requests - 1)
    return [0.0] + np.cumsum(gaps).tolist()


def ramped(offset: float, ramp_up_s: float) -> float:
    """Wall time of a steady-rate offset when the rate ramps linearly from 0 over `ramp_up_s`."""
    if ramp_up_s <= 0:
        return offset
    if offset < ramp_up_s / 2:
        return math.sqrt(2.0 * ramp_up_s * offset)
    return offset + ramp_up_s / 2


def arrival_times(request_rate: float, burstiness: float, rng: np.random.Generator,
                  ramp_up_s: float = 0.0) -> Iterator[float]:
    """Endless send times (seconds after the start), the same sequence `arrival_offsets` returns."""
    validate_rate(request_rate, burstiness)
    if math.isinf(request_rate):
        yield from itertools.repeat(0.0)
    scale = 1.0 / (request_rate * burstiness)
    offset = 0.0
    while True:
        yield ramped(offset, ramp_up_s)
        offset += float(rng.gamma(shape=burstiness, scale=scale))
