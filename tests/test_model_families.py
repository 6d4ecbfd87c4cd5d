"""The architectures and configurations beyond the plain Llama family, each against transformers on a tiny
random checkpoint it wrote: greedy tokens identical and float32 logits close, in one mixed batch with chunked
prefill and prefix-cache hits; and the RoPE scalings' frequencies against transformers' own functions."""

from __future__ import annotations

import math

import pytest
import torch

from conftest import make_tiny_model
from test_parity import LogitRecorder, make_prompts, reference_logits

from llmctl.engine import LLM, SamplingParams
from llmctl.engine.errors import ModelLoadError
from llmctl.engine.layers.rotary import inverse_frequencies
from llmctl.engine.model_config import ModelConfig

NEW_TOKENS = 8


def assert_matches_transformers(folder, max_model_len: int = 400, tolerance: float = 1e-3,
                                use_generate: bool = True) -> LLM:
    """`use_generate=False`: the greedy tokens are checked against the argmax of transformers' full-sequence
    logits instead of its generate() (whose Phi-3 cache reset at the LongRoPE switch breaks its own decoding)."""
    from transformers import AutoModelForCausalLM

    llm = LLM(str(folder), skip_tokenizer_init=True, dtype="float32", device="cpu", max_num_batched_tokens=64,
              block_size=16, max_num_seqs=4, max_model_len=max_model_len)
    prompts = make_prompts(llm.engine.vocab_size)[5:]  # 220, 300 and 180 tokens sharing a prefix of 160+
    recorders = [LogitRecorder() for _ in prompts]
    params = [SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, ignore_eos=True, logits_processors=[rec])
              for rec in recorders]
    outputs = llm.generate(prompts, params)
    assert llm.engine.get_stats()["prefix_cache_hit_rate"] > 0
    reference = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    for prompt, out, rec in zip(prompts, outputs, recorders):
        tokens = out.outputs[0].token_ids
        expected_logits = reference_logits(reference, prompt, tokens)
        if use_generate:
            with torch.no_grad():
                expected = reference.generate(torch.tensor([prompt]), max_new_tokens=NEW_TOKENS,
                                              min_new_tokens=NEW_TOKENS, do_sample=False)[0, len(prompt):]
        else:
            expected = expected_logits.argmax(dim=-1)
        assert tokens == expected.tolist(), f"a {len(prompt)}-token prompt diverged"
        diff = (torch.stack(rec.rows) - expected_logits).abs().max().item()
        assert diff < tolerance, f"max |logit diff| {diff} for a {len(prompt)}-token prompt"
    return llm


# ---- RoPE scalings ---------------------------------------------------------------------------------------

LONGROPE = dict(rope_type="longrope", short_factor=[1.0 + 0.1 * i for i in range(8)],
                long_factor=[2.0 + 0.3 * i for i in range(8)])


@pytest.mark.parametrize("scaling, length", [
    (dict(rope_type="yarn", factor=4.0, original_max_position_embeddings=256), 1024),
    (dict(rope_type="yarn", factor=8.0, original_max_position_embeddings=128, beta_fast=16, beta_slow=2,
          mscale=1.0, mscale_all_dim=0.5, truncate=False), 1024),
    (dict(rope_type="dynamic", factor=2.0), 1024),
    (dict(rope_type="dynamic", factor=2.0), 3000),
    (LONGROPE, 200),
    (LONGROPE, 1024),
])
def test_rope_frequencies_and_attention_factor_are_transformers(scaling, length):
    from transformers import LlamaConfig
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    raw = dict(architectures=["LlamaForCausalLM"], hidden_size=64, intermediate_size=128, num_hidden_layers=1,
               num_attention_heads=4, vocab_size=32, max_position_embeddings=1024, original_max_position_embeddings=256,
               rope_theta=10000.0, rope_scaling=dict(scaling))
    if scaling["rope_type"] != "longrope":
        del raw["original_max_position_embeddings"]
    config = ModelConfig.from_dict(raw)
    ours, factor = inverse_frequencies(config.head_dim, config.rope_theta, config.rope_scaling, length)
    reference = LlamaConfig(**{k: v for k, v in raw.items() if k != "rope_scaling"},
                            rope_parameters=dict(scaling, rope_theta=10000.0))
    expected, expected_factor = ROPE_INIT_FUNCTIONS[scaling["rope_type"]](reference, "cpu", seq_len=length)
    torch.testing.assert_close(ours, expected.float(), rtol=1e-6, atol=0)
    assert factor == pytest.approx(expected_factor)


def test_unsupported_rope_settings_are_refused_by_name():
    base = dict(architectures=["LlamaForCausalLM"], hidden_size=64, intermediate_size=128, num_hidden_layers=1,
                num_attention_heads=4, vocab_size=32)
    for extra, named in ((dict(rope_scaling=dict(rope_type="mrope")), "'mrope'"),
                         (dict(partial_rotary_factor=0.5), "partial_rotary_factor 0.5"),
                         (dict(rope_scaling=dict(LONGROPE, short_factor=[1.0])), "short_factor")):
        with pytest.raises(ModelLoadError, match=named):
            ModelConfig.from_dict(base | extra)


def test_qwen2_with_yarn_matches_transformers(tmp_path):
    assert_matches_transformers(make_tiny_model(
        tmp_path, "qwen2", rope_parameters=dict(rope_type="yarn", factor=4.0, original_max_position_embeddings=128,
                                                rope_theta=10000.0)))


def test_llama_with_dynamic_ntk_matches_transformers(tmp_path):
    assert_matches_transformers(make_tiny_model(
        tmp_path, "llama", rope_parameters=dict(rope_type="dynamic", factor=2.0, rope_theta=10000.0)))


# ---- Qwen2 sliding windows ---------------------------------------------------------------------------------

def test_qwen2_sliding_window_on_every_layer_matches_transformers(tmp_path):
    llm = assert_matches_transformers(make_tiny_model(tmp_path, "qwen2", use_sliding_window=True, sliding_window=48,
                                                      max_window_layers=0))
    assert llm.engine.model_config.sliding_window == 48


def test_qwen2_window_layers_follow_max_window_layers():
    raw = dict(architectures=["Qwen2ForCausalLM"], hidden_size=64, intermediate_size=128, num_hidden_layers=4,
               num_attention_heads=4, vocab_size=32, use_sliding_window=True, sliding_window=64)
    assert ModelConfig.from_dict(raw | dict(max_window_layers=4)).sliding_window is None
    assert ModelConfig.from_dict(raw | dict(max_window_layers=0)).sliding_window == 64
    assert ModelConfig.from_dict(raw | dict(use_sliding_window=False, max_window_layers=0)).sliding_window is None
    mixed = ModelConfig.from_dict(raw | dict(max_window_layers=2))  # tests/test_sliding_layers_and_gemma.py runs one
    assert mixed.sliding_window is None and mixed.layer_windows == (None, None, 64, 64)


# ---- Phi-3 -----------------------------------------------------------------------------------------------

PHI3 = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
            max_position_embeddings=1024, original_max_position_embeddings=128, pad_token_id=0)


@pytest.mark.parametrize("max_model_len", [128, 400])
def test_phi3_with_longrope_matches_transformers(tmp_path, max_model_len):
    """400 > original_max_position_embeddings: the long factors, which transformers takes for these prompts (all
    longer than 128 tokens); 128: the short ones, which it takes for sequences up to 128."""
    folder = make_tiny_model(tmp_path, "Phi3Config", **PHI3, rope_parameters=dict(
        rope_type="longrope", rope_theta=10000.0, short_factor=[1.0 + 0.05 * i for i in range(8)],
        long_factor=[1.5 + 0.5 * i for i in range(8)]))
    if max_model_len == 400:
        assert_matches_transformers(folder, max_model_len, use_generate=False)
    else:
        assert_short_prompts_match(folder, max_model_len)


def assert_short_prompts_match(folder, max_model_len: int) -> None:
    from transformers import AutoModelForCausalLM

    llm = LLM(str(folder), skip_tokenizer_init=True, dtype="float32", device="cpu", max_num_batched_tokens=32,
              block_size=16, max_model_len=max_model_len)
    prompts = [[(5 * i + 1) % 500 for i in range(n)] for n in (40, 70, 100)]
    outputs = llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, ignore_eos=True))
    reference = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    for prompt, out in zip(prompts, outputs):
        with torch.no_grad():
            expected = reference.generate(torch.tensor([prompt]), max_new_tokens=NEW_TOKENS,
                                          min_new_tokens=NEW_TOKENS, do_sample=False)[0, len(prompt):]
        assert out.outputs[0].token_ids == expected.tolist()


# ---- Gemma -----------------------------------------------------------------------------------------------

def test_gemma_matches_transformers(tmp_path):
    """GeGLU, (1 + weight) norms, embeddings scaled by sqrt(hidden) in the model dtype, tied head."""
    folder = make_tiny_model(tmp_path, "GemmaConfig", head_dim=32, hidden_act="gelu_pytorch_tanh")
    llm = assert_matches_transformers(folder)
    config = llm.engine.model_config
    assert config.tie_word_embeddings and config.norm_weight_offset == 1.0 and config.embedding_multiplier == 8.0


def test_gemma_layer_ops_agree():
    """Every LayerOps implementation's GeGLU is transformers' gelu_pytorch_tanh(gate) * up."""
    from transformers.activations import ACT2FN

    from llmctl.engine.layers.fused_ops import TorchLayerOps, TritonLayerOps

    gate_up = torch.randn(5, 64)
    expected = ACT2FN["gelu_pytorch_tanh"](gate_up[:, :32]) * gate_up[:, 32:]
    for ops in (TorchLayerOps(), TritonLayerOps(torch.device("cpu"))):
        torch.testing.assert_close(ops.gelu_tanh_and_mul(gate_up), expected)


def test_published_phi3_and_qwen25_configs_read_as_transformers_reads_them():
    """Phi-3.5-mini's config.json (top-level original_max_position_embeddings, 'longrope' factors) and a
    Qwen2.5 config with the YaRN block its model card gives."""
    phi = dict(architectures=["Phi3ForCausalLM"], hidden_size=3072, intermediate_size=8192, num_hidden_layers=32,
               num_attention_heads=32, num_key_value_heads=32, vocab_size=32064, max_position_embeddings=131072,
               original_max_position_embeddings=4096, rope_theta=10000.0, sliding_window=262144,
               rope_scaling=dict(type="longrope", long_factor=[1.5] * 48, short_factor=[1.0] * 48))
    config = ModelConfig.from_dict(phi)
    assert config.head_dim == 96 and config.rope_scaling["factor"] == 32.0
    assert config.rope_scaling["original_max_position_embeddings"] == 4096
    _, attention = inverse_frequencies(96, 10000.0, config.rope_scaling, 8192)
    assert attention == pytest.approx(math.sqrt(1 + math.log(32) / math.log(4096)))
    qwen = dict(architectures=["Qwen2ForCausalLM"], hidden_size=896, intermediate_size=4864, num_hidden_layers=24,
                num_attention_heads=14, num_key_value_heads=2, vocab_size=151936, max_position_embeddings=32768,
                rope_theta=1000000.0, use_sliding_window=False, sliding_window=32768, max_window_layers=21,
                rope_scaling=dict(type="yarn", factor=4.0, original_max_position_embeddings=32768))
    config = ModelConfig.from_dict(qwen)
    assert config.sliding_window is None and config.rope_scaling["rope_type"] == "yarn"
    assert config.max_context == 131072  # YaRN's stretched context, as vLLM derives it
    assert ModelConfig.from_dict(phi).max_context == 131072
