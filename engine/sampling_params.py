"""`SamplingParams`: how one request is sampled and when it stops (vLLM's names and meanings)."""

from __future__ import annotations

import copy
import enum
from dataclasses import dataclass, field
from typing import Any, Callable, Optional, Union

from llmctl.engine.errors import InvalidRequestError

MAX_LOGPROBS = 20


class RequestOutputKind(enum.Enum):
    """What each `RequestOutput` of a request carries (vLLM's names and meanings)."""
    CUMULATIVE = 0  # everything so far, every step (the offline API's default)
    DELTA = 1  # only what is new since the previous output: text, token ids, logprobs
    FINAL_ONLY = 2  # one output, when the request finishes


@dataclass
class SamplingParams:
    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0 or -1: all tokens
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    seed: Optional[int] = None
    max_tokens: Optional[int] = 16  # None: up to the model's context length
    min_tokens: int = 0
    stop: Union[None, str, list[str]] = None
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    include_stop_str_in_output: bool = False
    logprobs: Optional[int] = None  # top-N log-probabilities per generated token (plus the sampled one)
    prompt_logprobs: Optional[int] = None  # top-N log-probabilities per prompt token (plus the actual one)
    skip_special_tokens: bool = True
    # Callables (output_token_ids, logits_row) -> logits_row, applied to the raw logits first.
    logits_processors: list[Callable[[list[int], Any], Any]] = field(default_factory=list)
    output_kind: RequestOutputKind = RequestOutputKind.CUMULATIVE

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        self.stop = list(self.stop or [])
        self.stop_token_ids = list(self.stop_token_ids or [])
        if self.top_k == -1:
            self.top_k = 0
        self._validate()

    def _validate(self) -> None:
        """Every value check of a request's sampling, in one place; errors name the field."""
        for param, ok, message in self._checks():
            try:
                valid = ok()
            except TypeError as exc:  # e.g. temperature="hot" from a JSON body: a bad request, not a crash
                raise InvalidRequestError(f"{param} has the wrong type: {exc}", param=param) from None
            if not valid:
                raise InvalidRequestError(message, param=param)

    def _checks(self) -> list[tuple[str, Callable[[], bool], str]]:
        return [
            ("n", lambda: isinstance(self.n, int) and self.n >= 1, "n must be an integer >= 1"),
            ("temperature", lambda: self.temperature >= 0.0, "temperature must be >= 0"),
            ("top_p", lambda: 0.0 < self.top_p <= 1.0, "top_p must be in (0, 1]"),
            ("top_k", lambda: isinstance(self.top_k, int) and self.top_k >= 0,
             "top_k must be 0 or -1 (all) or a positive integer"),
            ("min_p", lambda: 0.0 <= self.min_p <= 1.0, "min_p must be in [0, 1]"),
            ("repetition_penalty", lambda: self.repetition_penalty > 0.0, "repetition_penalty must be > 0"),
            ("presence_penalty", lambda: -2.0 <= self.presence_penalty <= 2.0, "presence_penalty must be in [-2, 2]"),
            ("frequency_penalty", lambda: -2.0 <= self.frequency_penalty <= 2.0,
             "frequency_penalty must be in [-2, 2]"),
            ("max_tokens", lambda: self.max_tokens is None or (isinstance(self.max_tokens, int) and self.max_tokens >= 1),
             "max_tokens must be an integer >= 1"),
            ("min_tokens", lambda: isinstance(self.min_tokens, int) and self.min_tokens >= 0, "min_tokens must be >= 0"),
            ("min_tokens", lambda: self.max_tokens is None or self.min_tokens <= self.max_tokens,
             "min_tokens must be <= max_tokens"),
            ("logprobs", lambda: self.logprobs is None or 0 <= self.logprobs <= MAX_LOGPROBS,
             f"logprobs must be in [0, {MAX_LOGPROBS}]"),
            ("prompt_logprobs", lambda: self.prompt_logprobs is None or 0 <= self.prompt_logprobs <= MAX_LOGPROBS,
             f"prompt_logprobs must be in [0, {MAX_LOGPROBS}]"),
            ("stop", lambda: all(isinstance(s, str) and s for s in self.stop), "stop strings must be non-empty strings"),
            ("stop_token_ids", lambda: all(isinstance(t, int) and t >= 0 for t in self.stop_token_ids),
             "stop_token_ids must be token ids"),
            ("seed", lambda: self.seed is None or isinstance(self.seed, int), "seed must be an integer"),
            ("output_kind", lambda: isinstance(self.output_kind, RequestOutputKind),
             "output_kind must be a RequestOutputKind"),
        ]

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    @property
    def needs_penalties(self) -> bool:
        return self.repetition_penalty != 1.0 or self.presence_penalty != 0.0 or self.frequency_penalty != 0.0

    def clone_for_sample(self) -> "SamplingParams":
        """A copy for one of n parallel samples (each sample then has n == 1). A shallow copy, not
        `dataclasses.replace`: the values were validated once, at construction."""
        clone = copy.copy(self)
        clone.n = 1
        return clone
