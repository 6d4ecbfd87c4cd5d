"""Quantised linears on batches (16+ rows): the per-call paths and `--quantization-batch-cache`'s bf16 copy,
each against the float32 reference `GroupedIntWeight.dequantize()`, and what the copy costs in weight bytes."""

from __future__ import annotations

import pytest
import torch

from test_generate_cli import run_cli
from test_parity import make_prompts, reference_logits
from test_quant_kernels import make_layer, random_grouped
from test_quantization import bf16_runner, dequantised_reference, run_greedy

from llmctl.engine import LLM
from llmctl.engine.errors import EngineArgsError
from llmctl.engine.kernels import cpu_kernels_for
from llmctl.engine.kernels.quant import load_quant_kernels
from llmctl.engine.layers.linear import LinearBase
from llmctl.engine.layers.quantization.grouped import NATIVE_MAX_ROWS, add_batch_weights, gemv_max_rows

LAYOUTS = [  # shape, bits, group, asymmetric, permuted: the native layout's weights (bf16 activations)
    ((32, 64), 8, 64, False, True),    # int8 per row, act-order
    ((48, 128), 4, 32, True, True),    # int4 g32 asymmetric, act-order
    ((40, 256), 8, 32, False, False),  # GGUF Q8_0
    ((16, 576), 4, 576, False, True),  # GPTQ group_size -1, act-order
]
pytestmark = pytest.mark.skipif(load_quant_kernels() is None, reason="the native quant kernels do not build here")


KERNELS = cpu_kernels_for(torch.device("cpu"), torch.bfloat16)
AMX = [KERNELS] if KERNELS is not None and KERNELS.has_amx else []  # the copy in AMX tiles, else oneDNN's


@pytest.mark.parametrize("kernels", [None, *AMX])
@pytest.mark.parametrize("shape, bits, group, asymmetric, permuted", LAYOUTS)
def test_batch_weight_is_the_weight_the_layer_computes_with(shape, bits, group, asymmetric, permuted, kernels):
    weight = random_grouped(*shape, bits, group, asymmetric=asymmetric, permuted=permuted)
    layer, chosen = make_layer(weight, bias=True)
    assert chosen == "native"
    x = torch.randn(NATIVE_MAX_ROWS + 5, shape[1]).bfloat16()  # per call: the AMX GEMM (AMX CPUs), else `_native_product`
    expected = x.float() @ weight.dequantize().T + layer.bias.float()
    one_by_one = torch.cat([layer(row[None]) for row in x]).float()  # the quantised kernels (one row)
    per_call = layer(x).float()
    assert add_batch_weights(layer, kernels) >= 2 * shape[0] * shape[1]
    assert layer.batch_kernels is kernels
    cached = layer(x).float()
    assert getattr(layer, "batch_weight", None) is not None
    scale = expected.abs().max().item()
    for got in (one_by_one, per_call, cached):
        assert (got - expected).abs().max().item() <= 2e-2 * scale
    # the copy holds the layer's own weights: a batch row is a one-row product up to bf16 rounding of the sum
    assert (cached - one_by_one).abs().max().item() <= 1e-2 * scale
    # below BATCH_MIN_ROWS the quantised kernels still run (they stream a quarter to half the bytes)
    assert torch.equal(layer(x[:3]), torch.cat([layer(row[None]) for row in x[:3]]))


def test_batch_cache_costs_two_bytes_a_weight_in_the_reported_weight_bytes(tiny_models):
    plain = bf16_runner(tiny_models, quantization="int4-g32")
    cached = bf16_runner(tiny_models, quantization="int4-g32", quantization_batch_cache=True)
    linears = [m for m in cached.model.modules() if isinstance(m, LinearBase)]
    assert linears and all(m.batch_weight is not None for m in linears)
    copies = sum(m.batch_weight.numel() * m.batch_weight.element_size() for m in linears)
    assert copies >= sum(2 * m.in_features * m.out_features for m in linears)  # AMX tiles pad N to 64, K to 32
    assert cached.weight_bytes == plain.weight_bytes + copies


def test_bfloat16_with_the_batch_cache_tracks_the_dequantised_reference(tiny_models):
    folder = tiny_models["qwen2"]  # tied lm_head, q/k/v biases
    llm = LLM(str(folder), skip_tokenizer_init=True, dtype="bfloat16", device="cpu", quantization="int8",
              max_model_len=400, quantization_batch_cache=True)
    reference = dequantised_reference(folder, torch.bfloat16, "int8")
    for prompt, tokens, ours in run_greedy(llm, make_prompts(512)[:4]):  # prefill rows run the bf16 copy
        expected = reference_logits(reference, prompt, tokens)
        assert (ours.float() - expected).abs().max().item() < 0.05 * expected.abs().max().item() + 0.05


def test_batch_cache_without_quantised_linears_is_refused(tiny_models):
    with pytest.raises(EngineArgsError, match="--quantization-batch-cache needs quantised linears"):
        bf16_runner(tiny_models, quantization_batch_cache=True)


def test_generate_takes_the_batch_cache_flag(tiny_chat_model):
    proc = run_cli("generate", "hi", "-m", str(tiny_chat_model), "--quantization", "int8",
                   "--quantization-batch-cache", "--max-tokens", "3", "--json", "--dtype", "bfloat16")
    assert proc.returncode == 0, proc.stderr
    proc = run_cli("generate", "hi", "-m", str(tiny_chat_model), "--quantization-batch-cache", "--max-tokens", "3",
                   "--json", "--dtype", "bfloat16")
    assert proc.returncode == 2 and "--quantization-batch-cache needs quantised linears" in proc.stderr


QUANT = load_quant_kernels()


def int8_batches_run_the_gemv_arithmetic() -> bool:
    """Whether every row count up to 64 runs per-channel int8 on the GEMV's arithmetic here: AMX-INT8 tiles, or
    without AMX and AVX512-BF16 the AVX-512 GEMV (`_native_product`)."""
    if AMX:
        return True
    return QUANT is not None and not QUANT.has_bf16_gemm and gemv_max_rows(QUANT, 8) > 64


@pytest.mark.skipif(not int8_batches_run_the_gemv_arithmetic(),
                    reason="int8's batches run the GEMV's arithmetic only on AMX-INT8 tiles or the AVX-512 GEMV "
                           "without AVX512-BF16 (with it, the dequantising bf16 GEMM runs them)")
def test_int8_outputs_do_not_depend_on_the_batch(tiny_models):
    """Per-channel int8 runs the GEMV's arithmetic at every row count below INT8_TILE_MAX_ROWS (the GEMV, or
    AMX-INT8 bitwise it; without AMX the AVX-512 GEMV up to `gemv_max_rows`), so a request's logits are the same
    alone and in a batch of 20 (decode steps of 20 rows, one prefill step of 61 rows)."""
    llm = LLM(str(tiny_models["llama"]), skip_tokenizer_init=True, dtype="bfloat16", device="cpu",
              quantization="int8", max_model_len=64, enable_prefix_caching=False)
    generator = torch.Generator().manual_seed(5)
    prompts = [torch.randint(0, 512, (2 + i % 3,), generator=generator).tolist() for i in range(20)]
    together = run_greedy(llm, prompts)
    for prompt, (_, tokens, logits) in zip(prompts, together):
        [(_, alone_tokens, alone_logits)] = run_greedy(llm, [prompt])
        assert alone_tokens == tokens
        assert torch.equal(alone_logits, logits)
