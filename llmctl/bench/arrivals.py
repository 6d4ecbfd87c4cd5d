"""When each benchmark request is sent: a gamma arrival process, as in vLLM's `bench serve`.

Inter-arrival gaps are gamma distributed with shape = burstiness and scale = 1 / (rate x burstiness),
so the mean gap is always 1 / rate while the coefficient of variation is 1 / sqrt(burstiness):
burstiness 1 is a Poisson process, below 1 burstier, above 1 more regular. An infinite rate sends
everything at once. Offsets are computed up front (seconds after the benchmark start) so the driver
sleeps to absolute deadlines and per-request overhead never stretches the schedule.
"""

from __future__ import annotations

import math

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
