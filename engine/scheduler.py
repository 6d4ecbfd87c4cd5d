"""The scheduler: which sequences run in the next step, and how many tokens each.

One token budget per step is spent on running sequences first (decodes and unfinished prefill
chunks), then on waiting ones, so decode tokens and prefill chunks share every step and a long
prompt never stalls the running batch. When the block pool runs dry the newest running sequence
is preempted (its blocks freed; it is recomputed later and produces the same output).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Callable, Optional

from llmctl.engine.block_manager import BlockManager
from llmctl.engine.sequence import Sequence, SequenceStatus


@dataclass(frozen=True)
class SchedulerConfig:
    max_num_seqs: int
    max_num_batched_tokens: int
    max_model_len: int
    policy: str = "fcfs"
    batch_wait_timeout_s: float = 0.0
    long_prompt_penalty: float = 0.0  # seconds of admission delay per 1000 prompt tokens


@dataclass
class ScheduledSeq:
    seq: Sequence
    num_new_tokens: int

    @property
    def samples(self) -> bool:
        """This step computes the sequence's last known token, so a new token is sampled."""
        return self.seq.num_computed_tokens + self.num_new_tokens == self.seq.num_tokens


@dataclass
class SchedulerOutput:
    scheduled: list[ScheduledSeq] = field(default_factory=list)
    preempted: list[Sequence] = field(default_factory=list)

    @property
    def num_batched_tokens(self) -> int:
        return sum(s.num_new_tokens for s in self.scheduled)

    @property
    def is_empty(self) -> bool:
        return not self.scheduled


class Scheduler:
    def __init__(self, config: SchedulerConfig, block_manager: BlockManager,
                 clock: Callable[[], float] = time.monotonic):
        self.config = config
        self.blocks = block_manager
        self.clock = clock
        self.waiting: list[Sequence] = []
        self.running: list[Sequence] = []
        self.num_preemptions = 0

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

    # ---- one step -------------------------------------------------------------------------
    def schedule(self) -> SchedulerOutput:
        out = SchedulerOutput()
        budget = self.config.max_num_batched_tokens
        budget = self._schedule_running(out, budget)
        if not out.preempted:
            self._schedule_waiting(out, budget)
        return out

    def _schedule_running(self, out: SchedulerOutput, budget: int) -> int:
        index = 0
        while index < len(self.running) and budget > 0:
            seq = self.running[index]
            num_new = min(seq.num_uncomputed_tokens, budget)
            while not self.blocks.allocate(seq, num_new):
                victim = self._pick_victim()
                if self.running.index(victim) < index:
                    index -= 1
                budget += self._preempt(victim, out)
                if victim is seq:
                    break
            else:
                out.scheduled.append(ScheduledSeq(seq, num_new))
                budget -= num_new
                index += 1
        return budget

    def _schedule_waiting(self, out: SchedulerOutput, budget: int) -> None:
        if self._should_wait_for_more():
            return
        for seq in self._admission_order():
            if budget <= 0 or len(self.running) >= self.config.max_num_seqs:
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
            out.scheduled.append(ScheduledSeq(seq, num_new))
            budget -= num_new

    def _should_wait_for_more(self) -> bool:
        """Dynamic batching: with nothing running, hold an under-filled batch for a short while."""
        timeout = self.config.batch_wait_timeout_s
        if timeout <= 0 or self.running or not self.waiting:
            return False
        if len(self.waiting) >= self.config.max_num_seqs:
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

    def _pick_victim(self) -> Sequence:
        if self.config.policy == "priority":
            return max(self.running, key=lambda s: (s.priority, s.arrival_time, s.seq_id))
        return self.running[-1]

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
            "num_waiting": len(self.waiting),
            "kv_cache_usage": self.blocks.usage,
            "num_free_blocks": self.blocks.num_free_blocks,
            "num_total_blocks": self.blocks.num_blocks,
            "kv_cache_fragmentation": self._fragmentation(),
            "prefix_cache_hit_rate": self.blocks.prefix_hits / queries if queries else 0.0,
            "num_preemptions": self.num_preemptions,
        }

    def _fragmentation(self) -> float:
        """Share of the running sequences' allocated KV slots that hold no token (partly filled
        last blocks): the internal fragmentation paging keeps below one block per sequence."""
        slots = sum(len(seq.block_table) for seq in self.running) * self.blocks.block_size
        if not slots:
            return 0.0
        used = sum(min(seq.num_computed_tokens, len(seq.block_table) * self.blocks.block_size) for seq in self.running)
        return 1.0 - used / slots
