"""Draft-model speculative decoding (`--speculative-config '{"model": PATH, "num_speculative_tokens": K}'`):
the config, the draft's checks (vocabulary, tokenizer, positions), its KV pool on the target's block ids,
greedy outputs identical with and without it (chunked prefill, preemption, prefix-cache hits), 100 %
acceptance with the model as its own draft, sampled drafts handed over with their distribution, and
the shipped default draft."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch

from conftest import make_tiny_model, save_tiny_tokenizer

from llmctl.engine import LLM, EngineArgs, SamplingParams
from llmctl.engine.args import SpeculativeConfig
from llmctl.engine.errors import EngineArgsError, ModelLoadError
from llmctl.engine.llm_engine import LLMEngine, default_model_path
from llmctl.engine.model_config import ModelConfig
from llmctl.engine.model_runner import kv_bytes_per_token
from llmctl.engine.spec_decode.draft_proposer import DraftModel, DraftProposer, default_draft_path, resolve_draft_folder

GREEDY = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)


@pytest.fixture(scope="module")
def target(tmp_path_factory) -> Path:
    folder = make_tiny_model(tmp_path_factory.mktemp("draft-target") / "llama", "llama")
    save_tiny_tokenizer(folder)
    return folder


@pytest.fixture(scope="module")
def small_draft(tmp_path_factory, target) -> Path:
    """Another tiny Llama (other weights) with the target's tokenizer."""
    folder = make_tiny_model(tmp_path_factory.mktemp("draft-small") / "llama", "llama", seed=7)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copyfile(target / name, folder / name)
    return folder


def _spec(model: Path | str, k: int = 3, **extra) -> dict:
    """The cost gate off unless asked for: these tests count drafts, which the gate's timing would vary."""
    return {"model": str(model), "num_speculative_tokens": k, "disable_by_cost": False, **extra}


def _greedy_tokens(llm: LLM, prompts, params: SamplingParams = GREEDY) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in llm.generate(prompts, params)]


# ---- config and checks ------------------------------------------------------------------------
def test_a_model_implies_the_draft_model_method_as_in_vllm():
    config = EngineArgs(speculative_config='{"model": "default-draft", "num_speculative_tokens": 4}').speculative
    assert config == SpeculativeConfig("draft_model", 4, model="default-draft")
    assert resolve_draft_folder("default-draft") == default_draft_path()
    assert resolve_draft_folder("/some/folder") == Path("/some/folder")


@pytest.mark.parametrize("value, message", [
    ({"model": "d", "num_speculative_tokens": 3, "prompt_lookup_max": 3}, "belong to the ngram method"),
    ({"method": "ngram", "model": "d", "num_speculative_tokens": 3}, "takes no \"model\""),
    ({"method": "draft_model", "num_speculative_tokens": 3}, "needs \"model\""),
    ({"model": "d"}, "num_speculative_tokens"),
])
def test_inconsistent_draft_configs_are_refused_by_name(value, message):
    with pytest.raises(EngineArgsError, match=message):
        EngineArgs(speculative_config=value)


def test_a_missing_draft_folder_is_a_load_error(target, tmp_path):
    with pytest.raises(ModelLoadError, match="draft model folder .* does not exist"):
        LLMEngine(EngineArgs(model=str(target), speculative_config=_spec(tmp_path / "nope")))


def test_a_draft_with_another_vocabulary_is_refused(target, tmp_path):
    other = make_tiny_model(tmp_path / "other", "llama", vocab_size=384)
    with pytest.raises(EngineArgsError, match="vocabulary of 384 tokens, the target 512"):
        DraftModel.load(str(other), ModelConfig.from_pretrained(target), target, 256)


def test_a_draft_with_another_tokenizer_of_the_same_size_is_refused(target, small_draft, tmp_path):
    draft = tmp_path / "draft"
    shutil.copytree(small_draft, draft)
    data = json.loads((draft / "tokenizer.json").read_text())
    vocab = data["model"]["vocab"]
    a, b = [t for t, i in vocab.items() if i in (300, 301)]
    vocab[a], vocab[b] = vocab[b], vocab[a]  # two ids swapped: same size, other meaning
    (draft / "tokenizer.json").write_text(json.dumps(data))
    with pytest.raises(EngineArgsError, match="another tokenizer than the target's"):
        DraftModel.load(str(draft), ModelConfig.from_pretrained(target), target, 256)
    DraftModel.load(str(small_draft), ModelConfig.from_pretrained(target), target, 256)  # the real one passes


def test_a_draft_shorter_than_max_model_len_is_refused(target, small_draft, tmp_path):
    short = shutil.copytree(small_draft, tmp_path / "short")
    config = json.loads((short / "config.json").read_text())
    (short / "config.json").write_text(json.dumps({**config, "max_position_embeddings": 128}))
    with pytest.raises(EngineArgsError, match="covers 128 positions, fewer than max_model_len 256"):
        DraftModel.load(str(short), ModelConfig.from_pretrained(target), target, 256)


# ---- the KV pools -----------------------------------------------------------------------------
def test_the_pools_are_sized_together_on_the_same_block_ids(target, small_draft):
    budget = 1 << 20
    plain = LLMEngine(EngineArgs(model=str(target), kv_cache_memory=budget, block_size=16))
    engine = LLMEngine(EngineArgs(model=str(target), kv_cache_memory=budget, block_size=16,
                                  speculative_config=_spec(small_draft)))
    per_token = (kv_bytes_per_token(ModelConfig.from_pretrained(target), torch.float32)
                 + kv_bytes_per_token(ModelConfig.from_pretrained(small_draft), torch.float32))
    assert engine.executor.num_blocks == budget // (16 * per_token) < plain.executor.num_blocks
    assert isinstance(engine.proposer, DraftProposer)
    assert engine.proposer.runner.num_blocks == engine.executor.num_blocks
    assert engine.proposer.runner.block_size == engine.executor.block_size == 16
    assert engine.executor.kv_cache_bytes + engine.proposer.kv_cache_bytes <= budget


def test_on_a_device_budget_the_drafts_weights_and_kv_come_out_of_it(target, small_draft, monkeypatch):
    """The CUDA start-up plan run on the CPU with fake memory numbers: the target plans its pool after
    holding back the draft's weights (loaded after it plans) and pricing each block with both models' K/V."""
    from test_cuda_logic import MIB, cpu_runner_with_device_memory

    llm, _, _ = cpu_runner_with_device_memory(monkeypatch, target, total=100 * MIB, used=40 * MIB, peak=5 * MIB,
                                              per_row=0, max_model_len=256, max_num_seqs=256, enforce_eager=True,
                                              speculative_config=_spec(small_draft))
    runner, draft_runner = llm.engine.executor.runner, llm.engine.proposer.runner
    estimate = DraftModel.load(str(small_draft), ModelConfig.from_pretrained(target), target, 256).weight_bytes(
        torch.float32)
    # what the draft's parameters really took (weight_bytes also counts the CPU linears' packed copies,
    # which a CUDA device, the one this plan is for, does not make)
    assert estimate == sum(p.numel() * p.element_size() for p in draft_runner.model.parameters())
    budget = 90 * MIB - 40 * MIB - 5 * MIB - estimate
    per_block = int((runner.bytes_per_block + draft_runner.bytes_per_block) * 1.5)  # + the kept decode K/V share
    assert runner.num_blocks == draft_runner.num_blocks == budget // per_block


def test_the_draft_runs_whole_in_the_engines_process_under_tensor_parallelism(target, small_draft):
    """With a tensor-parallel target the draft is not sharded (rank 0 runs it whole, as vLLM's draft)."""
    from dataclasses import replace

    from llmctl.engine.parallel import TensorParallel

    engine = LLMEngine(EngineArgs(model=str(target), max_model_len=128, max_num_seqs=4, block_size=16))
    config = SpeculativeConfig("draft_model", 2, model=str(small_draft))
    draft = DraftModel.load(str(small_draft), engine.model_config, target, 128)
    runner_config = replace(engine.executor.runner.config, tensor_parallel=TensorParallel(0, 2))
    proposer = DraftProposer(config, draft, runner_config, engine.executor.num_blocks, 16, engine.block_manager)
    assert proposer.runner.config.tensor_parallel.size == 1


# ---- exactness ----------------------------------------------------------------------------------
def test_the_model_as_its_own_draft_accepts_every_greedy_draft():
    model = str(default_model_path())
    prompts = ["ROMEO:\n", "JULIET:\nO Romeo, Romeo"]
    small = dict(dtype="float32", max_model_len=128, max_num_seqs=4, num_threads=1)  # a small KV pool: fast
    plain = _greedy_tokens(LLM(model, **small), prompts)
    llm = LLM(model, **small, speculative_config=_spec(model, 4))
    assert _greedy_tokens(llm, prompts) == plain
    stats = llm.engine.get_stats()
    assert stats["spec_decode_num_draft_tokens"] > 20
    assert stats["spec_decode_num_accepted_tokens"] == stats["spec_decode_num_draft_tokens"]


@pytest.fixture(scope="module")
def small_drafts(tmp_path_factory) -> dict[str, Path]:
    """Per architecture a smaller draft of the same vocabulary: 1 layer, half the MLP, other weights."""
    root = tmp_path_factory.mktemp("small-drafts")
    return {arch: make_tiny_model(root / arch, arch, seed=7, num_hidden_layers=1, intermediate_size=64)
            for arch in ("llama", "mistral", "qwen2", "qwen3")}


@pytest.mark.parametrize("own", [True, False], ids=["own-draft", "small-draft"])
@pytest.mark.parametrize("arch", ["llama", "mistral", "qwen2", "qwen3"])
def test_greedy_outputs_match_with_chunked_prefill_preemption_and_prefix_hits(tiny_models, small_drafts, arch, own):
    """Each architecture, with the model as its own draft and with a smaller one: a mixed batch with
    chunked prefill (48-token budget), preemption (14 blocks) and prefix-cache hits (a shared 40-token
    prefix) gives plain decoding's greedy tokens, and every block comes back."""
    target = tiny_models[arch]
    shared = list(range(40, 80))  # 40 tokens: two full 16-token blocks shared between prompts
    prompts = [shared + [5, 6, 7], list(range(100, 160)), shared + [9], [3, 4, 5, 3, 4, 5, 3], shared + [11, 12]]
    settings = dict(model=str(target), skip_tokenizer_init=True, dtype="float32", block_size=16, num_kv_blocks=14,
                    max_model_len=128, max_num_batched_tokens=48, max_num_seqs=5, num_threads=1)
    params = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)
    plain = _greedy_tokens(LLM(**settings), prompts, params)
    llm = LLM(**settings, speculative_config=_spec(target if own else small_drafts[arch], 3))
    assert _greedy_tokens(llm, prompts, params) == plain
    stats = llm.engine.get_stats()
    assert stats["num_preemptions"] > 0 and stats["prefix_cache_hits"] > 0 and stats["spec_decode_num_drafts"] > 0
    if own:
        assert stats["spec_decode_num_accepted_tokens"] == stats["spec_decode_num_draft_tokens"]
    else:
        assert stats["spec_decode_num_accepted_tokens"] < stats["spec_decode_num_draft_tokens"], "no rollback ran"
    assert stats["num_free_blocks"] == stats["num_total_blocks"]
    llm.engine.block_manager.check_invariants([])


# ---- out of memory in the draft's forward --------------------------------------------------------
def _oom_settings(target: Path) -> dict:
    return dict(model=str(target), dtype="float32", block_size=16, num_kv_blocks=64, max_model_len=128,
                max_num_batched_tokens=96, max_num_seqs=4, num_threads=1)


def test_a_draft_forward_out_of_memory_drops_that_rounds_drafts_and_shrinks_the_rounds(target, small_draft, caplog):
    """The CPU allocator's own failure (a real 16 TiB allocation) in the draft's last MLP whenever a draft
    forward has more than 20 tokens: the first sequence's 61-token catch-up fails, the rounds shrink to 30
    tokens (fails again), then to 16 (one block: the catch-up runs in chunks), and drafting goes on from
    there. The requests finish with plain decoding's greedy tokens, nothing leaks, one warning per
    failed round."""
    from test_oom_recovery import InjectedOOM

    prompts = [list(range(100, 160)), list(range(200, 250))]
    params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    plain = _greedy_tokens(LLM(**_oom_settings(target)), prompts, params)
    llm = LLM(**_oom_settings(target), speculative_config=_spec(small_draft, 3))
    oom = InjectedOOM(llm.engine.proposer.runner, max_tokens=20, kind="cpu")
    try:
        with caplog.at_level("WARNING", logger="llmctl.engine.spec_decode.draft_proposer"):
            assert _greedy_tokens(llm, prompts, params) == plain
    finally:
        oom.remove()
    stats = llm.engine.get_stats()
    assert [tokens for tokens, _ in oom.events] == [61, 30], oom.events
    assert stats["num_draft_oom_skips"] == len(oom.events) and stats["num_oom_retries"] == 0
    assert stats["spec_decode_num_drafts"] > 0, "drafting resumed on the smaller rounds"
    warnings = [r for r in caplog.records if "out of memory in the draft model's forward" in r.getMessage()]
    assert len(warnings) == len(oom.events) and not any(r.exc_info for r in warnings)
    assert stats["num_free_blocks"] == stats["num_total_blocks"]
    llm.engine.block_manager.check_invariants([])


def test_a_draft_that_never_fits_stops_drafting_and_the_requests_decode_on(target, small_draft):
    """Every draft forward out of memory (CUDA's error): after the rounds shrank to one sequence and
    then none, the requests decode without drafts, with plain decoding's greedy tokens."""
    from test_oom_recovery import InjectedOOM

    prompts = [[5, 6, 7], [8, 9, 10, 11], [12, 13]]
    params = SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True)
    plain = _greedy_tokens(LLM(**_oom_settings(target)), prompts, params)
    llm = LLM(**_oom_settings(target), speculative_config=_spec(small_draft, 3))
    oom = InjectedOOM(llm.engine.proposer.runner, max_tokens=0)
    try:
        assert _greedy_tokens(llm, prompts, params) == plain
    finally:
        oom.remove()
    stats = llm.engine.get_stats()
    assert len(oom.events) == stats["num_draft_oom_skips"] == 2  # rounds of 3 sequences, then of 1, then none
    assert stats["spec_decode_num_drafts"] == 0
    assert stats["num_free_blocks"] == stats["num_total_blocks"]
    llm.engine.block_manager.check_invariants([])


# ---- sampled drafts ---------------------------------------------------------------------------
def _decoding_engine(target: Path, draft: Path, params: list[SamplingParams]) -> LLMEngine:
    engine = LLMEngine(EngineArgs(model=str(target), dtype="float32", max_model_len=128, max_num_seqs=4,
                                  speculative_config=_spec(draft, 3)))
    for i, p in enumerate(params):
        engine.add_request(f"r{i}", [5, 6, 7, 8, 9, 10], p)
    engine.step()  # the prompts' prefill: every sequence decodes from here
    return engine


def test_sampled_drafts_come_with_the_distribution_they_were_drawn_from(target, small_draft):
    sampled = SamplingParams(temperature=0.7, top_k=20, max_tokens=30, seed=3)
    engine = _decoding_engine(target, small_draft, [sampled, SamplingParams(temperature=0.0, max_tokens=30)])
    running = engine.scheduler.running
    engine.proposer.propose(running)
    sampled_seq, greedy_seq = running
    probs = sampled_seq.spec_draft_probs
    assert len(sampled_seq.spec_token_ids) == 3
    assert probs.dtype == torch.float32 and probs.shape == (3, 512)
    assert torch.allclose(probs.sum(dim=-1), torch.ones(3))
    assert ((probs > 0).sum(dim=-1) <= 20).all(), "top-k 20 applied to q"
    assert all(probs[j, t] > 0 for j, t in enumerate(sampled_seq.spec_token_ids))
    assert len(greedy_seq.spec_token_ids) == 3 and greedy_seq.spec_draft_probs is None  # deterministic draft


def test_q_is_the_drafts_distribution_under_the_requests_temperature(target, small_draft):
    """q of the first draft recomputed from the draft model's own next-token logits (transformers)."""
    from transformers import AutoModelForCausalLM

    engine = _decoding_engine(target, small_draft, [SamplingParams(temperature=0.5, max_tokens=30, seed=1)])
    seq = engine.scheduler.running[0]
    engine.proposer.propose([seq])
    model = AutoModelForCausalLM.from_pretrained(small_draft, dtype=torch.float32).eval()
    with torch.no_grad():
        logits = model(torch.tensor([seq.token_ids])).logits[0, -1]
    expected = torch.softmax(logits / 0.5, dim=-1)
    assert torch.allclose(seq.spec_draft_probs[0], expected, atol=1e-4)


def test_the_model_as_its_own_sampling_draft_is_accepted_by_the_rejection_sampler():
    """q = p (the same model, the same temperature and top-k): min(1, p/q) = 1, so nearly every sampled
    draft is accepted; a q that were not the distribution the draft drew from would lose that."""
    model = str(default_model_path())
    llm = LLM(model, dtype="float32", max_model_len=128, max_num_seqs=4, num_threads=1,
              speculative_config=_spec(model, 3))
    llm.generate(["ROMEO:\n", "JULIET:\n"], SamplingParams(temperature=0.8, top_k=50, max_tokens=24, seed=5,
                                                          ignore_eos=True))
    stats = llm.engine.get_stats()
    assert stats["spec_decode_num_draft_tokens"] > 20
    assert stats["spec_decode_num_accepted_tokens"] >= 0.95 * stats["spec_decode_num_draft_tokens"]


def test_seeded_sampling_with_a_draft_is_reproducible(target, small_draft):
    params = SamplingParams(temperature=0.9, max_tokens=20, seed=11, ignore_eos=True)
    runs = [LLM(str(target), dtype="float32", max_model_len=128, max_num_seqs=4,
                speculative_config=_spec(small_draft, 3)).generate([[5, 6, 7]], params)
            for _ in range(2)]
    assert runs[0][0].outputs[0].token_ids == runs[1][0].outputs[0].token_ids


def test_a_draft_that_accepts_too_little_is_switched_off_for_that_request(target, small_draft):
    """An unrelated draft (other random weights: its greedy guesses almost never match) drafts for each
    sequence's first WINDOW verify rows only, then that sequence decodes without drafts; the model as
    its own draft (every draft accepted) keeps drafting to the end."""
    from llmctl.engine.spec_decode.ngram_proposer import WINDOW

    params = SamplingParams(temperature=0.0, max_tokens=60, ignore_eos=True)
    prompts = [[5, 6, 7, 8], [20, 21, 22]]
    for draft, switched_off in ((small_draft, True), (target, False)):
        llm = LLM(str(target), dtype="float32", max_model_len=128, max_num_seqs=4, num_threads=1,
                  speculative_config=_spec(draft, 3))
        counts = [o.metrics.spec_decode for o in llm.generate(prompts, params)]
        if switched_off:
            assert all(c.num_drafts == WINDOW for c in counts), counts
            assert all(c.num_accepted_tokens < 0.2 * c.num_draft_tokens for c in counts)
        else:
            assert all(c.num_drafts > WINDOW and c.num_accepted_tokens == c.num_draft_tokens for c in counts)


def test_no_drafts_above_the_batch_size_gate(target, small_draft):
    engine = LLMEngine(EngineArgs(model=str(target), dtype="float32", max_model_len=128, max_num_seqs=4,
                                  speculative_config=_spec(small_draft, 3, disable_by_batch_size=1)))
    draft_calls = []
    sample_logits = engine.proposer.runner.sample_logits
    engine.proposer.runner.sample_logits = lambda rows: draft_calls.append(len(rows)) or sample_logits(rows)
    for i in range(2):
        engine.add_request(f"r{i}", [5, 6, 7], SamplingParams(temperature=0.0, max_tokens=4))
    while engine.has_unfinished_requests():
        engine.step()
    assert engine.get_stats()["spec_decode_num_drafts"] == 0
    assert draft_calls == []  # the draft model never ran: no catch-up rows while the batch is above the gate


# ---- the shipped draft ------------------------------------------------------------------------
def test_the_shipped_default_draft_is_small_and_shares_the_default_models_tokenizer():
    folder = default_draft_path()
    assert sum(f.stat().st_size for f in folder.iterdir()) < 2 * 1024 * 1024
    for name in ("tokenizer.json", "tokenizer_config.json"):
        assert (folder / name).read_bytes() == (default_model_path() / name).read_bytes()
    config = ModelConfig.from_pretrained(folder)
    assert config.num_layers == 1 and config.vocab_size == ModelConfig.from_pretrained(default_model_path()).vocab_size


def test_default_draft_works_offline_with_the_embedded_model_and_keeps_greedy_outputs():
    small = dict(dtype="float32", max_model_len=128, max_num_seqs=4, num_threads=1)
    prompts = ["ROMEO:\n", "First Citizen:\n"]
    plain = _greedy_tokens(LLM(**small), prompts)
    llm = LLM(**small, speculative_config='{"model": "default-draft", "num_speculative_tokens": 3, '
                                          '"disable_by_cost": false}')
    assert _greedy_tokens(llm, prompts) == plain
    stats = llm.engine.get_stats()
    assert stats["spec_decode_num_accepted_tokens"] > 0, "a trained draft agrees with its target sometimes"


def test_generate_takes_the_default_draft_from_the_flag():
    from test_generate_cli import run_cli

    ok = run_cli("generate", "--speculative-config", '{"model": "default-draft", "num_speculative_tokens": 2}',
                 "--json", "--max-tokens", "6", "--temperature", "0", "--ignore-eos", "--max-model-len", "128", "ROMEO:")
    assert ok.returncode == 0, ok.stderr
    assert '"completion_tokens": 6' in ok.stdout
    bad = run_cli("generate", "--speculative-config", '{"model": "/no/such/draft", "num_speculative_tokens": 2}', "hi")
    assert bad.returncode == 2 and "draft model folder /no/such/draft does not exist" in bad.stderr
    assert "Traceback" not in bad.stderr
