"""`RequestOutput` / `CompletionOutput`: what a request has produced (vLLM's shapes): everything so
far, or only what is new since its previous output (`SamplingParams.output_kind`)."""

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

    def extend(self, delta: "CompletionOutput") -> None:
        """Append a later delta of this completion (text, token ids, logprobs) in place."""
        self.text += delta.text
        self.token_ids.extend(delta.token_ids)
        if delta.logprobs is not None:
            if self.logprobs is None:
                self.logprobs = []
            self.logprobs.extend(delta.logprobs)
        self.cumulative_logprob = delta.cumulative_logprob
        self.finish_reason, self.stop_reason = delta.finish_reason, delta.stop_reason


@dataclass(frozen=True)
class SpecDecodeCounts:
    """Speculative decoding's counters, as vLLM's spec-decode metrics: verify rows (drafts), the draft
    tokens verified in them, and how many of those were accepted."""

    num_drafts: int = 0
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0

    def __add__(self, other: "SpecDecodeCounts") -> "SpecDecodeCounts":
        return SpecDecodeCounts(self.num_drafts + other.num_drafts, self.num_draft_tokens + other.num_draft_tokens,
                                self.num_accepted_tokens + other.num_accepted_tokens)

    @property
    def acceptance_rate(self) -> Optional[float]:
        """Accepted ÷ drafted tokens; None when nothing was drafted."""
        return self.num_accepted_tokens / self.num_draft_tokens if self.num_draft_tokens else None

    @property
    def mean_acceptance_length(self) -> Optional[float]:
        """Tokens a verify row produced on average, its own included: 1 + accepted ÷ verify rows (vLLM's
        mean acceptance length); None when nothing was drafted."""
        return 1 + self.num_accepted_tokens / self.num_drafts if self.num_drafts else None


@dataclass
class RequestMetrics:
    arrival_time: float
    first_scheduled_time: Optional[float] = None
    first_token_time: Optional[float] = None
    finished_time: Optional[float] = None
    num_preemptions: int = 0
    # Speculative decoding, summed over the request's samples.
    spec_decode: SpecDecodeCounts = field(default_factory=SpecDecodeCounts)

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

    def add(self, later: "RequestOutput", aggregate: bool) -> None:
        """Merge a later output of the same request into this one, in place (vLLM's
        `RequestOutput.add`): with `aggregate` (deltas) each completion's text, token ids and logprobs
        are appended; without (cumulative outputs) the later completions replace these."""
        self.finished = self.finished or later.finished
        self.metrics = later.metrics
        self.error = later.error or self.error
        if self.prompt_logprobs is None:  # deltas carry them once, in the first output
            self.prompt_logprobs = later.prompt_logprobs
        position = {completion.index: i for i, completion in enumerate(self.outputs)}
        for completion in later.outputs:
            i = position.get(completion.index)
            if i is None:
                position[completion.index] = len(self.outputs)
                self.outputs.append(completion)
            elif aggregate:
                self.outputs[i].extend(completion)
            else:
                self.outputs[i] = completion
        self.outputs.sort(key=lambda completion: completion.index)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self, dict_factory=_json_safe_dict)


@dataclass
class PoolingOutput:
    """A pooling request's vector (vLLM's name): float32, on the CPU."""

    data: Any  # torch.Tensor [dimensions]

    @property
    def embedding(self) -> list[float]:
        return self.data.tolist()


@dataclass
class PoolingRequestOutput:
    """A pooling request's one output (vLLM's shape): its vector, or None when it was aborted (`error` set
    when the engine failed it)."""

    request_id: str
    prompt: Optional[str]
    prompt_token_ids: list[int]
    outputs: Optional[PoolingOutput]
    finished: bool = True
    metrics: RequestMetrics = field(default_factory=lambda: RequestMetrics(0.0))
    error: Optional[Exception] = None


def _json_safe_dict(items: list[tuple[str, Any]]) -> dict[str, Any]:
    return {key: str(value) if isinstance(value, BaseException) else value for key, value in items}
