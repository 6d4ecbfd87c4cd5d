"""A step's plain types, shared by the scheduler, the engine, the runner and the executors: the scheduled
rows (`ScheduledSeq`, `SchedulerOutput`), what the model side computed (`ModelRunnerOutput`), and what a
row's tokens did to its sequence (`SeqUpdate`). Data only, so the runner side needs no scheduler."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

import torch

from llmctl.engine.sequence import Sequence


@dataclass
class ScheduledSeq:
    """One row of a step: `num_new_tokens` tokens from the sequence's first uncomputed one. A verify
    row ends with `spec_token_ids`, draft tokens past the known ones (they count in `num_new_tokens`),
    and `spec_draft_probs`, the distributions they were drawn from (None: a deterministic draft).
    `start` (the row's first position) and `samples` are fixed when the row is made: with async scheduling
    the sequence's counters move on (the step before lands) while the row is in flight. `in_flight`: the
    engine counted the row in its sequence's in-flight and pending tokens (async scheduling)."""

    seq: Sequence
    num_new_tokens: int
    spec_token_ids: list[int] = field(default_factory=list)
    spec_draft_probs: Optional[torch.Tensor] = None
    start: int = field(init=False)
    # This step computes the sequence's last token (known, or sampled by the step in flight), so a new one is sampled.
    samples: bool = field(init=False)
    in_flight: bool = False

    def __post_init__(self) -> None:
        seq = self.seq
        self.start = seq.num_computed_tokens + seq.num_in_flight_tokens
        end = seq.num_tokens + seq.num_pending_tokens + len(self.spec_token_ids)
        self.samples = self.start + self.num_new_tokens == end and seq.pooling is None  # pooling: never

    @property
    def num_samples(self) -> int:
        """Tokens sampled from this row: one per draft plus one after them (k + 1), or none."""
        return 1 + len(self.spec_token_ids) if self.samples else 0

    @property
    def input_token_ids(self) -> list[int]:
        """The row's input ids: its known uncomputed tokens, then the drafts to verify. With async scheduling a
        row may end at a token sampled by the step in flight: that one is not known here (the list is shorter)."""
        start = self.start
        known = self.seq.token_ids[start:start + self.num_new_tokens - len(self.spec_token_ids)]
        return known + self.spec_token_ids if self.spec_token_ids else known


@dataclass
class ModelRunnerOutput:
    """What a step computed, as lists aligned with `SchedulerOutput.scheduled` (plain data, so it can
    come back from another process). A row that does not sample has no tokens; a verify row has k + 1
    (the model's choice after each of its last k + 1 inputs), or, from the rejection sampler, fewer: the
    accepted drafts and the resample of the first rejected one."""

    sampled_token_ids: list[list[int]]
    logprobs: list[list[Optional[dict[int, float]]]]  # per row, one entry per sampled token (None: not asked)
    prompt_logprobs: list[list[tuple[int, dict[int, float]]]]  # per row: (position, {token: logprob})
    # per row: a pooling row's float32 sum of the final hidden states it pools in this chunk (None: nothing
    # pooled); empty when no row pools
    pooled_hidden: list[Optional[torch.Tensor]] = field(default_factory=list)


@dataclass
class SeqUpdate:
    """A row that produced tokens this step: the accepted ones, already appended to `seq` (which is
    finished when a token stop or a length limit ended it), and how many of its drafts were rejected
    (their K/V, past `seq.num_computed_tokens`, no longer hold) out of how many it verified."""

    seq: Sequence
    new_token_ids: list[int]
    num_rejected: int = 0
    num_drafts: int = 0

    @property
    def num_accepted_drafts(self) -> int:
        return self.num_drafts - self.num_rejected


@dataclass
class SchedulerOutput:
    scheduled: list[ScheduledSeq] = field(default_factory=list)
    preempted: list[Sequence] = field(default_factory=list)
    admitted: list[Sequence] = field(default_factory=list)  # moved from waiting to running by this step

    @property
    def num_batched_tokens(self) -> int:
        return sum(s.num_new_tokens for s in self.scheduled)

    @property
    def is_empty(self) -> bool:
        return not self.scheduled
