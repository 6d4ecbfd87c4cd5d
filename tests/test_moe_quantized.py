"""`--quantization int8 / int4-g32` on mixture-of-experts models: every expert's gate/up and down projections
quantised on load as one linear each (stored packed per expert), the router and Qwen2-MoE's shared-expert gate
kept whole. Greedy tokens and logits match transformers' model holding the dequantised weights (float32), bf16
tracks it, and a batch-1 step runs (so reads) only the chosen experts' linears."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from test_moe import moe_models  # noqa: F401 - the tiny checkpoints fixture
from test_parity import make_prompts, reference_logits
from test_quantization import assert_matches_reference, dequantised, run_greedy

from llmctl.engine import LLM, SamplingParams
from llmctl.engine.layers.fused_moe import FusedMoE
from llmctl.engine.layers.linear import LinearBase

VOCAB = 256


def dequantised_moe_reference(folder, weight_dtype: torch.dtype, quantization: str):
    """transformers' float32 model whose linears and experts (each expert's [gate | up] rows and down
    projection on their own) hold the dequantised weights; routers and the shared-expert gate stay as loaded."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    for name, module in model.named_modules():
        if isinstance(module, nn.Linear) and not name.endswith(("shared_expert_gate", ".gate")):
            module.weight = nn.Parameter(dequantised(module.weight.data.to(weight_dtype), quantization),
                                         requires_grad=False)
        for fused in ("gate_up_proj", "down_proj"):  # transformers' fused experts, [experts, out, in]
            param = getattr(module, fused, None) if name.endswith("experts") else None
            if isinstance(param, nn.Parameter) and param.dim() == 3:
                experts = [dequantised(w.to(weight_dtype), quantization) for w in param.data]
                setattr(module, fused, nn.Parameter(torch.stack(experts), requires_grad=False))
    return model


def moe_llm(folder, dtype: str, quantization: str) -> LLM:
    return LLM(str(folder), skip_tokenizer_init=True, dtype=dtype, device="cpu", quantization=quantization,
               max_model_len=400, max_num_batched_tokens=96)


@pytest.mark.parametrize("arch, quantization", [("mixtral", "int4-g32"), ("qwen2_moe", "int8"),
                                                ("qwen3_moe", "int4-g32")])
def test_float32_matches_the_dequantised_reference(moe_models, arch, quantization):
    from transformers import AutoModelForCausalLM

    folder = moe_models[arch]
    llm = moe_llm(folder, "float32", quantization)
    experts = [m for m in llm.engine.executor.runner.model.modules() if isinstance(m, FusedMoE)]
    assert experts and all(m.per_expert and not hasattr(m, "w13_weight") for m in experts)
    reference = dequantised_moe_reference(folder, torch.float32, quantization)
    unquantised = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    assert_matches_reference(llm, reference, unquantised, make_prompts(VOCAB)[1:4:2], tolerance=1e-3)


def test_bfloat16_tracks_the_dequantised_reference(moe_models):
    folder = moe_models["qwen3_moe"]
    llm = moe_llm(folder, "bfloat16", "int4-g32")
    reference = dequantised_moe_reference(folder, torch.bfloat16, "int4-g32")
    for prompt, tokens, ours in run_greedy(llm, make_prompts(VOCAB)[1:4:2]):
        expected = reference_logits(reference, prompt, tokens)
        scale = expected.abs().max().item()
        assert (ours.float() - expected).abs().max().item() < 0.05 * scale + 0.05


def test_experts_are_stored_packed_and_only_the_chosen_ones_run(moe_models):
    """int4-g32: each expert's linears hold half a byte a weight (uint8 codes); a one-token step runs top_k of
    the experts' linears per layer, so it streams top_k / experts of the experts' bytes."""
    llm = moe_llm(moe_models["qwen3_moe"], "bfloat16", "int4-g32")
    moe = [m for m in llm.engine.executor.runner.model.modules() if isinstance(m, FusedMoE)]
    calls: list[tuple[int, str, int]] = []
    for layer, block in enumerate(moe):
        for kind in ("w13", "w2"):
            for expert, linear in enumerate(getattr(block, kind)):
                assert isinstance(linear, LinearBase) and linear.weight.dtype is torch.uint8
                assert linear.weight.numel() * 2 <= linear.in_features * linear.out_features * 1.5  # padded rows
                linear.register_forward_hook(lambda *_, key=(layer, kind, expert): calls.append(key))
    steps = 4
    llm.generate([[7]], SamplingParams(temperature=0.0, max_tokens=steps, ignore_eos=True))
    top_k, experts = moe[0].top_k, moe[0].num_experts
    assert top_k < experts
    assert len(calls) == steps * len(moe) * 2 * top_k  # every step: top_k experts' two linears in every layer
    per_step = [calls[i:i + 2 * top_k] for i in range(0, len(calls), 2 * top_k)]
    assert all(len({expert for _, _, expert in step}) == top_k for step in per_step)
