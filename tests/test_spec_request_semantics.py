"""With speculation on (n-gram and a draft model) a request's fields keep their meaning: `n > 1`,
`logprobs`, `prompt_logprobs`, stop strings, `max_tokens` and seeds give what they give without it
(greedy: the same tokens, log-probs and texts; seeded sampling: reproducible, in any batch)."""

from __future__ import annotations

import math

import pytest

from llmctl.engine import LLM, SamplingParams

NGRAM = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 3, "prompt_lookup_min": 1}
PHRASE = [37, 81, 120, 45, 260, 19, 77, 301]
PROMPTS = [PHRASE * 4, [5, 6, 7, 8, 9] + PHRASE * 2, list(range(200, 230))]


def _llm(folder, spec: str | None) -> LLM:
    # The draft's cost gate off: these tests count drafts, which its timing would vary.
    speculative = {"ngram": NGRAM, "draft": {"model": str(folder), "num_speculative_tokens": 3,
                                             "disable_by_cost": False}}.get(spec)
    return LLM(str(folder), device="cpu", dtype="float32", block_size=16, max_model_len=256, max_num_seqs=8,
               max_num_batched_tokens=64, num_threads=1,
               **({"speculative_config": speculative} if speculative else {}))


def _flat(output) -> list[tuple]:
    return [(c.index, c.token_ids, c.text, c.finish_reason, c.stop_reason) for c in output.outputs]


def _assert_logprobs_close(got, want) -> None:
    assert len(got) == len(want)
    for g, w in zip(got, want):
        assert g.keys() == w.keys()
        for token in w:
            assert math.isclose(g[token], w[token], rel_tol=1e-4, abs_tol=1e-4)


@pytest.mark.parametrize("spec", ["ngram", "draft"])
def test_greedy_requests_keep_n_logprobs_stop_strings_and_max_tokens_under_speculation(tiny_chat_model, spec):
    plain = _llm(tiny_chat_model, None)
    probe = plain.generate(PROMPTS[1:2], SamplingParams(temperature=0.0, max_tokens=30, ignore_eos=True))[0]
    stop = probe.outputs[0].text[12:15]  # completed somewhere inside the output, maybe inside a verify row
    params = [SamplingParams(temperature=0.0, max_tokens=30, ignore_eos=True, n=2, logprobs=2),
              SamplingParams(temperature=0.0, max_tokens=30, ignore_eos=True, stop=[stop], prompt_logprobs=1),
              SamplingParams(temperature=0.0, max_tokens=7, ignore_eos=True, logprobs=0)]
    want = [plain.generate([p], s)[0] for p, s in zip(PROMPTS, params)]
    llm = _llm(tiny_chat_model, spec)
    got = [llm.generate([p], s)[0] for p, s in zip(PROMPTS, params)]
    stats = llm.engine.get_stats()
    assert stats["spec_decode_num_drafts"] > 0 and stats["spec_decode_num_accepted_tokens"] > 0
    for g, w in zip(got, want):
        assert _flat(g) == _flat(w)
        for gc, wc in zip(g.outputs, w.outputs):
            if wc.logprobs is not None:
                _assert_logprobs_close(gc.logprobs, wc.logprobs)
                assert math.isclose(gc.cumulative_logprob, wc.cumulative_logprob, rel_tol=1e-4, abs_tol=1e-3)
    assert len(got[0].outputs) == 2 and got[0].outputs[0].token_ids == got[0].outputs[1].token_ids
    assert got[1].outputs[0].finish_reason == "stop" and got[1].outputs[0].stop_reason == stop
    assert len(got[1].prompt_logprobs) == len(want[1].prompt_logprobs)
    _assert_logprobs_close(got[1].prompt_logprobs[1:], want[1].prompt_logprobs[1:])
    assert len(got[2].outputs[0].token_ids) == 7
    assert stats["num_free_blocks"] == stats["num_total_blocks"]


@pytest.mark.parametrize("spec", ["ngram", "draft"])
def test_seeded_sampled_requests_are_reproducible_under_speculation(tiny_chat_model, spec):
    """The same requests in a second engine give the same samples (and log-probs); under n-gram drafts
    also alone as in the batch (the next test: they are plain decoding's samples). Not claimed for a
    draft model: which steps carry its drafts can depend on the batch (the token budget,
    disable_by_batch_size, free blocks, its catch-up budget), and a position it drafted for is drawn
    by the rejection sampler instead of a one-token decode's draw."""
    # Temperature 0.1: this random model's distributions are flat, and n-gram drafts need a sharp one to be accepted.
    params = SamplingParams(temperature=0.1, top_k=40, max_tokens=24, ignore_eos=True, n=2, seed=17, logprobs=1)
    first = _llm(tiny_chat_model, spec)
    together = first.generate(PROMPTS, params)
    stats = first.engine.get_stats()
    assert stats["spec_decode_num_accepted_tokens"] > 0, "the workload must accept drafts to test anything"
    again = _llm(tiny_chat_model, spec).generate(PROMPTS, params)
    assert [_flat(o) for o in again] == [_flat(o) for o in together]
    assert [[c.logprobs for c in o.outputs] for o in again] == [[c.logprobs for c in o.outputs] for o in together]
    assert together[0].outputs[0].token_ids != together[0].outputs[1].token_ids, "two samples, two draws"
    if spec == "ngram":
        alone = _llm(tiny_chat_model, spec).generate(PROMPTS[:1], params)[0]
        assert _flat(alone) == _flat(together[0])
        for a, t in zip(alone.outputs, together[0].outputs):  # the batch changes the float rounding, not the values
            _assert_logprobs_close(a.logprobs, t.logprobs)


def test_seeded_samples_under_ngram_speculation_are_plain_decodings_samples(tiny_chat_model):
    """A seeded draw at output position t comes from (seed, t) alone, and an n-gram verify row draws
    each position as a one-token decode would (drafts kept while they equal the draw): the samples are
    exactly plain decoding's, alone or in a batch. Before position-keyed draws a verify row consumed
    the generator differently from one-token decodes, so the samples differed."""
    params = SamplingParams(temperature=0.1, top_k=40, max_tokens=24, ignore_eos=True, n=2, seed=17)
    want = _llm(tiny_chat_model, None).generate(PROMPTS, params)
    speculating = _llm(tiny_chat_model, "ngram")
    together = speculating.generate(PROMPTS, params)
    stats = speculating.engine.get_stats()
    assert stats["spec_decode_num_accepted_tokens"] > 0
    assert stats["spec_decode_num_draft_tokens"] > stats["spec_decode_num_accepted_tokens"], "rejections too"
    assert [_flat(o) for o in together] == [_flat(o) for o in want]
    alone = _llm(tiny_chat_model, "ngram").generate(PROMPTS[2:], params)[0]
    assert _flat(alone) == _flat(want[2])
