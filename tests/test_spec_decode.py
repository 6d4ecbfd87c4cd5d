"""N-gram speculative decoding (`--speculative-config '{"method": "ngram", ...}'`): the config, the
proposer, the acceptance rule against the exact target distribution, greedy outputs identical with and
without it, and sampled token histograms within the no-speculation noise floor."""

from __future__ import annotations

import collections
import random

import pytest
import torch

from conftest import make_tiny_model

from llmctl.engine import LLM, EngineArgs, SamplingParams
from llmctl.engine.args import SpeculativeConfig
from llmctl.engine.errors import EngineArgsError
from llmctl.engine.scheduler import accepted_tokens
from llmctl.engine.sequence import Sequence
from llmctl.engine.spec_decode.ngram_proposer import WINDOW, NgramProposer, find_ngram_continuation
from llmctl.engine.spec_decode.rejection_sampler import acceptance_probability, rejection_sample, residual_distribution

NGRAM = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 3, "prompt_lookup_min": 1}


# ---- config -----------------------------------------------------------------------------------
def test_speculative_config_takes_json_or_a_mapping_with_vllms_keys():
    from_json = EngineArgs(speculative_config='{"method": "ngram", "num_speculative_tokens": 3}').speculative
    assert from_json == SpeculativeConfig("ngram", 3, prompt_lookup_max=5, prompt_lookup_min=1)
    assert EngineArgs(speculative_config=NGRAM).speculative.prompt_lookup_max == 3
    assert EngineArgs().speculative is None


@pytest.mark.parametrize("value, message", [
    ({"model": "draft", "num_speculative_tokens": 3, "prompt_lookup_min": 2}, "belong to the ngram method"),
    ({"method": "eagle", "num_speculative_tokens": 3}, "method 'eagle' is not supported"),
    ({"method": "ngram", "num_speculative_tokens": 3, "typical_acceptance": 1}, "typical_acceptance"),
    ({"method": "ngram"}, "num_speculative_tokens"),
    ({"method": "ngram", "num_speculative_tokens": 0}, "num_speculative_tokens"),
    ({"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_min": 4, "prompt_lookup_max": 2}, "exceeds"),
    ("{not json", "not valid JSON"),
    ("[1, 2]", "JSON object"),
])
def test_bad_speculative_configs_are_refused_by_name(value, message):
    with pytest.raises(EngineArgsError, match=message):
        EngineArgs(speculative_config=value)


def test_the_flag_its_env_variable_and_yaml_read_the_config(tiny_chat_model, tmp_path):
    from test_generate_cli import run_cli

    bad = run_cli("generate", "--speculative-config", '{"method": "medusa", "num_speculative_tokens": 2}', "hi")
    assert bad.returncode == 2 and "method 'medusa' is not supported" in bad.stderr and "Traceback" not in bad.stderr
    config = tmp_path / "engine.yaml"
    config.write_text("speculative-config:\n  model: /no/draft\n  num_speculative_tokens: 2\n")  # a YAML mapping
    bad = run_cli("generate", "--config", str(config), "hi")
    assert bad.returncode == 2 and "draft model folder /no/draft does not exist" in bad.stderr
    ok = run_cli("generate", "-m", str(tiny_chat_model), "--json", "--max-tokens", "6", "--temperature", "0",
                 "--ignore-eos", "to be or not to be, to be or not to be",
                 env_extra={"LLMCTL_SPECULATIVE_CONFIG": '{"method": "ngram", "num_speculative_tokens": 3}'})
    assert ok.returncode == 0, ok.stderr
    assert '"completion_tokens": 6' in ok.stdout


# ---- proposer ---------------------------------------------------------------------------------
def test_the_longest_suffix_ngram_gives_the_tokens_after_its_latest_full_occurrence():
    # Suffix [2, 3]: at 1 (then 4, 5, 2) and at 5 (then 7, 8, 5); the 3-gram [5, 2, 3] occurs at 4 only.
    tokens = [1, 2, 3, 4, 5, 2, 3, 7, 8, 5, 2, 3]
    assert find_ngram_continuation(tokens, 3, 1, 3) == [7, 8, 5]
    assert find_ngram_continuation(tokens, 2, 1, 3) == [7, 8, 5]  # [2, 3]'s latest occurrence with 3 after it
    assert find_ngram_continuation([1, 2, 3, 4], 3, 1, 2) == []  # nothing recurs
    assert find_ngram_continuation([1, 2, 3, 4, 9, 3, 4], 3, 3, 2) == []  # only a 2-gram recurs: below min
    assert find_ngram_continuation([7, 7, 7, 7], 2, 1, 3) == [7, 7]  # no copy has 3 after it: the earliest's 2
    assert find_ngram_continuation([5], 3, 1, 2) == []


def _continuation_by_hand(tokens: list[int], max_n: int, min_n: int, k: int) -> list[int]:
    for n in range(min(max_n, len(tokens) - 1), min_n - 1, -1):
        starts = [s for s in range(len(tokens) - n) if tokens[s:s + n] == tokens[-n:]]
        if starts:
            full = [s for s in starts if s + n + k <= len(tokens)]
            start = (full[-1] if full else starts[0]) + n
            return tokens[start:start + k]
    return []


def test_the_continuation_matches_a_by_hand_search_on_random_sequences():
    rng = random.Random(3)
    for _ in range(3000):
        tokens = [rng.randrange(rng.randrange(1, 6)) for _ in range(rng.randrange(1, 30))]
        max_n = rng.randrange(1, 6)
        min_n, k = rng.randrange(1, max_n + 1), rng.randrange(1, 6)
        assert find_ngram_continuation(tokens, max_n, min_n, k) == _continuation_by_hand(tokens, max_n, min_n, k)


def _decoding(seq_id: int, tokens: list[int]) -> Sequence:
    seq = Sequence(seq_id, f"r{seq_id}", 0, tokens[:-1], SamplingParams())
    seq.append_token(tokens[-1])
    seq.num_computed_tokens = seq.num_tokens - 1
    return seq


def test_proposer_skips_prefills_large_batches_and_sequences_that_accept_too_little():
    config = SpeculativeConfig(**NGRAM, disable_by_batch_size=2)
    proposer = NgramProposer(config)
    repeating = [_decoding(i, [1, 2, 3, 1, 2]) for i in range(3)]
    proposer.propose(repeating[:2])
    assert [s.spec_token_ids for s in repeating[:2]] == [[3, 1, 2], [3, 1, 2]]
    for seq in repeating[:2]:
        seq.clear_drafts()  # what the engine's step does with a verify row's drafts
    proposer.propose(repeating)  # 3 running > 2: compute-bound, no drafts
    assert all(s.spec_token_ids == [] for s in repeating)

    prefill = _decoding(7, [1, 2, 1, 2])
    prefill.num_computed_tokens = 0
    proposer.propose([prefill])
    assert prefill.spec_token_ids == []

    seq = repeating[0]
    for _ in range(WINDOW - 1):
        proposer.observe(seq.seq_id, 4, 0)
    proposer.propose([seq])
    assert seq.spec_token_ids  # the window is not full yet
    proposer.observe(seq.seq_id, 4, 0)
    proposer.propose([seq])
    assert seq.spec_token_ids == [] and proposer.is_disabled(seq.seq_id)

    good = repeating[1]
    for _ in range(2 * WINDOW):
        proposer.observe(good.seq_id, 4, 1)  # 1 in 4 accepted: above the floor
    proposer.propose([good])
    assert good.spec_token_ids and not proposer.is_disabled(good.seq_id)


def test_above_the_batch_size_gate_the_proposer_touches_nothing():
    """While more than `disable_by_batch_size` sequences run, the engine's step does no speculation work:
    no lookup, no sequence written (not even its empty drafts replaced), no window pruned."""
    proposer = NgramProposer(SpeculativeConfig(**NGRAM, disable_by_batch_size=2))
    running = [_decoding(i, [1, 2, 3, 1, 2]) for i in range(3)]
    proposer.observe(99, 4, 1)  # a sequence that stopped running: forgotten only once drafting is back
    before = [seq.spec_token_ids for seq in running]
    proposer.propose(running)
    assert all(seq.spec_token_ids is old for seq, old in zip(running, before))
    assert 99 in proposer._history
    proposer.propose(running[:2])
    assert [s.spec_token_ids for s in running[:2]] == [[3, 1, 2], [3, 1, 2]] and 99 not in proposer._history


def test_the_engine_looks_up_no_ngram_while_the_batch_is_above_the_gate(tiny_models, monkeypatch):
    import llmctl.engine.spec_decode.ngram_proposer as ngram

    llm = LLM(str(tiny_models["llama"]), skip_tokenizer_init=True, dtype="float32", device="cpu", max_num_seqs=4,
              speculative_config={**NGRAM, "disable_by_batch_size": 2})
    batch_sizes = []

    def counted(*args):
        batch_sizes.append(len(llm.engine.scheduler.running))
        return find_ngram_continuation(*args)

    monkeypatch.setattr(ngram, "find_ngram_continuation", counted)
    prompt = [5, 6, 7, 8, 5, 6, 7, 8, 5, 6, 7]
    plain = LLM(str(tiny_models["llama"]), skip_tokenizer_init=True, dtype="float32", device="cpu", max_num_seqs=4)
    params = [SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True) for n in (4, 4, 16)]
    outputs = [o.outputs[0].token_ids for o in llm.generate([prompt] * 3, params)]
    assert outputs == [o.outputs[0].token_ids for o in plain.generate([prompt] * 3, params)]
    assert batch_sizes and max(batch_sizes) <= 2  # drafting came back once two of the three finished


def test_the_proposer_is_linear_in_the_sequence_length():
    import time

    rng = random.Random(0)
    tokens = [rng.randrange(32000) for _ in range(4096)]
    start = time.perf_counter()
    for _ in range(20):
        find_ngram_continuation(tokens, 5, 1, 4)  # no match at any n: the worst case, every n scanned
    per_call = (time.perf_counter() - start) / 20
    assert per_call < 0.05  # measured 0.15 ms of CPU for 4096 tokens


# ---- acceptance rule --------------------------------------------------------------------------
def test_the_acceptance_rule_is_the_rejection_sampler_for_a_deterministic_draft():
    """With q one-hot on the draft x, the rejection sampler accepts x with probability min(1, p(x)/q(x)) =
    p(x) and otherwise samples the residual max(0, p - q), i.e. p without x, renormalised. Keeping the
    target's sample y (accepting x iff y == x) does exactly that: check both halves and the whole."""
    p = torch.tensor([0.05, 0.4, 0.25, 0.2, 0.1])
    draft = 2
    generator = torch.Generator().manual_seed(0)
    draws = torch.multinomial(p, 200_000, replacement=True, generator=generator).tolist()
    outputs = [accepted_tokens([draft], [y, 0]) for y in draws]
    accepted = [out for out in outputs if len(out) == 2]
    rejected = [out[0] for out in outputs if len(out) == 1]
    assert len(accepted) / len(draws) == pytest.approx(p[draft].item(), abs=0.005)
    residual = p.clone()
    residual[draft] = 0
    residual /= residual.sum()
    counts = collections.Counter(rejected)
    for token in range(len(p)):
        assert counts[token] / len(rejected) == pytest.approx(residual[token].item(), abs=0.006)
    first = collections.Counter(out[0] for out in outputs)
    for token in range(len(p)):
        assert first[token] / len(draws) == pytest.approx(p[token].item(), abs=0.005)


# ---- engine -----------------------------------------------------------------------------------
def _prompts(vocab: int) -> list[list[int]]:
    rng = random.Random(7)
    shared = [rng.randrange(vocab) for _ in range(48)]
    phrase = [rng.randrange(vocab) for _ in range(12)]
    return [
        phrase * 6,  # repetitive: the lookup finds what follows
        shared + [rng.randrange(vocab) for _ in range(40)],  # chunked (budget 32), then a prefix-cache hit:
        shared + [rng.randrange(vocab) for _ in range(9)],
        [rng.randrange(vocab) for _ in range(5)],
        [rng.randrange(vocab) for _ in range(70)],
    ]


def _llm(folder, **extra) -> LLM:
    return LLM(str(folder), skip_tokenizer_init=True, dtype="float32", device="cpu", block_size=16,
               max_num_batched_tokens=32, max_num_seqs=8, enable_prefix_caching=True, **extra)


def test_greedy_outputs_are_identical_with_and_without_ngram_drafts(tiny_models):
    folder = tiny_models["llama"]
    params = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)
    prompts = _prompts(512)
    plain = _llm(folder)
    want = [o.outputs[0].token_ids for o in plain.generate(prompts, params)]
    spec = _llm(folder, speculative_config=NGRAM)
    outputs = spec.generate(prompts, params)
    got = [o.outputs[0].token_ids for o in outputs]
    assert got == want
    stats = spec.engine.get_stats()
    # Each request's metrics count its own verify rows; together they are the engine's counters.
    per_request = [o.metrics.spec_decode for o in outputs]
    assert sum(c.num_drafts for c in per_request) == stats["spec_decode_num_drafts"]
    assert sum(c.num_draft_tokens for c in per_request) == stats["spec_decode_num_draft_tokens"]
    assert sum(c.num_accepted_tokens for c in per_request) == stats["spec_decode_num_accepted_tokens"]
    repetitive = per_request[0]
    assert repetitive.acceptance_rate == repetitive.num_accepted_tokens / repetitive.num_draft_tokens > 0
    assert repetitive.mean_acceptance_length == 1 + repetitive.num_accepted_tokens / repetitive.num_drafts
    assert outputs[0].to_dict()["metrics"]["spec_decode"]["num_drafts"] == repetitive.num_drafts
    assert stats["prefix_cache_hits"] > 0
    assert stats["spec_decode_num_drafts"] > 0 and stats["spec_decode_num_accepted_tokens"] > 0
    assert stats["spec_decode_num_accepted_tokens"] == sum(
        stats[f"spec_decode_num_accepted_tokens_pos_{j}"] for j in range(4))
    assert plain.engine.get_stats()["spec_decode_num_drafts"] == 0
    assert all(o.metrics.spec_decode.acceptance_rate is None for o in plain.generate(prompts[:1], params))


def _histogram(llm: LLM, prompt: list[int], samples: int, length: int) -> collections.Counter:
    params = SamplingParams(temperature=1.0, max_tokens=length, ignore_eos=True, n=samples)
    (out,) = llm.generate([prompt], params)
    return collections.Counter((pos, tok) for c in out.outputs for pos, tok in enumerate(c.token_ids))


def _total_variation(a: collections.Counter, b: collections.Counter) -> float:
    na, nb = sum(a.values()), sum(b.values())
    return 0.5 * sum(abs(a[k] / na - b[k] / nb) for k in set(a) | set(b))


def test_sampled_token_histograms_match_without_speculation_within_the_noise_floor(tmp_path):
    # 12 tokens and sharp logits (initializer_range 0.3): repeats are frequent, so drafts get accepted.
    folder = make_tiny_model(tmp_path / "v12", "llama", vocab_size=12, initializer_range=0.3)
    prompt, samples, length, batch = [1, 2, 3, 1, 2, 3, 1, 2], 400, 8, 32

    def run(seed: int, **extra) -> tuple[collections.Counter, dict]:
        llm = LLM(str(folder), skip_tokenizer_init=True, dtype="float32", device="cpu", seed=seed,
                  max_num_seqs=batch, **extra)
        return _histogram(llm, prompt, samples, length), llm.engine.get_stats()

    base, _ = run(0)
    noise, _ = run(1)
    spec, stats = run(2, speculative_config={**NGRAM, "disable_by_batch_size": batch})
    assert stats["spec_decode_num_accepted_tokens"] > samples
    floor, tv = _total_variation(base, noise), _total_variation(base, spec)
    print(f"total variation: no-spec vs no-spec {floor:.4f}, spec vs no-spec {tv:.4f}; accepted "
          f"{stats['spec_decode_num_accepted_tokens']} of {stats['spec_decode_num_draft_tokens']} drafts")
    assert tv < 1.5 * floor + 0.01, (floor, tv)


def test_metrics_expose_the_engines_spec_decode_counters_with_positions(tiny_models):
    from prometheus_client.parser import text_string_to_metric_families

    from llmctl.server.metrics import ServerMetrics

    llm = _llm(tiny_models["llama"], speculative_config=NGRAM)
    llm.generate([_prompts(512)[0]], SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True))
    stats = llm.engine.get_stats()
    metrics = ServerMetrics("m", lambda: stats, lambda: True, lambda _: 0.0)
    samples = {(s.name, s.labels.get("position")): s.value
               for f in text_string_to_metric_families(metrics.render().decode()) for s in f.samples}
    assert samples[("llmctl:spec_decode_num_drafts_total", None)] == stats["spec_decode_num_drafts"] > 0
    assert samples[("llmctl:spec_decode_num_draft_tokens_total", None)] == stats["spec_decode_num_draft_tokens"]
    assert samples[("llmctl:spec_decode_num_accepted_tokens_total", None)] == stats["spec_decode_num_accepted_tokens"]
    per_pos = [samples[("llmctl:spec_decode_num_accepted_tokens_per_pos_total", str(j))] for j in range(4)]
    assert per_pos == [stats[f"spec_decode_num_accepted_tokens_pos_{j}"] for j in range(4)]
    assert sum(per_pos) == stats["spec_decode_num_accepted_tokens"] > 0
    assert per_pos == sorted(per_pos, reverse=True)  # position j is accepted only after 0..j-1 were


# ---- rejection sampler (drafts with a distribution q) ------------------------------------------
def _distributions(vocab: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    p = torch.rand(vocab, generator=generator) ** 3
    q = torch.rand(vocab, generator=generator) ** 3
    return p / p.sum(), q / q.sum()


def test_the_rejection_sampler_formulas_give_exactly_the_target_distribution():
    """q(t)·min(1, p(t)/q(t)) + P(reject)·residual(t) = p(t), exactly: for every draft x drawn from q,
    accept with acceptance_probability, else draw from residual_distribution."""
    for seed in range(5):
        p, q = _distributions(7, seed)
        q[3] = 0.0  # a token the draft never proposes still gets its target mass through the residual
        q /= q.sum()
        marginal = torch.zeros_like(p)
        for x in range(len(p)):
            if q[x] == 0:
                continue
            accept = acceptance_probability(p[None], q[None], torch.tensor([x]))[0]
            marginal[x] += q[x] * accept
            marginal += q[x] * (1 - accept) * residual_distribution(p, q, x)
        torch.testing.assert_close(marginal, p, atol=1e-6, rtol=0)
    p, q = _distributions(5, 9)
    assert residual_distribution(p, q, int((q - p).argmax()))[int((q - p).argmax())] == 0


def test_rejection_sample_emits_the_target_distribution_at_each_position_and_accepts_sum_min_p_q():
    """Monte Carlo over the whole sampler with drafts drawn from q (k = 2): each emitted position is
    distributed as p_j, and draft 0 is accepted with probability sum_x min(p(x), q(x)) — more than the
    sum_x p(x)q(x) of accepting only a draft equal to the target's own sample."""
    vocab, draws = 6, 20_000
    p0, q0 = _distributions(vocab, 1)
    p1, q1 = _distributions(vocab, 2)
    p2, _ = _distributions(vocab, 3)
    target, draft = torch.stack([p0, p1, p2]), torch.stack([q0, q1])
    generator = torch.Generator().manual_seed(0)
    proposals = torch.stack([torch.multinomial(q, draws, replacement=True, generator=generator) for q in (q0, q1)], 1)
    emitted = [rejection_sample(target, row.tolist(), draft, lambda j, stream: generator) for row in proposals]
    for position, p in enumerate((p0, p1, p2)):
        tokens = [out[position] for out in emitted if len(out) > position]
        counts = torch.bincount(torch.tensor(tokens), minlength=vocab).double()
        expected = p.double() * len(tokens)
        chi2 = float(((counts - expected) ** 2 / expected.clamp_min(1e-9)).sum())
        assert chi2 < 30, (position, chi2)  # 5 degrees of freedom: p < 1e-5 under the target distribution
    accepted0 = sum(len(out) > 1 for out in emitted) / draws
    assert accepted0 == pytest.approx(float(torch.minimum(p0, q0).sum()), abs=0.015)
    assert accepted0 > float((p0 * q0).sum()) + 0.05
    assert all(len(out) == 3 or out[-1] != row[len(out) - 1] for out, row in zip(emitted, proposals.tolist()))


def test_rejection_sample_refuses_draft_probabilities_that_do_not_fit():
    p, q = _distributions(6, 0)
    with pytest.raises(ValueError, match="do not fit 2 drafts"):
        rejection_sample(torch.stack([p, p, p]), [1, 2], q[None], lambda j, stream: None)
    with pytest.raises(ValueError, match="vocabulary of 6"):
        rejection_sample(torch.stack([p, p]), [1], torch.zeros(1, 5), lambda j, stream: None)


class DistributionDraft:
    """A sampling draft in the engine's proposer seat: k tokens drawn from `draft_probs(tokens)` for every
    running decode, set as `spec_token_ids` with their distributions in `spec_draft_probs` (what a draft
    model hands the verifier). `keyed`: drawn with a generator seeded by the tokens so far, so a sequence
    gets the same drafts in any batch (a seeded request's draft model does that with its own seed)."""

    def __init__(self, k: int, draft_probs, keyed: bool = False):
        self.k, self.draft_probs, self.keyed = k, draft_probs, keyed
        self.generator = torch.Generator().manual_seed(0)
        self.drafted = self.accepted = 0

    def propose(self, running: list[Sequence]) -> None:
        for seq in running:
            if seq.num_uncomputed_tokens != 1:
                continue
            generator = self.generator
            if self.keyed:
                generator = torch.Generator().manual_seed(hash(tuple(seq.token_ids)) & 0xFFFFFFFF)
            tokens, probs = list(seq.token_ids), []
            for _ in range(self.k):
                q = self.draft_probs(tokens)
                tokens.append(int(torch.multinomial(q, 1, generator=generator)))
                probs.append(q)
            seq.spec_token_ids = tokens[seq.num_tokens:]
            seq.spec_draft_probs = torch.stack(probs)

    def observe(self, seq_id: int, num_drafted: int, num_accepted: int) -> None:
        self.drafted += num_drafted
        self.accepted += num_accepted

    def end_step(self, scheduled, seconds: float) -> None:
        self.steps = getattr(self, "steps", 0) + 1  # the engine reports every step's cost to its proposer


def test_sampled_histograms_with_a_distribution_draft_match_without_speculation(tmp_path):
    """Drafts drawn from a q unrelated to the model (a fixed random distribution) through the rejection
    sampler: the output histograms stay within the no-speculation noise floor."""
    folder = make_tiny_model(tmp_path / "v12", "llama", vocab_size=12, initializer_range=0.3)
    prompt, samples, length = [1, 2, 3, 1, 2, 3, 1, 2], 256, 6
    _, q = _distributions(12, 4)

    llm = LLM(str(folder), skip_tokenizer_init=True, dtype="float32", device="cpu", max_num_seqs=64)
    base, noise = _histogram(llm, prompt, samples, length), _histogram(llm, prompt, samples, length)
    draft = DistributionDraft(3, lambda tokens: q)
    llm.engine.proposer = draft
    spec = _histogram(llm, prompt, samples, length)
    assert draft.accepted > samples // 2
    floor, tv = _total_variation(base, noise), _total_variation(base, spec)
    print(f"total variation: no-spec vs no-spec {floor:.4f}, q-draft vs no-spec {tv:.4f}; accepted "
          f"{draft.accepted} of {draft.drafted} drafts")
    assert tv < 1.5 * floor + 0.01, (floor, tv)


def _hf_next_token_probs(folder):
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()

    @torch.inference_mode()
    def probs(tokens: list[int]) -> torch.Tensor:
        return torch.softmax(model(torch.tensor([tokens])).logits[0, -1].float(), dim=-1)

    return probs


def test_a_draft_whose_distribution_is_the_targets_is_accepted_almost_always(tiny_models):
    """q = p (the same checkpoint under transformers): min(1, p/q) = 1, so nearly every draft is accepted,
    where matching the target's own sample would accept sum p(x)^2 of them (a few per cent here)."""
    folder = tiny_models["llama"]
    params = SamplingParams(temperature=1.0, max_tokens=12, ignore_eos=True, seed=3)
    llm = _llm(folder)
    draft = DistributionDraft(4, _hf_next_token_probs(folder), keyed=True)
    llm.engine.proposer = draft
    prompts = _prompts(512)[:3]
    first = [o.outputs[0].token_ids for o in llm.generate(prompts, params)]
    assert draft.drafted >= 3 * 8 and draft.accepted >= 0.95 * draft.drafted, (draft.accepted, draft.drafted)
    alone = [o.outputs[0].token_ids for o in llm.generate(prompts[1:2], params)]
    assert alone == first[1:2]  # a seeded request's output does not depend on its batch
