"""Mixture-of-experts models (Mixtral, Qwen2-MoE with its shared expert and a dense layer, Qwen3-MoE): tiny random
checkpoints written by transformers give transformers' greedy tokens and logits (float32) through a mixed batch
with chunked prefill; the router's normalisations, the per-expert checkpoint names (fused and per-expert forms),
the refusals, and the batch-1 step staying in Python (the native decode stack has no experts). Quantised experts:
test_moe_quantized.py; tensor parallel: test_moe_parallel.py; GGUF files: test_moe_gguf.py."""

from __future__ import annotations

import json

import pytest
import torch

from test_parity import LogitRecorder, reference_logits

from llmctl.engine import LLM, SamplingParams
from llmctl.engine.errors import EngineArgsError, ModelLoadError
from llmctl.engine.layers.fused_moe import ExpertNames
from llmctl.engine.layers.fused_moe.router import select_experts
from llmctl.engine.layers.fused_moe.torch_impl import fused_experts_torch

TINY = dict(hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
            vocab_size=256, max_position_embeddings=512, initializer_range=0.2, tie_word_embeddings=False,
            bos_token_id=None, eos_token_id=None)  # no EOS: min_new_tokens would mask it in the reference
MOE_CONFIGS = {
    "mixtral": ("MixtralConfig", dict(num_local_experts=6, num_experts_per_tok=2)),
    # layer 1 dense (mlp_only_layers); norm_topk_prob off: the top-k softmax weights as they are
    "qwen2_moe": ("Qwen2MoeConfig", dict(num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32,
                                         shared_expert_intermediate_size=48, mlp_only_layers=[1],
                                         norm_topk_prob=False, head_dim=32)),  # 32: the native decode kernel's
    "qwen3_moe": ("Qwen3MoeConfig", dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
                                         norm_topk_prob=True, head_dim=16)),
}
NEW_TOKENS = 10


@pytest.fixture(scope="module")
def moe_models(tmp_path_factory):
    import transformers

    root = tmp_path_factory.mktemp("tiny-moe")
    folders = {}
    for seed, (arch, (config_name, extra)) in enumerate(MOE_CONFIGS.items()):
        config = getattr(transformers, config_name)(**TINY, **extra)
        torch.manual_seed(seed)
        transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32).save_pretrained(root / arch)
        folders[arch] = root / arch
    return folders


@pytest.mark.parametrize("arch", list(MOE_CONFIGS))
def test_greedy_tokens_and_logits_match_transformers(moe_models, arch):
    from transformers import AutoModelForCausalLM

    llm = LLM(str(moe_models[arch]), skip_tokenizer_init=True, dtype="float32", device="cpu",
              max_num_batched_tokens=32, max_num_seqs=4, max_model_len=256)
    generator = torch.Generator().manual_seed(7)
    prompts = [torch.randint(0, 256, (length,), generator=generator).tolist() for length in (1, 11, 45)]
    recorders = [LogitRecorder() for _ in prompts]
    params = [SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, ignore_eos=True, logits_processors=[rec])
              for rec in recorders]
    outputs = llm.generate(prompts, params)
    reference = AutoModelForCausalLM.from_pretrained(moe_models[arch], dtype=torch.float32).eval()
    for prompt, out, rec in zip(prompts, outputs, recorders):
        tokens = out.outputs[0].token_ids
        with torch.no_grad():
            expected = reference.generate(torch.tensor([prompt]), max_new_tokens=NEW_TOKENS,
                                          min_new_tokens=NEW_TOKENS, do_sample=False)[0, len(prompt):]
        diff = (torch.stack(rec.rows) - reference_logits(reference, prompt, tokens)).abs().max().item()
        assert tokens == expected.tolist(), f"{arch}: a {len(prompt)}-token prompt diverged (logit diff {diff})"
        diff = (torch.stack(rec.rows) - reference_logits(reference, prompt, tokens)).abs().max().item()
        assert diff < 1e-3, f"{arch}: max |logit diff| {diff} for a {len(prompt)}-token prompt"


def test_model_tree_follows_the_config(moe_models):
    """Qwen2-MoE: layer 0 sparse with a shared expert, layer 1 (mlp_only_layers) a dense MLP; batch-1 decode runs
    `forward` (no native decode step for experts)."""
    llm = LLM(str(moe_models["qwen2_moe"]), skip_tokenizer_init=True, dtype="bfloat16", device="cpu",
              max_model_len=128)
    runner = llm.engine.executor.runner
    layers = runner.model.model.layers
    assert tuple(layers[0].mlp.experts.w13_weight.shape) == (8, 64, 64)
    assert tuple(layers[0].mlp.experts.w2_weight.shape) == (8, 64, 32)
    assert layers[0].mlp.shared_expert.size == 48
    assert not hasattr(layers[1].mlp, "experts") and layers[1].mlp.size == 96
    assert runner.native_decode is None
    out = llm.generate([[5, 6, 7]], SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True))[0]
    assert len(out.outputs[0].token_ids) == 3


@pytest.mark.parametrize("renormalize", [True, False])
def test_router_is_softmax_top_k_with_optional_renormalisation(renormalize):
    logits = torch.randn(5, 8, generator=torch.Generator().manual_seed(0))
    weights, ids = select_experts(logits, 3, renormalize, torch.float32)
    probabilities = torch.softmax(logits, dim=-1)
    assert torch.equal(ids, probabilities.topk(3, dim=-1).indices)
    if renormalize:  # = a softmax over the top-k logits (Mixtral's definition)
        expected = torch.softmax(logits.gather(1, ids), dim=-1)
    else:
        expected = probabilities.gather(1, ids)
    torch.testing.assert_close(weights, expected)


def test_torch_experts_match_a_per_token_loop():
    generator = torch.Generator().manual_seed(1)
    experts, hidden, inter, tokens, top_k = 5, 16, 24, 11, 2
    x = torch.randn(tokens, hidden, generator=generator)
    w13 = torch.randn(experts, 2 * inter, hidden, generator=generator) * 0.2
    w2 = torch.randn(experts, hidden, inter, generator=generator) * 0.2
    weights, ids = select_experts(torch.randn(tokens, experts, generator=generator), top_k, True, torch.float32)

    def silu_and_mul(gate_up):
        return torch.nn.functional.silu(gate_up[:, :inter]) * gate_up[:, inter:]

    expected = torch.stack([sum(weights[t, j] * w2[ids[t, j]] @ silu_and_mul((w13[ids[t, j]] @ x[t])[None])[0]
                                for j in range(top_k)) for t in range(tokens)])
    torch.testing.assert_close(fused_experts_torch(x, w13, w2, weights, ids, silu_and_mul), expected)


def test_expert_checkpoint_names_round_trip():
    mixtral = ExpertNames("block_sparse_moe", "w1", "w3", "w2")
    assert mixtral.target("model.layers.3.block_sparse_moe.experts.5.w3.weight") == \
        ("model.layers.3.mlp.experts.w13_weight", (5, 1))
    assert mixtral.target("model.layers.3.block_sparse_moe.experts.5.w2.weight") == \
        ("model.layers.3.mlp.experts.w2_weight", 5)
    assert mixtral.target("model.layers.3.block_sparse_moe.gate.weight") == ("model.layers.3.mlp.gate.weight", None)
    assert mixtral.target("model.layers.3.self_attn.q_proj.weight") is None
    for name in ("model.layers.0.block_sparse_moe.experts.2.w1.weight", "model.layers.0.block_sparse_moe.gate.weight",
                 "model.layers.0.block_sparse_moe.experts.7.w2.weight"):
        assert mixtral.checkpoint_name(*mixtral.target(name)) == name
    per_expert = ExpertNames("block_sparse_moe", "w1", "w3", "w2", per_expert=True)  # quantised: a linear each
    assert per_expert.target("model.layers.3.block_sparse_moe.experts.5.w3.weight") == \
        ("model.layers.3.mlp.experts.w13.5.weight", 1)
    assert per_expert.target("model.layers.3.block_sparse_moe.experts.5.w2.qweight_type") == \
        ("model.layers.3.mlp.experts.w2.5.qweight_type", None)
    assert mixtral.target("model.layers.3.block_sparse_moe.experts.5.w2.qweight") is None  # fused: weights only
    for name in ("model.layers.0.block_sparse_moe.experts.2.w1.qweight", "model.layers.0.block_sparse_moe.gate.weight",
                 "model.layers.0.block_sparse_moe.experts.7.w2.weight"):
        assert per_expert.checkpoint_name(*per_expert.target(name)) == name
    qwen = ExpertNames("mlp", "gate_proj", "up_proj", "down_proj")
    assert qwen.target("model.layers.0.mlp.shared_expert.gate_proj.weight") is None
    assert qwen.target("model.layers.0.mlp.shared_expert_gate.weight") is None
    assert qwen.target("model.layers.0.mlp.gate_proj.weight") is None  # a dense layer's


def test_missing_expert_tensor_is_named(moe_models, tmp_path):
    from safetensors.torch import load_file, save_file

    folder = tmp_path / "mixtral"
    folder.mkdir()
    (folder / "config.json").write_text((moe_models["mixtral"] / "config.json").read_text())
    state = load_file(moe_models["mixtral"] / "model.safetensors")
    del state["model.layers.1.block_sparse_moe.experts.4.w3.weight"]
    save_file(state, folder / "model.safetensors")
    with pytest.raises(ModelLoadError, match=r"missing tensor 'model\.layers\.1\.block_sparse_moe\.experts\.4\.w3"):
        LLM(str(folder), skip_tokenizer_init=True, dtype="float32", device="cpu", max_model_len=64)


def test_unsupported_quantisations_are_refused(moe_models):
    with pytest.raises(EngineArgsError, match="--quantization fp8 is not supported for mixture-of-experts"):
        LLM(str(moe_models["qwen3_moe"]), skip_tokenizer_init=True, dtype="bfloat16", device="cpu",
            max_model_len=64, quantization="fp8")
    raw = json.loads((moe_models["qwen3_moe"] / "config.json").read_text())
    raw["quantization_config"] = {"quant_method": "gptq", "bits": 4, "group_size": 128}
    from llmctl.engine.model_config import ModelConfig

    with pytest.raises(ModelLoadError, match="pre-quantised .gptq. mixture-of-experts checkpoints are not supported"):
        ModelConfig.from_dict(raw)


def test_a_gguf_architecture_without_expert_support_is_refused(tmp_path):
    import gguf

    path = tmp_path / "qwen2-experts.gguf"
    writer = gguf.GGUFWriter(str(path), "qwen2")
    writer.add_uint32("qwen2.expert_count", 8)
    writer.add_uint32("qwen2.expert_used_count", 2)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.close()
    with pytest.raises(ModelLoadError, match="GGUF architecture 'qwen2' with experts is not supported"):
        LLM(str(path), device="cpu")
