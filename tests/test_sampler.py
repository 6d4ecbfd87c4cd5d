"""Sampler unit tests on hand-made logits: greedy, filters, penalties, min_tokens, seeds, logprobs and
a statistical check that temperature sampling follows the softmax distribution."""

from __future__ import annotations

import math
from collections import Counter

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from llmctl.engine.sampler import Sampler, SamplingRow, row_argmax
from llmctl.engine.sampling_params import SamplingParams

VOCAB = 8


def row(params: SamplingParams, prompt=(), output=(), generator=None, stops=()) -> SamplingRow:
    return SamplingRow(params, list(prompt), list(output), generator, tuple(stops))


def sampler(seed: int = 0) -> Sampler:
    return Sampler(torch.Generator().manual_seed(seed))


def logits_of(*rows) -> torch.Tensor:
    return torch.tensor(rows, dtype=torch.float32)


BASE = [0.5, 2.0, -1.0, 1.5, 0.0, -3.0, 1.0, 0.2]  # argmax 1, runner-up 3


def draw_many(params: SamplingParams, logits_row, count: int, seed: int = 0) -> Counter:
    s = sampler(seed)
    logits = torch.tensor([logits_row] * count, dtype=torch.float32)
    return Counter(s(logits, [row(params) for _ in range(count)]).token_ids)


def chi_square(counts: Counter, probs: list[float], total: int) -> float:
    return sum((counts.get(i, 0) - total * p) ** 2 / (total * p) for i, p in enumerate(probs) if p > 0)


# ---- greedy and filters -------------------------------------------------------------------------

def test_greedy_is_argmax_per_row():
    logits = torch.randn(6, 50, generator=torch.Generator().manual_seed(3))
    out = sampler()(logits, [row(SamplingParams(temperature=0.0)) for _ in range(6)])
    assert out.token_ids == logits.argmax(dim=-1).tolist()
    assert out.logprobs is None


@settings(max_examples=60, deadline=None)
@given(rows=st.integers(1, 6), width=st.integers(1, 9000), ties=st.integers(0, 3), seed=st.integers(0, 2**16))
def test_row_argmax_matches_torch_including_ties(rows, width, ties, seed):
    generator = torch.Generator().manual_seed(seed)
    values = torch.randn(rows, width, generator=generator).to(torch.bfloat16).float()  # bf16 rounding: ties
    for _ in range(ties):  # repeat a row's maximum further along: the first index must win
        column = int(torch.randint(width, (1,), generator=generator))
        values[:, column] = values.amax(dim=-1)
    assert row_argmax(values) == values.argmax(dim=-1).tolist()
    masked = torch.full((rows, width), float("-inf"))
    assert row_argmax(masked) == masked.argmax(dim=-1).tolist()


@pytest.mark.parametrize("width", [1, 15, 16, 17, 63, 64, 65, 130, 4096, 49152 + 5])
def test_row_argmax_takes_the_first_nan_and_treats_signed_zeros_as_ties(width):
    from llmctl.engine.kernels import load_cpu_kernels

    values = torch.full((4, width), float("-inf"))
    values[1, width // 2:] = 0.0
    values[1, width // 3] = -0.0  # -0.0 == 0.0: the first of them wins
    values[2] = torch.randn(width, generator=torch.Generator().manual_seed(width))
    values[2, width - 1] = float("nan")
    values[2, (2 * width) // 3] = float("nan")
    values[3, -1] = float("inf")
    assert row_argmax(values) == values.argmax(dim=-1).tolist()
    kernels = load_cpu_kernels()
    if kernels is not None:  # the native kernel also below row_argmax's width threshold
        assert kernels.argmax(values) == values.argmax(dim=-1).tolist()
        with pytest.raises(ValueError, match="argmax"):
            kernels.argmax(values.double())


def test_top_k_1_equals_greedy():
    logits = torch.randn(16, 50, generator=torch.Generator().manual_seed(4))
    out = sampler()(logits, [row(SamplingParams(temperature=1.3, top_k=1)) for _ in range(16)])
    assert out.token_ids == logits.argmax(dim=-1).tolist()


def test_top_k_keeps_only_the_k_best():
    counts = draw_many(SamplingParams(temperature=5.0, top_k=2), BASE, 400)
    assert set(counts) == {1, 3}


def test_tiny_top_p_keeps_only_the_top_token():
    counts = draw_many(SamplingParams(temperature=1.0, top_p=1e-6), BASE, 300)
    assert counts == Counter({1: 300})


def test_top_p_keeps_the_smallest_set_reaching_p():
    probs = torch.softmax(torch.tensor(BASE), dim=-1).tolist()
    # p between P(top1) and P(top1)+P(top2): exactly the two best tokens survive.
    p = probs[1] + probs[3] * 0.5
    counts = draw_many(SamplingParams(temperature=1.0, top_p=p), BASE, 400)
    assert set(counts) == {1, 3}


def test_min_p_drops_tokens_below_a_fraction_of_the_top_probability():
    probs = torch.softmax(torch.tensor(BASE), dim=-1)
    min_p = 0.5
    allowed = {i for i, p in enumerate(probs.tolist()) if p >= min_p * probs.max().item()}
    assert allowed == {1, 3}  # P(3)/P(1) = e^-0.5 ~ 0.61; P(6)/P(1) = e^-1 ~ 0.37
    counts = draw_many(SamplingParams(temperature=1.0, min_p=min_p), BASE, 400)
    assert set(counts) == allowed


def test_temperature_sharpens_the_distribution():
    cold = draw_many(SamplingParams(temperature=0.3), BASE, 2000, seed=1)
    hot = draw_many(SamplingParams(temperature=3.0), BASE, 2000, seed=1)
    assert cold[1] > hot[1] * 1.5
    expected_cold = torch.softmax(torch.tensor(BASE) / 0.3, dim=-1).tolist()
    assert chi_square(cold, expected_cold, 2000) < 30.0


def test_sampling_at_temperature_1_follows_the_softmax():
    total = 8000
    counts = draw_many(SamplingParams(temperature=1.0), BASE, total, seed=123)
    probs = torch.softmax(torch.tensor(BASE, dtype=torch.float64), dim=-1).tolist()
    statistic = chi_square(counts, probs, total)
    # 7 degrees of freedom: P(chi2 > 24.3) = 0.001. A uniform sampler scores in the thousands here.
    assert statistic < 24.3, f"chi-square {statistic:.1f}: sampling does not follow softmax({BASE})"
    uniform = Counter({i: total // VOCAB for i in range(VOCAB)})
    assert chi_square(uniform, probs, total) > 1000


# ---- penalties ----------------------------------------------------------------------------------

def test_repetition_penalty_divides_positive_and_multiplies_negative_logits():
    params = SamplingParams(temperature=0.0, repetition_penalty=2.0)
    logits = logits_of(BASE)
    out = sampler()._apply_penalties(logits, [row(params, prompt=[1, 2], output=[2, 5])])
    expected = list(BASE)
    expected[1] = BASE[1] / 2.0  # seen in the prompt, positive: divided (HF/CTRL definition)
    expected[2] = BASE[2] * 2.0  # negative: multiplied (seen in prompt and output: once)
    expected[5] = BASE[5] * 2.0
    assert out[0].tolist() == pytest.approx(expected)
    assert logits[0].tolist() == pytest.approx(BASE), "the caller's logits are not modified"


def test_presence_and_frequency_penalties_follow_openai():
    params = SamplingParams(temperature=0.0, presence_penalty=0.5, frequency_penalty=0.25)
    # Prompt tokens do not count for presence/frequency; the output has token 3 twice, 6 once.
    out = sampler()._apply_penalties(logits_of(BASE), [row(params, prompt=[1, 1, 1], output=[3, 6, 3])])
    expected = list(BASE)
    expected[3] -= 2 * 0.25 + 0.5
    expected[6] -= 1 * 0.25 + 0.5
    assert out[0].tolist() == pytest.approx(expected)


def test_penalties_change_the_greedy_choice():
    s = sampler()
    plain = s(logits_of(BASE), [row(SamplingParams(temperature=0.0), output=[1, 1])]).token_ids
    assert plain == [1]
    penalised = s(logits_of(BASE), [row(SamplingParams(temperature=0.0, frequency_penalty=1.0), output=[1, 1])])
    assert penalised.token_ids == [3]  # 2.0 - 2*1.0 = 0.0 < 1.5
    repeated = s(logits_of(BASE), [row(SamplingParams(temperature=0.0, repetition_penalty=1.5), prompt=[1])])
    assert repeated.token_ids == [3]  # 2.0 / 1.5 < 1.5


def test_penalties_are_per_row():
    logits = logits_of(BASE, BASE)
    rows = [row(SamplingParams(temperature=0.0, presence_penalty=2.0), output=[1]),
            row(SamplingParams(temperature=0.0), output=[1])]
    assert sampler()(logits, rows).token_ids == [3, 1]


# ---- min_tokens ---------------------------------------------------------------------------------

def test_min_tokens_masks_stop_tokens_until_reached():
    params = SamplingParams(temperature=0.0, min_tokens=2, max_tokens=10)
    s = sampler()
    # Token 1 is the best and is a stop token (e.g. EOS): masked for the first two outputs.
    assert s(logits_of(BASE), [row(params, output=[], stops=(1,))]).token_ids == [3]
    assert s(logits_of(BASE), [row(params, output=[4], stops=(1, 3))]).token_ids == [6]
    assert s(logits_of(BASE), [row(params, output=[4, 4], stops=(1,))]).token_ids == [1]
    # Random sampling never draws a masked token either.
    hot = SamplingParams(temperature=2.0, min_tokens=1, max_tokens=4)
    logits = torch.tensor([BASE] * 300)
    drawn = s(logits, [row(hot, stops=(1, 3)) for _ in range(300)]).token_ids
    assert 1 not in drawn and 3 not in drawn


# ---- seeds and logprobs -------------------------------------------------------------------------

def test_seeded_row_does_not_depend_on_the_batch():
    params = SamplingParams(temperature=1.0, seed=42)
    logits_row = torch.randn(64, generator=torch.Generator().manual_seed(7))

    def run(batch_builder) -> list[int]:
        s = sampler(seed=999)
        gen = torch.Generator().manual_seed(42)
        tokens = []
        for step in range(12):
            logits, rows, where = batch_builder(step, gen)
            tokens.append(s(logits, rows).token_ids[where])
        return tokens

    def alone(step, gen):
        return logits_row.unsqueeze(0), [row(params, generator=gen)], 0

    def crowded(step, gen):
        others = torch.randn(step % 3 + 2, 64, generator=torch.Generator().manual_seed(step))
        logits = torch.cat([others, logits_row.unsqueeze(0), others[:1]])
        rows = [row(SamplingParams(temperature=0.7 + 0.1 * i, top_k=5 * i)) for i in range(len(others))]
        rows.append(row(params, generator=gen))
        rows.append(row(SamplingParams(temperature=1.0, seed=1), generator=torch.Generator().manual_seed(step)))
        return logits, rows, len(others)

    def greedy_neighbours(step, gen):
        logits = torch.stack([logits_row, logits_row, logits_row])
        rows = [row(SamplingParams(temperature=0.0)), row(params, generator=gen), row(SamplingParams())]
        return logits, rows, 1

    reference = run(alone)
    assert len(set(reference)) > 1, "the seeded row should actually sample"
    assert run(crowded) == reference
    assert run(greedy_neighbours) == reference


def test_unseeded_rows_differ_between_draws():
    counts = draw_many(SamplingParams(temperature=1.0), BASE, 200)
    assert len(counts) >= 4


def test_logprobs_hold_the_sampled_token_and_the_top_n():
    logits = logits_of(BASE, BASE, BASE)
    rows = [row(SamplingParams(temperature=0.0, logprobs=3)),
            row(SamplingParams(temperature=0.0, logprobs=0)),
            row(SamplingParams(temperature=0.0))]
    out = sampler()(logits, rows)
    reference = torch.log_softmax(torch.tensor(BASE), dim=-1)
    assert set(out.logprobs[0]) == {1, 3, 6}
    for token, value in out.logprobs[0].items():
        assert value == pytest.approx(reference[token].item(), abs=1e-6)
    assert out.logprobs[1] == {1: pytest.approx(reference[1].item(), abs=1e-6)}
    assert out.logprobs[2] is None


def test_logprobs_include_a_sampled_token_outside_the_top_n():
    # A presence bonus (negative penalty) on token 5 makes greedy pick it although token 7 is the
    # raw top-1; reported log-probs are those of the raw distribution (penalties excluded).
    params = SamplingParams(temperature=0.0, logprobs=1, presence_penalty=-2.0)
    logits = logits_of([0.0] * 5 + [1.5] + [0.0, 3.0])
    out = sampler()(logits, [row(params, output=[5])])
    assert out.token_ids == [5]
    raw = torch.log_softmax(logits[0], dim=-1)
    assert set(out.logprobs[0]) == {5, 7}
    assert out.logprobs[0][5] == pytest.approx(raw[5].item(), abs=1e-6)
    assert out.logprobs[0][7] == pytest.approx(raw[7].item(), abs=1e-6)


def test_logits_processors_run_first():
    def ban_top(output_ids, logits_row):
        logits_row = logits_row.clone()
        logits_row[1] = -math.inf
        return logits_row

    out = sampler()(logits_of(BASE), [row(SamplingParams(temperature=0.0, logits_processors=[ban_top]))])
    assert out.token_ids == [3]
