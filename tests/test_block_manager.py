"""The paged KV cache's bookkeeping: unit tests, plus a hypothesis state machine that drives random
add / step / abort / out-of-memory sequences, with verify rows (draft tokens) accepted in part and
rolled back, through the real Scheduler + BlockManager (`update_from_output` included) and checks,
after every step, ref counts, the free list, the simulated KV contents of shared and published
blocks, that no lookahead block outlives its step, and (at the end) that every block came back."""

from __future__ import annotations

import itertools

import pytest
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from llmctl.engine.block_manager import BlockAccountingError, BlockManager
from llmctl.engine.sampling_params import SamplingParams
from llmctl.engine.scheduler import Scheduler, SchedulerConfig
from llmctl.engine.sequence import Sequence, SequenceStatus
from llmctl.engine.step_types import ModelRunnerOutput

_ids = itertools.count()


def make_seq(tokens, **kwargs) -> Sequence:
    return Sequence(next(_ids), f"r{next(_ids)}", 0, list(tokens), SamplingParams(), **kwargs)


def computed_and_registered(bm: BlockManager, seq: Sequence) -> None:
    """What the engine does after a step that computed the whole known sequence."""
    seq.num_computed_tokens = seq.num_tokens
    bm.register_full_blocks(seq)


# ---- allocation ---------------------------------------------------------------------------------

def test_allocation_is_all_or_nothing():
    bm = BlockManager(num_blocks=4, block_size=4)
    big = make_seq(range(20))  # needs 5 blocks
    assert not bm.allocate(big, 20)
    assert big.block_table == [] and bm.num_free_blocks == 4
    small = make_seq(range(6))
    assert bm.allocate(small, 6)
    assert len(small.block_table) == 2 and bm.num_free_blocks == 2
    other = make_seq(range(100, 112))  # needs 3, only 2 free
    assert not bm.allocate(other, 12)
    assert other.block_table == [] and bm.num_free_blocks == 2
    bm.check_invariants([small, other])


def test_allocation_grows_the_table_only_when_a_block_fills():
    bm = BlockManager(num_blocks=4, block_size=4)
    seq = make_seq(range(3))
    assert bm.allocate(seq, 3)
    seq.num_computed_tokens = 3
    seq.append_token(7)
    assert bm.allocate(seq, 1)  # 4th slot of block 0
    assert len(seq.block_table) == 1
    seq.num_computed_tokens = 4
    seq.append_token(8)
    assert bm.allocate(seq, 1)
    assert len(seq.block_table) == 2
    bm.check_invariants([seq])


def test_free_returns_blocks_and_double_free_raises():
    bm = BlockManager(num_blocks=4, block_size=4)
    seq = make_seq(range(8))
    assert bm.allocate(seq, 8)
    table = list(seq.block_table)
    bm.free(seq)
    assert seq.block_table == [] and bm.num_free_blocks == 4
    bm.check_invariants([])
    seq.block_table = table  # a stale table freed again: an engine bug the manager must catch
    with pytest.raises(BlockAccountingError):
        bm.free(seq)


def test_check_invariants_catches_a_table_holding_an_unowned_block():
    bm = BlockManager(num_blocks=4, block_size=4)
    seq = make_seq(range(4))
    assert bm.allocate(seq, 4)
    intruder = make_seq(range(4))
    intruder.block_table = list(seq.block_table)  # shares without a ref count
    with pytest.raises(BlockAccountingError):
        bm.check_invariants([seq, intruder])


# ---- prefix cache -------------------------------------------------------------------------------

def test_prefix_cache_hit_shares_blocks_with_ref_counts():
    bm = BlockManager(num_blocks=8, block_size=4)
    prompt = list(range(10))  # two full blocks + 2 tokens
    a = make_seq(prompt)
    assert bm.allocate(a, len(prompt))
    computed_and_registered(bm, a)
    b = make_seq(prompt[:8] + [50, 51, 52])
    cached = bm.find_cached_prefix(b)
    assert cached == a.block_table[:2]
    free_before = bm.num_free_blocks
    assert bm.allocate(b, b.num_tokens - 8, cached)
    assert b.num_computed_tokens == 8
    assert b.block_table[:2] == a.block_table[:2] and b.block_table[2] != a.block_table[2]
    assert bm.num_free_blocks == free_before - 1  # only the tail block is new
    assert [bm.blocks[i].ref_count for i in b.block_table] == [2, 2, 1]
    bm.check_invariants([a, b])
    bm.free(a)
    assert [bm.blocks[i].ref_count for i in b.block_table] == [1, 1, 1]
    bm.check_invariants([b])
    assert bm.prefix_hits == 2


def test_prefix_cache_never_covers_the_last_token():
    bm = BlockManager(num_blocks=8, block_size=4)
    a = make_seq(range(8))
    assert bm.allocate(a, 8)
    computed_and_registered(bm, a)
    same = make_seq(range(8))
    # Both blocks are cached, but the last token must be computed again to get logits.
    assert bm.find_cached_prefix(same) == a.block_table[:1]


def test_prefix_cache_disabled_gives_no_hits():
    bm = BlockManager(num_blocks=8, block_size=4, enable_prefix_caching=False)
    a = make_seq(range(9))
    assert bm.allocate(a, 9)
    computed_and_registered(bm, a)
    assert bm.find_cached_prefix(make_seq(range(9))) == []


def test_cache_salt_separates_tenants():
    bm = BlockManager(num_blocks=8, block_size=4)
    a = make_seq(range(9), cache_salt=b"tenant-a")
    assert bm.allocate(a, 9)
    computed_and_registered(bm, a)
    assert bm.find_cached_prefix(make_seq(range(9), cache_salt=b"tenant-b")) == []
    assert len(bm.find_cached_prefix(make_seq(range(9), cache_salt=b"tenant-a"))) == 2


def test_forged_hash_entry_with_other_tokens_is_a_miss():
    bm = BlockManager(num_blocks=8, block_size=4)
    a = make_seq([1, 2, 3, 4, 5])
    assert bm.allocate(a, 5)
    computed_and_registered(bm, a)
    victim = make_seq([9, 9, 9, 9, 5])
    forged_hash = bm.hash_block(None, (9, 9, 9, 9))
    # Simulate a collision: the hash of victim's first block points at a's block (other tokens).
    bm._cached[forged_hash] = a.block_table[0]
    assert bm.find_cached_prefix(victim) == []
    # ...while the genuine entry still hits.
    assert bm.find_cached_prefix(make_seq([1, 2, 3, 4, 6])) == [a.block_table[0]]


def test_forged_entry_with_same_tokens_but_other_parent_is_a_miss():
    bm = BlockManager(num_blocks=8, block_size=2)
    a = make_seq([1, 2, 3, 4, 0])
    assert bm.allocate(a, 5)
    computed_and_registered(bm, a)
    # Second block of a holds (3, 4) after (1, 2); a prompt (7, 8, 3, 4) must not reuse it even if
    # its chained hash were forged to point there.
    other = make_seq([7, 8, 3, 4, 0])
    b0 = make_seq([7, 8, 0])
    assert bm.allocate(b0, 3)
    computed_and_registered(bm, b0)
    parent = bm.blocks[b0.block_table[0]].block_hash
    bm._cached[bm.hash_block(parent, (3, 4))] = a.block_table[1]
    assert bm.find_cached_prefix(other) == [b0.block_table[0]]


def test_hash_key_is_random_per_instance():
    one, two = BlockManager(4, 4), BlockManager(4, 4)
    tokens = (1, 2, 3, 4)
    assert one.hash_block(None, tokens) == one.hash_block(None, tokens)
    assert one.hash_block(None, tokens) != two.hash_block(None, tokens)
    assert one.hash_block(None, tokens) != one.hash_block(None, (1, 2, 3, 5))
    assert one.hash_block(None, tokens) != one.hash_block(one.hash_block(None, tokens), tokens)


def test_freed_cached_blocks_are_reused_then_evicted_in_lru_order():
    bm = BlockManager(num_blocks=4, block_size=2)
    a = make_seq([1, 2, 0])
    b = make_seq([3, 4, 0])
    for seq in (a, b):
        assert bm.allocate(seq, 3)
        computed_and_registered(bm, seq)
    a_block, b_block = a.block_table[0], b.block_table[0]
    bm.free(a)  # a's blocks become least recently used
    bm.free(b)
    assert bm.num_free_blocks == 4
    # Still cached after being freed: a later prompt reuses the block without recomputing.
    again = make_seq([3, 4, 9])
    cached = bm.find_cached_prefix(again)
    assert cached == [b_block]
    assert bm.allocate(again, 1, cached)
    assert bm.blocks[b_block].ref_count == 1
    # Taking new blocks evicts the least recently freed ones first: a's tail (already reused for
    # `again`'s tail), then a's full block.
    assert bm.num_free_blocks == 2
    filler = make_seq([5, 6, 7])
    assert bm.allocate(filler, 3)
    assert a_block in filler.block_table
    assert bm.find_cached_prefix(make_seq([1, 2, 0])) == []  # a's block was evicted
    bm.check_invariants([again, filler])


def test_lru_keeps_recently_freed_block_cached():
    bm = BlockManager(num_blocks=4, block_size=2)
    a, b = make_seq([1, 2, 0]), make_seq([3, 4, 0])
    for seq in (a, b):
        assert bm.allocate(seq, 3)
        computed_and_registered(bm, seq)
    b_block = b.block_table[0]
    bm.free(a)
    bm.free(b)
    filler = make_seq([5, 6, 7])  # 2 blocks: a's two blocks go first
    assert bm.allocate(filler, 3)
    assert b_block not in filler.block_table
    assert bm.find_cached_prefix(make_seq([3, 4, 0])) == [b_block]


def test_reset_prefix_cache_only_when_idle():
    bm = BlockManager(num_blocks=4, block_size=2)
    a = make_seq([1, 2, 0])
    assert bm.allocate(a, 3)
    computed_and_registered(bm, a)
    assert not bm.reset_prefix_cache()
    bm.free(a)
    assert bm.reset_prefix_cache()
    assert bm.find_cached_prefix(make_seq([1, 2, 0])) == []


# ---- property test: random workloads through the real scheduler ----------------------------------

BLOCK_SIZE = 4
NUM_BLOCKS = 8  # 32 token slots: small enough that preemption happens often
MAX_PROMPT, MAX_OUTPUT = 18, 8  # every sequence fits the pool on its own (no livelock)
STOP = 3  # the stop token; prompts and drafts use 0..2


class SchedulerBlockMachine(RuleBasedStateMachine):
    def __init__(self):
        super().__init__()
        self.now = 0.0
        self.bm = BlockManager(NUM_BLOCKS, BLOCK_SIZE)
        self.scheduler = Scheduler(
            SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=10, max_model_len=32),
            self.bm, clock=lambda: self.now)
        self.live: list[Sequence] = []
        # Simulated KV contents: which token each slot of each block holds.
        self.kv: dict[int, list] = {b: [None] * BLOCK_SIZE for b in range(NUM_BLOCKS)}
        self.preemptions = 0
        self.hits_seen = 0
        self.verify_rows = self.rejected_drafts = self.ooms = 0

    def _new_seq(self, prompt, max_output, parent=None) -> Sequence:
        self.now += 0.001
        params = SamplingParams(max_tokens=max_output, stop_token_ids=[STOP], ignore_eos=True)
        seq = Sequence(next(_ids), "req", 0, list(prompt), params, arrival_time=self.now, parent=parent)
        self.scheduler.add(seq)
        self.live.append(seq)
        return seq

    @precondition(lambda self: len(self.live) < 10)
    @rule(prompt=st.lists(st.integers(0, 2), min_size=1, max_size=MAX_PROMPT),
          max_output=st.integers(1, MAX_OUTPUT), children=st.integers(0, 2))
    def add(self, prompt, max_output, children):
        parent = self._new_seq(prompt, max_output)
        for _ in range(children):  # n > 1: samples that wait for the parent's prompt
            self._new_seq(prompt, max_output, parent=parent)

    @rule(data=st.data(), count=st.integers(1, 6))
    def steps(self, data, count):
        for _ in range(count):
            self._step(data)
            self.blocks_are_consistent()

    def _propose(self, data) -> None:
        """A stand-in proposer: some decoding sequences get 1-4 draft tokens for the next step. Some as a
        draft model gets them: the slots its forwards write (the last token and the first k - 1 drafts)
        reserved through the block manager first (no room: no drafts), and handed back when its round
        yields none (a catch-up the round's budget cut, or a draft forward out of memory)."""
        for seq in self.scheduler.running:
            if seq.num_uncomputed_tokens != 1 or not data.draw(st.booleans(), label="propose"):
                continue
            drafts = data.draw(st.lists(st.integers(0, 2), min_size=1, max_size=4), label="drafts")
            if data.draw(st.booleans(), label="draft model"):
                if not self.bm.allocate(seq, 1, num_lookahead_tokens=len(drafts) - 1):
                    continue
                if data.draw(st.booleans(), label="draft round yields nothing"):
                    self.bm.free_lookahead(seq)
                    continue
            seq.spec_token_ids = drafts

    def _forward(self, out) -> None:
        """The "forward pass": write each row's input tokens (drafts too) into its K/V slots."""
        for item in out.scheduled:
            seq = item.seq
            start = seq.num_computed_tokens
            end = start + item.num_new_tokens
            assert seq.status is SequenceStatus.RUNNING and item.num_new_tokens >= 1
            assert end <= seq.num_tokens + len(item.spec_token_ids)
            assert len(seq.block_table) * BLOCK_SIZE >= end, "slots for the step's tokens (and drafts) are allocated"
            for p, token in zip(range(start, end), item.input_token_ids):
                self.kv[seq.block_table[p // BLOCK_SIZE]][p % BLOCK_SIZE] = token

    def _sample(self, data, item) -> list[int]:
        """The model's k + 1 choices for a row: each draft agreed with or not, any token (STOP included)."""
        tokens = []
        for j in range(item.num_samples):
            if j < len(item.spec_token_ids) and data.draw(st.booleans(), label="agrees"):
                tokens.append(item.spec_token_ids[j])
            else:
                tokens.append(data.draw(st.sampled_from([0, 1, 2] * 3 + [STOP]), label="sampled"))
        return tokens

    def _step(self, data):
        self._propose(data)
        was_unfinished = self.scheduler.has_unfinished
        out = self.scheduler.schedule()
        self.preemptions += len(out.preempted)
        if was_unfinished:
            assert out.scheduled or out.preempted, "work is waiting but nothing was scheduled"
        assert out.num_batched_tokens <= self.scheduler.token_budget  # drafts count in the budget
        assert len(self.scheduler.running) <= self.scheduler.config.max_num_seqs
        scheduled_ids = [s.seq.seq_id for s in out.scheduled]
        assert len(scheduled_ids) == len(set(scheduled_ids))
        self._forward(out)
        sampled = [self._sample(data, item) for item in out.scheduled]
        for item, tokens in zip(out.scheduled, sampled):
            if item.spec_token_ids:
                self.verify_rows += 1
                self.rejected_drafts += item.spec_token_ids != tokens[: len(item.spec_token_ids)]
        self.scheduler.update_from_output(out, ModelRunnerOutput(
            sampled, [[None] * len(tokens) for tokens in sampled], [[] for _ in sampled]), now=self.now)
        for item in out.scheduled:
            if item.seq.is_finished:
                self.live.remove(item.seq)
        self.hits_seen = self.bm.prefix_hits

    @precondition(lambda self: self.scheduler.has_unfinished)
    @rule(data=st.data())
    def step_runs_out_of_memory(self, data):
        """A step whose forward wrote its K/V slots and then ran out of memory: undone, budgets lowered."""
        self._propose(data)
        out = self.scheduler.schedule()
        self.preemptions += len(out.preempted)
        if out.is_empty:
            return
        self._forward(out)
        self.ooms += 1
        self.scheduler.undo(out)
        self.scheduler.shrink_after_oom(out)
        self.blocks_are_consistent()

    @precondition(lambda self: self.live)
    @rule(data=st.data())
    def abort(self, data):
        self._finish(data.draw(st.sampled_from(self.live), label="abort"))

    def _finish(self, seq: Sequence) -> None:
        self.scheduler.finish(seq)
        self.live.remove(seq)

    @invariant()
    def blocks_are_consistent(self):
        self.bm.check_invariants(self.live)
        assert self.bm.num_free_blocks == NUM_BLOCKS - len({b for s in self.live for b in s.block_table})
        for seq in self.scheduler.waiting:
            assert seq.block_table == [] and seq.num_computed_tokens == 0
        assert set(map(id, self.scheduler.waiting + self.scheduler.running)) == set(map(id, self.live))
        for block in self.bm.blocks:
            if block.block_hash is not None:  # published: its K/V are exactly its tokens' (never a rejected draft's)
                assert self.kv[block.block_id] == list(block.token_ids), f"block {block.block_id} published wrong"
        for seq in self.scheduler.running:
            # No lookahead slot outlives its step: a table covers the known tokens and no more.
            assert len(seq.block_table) <= self.bm.blocks_needed(seq.num_tokens), f"seq {seq.seq_id} kept lookahead"
            # Every computed position's slot still holds that token: shared prefix blocks were never
            # overwritten, and no block was handed to someone else while still referenced.
            for p in range(seq.num_computed_tokens):
                assert self.kv[seq.block_table[p // BLOCK_SIZE]][p % BLOCK_SIZE] == seq.token_ids[p], (
                    f"seq {seq.seq_id} position {p} reads a foreign token")

    def teardown(self):
        for seq in list(self.live):
            self._finish(seq)
        self.bm.check_invariants([])
        assert self.bm.num_free_blocks == NUM_BLOCKS, "blocks leaked"
        assert not self.scheduler.has_unfinished
        STATS["preemptions"] += self.preemptions
        STATS["prefix_hits"] += self.hits_seen
        STATS["verify_rows"] += self.verify_rows
        STATS["rejected_drafts"] += self.rejected_drafts
        STATS["ooms"] += self.ooms


STATS = {"preemptions": 0, "prefix_hits": 0, "verify_rows": 0, "rejected_drafts": 0, "ooms": 0}

SchedulerBlockMachine.TestCase.settings = settings(
    max_examples=60, stateful_step_count=40, deadline=None, derandomize=True,
    suppress_health_check=[HealthCheck.too_slow])
TestSchedulerBlockMachine = SchedulerBlockMachine.TestCase


def test_property_run_exercised_preemption_prefix_hits_verify_rows_and_rollbacks():
    """The machine above is only meaningful if its workloads preempt, share prefixes, verify drafts
    (some rejected, so rolled back) and run out of memory."""
    if STATS["preemptions"] == 0 and STATS["prefix_hits"] == 0:
        # Run on its own (e.g. `-k`): drive the machine once here.
        from hypothesis.stateful import run_state_machine_as_test

        run_state_machine_as_test(SchedulerBlockMachine, settings=settings(
            max_examples=30, stateful_step_count=40, deadline=None, derandomize=True))
    assert STATS["preemptions"] > 0
    assert STATS["prefix_hits"] > 0
    assert STATS["verify_rows"] > 0 and STATS["rejected_drafts"] > 0 and STATS["ooms"] > 0
