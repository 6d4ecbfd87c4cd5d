"""The sampler's vectorised path against straightforward per-row references: top-k / top-p / min-p masks
(a full sort per row), penalties (a loop over rows), and one device->host transfer per step."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from llmctl.engine import sampler as sampler_module
from llmctl.engine.spec_decode.rejection_sampler import DraftSpan
from llmctl.engine.sampler import Sampler, SamplingRow, device_argmax, filter_logits
from llmctl.engine.sampling_params import SamplingParams


def reference_keep(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """One row's kept tokens: sort the whole vocabulary, keep the k best, then the shortest prefix whose
    mass before its last token is at most p (renormalised over the k), then min-p."""
    vocab = logits.shape[-1]
    order = logits.argsort(descending=True)
    k = params.top_k if 0 < params.top_k < vocab else vocab
    keep_sorted = torch.zeros(vocab, dtype=torch.bool)
    keep_sorted[:k] = True
    probs = torch.softmax(logits[order].masked_fill(~keep_sorted, float("-inf")), dim=-1)
    if params.top_p < 1.0:
        keep_sorted &= (probs.cumsum(0) - probs) <= params.top_p
    keep = torch.zeros(vocab, dtype=torch.bool)
    keep[order[keep_sorted]] = True
    kept = torch.softmax(logits.masked_fill(~keep, float("-inf")), dim=-1)
    return keep & (kept >= params.min_p * kept.max())


filter_settings = st.tuples(st.sampled_from([0, 1, 2, 5, 40, 1000]),
                            st.sampled_from([1.0, 1.0, 0.99, 0.8, 0.5, 0.1, 1e-6]),
                            st.sampled_from([0.0, 0.0, 0.01, 0.3]))


@settings(max_examples=30, deadline=None)
@given(rows=st.lists(filter_settings, min_size=1, max_size=6), vocab=st.integers(2, 300), seed=st.integers(0, 10**6))
def test_filters_keep_what_a_full_sort_keeps(rows, vocab, seed):
    logits = torch.randn(len(rows), vocab, generator=torch.Generator().manual_seed(seed)) * 4
    params = [SamplingParams(temperature=1.0, top_k=k, top_p=p, min_p=m) for k, p, m in rows]
    kept = filter_logits(logits, params) > float("-inf")
    for i, row_params in enumerate(params):
        assert kept[i].tolist() == reference_keep(logits[i], row_params).tolist(), row_params


def test_top_k_and_top_p_over_top_k_sort_no_vocabulary(monkeypatch):
    def no_sort(*args, **kwargs):
        raise AssertionError("sorted the vocabulary")

    monkeypatch.setattr(torch.Tensor, "sort", no_sort)
    logits = torch.randn(3, 500, generator=torch.Generator().manual_seed(1))
    params = [SamplingParams(top_k=20), SamplingParams(top_k=5, top_p=0.7), SamplingParams(top_p=1.0)]
    kept = filter_logits(logits, params) > float("-inf")
    assert kept.sum(dim=-1).tolist()[0] == 20 and kept[2].all()


def reference_penalties(logits: torch.Tensor, row: SamplingRow) -> torch.Tensor:
    """One row: repetition on prompt+output (divide positive, multiply negative), then OpenAI's
    presence/frequency on the output, tokens past the vocabulary ignored."""
    logits, vocab, params = logits.clone(), logits.shape[-1], row.params
    seen = torch.tensor([t for t in row.prompt_token_ids + row.output_token_ids if t < vocab], dtype=torch.long)
    if params.repetition_penalty != 1.0 and seen.numel():
        seen = seen.unique()
        values = logits[seen]
        logits[seen] = torch.where(values > 0, values / params.repetition_penalty, values * params.repetition_penalty)
    counts = torch.zeros(vocab)
    for token in row.output_token_ids:
        if token < vocab:
            counts[token] += 1
    return logits - (params.frequency_penalty * counts + params.presence_penalty * (counts > 0).float())


penalty_rows = st.tuples(st.sampled_from([1.0, 1.0, 1.5, 0.7]), st.sampled_from([0.0, 0.0, 0.3, -0.5]),
                         st.sampled_from([0.0, 0.0, 0.25, 1.0]),
                         st.lists(st.integers(0, 70), max_size=12), st.lists(st.integers(0, 70), max_size=8))


@settings(max_examples=30, deadline=None)
@given(rows=st.lists(penalty_rows, min_size=1, max_size=6), seed=st.integers(0, 10**6))
def test_penalties_equal_a_per_row_reference(rows, seed):
    vocab = 64  # token ids up to 70: some past the vocabulary
    logits = torch.randn(len(rows), vocab, generator=torch.Generator().manual_seed(seed)) * 3
    sampling_rows = [SamplingRow(SamplingParams(temperature=0.0, repetition_penalty=rep, presence_penalty=presence,
                                                frequency_penalty=frequency), prompt, output, None, ())
                     for rep, presence, frequency, prompt, output in rows]
    penalised = Sampler._apply_penalties(logits, sampling_rows)
    for i, row in enumerate(sampling_rows):
        expected = reference_penalties(logits[i], row) if row.params.needs_penalties else logits[i]
        assert torch.equal(penalised[i], expected), row.params


@pytest.mark.parametrize("width", [7, 5000])
def test_device_argmax_is_torch_argmax(width):
    values = torch.randn(9, width, generator=torch.Generator().manual_seed(width))
    values[3] = 0.0  # ties: the first index
    assert torch.equal(device_argmax(values), values.argmax(dim=-1))


def test_one_device_to_host_transfer_per_step(monkeypatch):
    calls = []

    def counting(values):
        calls.append(values.shape)
        return values.tolist()

    monkeypatch.setattr(sampler_module, "_to_host", counting)
    vocab = 40
    logits = torch.randn(6, vocab, generator=torch.Generator().manual_seed(2))
    rows = [SamplingRow(SamplingParams(temperature=0.0, logprobs=2, presence_penalty=0.5), [1], [3, 4], None, ()),
            SamplingRow(SamplingParams(temperature=0.8, top_k=5, seed=3), [], [], torch.Generator().manual_seed(3),
                        (7,), draw_seed=3),
            SamplingRow(SamplingParams(temperature=1.0, top_p=0.9, logprobs=0, min_tokens=2), [], [], None, (1,)),
            SamplingRow(SamplingParams(temperature=1.0), [], [], None, ())]
    rows += [SamplingRow(SamplingParams(temperature=1.0, logprobs=1), [], [5], None, ())] * 2  # a verify row
    drafts = [DraftSpan(4, [9], torch.softmax(torch.randn(1, vocab), dim=-1))]
    out = Sampler(torch.Generator().manual_seed(0))(logits, rows, drafts)
    assert len(calls) == 1 and len(out.token_ids) == 6
    assert out.logprobs[3] is None and len(out.logprobs[0]) in (2, 3)
    calls.clear()
    Sampler(torch.Generator().manual_seed(0))(logits[1:2], rows[1:2])
    assert len(calls) == 1


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_no_device_sync_but_the_one_transfer_on_cuda(monkeypatch):
    def transfer(values):
        torch.cuda.set_sync_debug_mode(0)
        try:
            return values.tolist()
        finally:
            torch.cuda.set_sync_debug_mode("error")

    monkeypatch.setattr(sampler_module, "_to_host", transfer)
    vocab, device = 1000, torch.device("cuda")
    logits = torch.randn(5, vocab, device=device)
    rows = [SamplingRow(SamplingParams(temperature=0.0, logprobs=2, repetition_penalty=1.2), [1, 2], [3], None, ()),
            SamplingRow(SamplingParams(temperature=0.8, top_k=5, top_p=0.8, seed=3),
                        [], [4], torch.Generator(device=device).manual_seed(3), (7,), draw_seed=3),
            SamplingRow(SamplingParams(temperature=1.0, top_p=0.9, min_p=0.1, min_tokens=2), [], [], None, (1,)),
            SamplingRow(SamplingParams(temperature=1.0, frequency_penalty=0.5), [], [9, 9], None, ()),
            SamplingRow(SamplingParams(temperature=0.0, min_tokens=1), [], [], None, (0,))]
    sampler = Sampler(torch.Generator(device=device).manual_seed(0))
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        out = sampler(logits, rows)
    finally:
        torch.cuda.set_sync_debug_mode(0)
    assert len(out.token_ids) == 5 and out.logprobs[0] is not None
