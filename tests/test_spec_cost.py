"""The per-step cost gate of speculative drafting (`speculative_config` `disable_by_cost`,
engine/spec_decode/cost_gate.py): its decisions from injected step times and acceptances (no timing), and in the
engine, with an injected clock, drafting stopped where a draft round costs more than it saves, kept
where it pays, outputs exact either way."""

from __future__ import annotations

import pytest

from llmctl.engine import LLM, EngineArgs, SamplingParams
from llmctl.engine.errors import EngineArgsError
from llmctl.engine.llm_engine import default_model_path
from llmctl.engine.spec_decode.cost_gate import MIN_SAMPLES, PROBE_INTERVAL, PROBE_STEPS, DraftCostGate, batch_bucket

LEARN = 2 * MIN_SAMPLES + 1  # a new bucket's steps before it decides (its first drafting step not measured)


def _step(gate: DraftCostGate, decodes: list[int], on: float, off: float, accepted: dict[int, int] | None = None,
          decodes_only: bool = True) -> bool:
    """One step: the gate's choice, then the injected outcome (its seconds, and the accepted drafts)."""
    choice = gate.should_draft(decodes, len(decodes))
    if choice:
        for seq_id, count in (accepted or {}).items():
            gate.observe(seq_id, count)
    gate.end_step(on if choice else off, decodes_only)
    return choice


def test_the_gate_measures_both_choices_then_drafts_only_where_it_pays():
    gate = DraftCostGate()
    # A draft round doubling the step: drafting pays only above one accepted draft per sequence and step.
    first = [_step(gate, [1], on=2.0, off=1.0, accepted={1: 3}) for _ in range(LEARN)]
    assert first == [True] * (MIN_SAMPLES + 1) + [False] * MIN_SAMPLES
    assert gate.expected_accepted(1) == pytest.approx(3.0)
    assert _step(gate, [1], on=2.0, off=1.0, accepted={1: 3})  # (1 + 3) / 1 * 1 / 2 = 2x: draft

    low = DraftCostGate()
    choices = [_step(low, [1], on=2.0, off=1.0, accepted={1: 0}) for _ in range(LEARN + 200)]
    drafted = [i for i, choice in enumerate(choices[LEARN:]) if choice]
    # Probes of PROBE_STEPS steps after PROBE_INTERVAL steps without drafts (MIN_SAMPLES of them while
    # learning), then after twice as many each time the probe changed nothing.
    first_probe = PROBE_INTERVAL - MIN_SAMPLES
    second_probe = first_probe + PROBE_STEPS + 2 * PROBE_INTERVAL
    assert drafted == [first_probe, first_probe + 1, second_probe, second_probe + 1]


def test_the_first_drafting_step_after_steps_without_is_not_measured():
    """It carries the draft's catch-up over the skipped tokens: the price of switching, not of drafting."""
    gate = DraftCostGate()
    assert _step(gate, [1], on=100.0, off=1.0, accepted={1: 1})  # unmeasured: the draft's first catch-up
    for _ in range(MIN_SAMPLES):
        _step(gate, [1], on=1.5, off=1.0, accepted={1: 1})
    for _ in range(MIN_SAMPLES):
        _step(gate, [1], on=1.5, off=1.0)
    assert gate.should_draft([1], 1)  # (1 + 1) / 1 * 1 / 1.5 = 1.33x, the 100 s step left out


def test_the_gain_is_per_request_with_the_average_for_a_new_one():
    gate = DraftCostGate()
    for _ in range(MIN_SAMPLES + 1):  # sequence 1 accepts 4 drafts a step, sequence 2 none
        _step(gate, [1, 2], on=3.0, off=2.0, accepted={1: 4, 2: 0})
    for _ in range(MIN_SAMPLES):
        _step(gate, [1, 2], on=3.0, off=2.0)
    assert gate.expected_accepted(1) == pytest.approx(4.0) and gate.expected_accepted(2) == 0.0
    assert gate.expected_accepted(7) == pytest.approx(2.0)  # not seen yet: the average over all
    # Both: (2 + 4) / 2 * 2 / 3 = 2x. Sequence 2 alone with another that accepts nothing: 1 * 2 / 3 < 1.
    assert gate.should_draft([1, 2], 2)
    gate.skip_measurement()
    gate.forget({2, 3})
    # Sequence 3 is new: with the average's 2 accepted a step, (2 + 0 + 2) / 2 * 2 / 3 = 1.33x: it drafts,
    # accepts nothing, and then the pair does not pay.
    assert _step(gate, [2, 3], on=3.0, off=2.0, accepted={2: 0, 3: 0})
    assert not gate.should_draft([2, 3], 2)
    # A sequence with drafting switched off (not among the drafting decodes) still counts as a decode.
    gate.skip_measurement()
    assert gate.expected_speedup([], 2, gate._buckets[2]) == pytest.approx(2.0 / 3.0)


def test_only_steps_of_decodes_count_and_each_batch_size_bucket_has_its_own_times():
    assert [batch_bucket(n) for n in (1, 2, 3, 4, 5, 8, 9)] == [1, 2, 4, 4, 8, 8, 16]
    gate = DraftCostGate()
    for _ in range(5):  # steps with a prefill chunk in them: their times say nothing about drafting
        assert _step(gate, [1], on=50.0, off=1.0, accepted={1: 0}, decodes_only=False)
    for _ in range(MIN_SAMPLES):
        _step(gate, [1], on=1.0, off=1.0, accepted={1: 1})
    for _ in range(MIN_SAMPLES):
        _step(gate, [1], on=1.0, off=1.0)
    assert gate.should_draft([1], 1)  # the prefill-chunk steps' 50 s are not in the average
    gate.skip_measurement()
    assert gate.should_draft([1, 2, 3], 3)  # bucket 4 has no measurement yet: it drafts to measure
    gate.skip_measurement()
    assert gate.should_draft([], 0) and not gate.measuring  # nothing decodes: nothing to decide


def test_the_ngram_proposer_asks_the_gate_only_about_steps_with_drafts():
    from llmctl.engine.args import SpeculativeConfig
    from llmctl.engine.spec_decode.ngram_proposer import NgramProposer
    from llmctl.engine.step_types import ScheduledSeq
    from llmctl.engine.sequence import Sequence

    proposer = NgramProposer(SpeculativeConfig("ngram", 3, prompt_lookup_max=3, prompt_lookup_min=1,
                                               disable_by_cost=True))

    def decoding(seq_id: int, tokens: list[int]) -> Sequence:
        seq = Sequence(seq_id, f"r{seq_id}", 0, tokens[:-1], SamplingParams())
        seq.append_token(tokens[-1])
        seq.num_computed_tokens = seq.num_tokens - 1
        return seq

    miss = decoding(1, [1, 2, 3, 4])
    proposer.propose([miss])
    assert miss.spec_token_ids == [] and not proposer.cost_gate.measuring  # a miss: nothing to decide
    # Verify rows that accept nothing and cost twice a step: after learning, the lookup's drafts are dropped.
    seq, choices = decoding(2, [1, 2, 3, 1, 2]), []
    for _ in range(LEARN + 2):
        proposer.propose([seq])
        drafts = seq.spec_token_ids
        choices.append(bool(drafts))
        if drafts:
            proposer.observe(seq.seq_id, len(drafts), 0)
        proposer.end_step([ScheduledSeq(seq, 1 + len(drafts), list(drafts))], 2.0 if drafts else 1.0)
        seq.clear_drafts()
    assert choices == [True] * (MIN_SAMPLES + 1) + [False] * (MIN_SAMPLES + 2)
    # Now the model produces what the dropped drafts said (the cycle 1 2 3): the proposer scores them
    # against its tokens, the gain rises, and drafting comes back long before a probe would.
    back = None
    for step in range(12):
        proposer.propose([seq])
        if seq.spec_token_ids:
            back = step
            break
        proposer.end_step([ScheduledSeq(seq, 1)], 1.0)
        seq.append_token([1, 2, 3][seq.num_tokens % 3])
        seq.num_computed_tokens = seq.num_tokens - 1
    assert back is not None and proposer.cost_gate.expected_accepted(seq.seq_id) > 1.0, back


def test_disable_by_cost_defaults_on_for_a_draft_model_off_for_ngram_and_must_be_a_boolean():
    assert EngineArgs(speculative_config={"model": "default-draft", "num_speculative_tokens": 2}).speculative.disable_by_cost
    ngram = EngineArgs(speculative_config={"method": "ngram", "num_speculative_tokens": 2}).speculative
    assert ngram.disable_by_cost is False
    assert EngineArgs(speculative_config={"method": "ngram", "num_speculative_tokens": 2,
                                          "disable_by_cost": True}).speculative.disable_by_cost
    with pytest.raises(EngineArgsError, match="disable_by_cost must be true or false"):
        EngineArgs(speculative_config={"method": "ngram", "num_speculative_tokens": 2, "disable_by_cost": "yes"})


class _Clock:
    """The engine's step clock: time passes only in the model forwards, by what the test says they cost."""

    def __init__(self):
        self.now = 0.0

    def __call__(self) -> float:
        return self.now

    def charge(self, call, seconds: float):
        def charged(*args, **kwargs):
            self.now += seconds
            return call(*args, **kwargs)
        return charged


def _gated_engine(draft_seconds: float):
    model = str(default_model_path())
    llm = LLM(model, dtype="float32", max_model_len=128, max_num_seqs=4, num_threads=1,
              speculative_config={"model": model, "num_speculative_tokens": 3})  # the model as its own draft
    engine, clock = llm.engine, _Clock()
    engine.step_clock = clock
    engine.executor.execute = clock.charge(engine.executor.execute, 1.0)  # a target step: 1 s
    draft_rounds = []
    sample_logits = clock.charge(engine.proposer.runner.sample_logits, draft_seconds)  # each draft forward
    engine.proposer.runner.sample_logits = lambda rows: draft_rounds.append(len(rows)) or sample_logits(rows)
    return llm, draft_rounds


@pytest.mark.parametrize("draft_seconds, pays", [(5.0, False), (0.1, True)])
def test_the_engine_stops_drafting_where_a_round_costs_more_than_it_saves(draft_seconds, pays):
    """The model as its own draft accepts every draft (3 a step): with draft forwards of 5 s against a 1 s
    target step a drafting step costs 16 s for 4 tokens, so after measuring both the engine decodes without
    drafts (a probe every PROBE_INTERVAL steps); at 0.1 s a forward it keeps drafting. Greedy outputs equal
    no speculation's either way."""
    prompts = ["ROMEO:\n", "JULIET:\nO Romeo, Romeo"]
    params = SamplingParams(temperature=0.0, max_tokens=100, ignore_eos=True)
    plain = LLM(str(default_model_path()), dtype="float32", max_model_len=128, max_num_seqs=4, num_threads=1)
    expected = [o.outputs[0].token_ids for o in plain.generate(prompts, params)]
    llm, draft_rounds = _gated_engine(draft_seconds)
    assert [o.outputs[0].token_ids for o in llm.generate(prompts, params)] == expected
    stats = llm.engine.get_stats()
    verify_rows = stats["spec_decode_num_drafts"]
    assert stats["spec_decode_num_accepted_tokens"] == stats["spec_decode_num_draft_tokens"] > 0
    if pays:
        assert verify_rows >= 2 * 20  # both sequences draft on nearly every step (100 tokens, 4 a step)
    else:
        # MIN_SAMPLES + 1 drafting steps while learning, then one probe: 100 tokens take ~85 more steps.
        assert verify_rows <= 2 * (MIN_SAMPLES + 1 + PROBE_STEPS), verify_rows
