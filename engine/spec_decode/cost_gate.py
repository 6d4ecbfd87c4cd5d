"""Per-step, cost-aware switch-off of speculative drafting (`speculative_config` `disable_by_cost`).

A step that drafts produces, per running decode, one token plus the drafts it accepts, and costs a
draft round (the proposer: a draft model's forwards, or the n-gram lookup) plus a target step with
verify rows; a step without drafts produces one token per decode. So drafting pays when

    (decodes + expected accepted drafts) / seconds with drafts  >=  decodes / seconds without,

and `DraftCostGate.should_draft` asks that of every step the batch-size gate lets through:
  * expected accepted drafts: per sequence, an exponential average of the drafts it had accepted per
    drafting step it decoded in (0 for a step in which it drafted nothing: an n-gram miss), from the
    verify outcomes the engine already reports (`AdaptiveProposer.observe`); a sequence not seen yet
    gets the average over all sequences;
  * seconds with and without drafts: exponential averages of the measured step times (the engine's
    clock around propose + schedule + execute + update), per batch-size bucket (1, 2, 3-4, 5-8, ...:
    a step's cost grows with its rows), from steps of decodes and verify rows only (a prefill chunk's
    cost would say nothing about drafting).
Before a bucket has `MIN_SAMPLES` measured steps of each kind it drafts, then measures without; after
that, `PROBE_INTERVAL` steps of one choice in a row are followed by a probe of the other (`PROBE_STEPS`),
so a change (the acceptance rising, the batch getting memory-bound) is seen again; the interval doubles
(up to `MAX_PROBE_INTERVAL`) each time a probe leaves the choice as it was. Why: a draft round of the
1-layer default draft costs about a target step on CPU, so drafting every step ran at 0.43-0.45x of no
speculation at batch 8 (benchmarks/results/2026-12-01-spec-decode-idle-host-fb0d3d0.md).

The gate decides only whether drafts are proposed; every output stays exactly what it is without
speculation (greedy) or distributed as it (sampling). It never looks at the wall clock itself: the
engine hands it each step's seconds (tests inject them).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Iterable, Optional

MIN_SAMPLES = 3  # steps of each kind per bucket before the averages decide
PROBE_INTERVAL = 32  # steps of one choice in a row before a probe of the other...
MAX_PROBE_INTERVAL = 512  # ...doubled, up to this, each time a probe leaves the choice as it was
PROBE_STEPS = 2  # a probe's steps: the first drafting one after steps without is not measured (below)
STEP_WEIGHT = 0.2  # the newest step time's weight in its average (a running mean until 1 / weight steps)
GAIN_WEIGHT = 0.3  # the newest drafting step's weight in a sequence's accepted-drafts average


def batch_bucket(num_decodes: int) -> int:
    """The power of two at or above `num_decodes` (1, 2, 4, 8, ...): steps of one bucket cost alike."""
    return 1 << max(0, num_decodes - 1).bit_length()


@dataclass
class _Average:
    value: Optional[float] = None
    count: int = 0

    def add(self, sample: float, weight: float) -> None:
        self.count += 1
        w = max(weight, 1.0 / self.count)
        self.value = sample if self.value is None else self.value + w * (sample - self.value)


@dataclass
class _Bucket:
    with_drafts: _Average
    without: _Average
    last_choice: Optional[bool] = None
    streak: int = 0  # steps in a row of last_choice
    interval: int = PROBE_INTERVAL
    probe_left: int = 0  # steps of the probe under way still to run
    probing_from: Optional[bool] = None  # the choice a probe under way interrupted


class DraftCostGate:
    def __init__(self) -> None:
        self._buckets: dict[int, _Bucket] = {}
        self._accepted: dict[int, _Average] = {}  # seq_id -> accepted drafts per drafting step
        self._all = _Average()  # the same over every sequence: the prior for a new one
        self._step: Optional[tuple[int, bool, bool]] = None  # (bucket, drafting, measured) of the step decided
        self._offered: dict[int, int] = {}  # a drafting step's decodes -> drafts they accepted

    def should_draft(self, decodes: Iterable[int], num_decodes: int) -> bool:
        """Whether this step drafts: `decodes` are the seq_ids of the running decodes that would draft
        (drafting not switched off for them), `num_decodes` all running decodes."""
        if not num_decodes:
            self._step = None
            return True  # nothing decodes: no draft is proposed, nothing to measure
        key = batch_bucket(num_decodes)
        bucket = self._buckets.get(key)
        if bucket is None:
            bucket = self._buckets[key] = _Bucket(_Average(), _Average())
        decodes = list(decodes)
        if bucket.probe_left:
            bucket.probe_left -= 1
            choice = bucket.last_choice
        elif bucket.with_drafts.count < MIN_SAMPLES:
            choice = True
        elif bucket.without.count < MIN_SAMPLES:
            choice = False
        elif bucket.streak >= bucket.interval:  # a probe of the other choice
            choice, bucket.probing_from = not bucket.last_choice, bucket.last_choice
            bucket.probe_left = PROBE_STEPS - 1
        else:
            choice = self.expected_speedup(decodes, num_decodes, bucket) >= 1.0
            if bucket.probing_from is not None:  # the decision after a probe: back off while it changes nothing
                same = choice == bucket.probing_from
                bucket.interval = min(2 * bucket.interval, MAX_PROBE_INTERVAL) if same else PROBE_INTERVAL
                bucket.probing_from = None
        # The first drafting step after steps without pays for the draft's catch-up over the tokens it did
        # not see (a draft model's row of ~33 tokens after a probe interval): that is the price of switching,
        # not what a drafting step costs, and counted in it the gate kept a winning draft off.
        measured = not (choice and bucket.last_choice is not True)
        bucket.streak = bucket.streak + 1 if choice == bucket.last_choice else 1
        bucket.last_choice = choice
        self._step = (key, choice, measured)
        self._offered = dict.fromkeys(decodes, 0) if choice else {}
        return choice

    def expected_speedup(self, decodes: list[int], num_decodes: int, bucket: _Bucket) -> float:
        """Tokens per second with drafts over tokens per second without, from the averages."""
        gain = sum(self.expected_accepted(seq_id) for seq_id in decodes)
        return (num_decodes + gain) / num_decodes * bucket.without.value / bucket.with_drafts.value

    def expected_accepted(self, seq_id: int) -> float:
        average = self._accepted.get(seq_id)
        if average is not None:
            return average.value
        return self._all.value or 0.0

    def observe(self, seq_id: int, num_accepted: int) -> None:
        """A verify row's accepted drafts, in the step being measured."""
        if seq_id in self._offered:
            self._offered[seq_id] = num_accepted

    def observe_unverified(self, seq_id: int, num_accepted: int) -> None:
        """What drafts the gate dropped would have accepted (the n-gram proposer compares them with the
        tokens produced instead): a sequence's gain is learnt while its drafting is off too."""
        self._accepted.setdefault(seq_id, _Average()).add(num_accepted, GAIN_WEIGHT)

    @property
    def measuring(self) -> bool:
        """A step decided by `should_draft` has not ended yet."""
        return self._step is not None

    def skip_measurement(self) -> None:
        """This step's time says nothing about the choice (e.g. some sequences drafted anyway)."""
        self._step, self._offered = None, {}

    def end_step(self, seconds: float, decodes_only: bool) -> None:
        """The step's measured seconds (propose to update); `decodes_only`: every row was a decode or a
        verify row. Folds the drafting step's accepted drafts into the sequences' averages."""
        step, self._step = self._step, None
        if step is None:
            return
        key, drafting, measured = step
        for seq_id, accepted in self._offered.items():
            self._accepted.setdefault(seq_id, _Average()).add(accepted, GAIN_WEIGHT)
        if self._offered:  # the prior: one sample a step, the step's mean over its decodes
            self._all.add(sum(self._offered.values()) / len(self._offered), GAIN_WEIGHT)
        self._offered = {}
        if decodes_only and measured:
            bucket = self._buckets[key]
            (bucket.with_drafts if drafting else bucket.without).add(seconds, STEP_WEIGHT)

    def forget(self, live: set[int]) -> None:
        """Drop the averages of sequences that stopped running."""
        self._accepted = {sid: a for sid, a in self._accepted.items() if sid in live}
