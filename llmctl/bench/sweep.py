"""`bench serve` sweeps: comma lists of --request-rate and --max-concurrency expand into load points run
in turn; the result document holds one row per point and the highest load still meeting the targets.

A point meets the targets when every --slo gate holds and, with --goodput, at least
GOODPUT_ATTAINMENT of its requests met the per-request SLOs (DistServe's definition of goodput).
"""

from __future__ import annotations

import csv
import math
from pathlib import Path
from typing import Any, Optional

from llmctl.errors import UserError

GOODPUT_ATTAINMENT = 0.9
# The CSV's leading columns; the numeric metrics follow in document order.
CSV_FIRST = ("label", "request_rate", "max_concurrency", "completed", "failed", "meets_targets")


def parse_rates(text: str) -> list[float]:
    """'1,2,4,inf' -> [1.0, 2.0, 4.0, inf]; each > 0."""
    from llmctl.bench.arrivals import validate_rate

    rates = []
    for part in _parts(text, "--request-rate"):
        try:
            rate = float(part)
            validate_rate(rate, 1.0)
        except ValueError as exc:
            detail = str(exc) if "rate" in str(exc) else f"{part!r} is not a number"
            raise ValueError(f"{detail} (expected e.g. 1,4,16,inf)") from None
        rates.append(rate)
    return rates


def parse_concurrencies(text: Optional[str]) -> list[Optional[int]]:
    """'1,8,32' -> [1, 8, 32]; None (no flag) -> [None], no limit."""
    if text is None:
        return [None]
    values: list[Optional[int]] = []
    for part in _parts(text, "--max-concurrency"):
        if not part.isdigit() or int(part) < 1:
            raise ValueError(f"{part!r} is not an integer >= 1 (expected e.g. 1,8,32)")
        values.append(int(part))
    return values


def _parts(text: str, flag: str) -> list[str]:
    parts = [part.strip() for part in str(text).split(",") if part.strip()]
    if not parts:
        raise ValueError(f"{flag} needs at least one value")
    return parts


def json_rate(rate: float) -> Any:
    """JSON has no infinity; vLLM writes the string "inf" too."""
    return "inf" if math.isinf(rate) else rate


def meets_targets(row: dict[str, Any]) -> bool:
    """Every --slo gate held and (with --goodput) GOODPUT_ATTAINMENT of the requests met their SLOs."""
    if not row["completed"]:
        return False
    if not all(gate["passed"] for gate in row.get("slo", [])):
        return False
    goodput = row.get("request_goodput")
    return goodput is None or goodput >= GOODPUT_ATTAINMENT * row["request_throughput"]


def frontier(rows: list[dict[str, Any]]) -> Optional[dict[str, Any]]:
    """The point with the highest measured request throughput among those meeting the targets."""
    passing = [row for row in rows if row["meets_targets"]]
    if not passing:
        return None
    best = max(passing, key=lambda row: row["request_throughput"])
    return {key: best[key] for key in ("request_rate", "max_concurrency", "request_throughput", "output_throughput")}


def sweep_document(settings: dict[str, Any], points: list[dict[str, Any]]) -> dict[str, Any]:
    """Shared settings once, then a row per point (its own rate, concurrency, metrics, gates)."""
    shared = {key: value for key, value in settings.items() if key not in ("request_rate", "max_concurrency")}
    rows = []
    for point in points:
        row = {key: value for key, value in point.items() if key not in shared}
        row["meets_targets"] = meets_targets(row)
        rows.append(row)
    return {**shared, "request_rates": [row["request_rate"] for row in rows],
            "max_concurrencies": [row["max_concurrency"] for row in rows],
            "sweep": rows, "best_point": frontier(rows)}


def csv_rows(document: dict[str, Any]) -> list[dict[str, Any]]:
    """One flat row per load point (a single run is one point): the scalar fields only."""
    rows = document.get("sweep") or [document]
    flat = []
    for row in rows:
        values = {key: value for key, value in row.items()
                  if isinstance(value, (int, float, str, bool)) or value is None}
        values["label"] = document.get("label")
        values.setdefault("meets_targets", meets_targets(row))
        flat.append(values)
    return flat


def write_csv(path: Path, document: dict[str, Any]) -> None:
    rows = csv_rows(document)
    columns = list(CSV_FIRST) + [key for key in rows[0] if key not in CSV_FIRST]
    try:
        with Path(path).open("w", newline="") as stream:
            writer = csv.DictWriter(stream, fieldnames=columns, extrasaction="ignore")
            writer.writeheader()
            writer.writerows(rows)
    except OSError as exc:
        raise UserError(f"cannot write --csv {path}: {exc.strerror or exc}") from None
