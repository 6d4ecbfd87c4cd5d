"""Serving cost from a measured throughput and the instance's price per hour (`--price-per-hour`).

A model, not a bill: it prices compute time only, at the throughput the benchmark measured, as if
the instance ran at that load around the clock. Transfer and storage are not measured here; see
docs/operations.md ("Cost model") for how to add them and why their weights are assumptions.
"""

from __future__ import annotations

import math
from typing import Any, Optional

from llmctl.errors import UserError

HOURS_PER_MONTH = 730.0  # 365 days x 24 h / 12 months


def check_cost_flags(price_per_hour: Optional[float], monthly_request_rate: Optional[float]) -> None:
    """Raise a UserError naming the flag when a value cannot give a cost (before any benchmark runs)."""
    if price_per_hour is not None and not (math.isfinite(price_per_hour) and price_per_hour > 0):
        raise UserError(f"--price-per-hour must be a positive number of USD, got {price_per_hour:g}")
    if monthly_request_rate is not None:
        if price_per_hour is None:
            raise UserError("--monthly-request-rate needs --price-per-hour (the instance's price)")
        if not (math.isfinite(monthly_request_rate) and monthly_request_rate > 0):
            raise UserError(f"--monthly-request-rate must be a positive number of requests/s, "
                             f"got {monthly_request_rate:g}")


def _per_million(price_per_hour: float, tokens_per_s: float) -> Optional[float]:
    return price_per_hour / (tokens_per_s * 3600.0) * 1e6 if tokens_per_s > 0 else None


def cost_figures(price_per_hour: float, *, requests_per_s: float, output_tokens_per_s: float,
                 total_tokens_per_s: float, monthly_request_rate: Optional[float] = None) -> dict[str, Any]:
    """USD per 1M output / total tokens at the measured rates, and the monthly cost of serving
    `monthly_request_rate` requests/s (default: the measured rate) with as many instances as that
    takes at the measured requests/s per instance. Figures that need a zero rate are None."""
    rate = monthly_request_rate if monthly_request_rate is not None else requests_per_s
    replicas = math.ceil(rate / requests_per_s - 1e-9) if requests_per_s > 0 else None
    return {
        "price_per_hour_usd": price_per_hour,
        "usd_per_1m_output_tokens": _per_million(price_per_hour, output_tokens_per_s),
        "usd_per_1m_total_tokens": _per_million(price_per_hour, total_tokens_per_s),
        "monthly_request_rate": rate,
        "instances_needed": replicas,
        "hours_per_month": HOURS_PER_MONTH,
        "monthly_usd": replicas * price_per_hour * HOURS_PER_MONTH if replicas is not None else None,
        "model": "compute only: price per hour / measured throughput; transfer and storage excluded",
    }


def cost_rows(cost: dict[str, Any]) -> list[tuple[str, Optional[str]]]:
    """The cost block as (label, value) rows; None starts a section (like the serving summary)."""
    def usd(value: Optional[float], digits: int = 4) -> str:
        return "n/a (nothing measured)" if value is None else f"{value:.{digits}f}"

    instances = cost["instances_needed"]
    return [
        (f"Cost at ${cost['price_per_hour_usd']:g}/h (compute only)", None),
        ("USD per 1M output tokens", usd(cost["usd_per_1m_output_tokens"])),
        ("USD per 1M total tokens", usd(cost["usd_per_1m_total_tokens"])),
        (f"USD per month at {cost['monthly_request_rate']:.3g} req/s",
         usd(cost["monthly_usd"], 2) + ("" if instances is None else f" ({instances} instance(s))")),
    ]
