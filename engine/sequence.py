"""`Sequence`: one generation stream's tokens, progress, KV blocks and stop state.

A request with `n` samples owns `n` sequences; each sequence is scheduled, preempted and
freed on its own.
"""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field
from typing import Any, Optional

import torch

from llmctl.engine.outputs import SpecDecodeCounts
from llmctl.engine.sampling_params import SamplingParams


class SequenceStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


@dataclass
class Sequence:
    seq_id: int
    request_id: str
    index: int  # which of the request's n samples
    prompt_token_ids: list[int]
    params: SamplingParams
    arrival_time: float = field(default_factory=time.monotonic)
    priority: int = 0
    cache_salt: bytes = b""
    # n > 1 siblings share their prompt's blocks through the prefix cache even when it is off
    # globally, under a salt private to their request.
    shares_with_siblings: bool = False
    parent: Optional["Sequence"] = None  # n > 1: wait for the first sample's prompt to be cached
    status: SequenceStatus = SequenceStatus.WAITING
    num_computed_tokens: int = 0  # by the steps applied so far
    # Async scheduling: tokens scheduled in a step still in flight, and tokens it samples (not appended yet).
    num_in_flight_tokens: int = 0
    num_pending_tokens: int = 0
    block_table: list[int] = field(default_factory=list)
    output_token_ids: list[int] = field(default_factory=list)
    # Draft tokens proposed for the next step (speculative decoding): the scheduler makes the next decode
    # a verify row of 1 + len(spec_token_ids) tokens, and the step's update keeps the accepted prefix.
    spec_token_ids: list[int] = field(default_factory=list)
    # The distributions the drafts were drawn from (float32 [k, vocab], after the request's temperature,
    # top-k, top-p), set with them by a sampling draft model; None for a deterministic draft (n-gram,
    # greedy). With it a sampled request's verify row goes through the rejection sampler.
    spec_draft_probs: Optional[torch.Tensor] = None
    spec_decode: SpecDecodeCounts = field(default_factory=SpecDecodeCounts)  # this sequence's verify rows so far
    output_logprobs: list[dict[int, float]] = field(default_factory=list)
    cumulative_logprob: float = 0.0
    finish_reason: Optional[str] = None
    stop_reason: Optional[object] = None
    num_preemptions: int = 0
    generator: Optional[torch.Generator] = None  # a seeded request's, re-seeded per output position
    draw_seed: Optional[int] = None  # what `generator` is re-seeded from (sampler.SamplingRow.generator_at)
    # structured outputs: a structured_output.SequenceGrammar that has accepted exactly output_token_ids (kept
    # through preemption, since the outputs are)
    grammar: Optional[Any] = None
    # a pooling request's (pooling.Pooling): its prompt is prefilled, pooled, and the sequence ends there
    pooling: Optional[Any] = None
    first_scheduled_time: Optional[float] = None
    first_token_time: Optional[float] = None
    last_token_time: Optional[float] = None  # for the inter-token latency of the next token
    finished_time: Optional[float] = None

    def __post_init__(self) -> None:
        self.token_ids: list[int] = list(self.prompt_token_ids)
        self.prompt_logprobs: list[Optional[dict[int, float]]] = [None] * len(self.prompt_token_ids)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def num_uncomputed_tokens(self) -> int:
        """Tokens no step has computed or is computing (a pending sampled token counts: it is the next input)."""
        return self.num_tokens + self.num_pending_tokens - self.num_computed_tokens - self.num_in_flight_tokens

    @property
    def is_finished(self) -> bool:
        return self.status is SequenceStatus.FINISHED

    @property
    def prompt_computed(self) -> bool:
        return self.num_computed_tokens >= self.num_prompt_tokens

    def append_token(self, token_id: int, logprobs: Optional[dict[int, float]] = None) -> None:
        self.token_ids.append(token_id)
        self.output_token_ids.append(token_id)
        if logprobs is not None:
            self.output_logprobs.append(logprobs)
            self.cumulative_logprob += logprobs[token_id]

    def drop_last_outputs(self, count: int) -> None:
        """Take back the newest `count` output tokens (a stop string ended the text before them)."""
        for _ in range(count):
            token = self.output_token_ids.pop()
            self.token_ids.pop()
            if len(self.output_logprobs) > len(self.output_token_ids):
                self.cumulative_logprob -= self.output_logprobs.pop()[token]
        self.num_computed_tokens = min(self.num_computed_tokens, self.num_tokens)

    def clear_drafts(self) -> None:
        self.spec_token_ids = []
        self.spec_draft_probs = None

    def reset_for_recompute(self) -> None:
        """After preemption: blocks are gone, so everything (prompt and output) is computed again."""
        self.num_computed_tokens = 0
        self.block_table = []
        self.clear_drafts()
        if self.pooling is not None:
            self.pooling.reset()
        self.num_preemptions += 1
        self.status = SequenceStatus.WAITING
