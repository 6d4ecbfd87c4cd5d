"""Scheduler unit tests: one token budget per step (running first, then waiting), chunked prefill,
limits, preemption by recompute, priority, dynamic batching knobs, n > 1 children, and verify rows
(draft tokens: budget, lookahead blocks, acceptance, rollback) through `update_from_output`."""

from __future__ import annotations

import itertools

from llmctl.engine.block_manager import BlockManager
from llmctl.engine.sampling_params import SamplingParams
from llmctl.engine.scheduler import Scheduler, SchedulerConfig, accepted_tokens
from llmctl.engine.sequence import Sequence, SequenceStatus
from llmctl.engine.step_types import ModelRunnerOutput

_ids = itertools.count()


class Clock:
    def __init__(self, now: float = 100.0):
        self.now = now

    def __call__(self) -> float:
        return self.now


def make(num_blocks=64, block_size=4, max_num_seqs=8, budget=32, clock=None, caching=True, **config):
    bm = BlockManager(num_blocks, block_size, caching)
    cfg = SchedulerConfig(max_num_seqs=max_num_seqs, max_num_batched_tokens=budget, max_model_len=1024, **config)
    return Scheduler(cfg, bm, clock=clock or Clock())


def seq_of(length, arrival=0.0, first_token=0, **kwargs) -> Sequence:
    tokens = [first_token + i for i in range(length)]
    return Sequence(next(_ids), "r", 0, tokens, SamplingParams(), arrival_time=arrival, **kwargs)


def advance(sched: Scheduler, out, token: int = 7) -> None:
    """What the engine does after the forward pass."""
    for item in out.scheduled:
        samples = item.samples
        item.seq.num_computed_tokens += item.num_new_tokens
        sched.blocks.register_full_blocks(item.seq)
        if samples:
            item.seq.append_token(token)


def plan(out) -> dict[int, int]:
    return {s.seq.seq_id: s.num_new_tokens for s in out.scheduled}


def test_budget_goes_to_running_first_then_a_prefill_chunk_shares_the_step():
    sched = make(budget=8)
    a = seq_of(3, arrival=0.0)
    sched.add(a)
    out = sched.schedule()
    assert plan(out) == {a.seq_id: 3}
    advance(sched, out)
    b = seq_of(20, arrival=1.0, first_token=100)  # joins the running batch between steps
    sched.add(b)
    out = sched.schedule()
    # a's decode token first, then as much of b's prompt as the budget allows: one forward.
    assert [(s.seq.seq_id, s.num_new_tokens) for s in out.scheduled] == [(a.seq_id, 1), (b.seq_id, 7)]
    assert out.num_batched_tokens == 8
    assert [s.samples for s in out.scheduled] == [True, False]
    advance(sched, out)
    out = sched.schedule()
    assert plan(out) == {a.seq_id: 1, b.seq_id: 7}  # a keeps decoding while b is prefilled
    sched.blocks.check_invariants([a, b])


def test_running_sequences_can_use_the_whole_budget():
    sched = make(budget=4)
    running = [seq_of(2, arrival=i, first_token=10 * i) for i in range(4)]
    for seq in running:
        sched.add(seq)
    advance(sched, sched.schedule())  # 2+2 tokens: two sequences admitted
    advance(sched, sched.schedule())
    late = seq_of(5, arrival=10.0)
    sched.add(late)
    out = sched.schedule()
    assert late.seq_id not in plan(out), "waiting requests only get what running ones leave"
    assert out.num_batched_tokens <= 4


def test_chunked_prefill_of_a_long_prompt_across_steps():
    sched = make(budget=8)
    seq = seq_of(20)
    sched.add(seq)
    chunks = []
    for _ in range(3):
        out = sched.schedule()
        chunks.append((out.scheduled[0].num_new_tokens, out.scheduled[0].samples))
        advance(sched, out)
    assert chunks == [(8, False), (8, False), (4, True)]
    assert seq.num_computed_tokens == 20 and seq.output_token_ids == [7]
    out = sched.schedule()
    assert plan(out) == {seq.seq_id: 1} and out.scheduled[0].samples


def test_max_num_seqs_is_respected():
    sched = make(max_num_seqs=2, budget=100)
    seqs = [seq_of(3, arrival=i, first_token=10 * i) for i in range(5)]
    for seq in seqs:
        sched.add(seq)
    for _ in range(3):
        out = sched.schedule()
        assert set(plan(out)) == {seqs[0].seq_id, seqs[1].seq_id}
        advance(sched, out)
    assert len(sched.running) == 2 and len(sched.waiting) == 3
    sched.finish(seqs[0])
    out = sched.schedule()
    assert set(plan(out)) == {seqs[1].seq_id, seqs[2].seq_id}


def test_preemption_by_recompute_evicts_the_newest_running_sequence():
    # 4 blocks of 4 tokens; three sequences of 4 tokens fill 3 blocks, then decodes need more.
    sched = make(num_blocks=4, block_size=4, budget=64, caching=False)
    seqs = [seq_of(4, arrival=i, first_token=10 * i) for i in range(3)]
    for seq in seqs:
        sched.add(seq)
    advance(sched, sched.schedule())
    assert sched.blocks.num_free_blocks == 1
    out = sched.schedule()  # each decode needs a fresh block: only one is left
    newest = seqs[2]
    assert out.preempted == [newest]
    assert plan(out) == {seqs[0].seq_id: 1, seqs[1].seq_id: 1}
    assert newest.status is SequenceStatus.WAITING and newest.block_table == []
    assert newest.num_computed_tokens == 0 and newest.num_preemptions == 1
    assert newest.output_token_ids == [7], "generated tokens are kept and recomputed"
    assert sched.num_preemptions == 1 and sched.stats()["num_preemptions"] == 1
    sched.blocks.check_invariants(seqs)
    advance(sched, out)
    sched.finish(seqs[0])
    sched.finish(seqs[1])
    out = sched.schedule()
    # Recompute: prompt and already generated token, in one chunk, then sampling resumes.
    assert plan(out) == {newest.seq_id: 5} and out.scheduled[0].samples
    advance(sched, out, token=8)
    assert newest.output_token_ids == [7, 8]


def test_a_sequence_that_cannot_fit_preempts_itself_and_waits():
    sched = make(num_blocks=2, block_size=4, budget=64, caching=False)
    a, b = seq_of(4, arrival=0), seq_of(4, arrival=1, first_token=50)
    sched.add(a)
    sched.add(b)
    advance(sched, sched.schedule())
    out = sched.schedule()
    # a's decode needs a third block: b (newest) goes; then a fits.
    assert out.preempted == [b] and plan(out) == {a.seq_id: 1}
    assert sched.blocks.num_free_blocks == 0
    sched.blocks.check_invariants([a, b])


def test_priority_policy_admits_lower_values_first_and_preempts_higher_values():
    sched = make(max_num_seqs=1, budget=64, policy="priority")
    early_low = seq_of(3, arrival=0.0, priority=5)
    late_high = seq_of(3, arrival=1.0, priority=-1, first_token=40)
    sched.add(early_low)
    sched.add(late_high)
    out = sched.schedule()
    assert plan(out) == {late_high.seq_id: 3}

    fcfs = make(max_num_seqs=1, budget=64)
    a, b = seq_of(3, arrival=0.0, priority=5), seq_of(3, arrival=1.0, priority=-1)
    fcfs.add(a)
    fcfs.add(b)
    assert plan(fcfs.schedule()) == {a.seq_id: 3}, "fcfs ignores priority"

    # Preemption picks the least important running sequence even if it is not the newest.
    sched = make(num_blocks=3, block_size=4, budget=64, policy="priority", caching=False)
    important = seq_of(4, arrival=1.0, priority=0)
    unimportant = seq_of(4, arrival=0.0, priority=9, first_token=30)
    sched.add(unimportant)
    sched.add(important)
    advance(sched, sched.schedule())
    assert sched.running == [important, unimportant]  # admitted in priority order
    sched.running.reverse()  # make the important one the newest in the running list
    extra = seq_of(4, arrival=2.0, priority=0, first_token=60)
    sched.add(extra)
    out = sched.schedule()
    assert unimportant in out.preempted and important not in out.preempted


def test_batch_wait_timeout_holds_an_underfilled_batch():
    clock = Clock(100.0)
    sched = make(max_num_seqs=3, budget=64, clock=clock, batch_wait_timeout_s=0.05)
    a = seq_of(3, arrival=100.0)
    sched.add(a)
    assert sched.schedule().is_empty
    clock.now = 100.03
    b = seq_of(3, arrival=100.03, first_token=20)
    sched.add(b)
    assert sched.schedule().is_empty, "still under-filled and within the timeout"
    clock.now = 100.051  # the oldest request has waited past the timeout
    out = sched.schedule()
    assert plan(out) == {a.seq_id: 3, b.seq_id: 3}
    assert a.first_scheduled_time == 100.051


def test_batch_wait_timeout_releases_a_full_batch_at_once():
    clock = Clock(5.0)
    sched = make(max_num_seqs=2, budget=64, clock=clock, batch_wait_timeout_s=10.0)
    a, b = seq_of(3, arrival=5.0), seq_of(3, arrival=5.0, first_token=20)
    sched.add(a)
    assert sched.schedule().is_empty
    sched.add(b)
    assert len(sched.schedule().scheduled) == 2


def test_batch_wait_timeout_does_not_delay_joining_a_running_batch():
    clock = Clock(0.0)
    held = make(max_num_seqs=4, budget=64, clock=clock, batch_wait_timeout_s=1.0)
    held.add(a2 := seq_of(3))
    clock.now = 2.0
    advance(held, held.schedule())
    assert held.running == [a2]
    held.add(b := seq_of(3, arrival=2.0, first_token=9))
    assert b.seq_id in plan(held.schedule()), "a running batch admits newcomers without waiting"


def test_long_prompt_penalty_reorders_admission():
    def first_admitted(penalty: float) -> str:
        sched = make(max_num_seqs=1, budget=256, long_prompt_penalty=penalty)
        long_prompt = seq_of(200, arrival=0.0)
        short_prompt = seq_of(8, arrival=0.05, first_token=500)
        sched.add(long_prompt)
        sched.add(short_prompt)
        out = sched.schedule()
        return "long" if long_prompt.seq_id in plan(out) else "short"

    assert first_admitted(0.0) == "long"
    # 1 s per 1000 tokens: the 200-token prompt is delayed 0.2 s, the 8-token one 0.008 s.
    assert first_admitted(1.0) == "short"


def test_long_prompt_penalty_does_not_apply_to_preempted_sequences():
    sched = make(max_num_seqs=1, budget=256, long_prompt_penalty=1.0)
    long_prompt = seq_of(200, arrival=0.0)
    long_prompt.num_preemptions = 1  # it already waited once: no second penalty
    short_prompt = seq_of(8, arrival=0.05, first_token=500)
    sched.add(long_prompt)
    sched.add(short_prompt)
    assert long_prompt.seq_id in plan(sched.schedule())


def test_n_children_wait_for_the_parents_prompt_then_share_its_blocks():
    sched = make(budget=8, block_size=4)
    prompt_len = 14
    parent = seq_of(prompt_len)
    children = [seq_of(prompt_len, parent=parent) for _ in range(2)]
    for seq in [parent, *children]:
        sched.add(seq)
    out = sched.schedule()
    assert plan(out) == {parent.seq_id: 8}, "children wait while the parent's prompt is prefilled"
    advance(sched, out)
    out = sched.schedule()
    assert plan(out) == {parent.seq_id: 6}
    advance(sched, out)
    hits_before = sched.blocks.prefix_hits
    out = sched.schedule()
    scheduled = plan(out)
    assert scheduled[parent.seq_id] == 1
    # Each child reuses the parent's 3 full blocks (12 tokens) and computes only the last 2.
    for child in children:
        assert scheduled[child.seq_id] == 2
        assert child.block_table[:3] == parent.block_table[:3]
    assert sched.blocks.prefix_hits - hits_before == 6
    sched.blocks.check_invariants([parent, *children])


def test_finish_frees_blocks_from_running_and_waiting():
    sched = make(max_num_seqs=1)
    a, b = seq_of(5), seq_of(5, arrival=1.0, first_token=9)
    sched.add(a)
    sched.add(b)
    advance(sched, sched.schedule())
    sched.finish(b)  # still waiting
    sched.finish(a)
    assert not sched.has_unfinished
    assert sched.blocks.num_free_blocks == sched.blocks.num_blocks
    assert a.status is SequenceStatus.FINISHED and b.status is SequenceStatus.FINISHED


# ---- verify rows ----------------------------------------------------------------------------------

def results(out, sampled: dict[int, list[int]]) -> ModelRunnerOutput:
    """The runner's output for `out`: `sampled[seq_id]` for the rows that sample."""
    tokens = [sampled.get(s.seq.seq_id, []) if s.samples else [] for s in out.scheduled]
    return ModelRunnerOutput(tokens, [[None] * len(t) for t in tokens], [[] for _ in tokens])


def decoding(sched: Scheduler, length: int, **params) -> Sequence:
    """A running sequence of `length` prompt tokens whose first output token is sampled."""
    seq = Sequence(next(_ids), "r", 0, list(range(length)), SamplingParams(ignore_eos=True, **params))
    sched.add(seq)
    out = sched.schedule()
    sched.update_from_output(out, results(out, {seq.seq_id: [100]}))
    return seq


def test_accepted_tokens_are_the_agreeing_drafts_then_the_models_next_token():
    assert accepted_tokens([5, 6, 7], [5, 6, 7, 8]) == [5, 6, 7, 8]
    assert accepted_tokens([5, 6, 7], [5, 9, 7, 8]) == [5, 9]
    assert accepted_tokens([5, 6, 7], [4, 6, 7, 8]) == [4]
    assert accepted_tokens([], [4]) == [4]


def test_a_verify_row_counts_its_drafts_in_the_budget_and_reserves_lookahead_blocks():
    sched = make(budget=6, block_size=4)
    seq = decoding(sched, 6)  # 7 tokens, 6 computed: blocks 0-1
    seq.spec_token_ids = [1, 2, 3, 4, 5, 6, 7]
    other = seq_of(8, arrival=1.0, first_token=50)
    sched.add(other)
    out = sched.schedule()
    (row,) = [s for s in out.scheduled if s.seq is seq]
    # budget 6: the last token + 5 drafts; nothing is left for the waiting prompt.
    assert (row.num_new_tokens, row.spec_token_ids, row.num_samples) == (6, [1, 2, 3, 4, 5], 6)
    assert row.input_token_ids == [100, 1, 2, 3, 4, 5] and plan(out) == {seq.seq_id: 6}
    assert len(seq.block_table) == 3  # positions 6..11: a lookahead block for the drafts
    sched.update_from_output(out, results(out, {seq.seq_id: [1, 2, 9, 0, 0, 0]}))
    assert seq.output_token_ids == [100, 1, 2, 9]
    assert seq.num_computed_tokens == 9 and seq.spec_token_ids == []
    assert len(seq.block_table) == 3  # 10 known tokens still need 3 blocks
    sched.blocks.check_invariants([seq])


def test_a_rejected_verify_row_returns_its_lookahead_blocks_and_publishes_no_draft():
    sched = make(budget=16, block_size=4)
    seq = decoding(sched, 3)  # 4 tokens, 3 computed
    seq.spec_token_ids = [7, 7, 7, 7, 7]
    out = sched.schedule()
    assert len(seq.block_table) == 3  # positions 3..8
    free_before = sched.blocks.num_free_blocks
    sched.update_from_output(out, results(out, {seq.seq_id: [8, 0, 0, 0, 0, 0]}))
    assert seq.output_token_ids == [100, 8] and seq.num_computed_tokens == 4
    assert len(seq.block_table) == 2 and sched.blocks.num_free_blocks == free_before + 1
    # Block 0 (positions 0..3) is full of computed tokens and published; block 1 held drafts only.
    published = [b.block_id for b in sched.blocks.blocks if b.block_hash is not None]
    assert published == [seq.block_table[0]]


def test_drafts_stop_at_max_tokens_and_max_model_len():
    sched = make(budget=32, block_size=4)
    seq = decoding(sched, 6, max_tokens=4)  # one produced: 3 to go, the last after the drafts
    seq.spec_token_ids = [1, 2, 3, 4, 5]
    (row,) = sched.schedule().scheduled
    assert row.spec_token_ids == [1, 2]
    sched = Scheduler(SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=32, max_model_len=10),
                      BlockManager(16, 4))
    seq = decoding(sched, 6, max_tokens=None)  # 7 tokens: positions 7..9 are the last ones
    seq.spec_token_ids = [1, 2, 3, 4, 5]
    out = sched.schedule()
    assert out.scheduled[0].spec_token_ids == [1, 2, 3]
    sched.update_from_output(out, results(out, {seq.seq_id: [1, 2, 3, 4]}))
    assert seq.num_tokens == 10 and seq.finish_reason == "length" and seq.is_finished
    assert sched.blocks.num_free_blocks == 16


def test_no_room_for_lookahead_decodes_one_token_instead_of_preempting():
    sched = make(num_blocks=3, budget=16, block_size=4)
    a = decoding(sched, 3)  # 4 tokens: block 0 (position 3 next)
    b = decoding(sched, 6)  # 7 tokens: blocks 1-2
    assert sched.blocks.num_free_blocks == 0
    a.spec_token_ids = [1, 2, 3]  # needs a block for positions 4..6
    out = sched.schedule()
    assert plan(out) == {a.seq_id: 1, b.seq_id: 1} and not out.preempted
    assert out.scheduled[0].spec_token_ids == [] and a.spec_token_ids == []


def test_a_draft_models_reserved_lookahead_does_not_outlive_a_step_that_verifies_none_of_its_drafts():
    """The draft proposer reserves its slots before the step (`allocate(seq, 1, k - 1)`); when the step's
    budget cuts a sequence's drafts to none, or never reaches it, its drafts and those blocks go back."""
    sched = make(budget=5, block_size=4)
    a, b, c = decoding(sched, 3), decoding(sched, 3), decoding(sched, 3)  # 4 tokens each: one block
    for seq in (a, b, c):
        assert sched.blocks.allocate(seq, 1, num_lookahead_tokens=2)  # positions 3..5: a second block
        seq.spec_token_ids = [1, 2, 3]
    free_before = sched.blocks.num_free_blocks
    out = sched.schedule()
    # budget 5: a verifies its 3 drafts (the last token + 3), b decodes its one token (no budget left
    # for a draft), c is never reached.
    assert plan(out) == {a.seq_id: 4, b.seq_id: 1} and out.scheduled[0].spec_token_ids == [1, 2, 3]
    assert b.spec_token_ids == c.spec_token_ids == [] and len(b.block_table) == len(c.block_table) == 1
    assert sched.blocks.num_free_blocks == free_before + 2
    sched.update_from_output(out, results(out, {a.seq_id: [1, 9, 0, 0], b.seq_id: [5]}))
    for seq in (a, b, c):
        assert len(seq.block_table) <= sched.blocks.blocks_needed(seq.num_tokens)
    sched.blocks.check_invariants([a, b, c])


def test_undo_returns_the_lookahead_blocks_of_a_verify_row():
    sched = make(budget=16, block_size=4)
    seq = decoding(sched, 3)
    seq.spec_token_ids = [1, 2, 3, 4, 5]
    out = sched.schedule()
    assert len(seq.block_table) == 3
    sched.undo(out)
    assert len(seq.block_table) == 1 and seq.spec_token_ids == [1, 2, 3, 4, 5]  # the retry verifies again
    sched.blocks.check_invariants([seq])
