"""Gemma 2, Gemma 3 (text-only) and Qwen2 with mixed sliding-window and full-attention layers, each against
transformers on a tiny random checkpoint it wrote (contexts longer than the window): greedy tokens identical and
float32 logits close in one mixed batch with chunked prefill, preemption and prefix-cache hits (with and
without the native CPU kernels), with two tensor-parallel ranks (gloo), and with --quantization int8 (and Gemma's
GPTQ / AWQ checkpoints) against the dequantised reference; the configs' per-layer windows, scales, soft-caps and RoPE bases as read."""

from __future__ import annotations

import pytest
import torch

from conftest import make_tiny_model, skip_unless_native_decode
from test_parity import LogitRecorder, make_prompts, reference_logits
from tp_helpers import greedy_run, run_ranks

from llmctl.engine import LLM, SamplingParams
from llmctl.engine.errors import ModelLoadError
from llmctl.engine.model_config import ModelConfig
from llmctl.engine.parallel import TensorParallel

NEW_TOKENS = 8
WINDOW = 48
SLIDING, FULL = "sliding_attention", "full_attention"
# name -> (transformers config class, overrides, config changes that switch off what the test must show)
MODELS = {
    "gemma2": ("Gemma2Config", dict(head_dim=32, num_hidden_layers=3, sliding_window=WINDOW, query_pre_attn_scalar=24,
                                    attn_logit_softcapping=2.0, final_logit_softcapping=3.0),
               dict(layer_types=[FULL] * 3, attn_logit_softcapping=None, final_logit_softcapping=None)),
    "gemma3": ("Gemma3TextConfig", dict(head_dim=32, num_hidden_layers=3, sliding_window=WINDOW,
                                        query_pre_attn_scalar=24, layer_types=[SLIDING, FULL, SLIDING],
                                        rope_parameters={SLIDING: dict(rope_type="default", rope_theta=1000.0),
                                                         FULL: dict(rope_type="linear", factor=2.0,
                                                                    rope_theta=100000.0)}),
               dict(layer_types=[FULL] * 3)),
    "qwen2-mixed": ("Qwen2Config", dict(head_dim=32, num_hidden_layers=3, tie_word_embeddings=True,
                                        use_sliding_window=True, sliding_window=WINDOW, max_window_layers=1),
                    dict(layer_types=[FULL] * 3)),
}
ENGINE = dict(skip_tokenizer_init=True, dtype="float32", device="cpu", max_num_batched_tokens=96, num_kv_blocks=40,
              block_size=16, max_num_seqs=8, max_model_len=400)


def prompts() -> list[list[int]]:
    """33 to 300 tokens, two sharing a 200-token prefix and one a 160-token one (prefix-cache hits)."""
    return make_prompts(512)[3:]


@pytest.fixture(scope="module")
def models(tmp_path_factory) -> dict[str, str]:
    root = tmp_path_factory.mktemp("sliding-layers")
    return {name: str(make_tiny_model(root / name, config, **overrides))
            for name, (config, overrides, _) in MODELS.items()}


def reference_model(folder: str, **changes):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32, **changes).eval()


def assert_transformers_tokens_and_logits(folder: str, runs, tolerance: float = 1e-3, reference=None) -> None:
    """`runs`: (prompt, greedy tokens, logits of each sampled position) per prompt."""
    reference = reference or reference_model(folder)
    for prompt, tokens, logits in runs:
        with torch.no_grad():
            expected = reference.generate(torch.tensor([prompt]), max_new_tokens=NEW_TOKENS, min_new_tokens=NEW_TOKENS,
                                          do_sample=False)[0, len(prompt):]
        assert list(tokens) == expected.tolist(), f"a {len(prompt)}-token prompt diverged from transformers"
        diff = (torch.as_tensor(logits) - reference_logits(reference, prompt, list(tokens))).abs().max().item()
        assert diff < tolerance, f"max |logit diff| {diff} for a {len(prompt)}-token prompt"


def generate(llm: LLM, batch: list[list[int]]):
    recorders = [LogitRecorder() for _ in batch]
    params = [SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, ignore_eos=True, logits_processors=[rec])
              for rec in recorders]
    outputs = llm.generate(batch, params)
    return [(p, o.outputs[0].token_ids, torch.stack(r.rows)) for p, o, r in zip(batch, outputs, recorders)]


@pytest.mark.parametrize("name", MODELS)
def test_greedy_tokens_and_logits_match_transformers(models, name, cpu_decode_path):
    llm = LLM(models[name], **ENGINE)
    if cpu_decode_path == "native":
        skip_unless_native_decode(llm)
    runs = generate(llm, prompts())
    stats = llm.engine.get_stats()
    assert stats["num_preemptions"] > 0 and stats["prefix_cache_hit_rate"] > 0  # the batching machinery ran
    assert llm.engine.block_manager.num_free_blocks == llm.engine.block_manager.num_blocks
    assert_transformers_tokens_and_logits(models[name], runs)
    # what the test shows matters: without the windows (and Gemma 2's soft-caps) transformers' logits move
    prompt, tokens, logits = runs[-2]  # 300 tokens, far past the window
    changed = reference_logits(reference_model(models[name], **MODELS[name][2]), prompt, list(tokens))
    assert (changed - logits).abs().max().item() > 1e-2


def test_gemma2_soft_caps_each_matter(models):
    """Either cap alone changes transformers' logits beyond the tolerance the engine meets."""
    prompt = prompts()[-2]
    expected = reference_logits(reference_model(models["gemma2"]), prompt, [1, 2])
    for cap in ("attn_logit_softcapping", "final_logit_softcapping"):
        changed = reference_logits(reference_model(models["gemma2"], **{cap: None}), prompt, [1, 2])
        assert (changed - expected).abs().max().item() > 1e-2, cap


def _generate_models(tp: TensorParallel, folders: dict[str, str]):
    return {name: greedy_run(folder, tp, prompts(), NEW_TOKENS, **ENGINE) for name, folder in folders.items()}


def test_two_tensor_parallel_ranks_match_transformers(models):
    rank0, rank1 = run_ranks(_generate_models, 2, models, timeout=300)
    for name, folder in models.items():
        ours, other = rank0[name], rank1[name]
        assert ours["heads"] == other["heads"] == (2, 1)  # 4 heads and 2 KV heads split over the ranks
        assert ours["preemptions"] > 0 and ours["prefix_hits"] > 0 and ours["free_blocks"]
        assert ours["tokens"] == other["tokens"]
        assert_transformers_tokens_and_logits(folder, zip(prompts(), ours["tokens"], ours["logits"]))


@pytest.mark.parametrize("name", ["gemma2", "qwen2-mixed"])  # Gemma 3's linears are Gemma 2's (its AWQ run below)
def test_int8_matches_the_dequantised_reference(models, name):
    from test_quantization import assert_matches_reference, dequantised_reference

    llm = LLM(models[name], **ENGINE | dict(quantization="int8"))
    reference = dequantised_reference(models[name], torch.float32, "int8")
    assert_matches_reference(llm, reference, reference_model(models[name]), prompts()[:3], tolerance=1e-3)


@pytest.mark.parametrize("name, method", [("gemma2", "gptq"), ("gemma3", "awq")])
def test_pre_quantised_checkpoint_matches_its_dequantised_weights(models, tmp_path, name, method):
    from test_gptq_awq import Scheme, dequantised_model, write_quantised_checkpoint
    from test_quantization import assert_matches_reference

    folder = tmp_path / method
    reference = dequantised_model(models[name], write_quantised_checkpoint(models[name], folder, Scheme(method)))
    llm = LLM(str(folder), **ENGINE)
    assert_matches_reference(llm, reference, reference_model(models[name]), prompts()[:3], tolerance=1e-2)


# ---- configs ---------------------------------------------------------------------------------------------

BASE = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=6, num_attention_heads=4, vocab_size=32,
            sliding_window=64)


def test_per_layer_windows_follow_transformers_rules():
    gemma2 = ModelConfig.from_dict(BASE | dict(architectures=["Gemma2ForCausalLM"], query_pre_attn_scalar=16,
                                               attn_logit_softcapping=50.0, final_logit_softcapping=30.0))
    assert gemma2.layer_windows == (64, None) * 3 and gemma2.sliding_window is None
    assert [gemma2.window_of(i) for i in range(2)] == [64, None]
    assert (gemma2.attention_scale, gemma2.attn_logit_softcapping, gemma2.final_logit_softcapping) == (0.25, 50, 30)
    assert gemma2.tie_word_embeddings and gemma2.norm_weight_offset == 1.0 and gemma2.embedding_multiplier == 8.0
    gemma3 = ModelConfig.from_dict(BASE | dict(architectures=["Gemma3ForCausalLM"], sliding_window_pattern=3))
    assert gemma3.layer_windows == (64, 64, None) * 2 and gemma3.qk_norm
    qwen2 = dict(BASE, architectures=["Qwen2ForCausalLM"], use_sliding_window=True, max_window_layers=4)
    assert ModelConfig.from_dict(qwen2).layer_windows == (None,) * 4 + (64,) * 2
    assert ModelConfig.from_dict(qwen2 | dict(layer_types=[SLIDING] * 6)).sliding_window == 64
    assert ModelConfig.from_dict(qwen2 | dict(use_sliding_window=False, layer_types=[SLIDING] * 6)).sliding_window is None
    moe = dict(qwen2, architectures=["Qwen2MoeForCausalLM"], num_experts=4, num_experts_per_tok=2,
               moe_intermediate_size=32)
    assert ModelConfig.from_dict(moe).layer_windows == (64, None, 64, None, None, None)  # its own rule
    with pytest.raises(ModelLoadError, match="layer_types must name sliding_attention or full_attention"):
        ModelConfig.from_dict(qwen2 | dict(layer_types=["chunked_attention"] * 6))


def test_gemma3_local_rope_base_from_either_config_format():
    """Hub configs keep rope_theta / rope_local_base_freq / rope_scaling; transformers 5 writes rope_parameters
    per layer type. The scaling applies to the full layers only."""
    classic = ModelConfig.from_dict(BASE | dict(architectures=["Gemma3ForCausalLM"], rope_theta=1e6,
                                                rope_local_base_freq=1e4, rope_scaling=dict(rope_type="linear",
                                                                                            factor=8.0)))
    current = ModelConfig.from_dict(BASE | dict(architectures=["Gemma3ForCausalLM"], rope_parameters={
        SLIDING: dict(rope_type="default", rope_theta=1e4), FULL: dict(rope_type="linear", factor=8.0,
                                                                       rope_theta=1e6)}))
    for config in (classic, current):
        assert (config.rope_theta, config.local_rope_theta) == (1e6, 1e4)
        assert config.rope_scaling == dict(rope_type="linear", factor=8.0)


def test_vision_and_bidirectional_gemma_are_refused_by_name():
    vision = dict(architectures=["Gemma3ForConditionalGeneration"], text_config=BASE, vision_config={})
    with pytest.raises(ModelLoadError, match="Gemma3ForConditionalGeneration is a vision-language checkpoint"):
        ModelConfig.from_dict(vision)
    with pytest.raises(ModelLoadError, match="use_bidirectional_attention"):
        ModelConfig.from_dict(BASE | dict(architectures=["Gemma3ForCausalLM"], use_bidirectional_attention=True))
