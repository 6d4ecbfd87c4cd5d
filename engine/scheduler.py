"""The scheduler: which sequences run in the next step, and how many tokens each.

One token budget per step is spent on running sequences first (decodes and unfinished prefill
chunks), then on waiting ones, so decode tokens and prefill chunks share every step and a long
prompt never stalls the running batch. When the block pool runs dry the newest running sequence
is preempted (its blocks freed; it is recomputed later and produces the same output).

When a step runs out of memory the engine undoes the schedule (`undo`) and lowers the budgets
below the batch that failed (`shrink_after_oom`): first the prefill chunk (the token budget), then
the number of sequences (running ones over the cap are preempted as above). The lowered budgets
hold for `OOM_RECOVERY_STEPS` steps, then double back towards the configured ones.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Callable, Optional

from llmctl.engine.block_manager import BlockManager
from llmctl.engine.outputs import SpecDecodeCounts
from llmctl.engine.sequence import Sequence, SequenceStatus
from llmctl.engine.step_types import ModelRunnerOutput, ScheduledSeq, SchedulerOutput, SeqUpdate


# Steps a lowered budget holds before it doubles back: long enough that a workload which ran out of
# memory does not hit the same wall every few steps, short enough (about a second of decode on CPU,
# less on a GPU) that a passing spike does not cost throughput for long.
OOM_RECOVERY_STEPS = 64


@dataclass(frozen=True)
class SchedulerConfig:
    max_num_seqs: int
    max_num_batched_tokens: int
    max_model_len: int
    eos_token_ids: frozenset[int] = frozenset()  # token stops unless a request sets ignore_eos
    policy: str = "fcfs"
    batch_wait_timeout_s: float = 0.0
    long_prompt_penalty: float = 0.0  # seconds of admission delay per 1000 prompt tokens


def accepted_tokens(drafts: list[int], sampled: list[int]) -> list[int]:
    """Drafts the model agrees with, then its own next token: `sampled[j]` is the model's choice after
    the row's input before `drafts[j]`, so each draft equal to it is what decoding one token at a time
    would have produced (for greedy and seeded or unseeded sampling alike), and the first mismatch
    ends the accepted run.

    For a deterministic proposer (n-gram: q is one-hot on the draft x) this IS the standard rejection
    sampler: it accepts x with probability p(x) = min(1, p(x)/q(x)), and on a rejection keeps the
    target's sample given it is not x, which is distributed as the residual max(0, p - q) normalised
    (p without x, renormalised). So the output distribution is exactly the target's
    (tests/test_spec_decode.py checks both halves and the token histograms). For a draft with a
    distribution q, `sampled` comes from the rejection sampler (engine/spec_decode/rejection_sampler.py): its
    accepted drafts, then a token that differs from the rejected draft, which this rule reads alike."""
    accepted = 0
    while accepted < min(len(drafts), len(sampled) - 1) and drafts[accepted] == sampled[accepted]:
        accepted += 1
    return sampled[: accepted + 1]


class Scheduler:
    def __init__(self, config: SchedulerConfig, block_manager: BlockManager,
                 clock: Callable[[], float] = time.monotonic):
        self.config = config
        self.blocks = block_manager
        self.clock = clock
        self.waiting: list[Sequence] = []
        self.running: list[Sequence] = []
        self.num_preemptions = 0
        # Budgets lowered after an out-of-memory step (None: the configured one) and the steps since.
        self._token_cap: Optional[int] = None
        self._seq_cap: Optional[int] = None
        self._steps_since_shrink = 0

    # ---- queue management -----------------------------------------------------------------
    def add(self, seq: Sequence) -> None:
        seq.status = SequenceStatus.WAITING
        self.waiting.append(seq)

    def finish(self, seq: Sequence) -> None:
        """Remove a finished or aborted sequence from the queues and free its blocks."""
        if seq in self.running:
            self.running.remove(seq)
        elif seq in self.waiting:
            self.waiting.remove(seq)
        self.blocks.free(seq)
        seq.status = SequenceStatus.FINISHED

    @property
    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    @property
    def token_budget(self) -> int:
        """Tokens a step may compute: the configured budget, or less after an out-of-memory step."""
        return self.config.max_num_batched_tokens if self._token_cap is None else self._token_cap

    @property
    def max_num_seqs(self) -> int:
        """Sequences that may run: the configured limit, or less after an out-of-memory step."""
        return self.config.max_num_seqs if self._seq_cap is None else self._seq_cap

    # ---- one step -------------------------------------------------------------------------
    def schedule(self, busy: frozenset[int] = frozenset(), max_seqs: Optional[int] = None) -> SchedulerOutput:
        """The next batch. With pipeline parallelism several batches are in flight: the sequences in `busy`
        (seq ids) are in one already, so they are neither scheduled nor preempted, and `max_seqs` caps this
        batch's rows so the running sequences spread over the batches in flight."""
        out = SchedulerOutput()
        if self._token_cap is not None or self._seq_cap is not None:
            self._relax_budgets(out)
        limit = self.max_num_seqs if max_seqs is None else max_seqs
        budget = self._schedule_running(out, self.token_budget, busy, limit)
        if not out.preempted:
            self._schedule_waiting(out, budget, limit)
        return out

    # ---- after the step ran ---------------------------------------------------------------
    def update_from_output(self, out: SchedulerOutput, result: ModelRunnerOutput,
                           now: Optional[float] = None) -> list[SeqUpdate]:
        """Apply a step's results, row by row: count the computed tokens (a verify row's rejected
        drafts rolled back first), publish the now-full blocks, append the accepted tokens, apply
        token stops and length limits (finishing and freeing those sequences), and return the
        lookahead blocks a rollback left unused. Returns the rows that produced tokens."""
        now = self.clock() if now is None else now
        updates: list[SeqUpdate] = []
        for i, (item, sampled, logprobs, prompt) in enumerate(zip(out.scheduled, result.sampled_token_ids,
                                                                  result.logprobs, result.prompt_logprobs)):
            seq = item.seq
            if item.in_flight:
                seq.num_in_flight_tokens -= item.num_new_tokens
                seq.num_pending_tokens -= item.num_samples
            if seq.is_finished:  # aborted, or ended by the step before, while its batch was in flight
                continue
            if item.in_flight and seq.status is SequenceStatus.WAITING:  # preempted while in flight
                updates.extend(self._append_to_preempted(seq, sampled, logprobs, now))
                continue
            for position, entry in prompt:
                seq.prompt_logprobs[position] = entry
            drafts = item.spec_token_ids
            known = item.num_new_tokens - len(drafts)
            if not item.samples:
                seq.num_computed_tokens += known
                self.blocks.register_full_blocks(seq)
                if seq.pooling is not None and self._pool(seq, result.pooled_hidden[i], now):
                    updates.append(SeqUpdate(seq, []))
                continue
            accepted = accepted_tokens(drafts, sampled)
            kept, stopped = self._append_until_stop(seq, accepted, logprobs, now)
            # Rejected drafts' K/V lie past this count (their slots are written again later), and it is set
            # before any block is published: a block holding a rejected token is never registered.
            seq.num_computed_tokens += known + min(len(accepted) - 1, kept)
            seq.clear_drafts()
            if drafts:
                seq.spec_decode += SpecDecodeCounts(1, len(drafts), len(accepted) - 1)
            self.blocks.register_full_blocks(seq)
            if stopped:
                self.finish(seq)
            elif drafts:
                self.blocks.free_lookahead(seq)
            updates.append(SeqUpdate(seq, seq.output_token_ids[len(seq.output_token_ids) - kept:],
                                     len(drafts) - (len(accepted) - 1), len(drafts)))
        return updates

    def mark_in_flight(self, out: SchedulerOutput) -> None:
        """Async scheduling: `out` was launched and lands after the next schedule, which must count its rows'
        tokens as being computed and its sampled tokens as pending (the next inputs of their sequences)."""
        for item in out.scheduled:
            item.in_flight = True
            item.seq.num_in_flight_tokens += item.num_new_tokens
            item.seq.num_pending_tokens += item.num_samples

    def _append_to_preempted(self, seq: Sequence, sampled: list[int], logprobs: list,
                             now: float) -> list[SeqUpdate]:
        """A row's tokens for a sequence preempted after the row was launched: they are its next outputs (the
        step read its K/V before the blocks went), and its recompute starts from zero either way."""
        if not sampled:
            return []
        kept, stopped = self._append_until_stop(seq, sampled[:1], logprobs, now)
        if stopped:
            self.finish(seq)
        return [SeqUpdate(seq, seq.output_token_ids[-kept:])]

    def _ends_with_pending(self, seq: Sequence) -> bool:
        """The token the step in flight samples for `seq` ends it by length: no row for it after that one."""
        if not seq.num_pending_tokens:
            return False
        limit = seq.params.max_tokens
        produced = len(seq.output_token_ids) + seq.num_pending_tokens
        return (limit is not None and produced >= limit) or \
            seq.num_tokens + seq.num_pending_tokens >= self.config.max_model_len
    def _pool(self, seq: Sequence, chunk_sum, now: float) -> bool:
        """Add a pooling row's chunk to its sum; once the prompt is computed the sequence is finished (its
        blocks freed: a pooling request never decodes). Returns whether it finished."""
        seq.pooling.add(chunk_sum)
        if not seq.prompt_computed:
            return False
        seq.finish_reason, seq.finished_time = "stop", now
        self.finish(seq)
        return True

    def _append_until_stop(self, seq: Sequence, tokens: list[int], logprobs: list,
                           now: float) -> tuple[int, bool]:
        """Append `tokens` up to the first that ends the sequence (its finish reason set); returns how
        many were appended and whether one ended it."""
        for count, (token, entry) in enumerate(zip(tokens, logprobs or [None] * len(tokens)), start=1):
            seq.append_token(token, entry)
            stop = self._token_stop(seq, token)
            if stop is not None:
                seq.finish_reason, seq.stop_reason = stop
                seq.finished_time = now
                return count, True
        return len(tokens), False

    def _token_stop(self, seq: Sequence, token: int) -> Optional[tuple[str, object]]:
        """Token stops (stop_token_ids, EOS; after min_tokens) then length limits; stop strings need the
        text and are the engine's (it checks them before a length stop of the same token wins)."""
        params = seq.params
        produced = len(seq.output_token_ids)
        if produced >= params.min_tokens:
            if token in params.stop_token_ids:
                return "stop", token
            if not params.ignore_eos and token in self.config.eos_token_ids:
                return "stop", None
        if params.max_tokens is not None and produced >= params.max_tokens:
            return "length", None
        if seq.num_tokens >= self.config.max_model_len:
            return "length", None
        return None

    # ---- out of memory --------------------------------------------------------------------
    def undo(self, out: SchedulerOutput) -> None:
        """Take back `schedule()` after its step failed before any of it was applied: sequences it
        admitted return to waiting with their blocks freed (a cached prefix stays in the cache);
        running ones keep their blocks, and a retry writes the same KV slots again. Lookahead blocks
        go back (the retry may verify fewer drafts, or none)."""
        for item in out.scheduled:
            if item.spec_token_ids and item.seq not in out.admitted:
                self.blocks.free_lookahead(item.seq)
        for seq in out.admitted:
            self.running.remove(seq)
            self.blocks.free(seq)
            seq.num_computed_tokens = 0
            seq.status = SequenceStatus.WAITING
            self.waiting.append(seq)

    def shrink_after_oom(self, out: SchedulerOutput) -> bool:
        """Lower the budgets below the batch `out` that ran out of memory: halve the token budget
        (the prefill chunk) while a chunk is longer than one block, else halve the number of
        sequences. False when the batch was one sequence at one block or less: nothing smaller runs."""
        floor = self.blocks.block_size
        longest = max(item.num_new_tokens for item in out.scheduled)
        if longest > floor:
            self._token_cap = max(floor, out.num_batched_tokens // 2)
        elif len(out.scheduled) > 1:
            self._seq_cap = max(1, len(out.scheduled) // 2)
        else:
            return False
        self._steps_since_shrink = 0
        return True

    def _relax_budgets(self, out: SchedulerOutput) -> None:
        """Preempt running sequences over a lowered sequence cap; double lowered budgets back every
        `OOM_RECOVERY_STEPS` steps (a cap that reaches the configured value is dropped)."""
        self._steps_since_shrink += 1
        if self._steps_since_shrink >= OOM_RECOVERY_STEPS:
            self._steps_since_shrink = 0
            self._token_cap = _doubled(self._token_cap, self.config.max_num_batched_tokens)
            self._seq_cap = _doubled(self._seq_cap, self.config.max_num_seqs)
        while len(self.running) > self.max_num_seqs:
            self._preempt(self._pick_victim(), out)

    def _schedule_running(self, out: SchedulerOutput, budget: int, busy: frozenset[int], limit: int) -> int:
        index = 0
        while index < len(self.running) and budget > 0 and len(out.scheduled) < limit:
            seq = self.running[index]
            if seq.seq_id in busy or not seq.num_uncomputed_tokens or self._ends_with_pending(seq):
                index += 1
                continue
            num_new = min(seq.num_uncomputed_tokens, budget)
            drafts = self._drafts_to_verify(seq, budget)
            if drafts:
                if self.blocks.allocate(seq, num_new, num_lookahead_tokens=len(drafts)):
                    probs = None if seq.spec_draft_probs is None else seq.spec_draft_probs[: len(drafts)]
                    out.scheduled.append(ScheduledSeq(seq, num_new + len(drafts), drafts, probs))
                    budget -= num_new + len(drafts)
                    index += 1
                    continue
                self._drop_drafts(seq)  # no room for the lookahead: decode one token, never preempt for drafts
            while not self.blocks.allocate(seq, num_new):
                victim = self._pick_victim(busy)
                if victim is None:  # only sequences in flight hold blocks: this one waits for them
                    index += 1
                    break
                if self.running.index(victim) < index:
                    index -= 1
                budget += self._preempt(victim, out)
                if victim is seq:
                    break
            else:
                out.scheduled.append(ScheduledSeq(seq, num_new))
                budget -= num_new
                index += 1
        verifying = {id(item.seq) for item in out.scheduled if item.spec_token_ids}
        for seq in self.running:  # the budget cut their drafts, or never reached them
            if seq.spec_token_ids and id(seq) not in verifying:
                self._drop_drafts(seq)
        return budget

    def _drop_drafts(self, seq: Sequence) -> None:
        """No verify row for `seq` this step: its drafts go, and so do the lookahead slots a draft model
        reserved for them before the step (they would outlive it, and hold blocks others may need)."""
        seq.clear_drafts()
        self.blocks.free_lookahead(seq)

    def _drafts_to_verify(self, seq: Sequence, budget: int) -> list[int]:
        """The draft tokens a decode of `seq` verifies this step: within the token budget, the model's
        positions (max_model_len) and the request's max_tokens (the token after the drafts is the last)."""
        if not seq.spec_token_ids or seq.num_uncomputed_tokens != 1:
            return []
        room = min(budget - 1, self.config.max_model_len - seq.num_tokens)
        if seq.params.max_tokens is not None:
            room = min(room, seq.params.max_tokens - len(seq.output_token_ids) - 1)
        return seq.spec_token_ids[: max(room, 0)]

    def _schedule_waiting(self, out: SchedulerOutput, budget: int, limit: int) -> None:
        if self._should_wait_for_more():
            return
        for seq in self._admission_order():
            if budget <= 0 or len(self.running) >= self.max_num_seqs or len(out.scheduled) >= limit:
                break
            if seq.parent is not None and not (seq.parent.prompt_computed or seq.parent.is_finished):
                continue
            cached = self.blocks.find_cached_prefix(seq) if seq.num_computed_tokens == 0 else []
            remaining = seq.num_tokens - seq.num_computed_tokens - len(cached) * self.blocks.block_size
            num_new = min(remaining, budget)
            if not self.blocks.allocate(seq, num_new, cached):
                break
            self.waiting.remove(seq)
            seq.status = SequenceStatus.RUNNING
            if seq.first_scheduled_time is None:
                seq.first_scheduled_time = self.clock()
            self.running.append(seq)
            out.admitted.append(seq)
            out.scheduled.append(ScheduledSeq(seq, num_new))
            budget -= num_new

    def _should_wait_for_more(self) -> bool:
        """Dynamic batching: with nothing running, hold an under-filled batch for a short while."""
        timeout = self.config.batch_wait_timeout_s
        if timeout <= 0 or self.running or not self.waiting:
            return False
        if len(self.waiting) >= self.max_num_seqs:
            return False
        oldest = min(seq.arrival_time for seq in self.waiting)
        return self.clock() - oldest < timeout

    def _admission_order(self) -> list[Sequence]:
        penalty = self.config.long_prompt_penalty

        def key(seq: Sequence) -> tuple:
            delay = penalty * seq.num_prompt_tokens / 1000.0 if seq.num_preemptions == 0 else 0.0
            if self.config.policy == "priority":
                return (seq.priority, seq.arrival_time + delay, seq.seq_id)
            return (seq.arrival_time + delay, seq.seq_id)

        return sorted(self.waiting, key=key)

    def _pick_victim(self, busy: frozenset[int] = frozenset()) -> Optional[Sequence]:
        """The running sequence to preempt (None: every one is in a batch in flight)."""
        candidates = [seq for seq in self.running if seq.seq_id not in busy]
        if not candidates:
            return None
        if self.config.policy == "priority":
            return max(candidates, key=lambda s: (s.priority, s.arrival_time, s.seq_id))
        return candidates[-1]

    def _preempt(self, seq: Sequence, out: SchedulerOutput) -> int:
        """Preempt by recompute; returns the tokens it had been given this step (budget to refund)."""
        self.running.remove(seq)
        self.blocks.free(seq)
        seq.reset_for_recompute()
        self.waiting.append(seq)
        self.num_preemptions += 1
        out.preempted.append(seq)
        refund = sum(s.num_new_tokens for s in out.scheduled if s.seq is seq)
        out.scheduled = [s for s in out.scheduled if s.seq is not seq]
        return refund

    def stats(self) -> dict[str, float]:
        queries = self.blocks.prefix_queries
        return {
            "num_running": len(self.running),
            "num_running_requests": len({seq.request_id for seq in self.running}),  # n > 1: siblings count once
            "num_waiting": len(self.waiting),
            "kv_cache_usage": self.blocks.usage,
            "num_free_blocks": self.blocks.num_free_blocks,
            "num_total_blocks": self.blocks.num_blocks,
            "kv_cache_fragmentation": self._fragmentation(),
            "prefix_cache_hit_rate": self.blocks.prefix_hits / queries if queries else 0.0,
            # In tokens like vLLM's counters; the cache works in whole blocks, so these are multiples of it.
            "prefix_cache_queries": queries * self.blocks.block_size,
            "prefix_cache_hits": self.blocks.prefix_hits * self.blocks.block_size,
            "num_preemptions": self.num_preemptions,
            "token_budget": self.token_budget,
            "max_num_seqs": self.max_num_seqs,
        }

    def _fragmentation(self) -> float:
        """Share of the running sequences' allocated KV slots that hold no token (partly filled
        last blocks): the internal fragmentation paging keeps below one block per sequence."""
        slots = sum(len(seq.block_table) for seq in self.running) * self.blocks.block_size
        if not slots:
            return 0.0
        used = sum(min(seq.num_computed_tokens, len(seq.block_table) * self.blocks.block_size) for seq in self.running)
        return 1.0 - used / slots


def _doubled(cap: Optional[int], limit: int) -> Optional[int]:
    return None if cap is None or 2 * cap >= limit else 2 * cap
