"""N-gram (prompt lookup) drafts for speculative decoding, as vLLM's `{"method": "ngram"}`.

For each running decode, the drafts are the tokens that followed the most recent earlier occurrence
of the sequence's last n tokens (the longest n from `prompt_lookup_max` down to `prompt_lookup_min`)
in its prompt and output. The engine sets them as `Sequence.spec_token_ids` before it schedules; the
scheduler turns them into a verify row and `Scheduler.update_from_output` keeps what the model agrees
with. A sequence with no match gets no drafts and decodes normally in the same step.

Drafts are skipped when more than `disable_by_batch_size` sequences run (a compute-bound step pays
for every rejected draft) and, per sequence, once its acceptance over the last `WINDOW` drafts falls
below `MIN_ACCEPTANCE` (the verify rows cost more than the accepted tokens save).
"""

from __future__ import annotations

from collections import deque
import numpy as np

from llmctl.engine.args import SpeculativeConfig
from llmctl.engine.sequence import Sequence
from llmctl.engine.spec_decode.cost_gate import DraftCostGate

# Per-sequence adaptivity: over its last 8 drafts, fewer than 1 accepted token in 5 drafted turns
# drafting off for that sequence. A verify row of k + 1 tokens on CPU costs about one decode plus a few
# per cent per extra token, so a sequence that accepts a fifth of its drafts still about breaks even.
WINDOW = 8
MIN_ACCEPTANCE = 0.2


def find_ngram_continuation(token_ids: list[int] | np.ndarray, max_n: int, min_n: int, k: int) -> list[int]:
    """Up to `k` tokens after an earlier occurrence of the last n tokens, for the longest n in
    [min_n, max_n] that occurs earlier; [] when none does.

    One pass finds the earlier positions holding the last token; each is then extended backwards (at
    most max_n - 1 compares over the survivors) to the length of the suffix it matches: ~28 us at 300
    tokens, about 1 % of the embedded model's batch-1 decode step."""
    tokens = np.asarray(token_ids)
    length = len(tokens)
    max_n = min(max_n, length - 1)
    if max_n < min_n:
        return []
    ends = np.flatnonzero(tokens[:-1] == tokens[-1])  # last positions of earlier 1-gram matches
    matched = np.ones(len(ends), dtype=np.int64)  # suffix length each one matches, up to max_n
    alive = np.ones(len(ends), dtype=bool)
    for back in range(1, max_n):
        alive &= ends >= back
        alive[alive] = tokens[ends[alive] - back] == tokens[length - 1 - back]
        if not alive.any():
            break
        matched += alive
    for n in range(max_n, min_n - 1, -1):
        hits = ends[matched >= n]
        if hits.size:
            # The most recent occurrence with k tokens after it (in a repeated text, the nearest copy), else
            # the earliest (the longest continuation there is).
            full = hits[hits + 1 + k <= length]
            start = int(full[-1] if full.size else hits[0]) + 1
            return tokens[start:start + k].tolist()
    return []


class AdaptiveProposer:
    """What every proposer shares: the per-sequence window of verify outcomes that turns drafting off
    for a sequence accepting too little, the batch-size gate (`disable_by_batch_size`) and the per-step
    cost gate (`disable_by_cost`: `cost_gate.DraftCostGate`, fed each step's seconds by `end_step`)."""

    def __init__(self, config: SpeculativeConfig):
        self.config = config
        # seq_id -> the last WINDOW drafts' (drafted, accepted) counts; seq_ids whose drafting is off.
        self._history: dict[int, deque[tuple[int, int]]] = {}
        self._disabled: set[int] = set()
        self.num_oom_skips = 0  # rounds dropped because a draft forward ran out of memory (a draft model's)
        self.cost_gate = DraftCostGate() if config.disable_by_cost else None

    def _start_round(self, running: list[Sequence]) -> bool:
        """False, touching nothing, when the batch is too large to draft for: no running sequence holds
        drafts between steps (a step's update clears a verify row's, the scheduler drops the ones it did
        not verify), so the engine's step then does no speculation work at all. Else forget sequences that
        stopped running (deferred to here while large)."""
        if len(running) > self.config.disable_by_batch_size:
            return False
        live = {seq.seq_id for seq in running}
        self._history = {sid: h for sid, h in self._history.items() if sid in live}
        self._disabled &= live
        if self.cost_gate is not None:
            self.cost_gate.forget(live)
        return True

    def _drafting_pays(self, running: list[Sequence]) -> bool:
        """The cost gate's choice for this step, asked before drafting (True without one)."""
        if self.cost_gate is None:
            return True
        decodes = [seq.seq_id for seq in running if seq.num_uncomputed_tokens == 1]
        return self.cost_gate.should_draft([sid for sid in decodes if sid not in self._disabled], len(decodes))

    def end_step(self, scheduled: list | None, seconds: float) -> None:
        """The engine's step ended after `seconds` (from before `propose`) having run the rows `scheduled`
        (`ScheduledSeq`s; None: it ran nothing, or failed)."""
        gate = self.cost_gate
        if gate is None or not gate.measuring:
            return
        if scheduled is None:
            gate.skip_measurement()
            return
        gate.end_step(seconds, all(item.num_new_tokens - len(item.spec_token_ids) == 1 for item in scheduled))

    def observe(self, seq_id: int, num_drafted: int, num_accepted: int) -> None:
        """A verify row's outcome: turn drafting off for a sequence whose window accepts too little."""
        if self.cost_gate is not None:
            self.cost_gate.observe(seq_id, num_accepted)
        history = self._history.setdefault(seq_id, deque(maxlen=WINDOW))
        history.append((num_drafted, num_accepted))
        if len(history) == WINDOW:
            drafted = sum(d for d, _ in history)
            if sum(a for _, a in history) < MIN_ACCEPTANCE * drafted:
                self._disabled.add(seq_id)

    def is_disabled(self, seq_id: int) -> bool:
        return seq_id in self._disabled


class NgramProposer(AdaptiveProposer):
    def __init__(self, config: SpeculativeConfig):
        super().__init__(config)
        # With the cost gate: seq_id -> (the position of its first draft, the drafts the gate dropped).
        self._dropped: dict[int, tuple[int, list[int]]] = {}

    def propose(self, running: list[Sequence]) -> None:
        """Set `spec_token_ids` of every running decode (nothing at all when the batch is too large or
        the cost gate says this step's drafts would not pay).

        With the cost gate the lookup comes first (28 us a sequence): a step in which no sequence finds a
        continuation verifies nothing and costs what a step without speculation does, so the gate is asked
        only about steps with drafts, and a sequence's expected gain is what its verify rows accepted."""
        if not self._start_round(running):
            return
        if self.cost_gate is None:
            for seq in running:
                seq.spec_token_ids = self._drafts(seq)
            return
        self._score_dropped(running)
        found = [(seq, drafts) for seq, drafts in ((seq, self._drafts(seq)) for seq in running) if drafts]
        if not found:
            return
        num_decodes = sum(seq.num_uncomputed_tokens == 1 for seq in running)
        if self.cost_gate.should_draft([seq.seq_id for seq, _ in found], num_decodes):
            for seq, drafts in found:
                seq.spec_token_ids = drafts
            return
        for seq, drafts in found:  # kept, to learn what they would have accepted
            self._dropped.setdefault(seq.seq_id, (seq.num_tokens, drafts))

    def _score_dropped(self, running: list[Sequence]) -> None:
        """Drafts the gate dropped, compared with the tokens the sequence then produced: a verify row
        keeps drafts while they equal what the model produces one token at a time, so this is what their
        row would have accepted. Without it a sequence's gain froze while the gate had it off (two or
        three rejections in a row kept a copying workload off for a whole probe interval)."""
        if not self._dropped:
            return
        live = {seq.seq_id: seq for seq in running}
        for seq_id in [sid for sid in self._dropped if sid not in live]:
            del self._dropped[seq_id]
        for seq_id, (start, drafts) in list(self._dropped.items()):
            produced = live[seq_id].token_ids[start:start + len(drafts)]
            matched = 0
            while matched < len(produced) and produced[matched] == drafts[matched]:
                matched += 1
            if matched < len(produced) or len(produced) == len(drafts):  # a mismatch, or all of them matched
                del self._dropped[seq_id]
                self.cost_gate.observe_unverified(seq_id, matched)

    def _drafts(self, seq: Sequence) -> list[int]:
        if seq.num_uncomputed_tokens != 1 or seq.seq_id in self._disabled:
            return []  # still in prefill, or drafting turned off for it
        cfg = self.config
        return find_ngram_continuation(seq.token_ids, cfg.prompt_lookup_max, cfg.prompt_lookup_min,
                                       cfg.num_speculative_tokens)


class SpecDecodeStats:
    """Counters as vLLM's spec-decode metrics: drafts (verify rows), draft tokens, accepted tokens,
    and per draft position how often it was accepted."""

    def __init__(self, num_positions: int):
        self.num_drafts = 0
        self.num_draft_tokens = 0
        self.num_accepted_tokens = 0
        self.accepted_per_pos = [0] * num_positions

    def observe(self, num_drafted: int, num_accepted: int) -> None:
        self.num_drafts += 1
        self.num_draft_tokens += num_drafted
        self.num_accepted_tokens += num_accepted
        if num_drafted > len(self.accepted_per_pos):  # drafts set by hand (tests) may be longer than K
            self.accepted_per_pos.extend([0] * (num_drafted - len(self.accepted_per_pos)))
        for position in range(num_accepted):
            self.accepted_per_pos[position] += 1

    def as_stats(self) -> dict[str, float]:
        stats = {"spec_decode_num_drafts": self.num_drafts, "spec_decode_num_draft_tokens": self.num_draft_tokens,
                 "spec_decode_num_accepted_tokens": self.num_accepted_tokens}
        for position, count in enumerate(self.accepted_per_pos):
            stats[f"spec_decode_num_accepted_tokens_pos_{position}"] = count
        return stats
