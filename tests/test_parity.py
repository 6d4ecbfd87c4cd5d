"""Logit parity with transformers for every supported architecture, with the engine's batching
machinery (continuous batching, chunked prefill, preemption, prefix caching) all exercised at once."""

from __future__ import annotations

import random

import pytest
import torch

from conftest import skip_unless_native_decode

from llmctl.engine import LLM, SamplingParams
from llmctl.engine.layers.linear import AMXLinearMethod

NEW_TOKENS = 32
PROMPT_LENGTHS = (1, 7, 16, 33, 64, 150, 220, 300)


def make_prompts(vocab: int) -> list[list[int]]:
    rng = random.Random(1234)
    shared = [rng.randrange(vocab) for _ in range(200)]
    prompts = []
    for i, length in enumerate(PROMPT_LENGTHS):
        if length >= 200 and i % 2:  # share a 200-token prefix to hit the prefix cache
            prompts.append(shared + [rng.randrange(vocab) for _ in range(length - 200)])
        else:
            prompts.append([rng.randrange(vocab) for _ in range(length)])
    prompts.append(shared[:160] + [rng.randrange(vocab) for _ in range(20)])
    return prompts


class LogitRecorder:
    def __init__(self):
        self.rows: list[torch.Tensor] = []

    def __call__(self, output_ids, logits):
        self.rows.append(logits.detach().clone())
        return logits


def reference_logits(model, prompt: list[int], output: list[int]) -> torch.Tensor:
    ids = torch.tensor([prompt + output])
    with torch.no_grad():
        logits = model(ids).logits[0].float()
    return logits[len(prompt) - 1: len(prompt) - 1 + len(output)]


def use_decode_path(llm: LLM, path: str) -> None:
    """The engine was built for `path` (the cpu_decode_path fixture): skip where the native kernel cannot serve."""
    if path == "native":
        skip_unless_native_decode(llm)
    else:
        assert llm.engine.executor.runner.attention.label == "torch"


@pytest.mark.parametrize("arch", ["llama", "mistral", "qwen2", "qwen3"])
def test_greedy_tokens_and_logits_match_transformers(tiny_models, arch, cpu_decode_path):
    from transformers import AutoModelForCausalLM

    folder = tiny_models[arch]
    llm = LLM(str(folder), skip_tokenizer_init=True, dtype="float32", device="cpu",
              max_num_batched_tokens=96, num_kv_blocks=40, block_size=16, max_num_seqs=8,
              max_model_len=400)
    use_decode_path(llm, cpu_decode_path)
    prompts = make_prompts(llm.engine.vocab_size)
    recorders = [LogitRecorder() for _ in prompts]
    params = [SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, ignore_eos=True, logits_processors=[rec])
              for rec in recorders]
    outputs = llm.generate(prompts, params)
    stats = llm.engine.get_stats()
    assert stats["num_preemptions"] > 0, "the tiny KV pool should have forced preemption"
    assert stats["prefix_cache_hit_rate"] > 0, "shared prefixes should have hit the prefix cache"

    reference = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    for prompt, out, rec in zip(prompts, outputs, recorders):
        tokens = out.outputs[0].token_ids
        assert len(tokens) == NEW_TOKENS
        with torch.no_grad():
            expected_tokens = reference.generate(torch.tensor([prompt]), max_new_tokens=NEW_TOKENS,
                                                 min_new_tokens=NEW_TOKENS, do_sample=False)[0, len(prompt):]
        assert tokens == expected_tokens.tolist(), f"prompt of {len(prompt)} tokens diverged"
        ours = torch.stack(rec.rows)
        assert ours.shape[0] == NEW_TOKENS  # one recorded row per sampled token, even across preemption
        diff = (ours - reference_logits(reference, prompt, tokens)).abs().max().item()
        assert diff < 1e-3, f"max |logit diff| {diff} for a {len(prompt)}-token prompt"
    assert llm.engine.block_manager.num_free_blocks == llm.engine.block_manager.num_blocks


def test_prompt_logprobs_match_transformers_across_chunks(tiny_models):
    from transformers import AutoModelForCausalLM

    folder = tiny_models["qwen2"]
    llm = LLM(str(folder), skip_tokenizer_init=True, dtype="float32", device="cpu", max_num_batched_tokens=32,
              max_model_len=400)
    prompt = [(7 * i + 3) % 500 for i in range(150)]
    out = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=1, prompt_logprobs=3))[0]
    reference = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    with torch.no_grad():
        expected = torch.log_softmax(reference(torch.tensor([prompt])).logits[0].float(), dim=-1)
    assert out.prompt_logprobs[0] is None and len(out.prompt_logprobs) == len(prompt)
    for position in range(1, len(prompt)):
        entry = out.prompt_logprobs[position]
        assert abs(entry[prompt[position]] - expected[position - 1, prompt[position]].item()) < 1e-4
        assert len(entry) >= 3


def test_decode_workspace_changes_nothing(tiny_models, cpu_kernels_off):
    """Kept decode K/V (append/rebuild) and per-step gathers give the same logits."""
    prompts = make_prompts(512)[:6]
    results = []
    for budget in (None, 0):
        llm = LLM(str(tiny_models["mistral"]), skip_tokenizer_init=True, dtype="float32", device="cpu",
                  max_model_len=400, max_num_batched_tokens=128)
        use_decode_path(llm, "torch")
        if budget is not None:
            llm.engine.executor.runner.attention.set_workspace_budget(budget)
        recorders = [LogitRecorder() for _ in prompts]
        params = [SamplingParams(temperature=0.0, max_tokens=20 + 3 * i, ignore_eos=True, logits_processors=[r])
                  for i, r in enumerate(recorders)]
        llm.generate(prompts, params)
        results.append([torch.stack(r.rows) for r in recorders])
    for kept, gathered in zip(*results):
        assert torch.equal(kept, gathered)


def test_bfloat16_cpu_path_tracks_float32_reference(tiny_models, cpu_decode_path):
    """The bf16 CPU kernels (oneDNN-packed batches, mv for single rows, decode attention) stay close
    to fp32 logits."""
    from transformers import AutoModelForCausalLM

    folder = tiny_models["qwen2"]
    llm = LLM(str(folder), skip_tokenizer_init=True, dtype="bfloat16", device="cpu", max_model_len=400)
    use_decode_path(llm, cpu_decode_path)
    prompts = make_prompts(512)[:4]
    recorders = [LogitRecorder() for _ in prompts]
    params = [SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True, logits_processors=[r]) for r in recorders]
    outputs = llm.generate(prompts, params)
    reference = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    for prompt, out, rec in zip(prompts, outputs, recorders):
        expected = reference_logits(reference, prompt, out.outputs[0].token_ids)
        ours = torch.stack(rec.rows)
        scale = expected.abs().max().item()
        assert (ours - expected).abs().max().item() < 0.05 * scale + 0.05


def test_idle_engine_drops_kept_decode_kv(tiny_models, cpu_kernels_off):
    llm = LLM(str(tiny_models["llama"]), skip_tokenizer_init=True, dtype="float32", device="cpu", max_model_len=400)
    use_decode_path(llm, "torch")
    seen = []
    params = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True,
                            logits_processors=[lambda ids, row: seen.append(llm.engine.executor.runner.attention.kept_layers) or row])
    llm.generate([[1, 2, 3], list(range(40))], params)
    assert max(seen) > 0, "a steady decode batch should keep its K/V"
    assert llm.engine.executor.runner.attention.kept_layers == 0


NGRAM = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 3, "prompt_lookup_min": 1,
         "disable_by_batch_size": 16}  # above max_num_seqs: every step of the mixed batch drafts


def greedy_runs_agree_in_a_mixed_batch(folder, vocab: int, dtype: str, check=None) -> dict:
    """make_prompts' batch plus two prompts that repeat a phrase, under a small token budget (chunked prefill),
    few KV blocks (preemption) and shared prefixes (prefix-cache hits), with and without n-gram speculation:
    the same greedy tokens, no block leaked; `check(llm)` may skip first. The speculating run's stats."""
    rng = random.Random(99)
    phrases = [[rng.randrange(vocab) for _ in range(10)] for _ in range(2)]
    prompts = make_prompts(vocab) + [phrases[0] * 5, phrases[1] * 3 + phrases[0]]
    params = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, ignore_eos=True)
    runs = {}
    for name, extra in (("plain", {}), ("ngram", {"speculative_config": NGRAM})):
        llm = LLM(None if folder is None else str(folder), skip_tokenizer_init=True, dtype=dtype, device="cpu",
                  max_num_batched_tokens=96, num_kv_blocks=40, block_size=16, max_num_seqs=8, max_model_len=400,
                  **extra)
        if check is not None:
            check(llm)
        runs[name] = ([o.outputs[0].token_ids for o in llm.generate(prompts, params)], llm.engine.get_stats())
        assert llm.engine.block_manager.num_free_blocks == llm.engine.block_manager.num_blocks
    (want, _), (got, stats) = runs["plain"], runs["ngram"]
    for prompt, expected, tokens in zip(prompts, want, got):
        assert tokens == expected, f"prompt of {len(prompt)} tokens diverged under speculation"
    assert stats["num_preemptions"] > 0 and stats["prefix_cache_hit_rate"] > 0
    assert stats["spec_decode_num_accepted_tokens"] > 0
    return stats


@pytest.mark.parametrize("arch", ["llama", "mistral", "qwen2", "qwen3"])
def test_greedy_tokens_are_identical_with_and_without_ngram_speculation(tiny_models, arch):
    """The mixed batch above (chunked prefill, preemption, prefix-cache hits) plus two prompts that repeat
    a phrase, with n-gram verify rows in the same steps: the same greedy tokens as plain decoding, and
    no block leaked or left published past a rollback."""
    stats = greedy_runs_agree_in_a_mixed_batch(tiny_models[arch], 512, "float32")
    assert stats["spec_decode_num_accepted_tokens"] < stats["spec_decode_num_draft_tokens"]  # rollbacks ran



BF16_NGRAM = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 3, "prompt_lookup_min": 1}


class LogitsByPrefix:
    """Each sampled position's logits, keyed by the output tokens before it (a verify row's positions
    see its drafts as output already)."""

    def __init__(self):
        self.seen: dict[tuple[int, ...], torch.Tensor] = {}

    def __call__(self, output_ids, logits):
        self.seen[tuple(output_ids)] = logits.detach().clone()
        return logits


@pytest.mark.parametrize("model", ["embedded", "llama", "mistral", "qwen2", "qwen3"])
def test_bfloat16_greedy_speculation_gives_the_decodes_logits_bitwise(tiny_models, model):
    """bf16 on CPU, where a verify row's values are exactly its one-token decodes': its linears run the
    AMX kernel (each output row independent of the others) and its attention the native kernel (bitwise the
    one-token decode at each position), so every position's logits equal plain decoding's bit for bit and
    speculation changes no greedy token, near ties included. One request at a time, so each prompt's
    prefill is the same chunk with and without speculation: a longer row's SDPA rounds by its chunking (in
    a mixed batch with chunked prefill and preemption, bf16 tokens diverge at a near tie; with every row on
    the native kernel they do not)."""
    folder = None if model == "embedded" else str(tiny_models[model])
    vocab = 2048 if model == "embedded" else 512
    rng = random.Random(7)
    phrases = [[rng.randrange(vocab) for _ in range(8)] for _ in range(3)]
    prompts = [phrases[0] * 4, phrases[1] * 2 + phrases[2], [rng.randrange(vocab) for _ in range(30)]]
    runs = {}
    for name, extra in (("plain", {}), ("ngram", {"speculative_config": BF16_NGRAM})):
        llm = LLM(folder, skip_tokenizer_init=True, dtype="bfloat16", device="cpu", max_num_seqs=1,
                  max_model_len=256, **extra)
        skip_unless_native_decode(llm)
        layer = llm.engine.executor.runner.model.model.layers[0].self_attn.qkv_proj
        if not isinstance(layer.method, AMXLinearMethod):  # oneDNN rounds a row by the rows beside it
            pytest.skip("bf16 linears are not the AMX kernel here (no AMX)")
        recorders = [LogitsByPrefix() for _ in prompts]
        params = [SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True, logits_processors=[r])
                  for r in recorders]
        outputs = llm.generate(prompts, params)
        runs[name] = ([o.outputs[0].token_ids for o in outputs], recorders, llm.engine.get_stats())
    (want, plain, _), (got, spec, stats) = runs["plain"], runs["ngram"]
    assert got == want
    for prompt, expected, ours in zip(prompts, plain, spec):
        for prefix, logits in expected.seen.items():
            assert torch.equal(ours.seen[prefix], logits), f"{len(prompt)}-token prompt, position {len(prefix)}"
    assert 0 < stats["spec_decode_num_accepted_tokens"] < stats["spec_decode_num_draft_tokens"]  # rollbacks ran


@pytest.fixture(scope="module")
def windowed_mistral(tmp_path_factory):
    """Mistral with a sliding window shorter than the prompts, so prefill chunks and verify rows mask it."""
    from conftest import make_tiny_model

    return make_tiny_model(tmp_path_factory.mktemp("windowed") / "mistral", "mistral", sliding_window=48)


@pytest.mark.parametrize("model", ["embedded", "llama", "mistral-window", "qwen2", "qwen3"])
def test_bfloat16_greedy_tokens_identical_with_and_without_speculation_in_mixed_batches(
        tiny_models, windowed_mistral, model):
    """bf16 on CPU in the fp32 test's mixed batch (chunked prefill under a small token budget, preemption from
    few KV blocks, prefix-cache hits on shared prefixes) with n-gram verify rows: speculation changes which
    steps carry which chunk of a prompt, and with every row's attention on the native kernel (each query
    exactly the one-token decode at its position) and the AMX linears (each output row independent of the
    others) no value depends on the chunking, so the greedy tokens are those of plain decoding."""
    folder = {"embedded": None, "mistral-window": windowed_mistral}.get(model) or tiny_models.get(model)

    def every_row_native(llm):
        skip_unless_native_decode(llm)
        layer = llm.engine.executor.runner.model.model.layers[0].self_attn.qkv_proj
        if not isinstance(layer.method, AMXLinearMethod):  # oneDNN rounds a row by the rows beside it
            pytest.skip("bf16 linears are not the AMX kernel here (no AMX)")
        assert llm.engine.executor.runner.attention.native_max_query is None  # prefill chunks on the kernel too

    greedy_runs_agree_in_a_mixed_batch(folder, 2048 if model == "embedded" else 512, "bfloat16", every_row_native)
