"""`SamplingParams`: how one request is sampled and when it stops (vLLM's names and meanings)."""

from __future__ import annotations

import copy
import enum
import json
from dataclasses import dataclass, field
from typing import Any, Callable, Optional, Union

from llmctl.engine.errors import InvalidRequestError

MAX_LOGPROBS = 20


class RequestOutputKind(enum.Enum):
    """What each `RequestOutput` of a request carries (vLLM's names and meanings)."""
    CUMULATIVE = 0  # everything so far, every step (the offline API's default)
    DELTA = 1  # only what is new since the previous output: text, token ids, logprobs
    FINAL_ONLY = 2  # one output, when the request finishes


@dataclass(frozen=True)
class StructuredOutputsParams:
    """vLLM's structured outputs: exactly one constraint the output must match (compiled once per distinct
    spec by engine/structured_output/). `json`: a JSON schema (dict or its text); `regex`; `choice`: one of
    these strings; `grammar`: EBNF (GBNF); `json_object`: any JSON object."""
    json: Union[None, str, dict] = None
    regex: Optional[str] = None
    choice: Optional[list[str]] = None
    grammar: Optional[str] = None
    json_object: Optional[bool] = None

    def __post_init__(self) -> None:
        set_fields = [name for name in STRUCTURED_KINDS if getattr(self, name) not in (None, False)]
        if len(set_fields) != 1:
            raise InvalidRequestError("structured_outputs needs exactly one of json, regex, choice, grammar or "
                                      f"json_object (got {', '.join(set_fields) or 'none'})", param="structured_outputs")
        kind = set_fields[0]
        value = getattr(self, kind)
        ok = {"json": isinstance(value, dict) or (isinstance(value, str) and bool(value.strip())),
              "regex": isinstance(value, str) and bool(value),
              "choice": isinstance(value, list) and bool(value) and all(isinstance(c, str) for c in value),
              "grammar": isinstance(value, str) and bool(value.strip()),
              "json_object": value is True}[kind]
        if not ok:
            raise InvalidRequestError(f"structured_outputs.{kind} must be {STRUCTURED_KINDS[kind]}",
                                      param=f"structured_outputs.{kind}")
        if kind == "json" and isinstance(value, str):
            try:
                parsed = json.loads(value)
            except json.JSONDecodeError as exc:
                raise InvalidRequestError(f"structured_outputs.json is not valid JSON: {exc}",
                                          param="structured_outputs.json") from None
            if not isinstance(parsed, (dict, bool)):
                raise InvalidRequestError("structured_outputs.json must be a JSON schema (an object)",
                                          param="structured_outputs.json")

    @property
    def kind(self) -> str:
        return next(name for name in STRUCTURED_KINDS if getattr(self, name) not in (None, False))

    @property
    def key(self) -> tuple[str, str]:
        """What identifies the compiled grammar: the kind and its spec in one canonical text (a schema's
        keys sorted, so two spellings of one schema share a compile)."""
        value = getattr(self, self.kind)
        if self.kind == "json":
            value = json.loads(value) if isinstance(value, str) else value
            return "json", json.dumps(value, sort_keys=True, separators=(",", ":"))
        if self.kind == "choice":
            return "choice", json.dumps(value)
        return self.kind, str(value)


# kind -> what its value must be (the error message's words)
STRUCTURED_KINDS = {"json": "a JSON schema (an object, or its JSON text)", "regex": "a non-empty regular expression",
                    "choice": "a non-empty list of strings", "grammar": "a non-empty EBNF grammar",
                    "json_object": "true"}


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
    structured_outputs: Optional[StructuredOutputsParams] = None  # the output must match this grammar

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
            ("structured_outputs", lambda: self.structured_outputs is None
             or isinstance(self.structured_outputs, StructuredOutputsParams),
             "structured_outputs must be a StructuredOutputsParams"),
            # the grammar decides where the output ends; masking its end tokens would leave no token to draw
            ("min_tokens", lambda: self.structured_outputs is None or self.min_tokens == 0,
             "min_tokens cannot be combined with structured_outputs (the grammar decides where the output ends)"),
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
