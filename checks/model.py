"""Result types shared by every check: a status, what was observed, what was expected, the fix."""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import Enum
from typing import Any, Callable, Iterable, Optional


class Status(str, Enum):
    PASS = "pass"
    WARN = "warn"
    FAIL = "fail"
    SKIP = "skip"
    INFO = "info"


# Folding several findings into one result keeps the most serious one.
SEVERITY = {Status.SKIP: 0, Status.INFO: 1, Status.PASS: 2, Status.WARN: 3, Status.FAIL: 4}

AREAS = ("GPU", "Interconnect", "CPU/OS", "Memory", "Software", "Storage/container", "Deployment")


@dataclass(frozen=True)
class Finding:
    """One observation inside a check, e.g. about one GPU."""

    status: Status
    message: str
    fix: Optional[str] = None


@dataclass(frozen=True)
class Result:
    id: str
    status: Status
    summary: str
    observed: Any = None
    expected: Any = None
    fix: Optional[str] = None
    details: tuple[str, ...] = ()

    def to_dict(self) -> dict[str, Any]:
        return {
            "id": self.id,
            "status": self.status.value,
            "summary": self.summary,
            "observed": self.observed,
            "expected": self.expected,
            "fix": self.fix,
            "details": list(self.details),
        }


@dataclass(frozen=True)
class Check:
    id: str
    area: str
    title: str
    run: Callable[..., Result] = field(repr=False)

    @property
    def explain(self) -> str:
        return (self.run.__doc__ or self.title).strip()


def fold(check_id: str, findings: Iterable[Finding], observed: Any = None, expected: Any = None) -> Result:
    """One result from many findings: the worst status, its messages, and the first fix offered."""
    findings = list(findings)
    if not findings:
        raise ValueError(f"{check_id}: a check must report at least one finding")
    worst = max(findings, key=lambda f: SEVERITY[f.status]).status
    top = [f for f in findings if f.status == worst]
    fix = next((f.fix for f in top if f.fix), None)
    details = tuple(f"{f.status.value}: {f.message}" for f in findings if len(findings) > 1)
    return Result(check_id, worst, "; ".join(dict.fromkeys(f.message for f in top)), observed, expected, fix, details)


def skip(check_id: str, reason: str, observed: Any = None) -> Result:
    return Result(check_id, Status.SKIP, reason, observed=observed)
