"""`RequestOutput` / `CompletionOutput`: what a request has produced so far (vLLM's shapes)."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any, Optional


@dataclass
class CompletionOutput:
    index: int
    text: str
    token_ids: list[int]
    cumulative_logprob: Optional[float]
    logprobs: Optional[list[dict[int, float]]]
    finish_reason: Optional[str] = None  # "stop", "length" or "abort"
    stop_reason: Any = None  # the stop string or stop token id that ended it

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class RequestMetrics:
    arrival_time: float
    first_scheduled_time: Optional[float] = None
    first_token_time: Optional[float] = None
    finished_time: Optional[float] = None
    num_preemptions: int = 0

    @property
    def time_to_first_token(self) -> Optional[float]:
        if self.first_token_time is None:
            return None
        return self.first_token_time - self.arrival_time

    @property
    def queue_time(self) -> Optional[float]:
        if self.first_scheduled_time is None:
            return None
        return self.first_scheduled_time - self.arrival_time


@dataclass
class RequestOutput:
    request_id: str
    prompt: Optional[str]
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool
    metrics: RequestMetrics = field(default_factory=lambda: RequestMetrics(0.0))
    # One entry per prompt token (None for the first, which nothing predicts), when asked for.
    prompt_logprobs: Optional[list[Optional[dict[int, float]]]] = None
    # Set when the engine finished the request on a failure of its own (a `CapacityError`: it does
    # not fit in memory even alone); the completions then end with finish_reason "abort".
    error: Optional[Exception] = None

    def to_dict(self) -> dict[str, Any]:
        return asdict(self, dict_factory=_json_safe_dict)


def _json_safe_dict(items: list[tuple[str, Any]]) -> dict[str, Any]:
    return {key: str(value) if isinstance(value, BaseException) else value for key, value in items}
