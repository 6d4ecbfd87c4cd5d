"""Quantised linears on CUDA (engine/layers/quantization/cuda.py, fp8.py). On CPU: tinygemm's CUDA nibble order and
k-tiling rules, the fp8 quantiser and matmul through torch's real `_scaled_mm` (CPU has one), and fp8 refused
off CUDA. On a GPU (scripts/gpu_check.sh; skipped here): int8/int4 on the CUDA kernels and fp8 on the fp8
tensor cores, each against the dequantised reference."""

from __future__ import annotations

import gc
import json

import pytest
import torch
from test_generate_cli import run_cli
from test_parity import make_prompts, reference_logits
from test_quantization import dequantised_reference, run_greedy

from llmctl.engine import LLM, SamplingParams
from llmctl.engine.errors import EngineArgsError
from llmctl.engine.layers.linear import LinearBase
from llmctl.engine.layers.quantization.grouped import GroupedIntWeight
from llmctl.engine.layers.quantization.cuda import (inner_k_tiles, int4_cuda_fits, pack_int4_tinygemm,
                                                    unpack_int4_tinygemm)
from llmctl.engine.layers.quantization.fp8 import FP8_MAX, dequantize_fp8, fp8_linear, quantize_fp8, rowwise_fp8_runs

needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


# ---- CPU: packing rules and the fp8 arithmetic ----------------------------------------------------------
def test_tinygemm_packing_puts_even_inputs_in_the_high_nibble_and_round_trips():
    codes = torch.randint(0, 16, (24, 64), dtype=torch.uint8, generator=torch.Generator().manual_seed(0))
    packed = pack_int4_tinygemm(codes)
    assert packed.shape == (24, 32) and packed.dtype is torch.uint8
    assert packed[3, 5].item() == (codes[3, 10].item() << 4) | codes[3, 11].item()
    assert torch.equal(unpack_int4_tinygemm(packed), codes)


def test_inner_k_tiles_and_which_weights_fit_tinygemm():
    assert [inner_k_tiles(k) for k in (1024, 256, 128, 64, 96, 32, 48, 40)] == [8, 8, 8, 4, 2, 2, None, None]

    def weight(out_features, in_features, bits=4, group=32):
        return GroupedIntWeight.quantize(torch.randn(out_features, in_features), bits, group)

    assert int4_cuda_fits(weight(64, 128)) and int4_cuda_fits(weight(8, 32))
    assert not int4_cuda_fits(weight(12, 128))  # outputs not a multiple of 8
    assert not int4_cuda_fits(weight(64, 48, group=16))  # group 16 and 48 inputs: no tinygemm tiling
    assert not int4_cuda_fits(weight(64, 128, bits=8, group=128))


@pytest.mark.parametrize("per_channel", [True, False])
def test_fp8_quantiser_maps_the_largest_magnitude_to_448_within_e4m3_precision(per_channel):
    weight = torch.randn(48, 64, generator=torch.Generator().manual_seed(1)) * torch.linspace(0.01, 3, 48)[:, None]
    codes, scale = quantize_fp8(weight, per_channel)
    assert codes.dtype is torch.float8_e4m3fn and scale.dtype is torch.float32
    assert scale.shape == ((48, 1) if per_channel else ())
    largest = codes.float().abs().amax(dim=1) if per_channel else codes.float().abs().amax()
    assert torch.all(largest == FP8_MAX)
    back = dequantize_fp8(codes, scale)
    # e4m3 keeps 3 mantissa bits: relative error at most 2^-4 for normal values
    bound = (weight.abs() * 2**-4 + scale * 2**-9)  # plus half the smallest subnormal step near zero
    assert torch.all((back - weight).abs() <= bound)
    if per_channel:  # per-channel scales follow each row, so small rows keep their precision
        small_row = (back[0] - weight[0]).abs().max() / weight[0].abs().max()
        assert small_row < 2**-4


@pytest.mark.parametrize("per_channel", [True, False])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_fp8_linear_is_scaled_mm_of_the_quantised_operands(per_channel, dtype):
    if dtype is torch.float32 and per_channel:
        pytest.skip("row-wise scales: bfloat16 output only, as on CUDA")
    if per_channel and not rowwise_fp8_runs(torch.device("cpu"), dtype):  # torch 2.11's CPU: per tensor only
        pytest.skip(f"this torch's CPU _scaled_mm takes per-tensor scales only (torch {torch.__version__})")
    gen = torch.Generator().manual_seed(2)
    weight, bias = torch.randn(48, 64, generator=gen), torch.randn(48, generator=gen).to(dtype)
    x = torch.randn(5, 64, generator=gen).to(dtype)
    codes, scale = quantize_fp8(weight, per_channel)
    out = fp8_linear(x, codes, scale, per_channel, bias)
    x_codes, x_scale = quantize_fp8(x, per_channel)
    expected = dequantize_fp8(x_codes, x_scale) @ dequantize_fp8(codes, scale).t() + bias.float()
    assert out.dtype is dtype and out.shape == (5, 48)
    assert (out.float() - expected).abs().max() < 0.02 * expected.abs().max()
    unquantised = x.float() @ weight.t() + bias.float()
    assert (out.float() - unquantised).abs().max() < 0.1 * unquantised.abs().max()


def test_fp8_is_refused_on_cpu(tiny_models):
    with pytest.raises(EngineArgsError, match="--quantization fp8 needs a CUDA GPU with fp8 tensor cores"):
        LLM(str(tiny_models["llama"]), skip_tokenizer_init=True, device="cpu", dtype="bfloat16", max_model_len=64,
            num_kv_blocks=8, quantization="fp8")


def test_generate_refuses_fp8_on_cpu_in_one_line(tiny_chat_model):
    proc = run_cli("generate", "hi", "-m", str(tiny_chat_model), "--device", "cpu", "--quantization", "fp8",
                   "--max-tokens", "2")
    assert proc.returncode == 2
    lines = [line for line in proc.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and "needs a CUDA GPU" in lines[0] and "int8 or int4" in lines[0]


# ---- CUDA -----------------------------------------------------------------------------------------------
@pytest.fixture
def release_gpu():
    yield
    gc.collect()
    torch.cuda.empty_cache()


def cuda_llm(folder, quantization: str) -> LLM:
    return LLM(str(folder), skip_tokenizer_init=True, dtype="bfloat16", device="cuda", quantization=quantization,
               max_model_len=400, num_kv_blocks=64)


def layouts(llm: LLM) -> set[str]:
    model = llm.engine.executor.runner.model
    return {getattr(m, "quant_layout", None) for m in model.modules() if isinstance(m, LinearBase)}


@pytest.mark.parametrize("quantization, layout", [("int4-g32", "int4pack-cuda"), ("int4-g64-asym", "int4pack-cuda"),
                                                  ("int8", None)])
@pytest.mark.usefixtures("release_gpu")
@pytest.mark.cuda
@needs_cuda
def test_int8_and_int4_on_cuda_track_the_dequantised_reference(tiny_models, quantization, layout):
    folder = tiny_models["qwen2"]  # tied lm_head, q/k/v biases
    llm = cuda_llm(folder, quantization)
    installed = layouts(llm)
    if layout is None:  # int8: torch's CUDA kernel where this build has one, else dequantised per call
        assert installed <= {"int8pack-cuda", "dequant"} and len(installed) == 1, installed
    else:
        assert installed == {layout}, installed  # tinygemm on sm_80+
    reference = dequantised_reference(folder, torch.bfloat16, quantization)
    for prompt, tokens, ours in run_greedy(llm, make_prompts(512)[:4]):
        expected = reference_logits(reference, prompt, tokens)
        scale = expected.abs().max().item()
        assert (ours.float().cpu() - expected).abs().max().item() < 0.05 * scale + 0.05


@pytest.mark.usefixtures("release_gpu")
@pytest.mark.cuda
@needs_cuda
def test_fp8_on_cuda_runs_each_linear_as_its_reference(tiny_models):
    if torch.cuda.get_device_capability() < (8, 9):
        with pytest.raises(EngineArgsError, match="compute capability 8.9"):
            cuda_llm(tiny_models["llama"], "fp8")
        return
    llm = cuda_llm(tiny_models["llama"], "fp8")
    full = cuda_llm(tiny_models["llama"], None)
    assert llm.engine.model_info.weight_bytes < 0.7 * full.engine.model_info.weight_bytes
    linears = [m for m in llm.engine.executor.runner.model.modules() if isinstance(m, LinearBase)]
    assert linears and all(m.weight.dtype is torch.float8_e4m3fn for m in linears)
    for layer in linears:
        x = torch.randn(3, layer.in_features, device="cuda", dtype=torch.bfloat16)
        per_channel = layer.weight_scale.dim() == 2
        x_codes, x_scale = quantize_fp8(x, per_channel)
        expected = dequantize_fp8(x_codes, x_scale) @ dequantize_fp8(layer.weight, layer.weight_scale).t()
        if layer.bias is not None:
            expected = expected + layer.bias.float()
        out = layer(x)
        assert (out.float() - expected).abs().max() < 0.02 * expected.abs().max() + 1e-3
    (output,) = llm.generate([[1, 2, 3, 4]], SamplingParams(max_tokens=4, ignore_eos=True))
    assert len(output.outputs[0].token_ids) == 4


@pytest.mark.usefixtures("release_gpu")
@pytest.mark.cuda
@needs_cuda
def test_generate_json_on_cuda_reports_the_quantised_bytes(tiny_chat_model):
    rows = {}
    for quantization in ("", "int4-g32"):
        extra = ("--quantization", quantization) if quantization else ()
        proc = run_cli("generate", "ROMEO:", "-m", str(tiny_chat_model), "--device", "cuda", "--dtype", "bfloat16",
                       "--max-tokens", "3", "--max-model-len", "256", "--num-kv-blocks", "16", "--json", *extra)
        assert proc.returncode == 0, proc.stderr
        rows[quantization] = json.loads(proc.stdout.splitlines()[-1])
    assert rows["int4-g32"]["quantization"] == "int4-g32" and rows["int4-g32"]["completion_tokens"] == 3
    # Every linear (the lm_head too) goes from 2 bytes a weight to tinygemm's 4 bits plus its group of 32's
    # bfloat16 scale and offset; the embedding and norms stay bfloat16 (on this tiny model they are about half).
    saved = rows[""]["weight_bytes"] - rows["int4-g32"]["weight_bytes"]
    assert saved == _linear_weights(tiny_chat_model) * (2 - 0.5 - 2 * 2 / 32)
    assert rows["int4-g32"]["kv_cache_bytes"] == rows[""]["kv_cache_bytes"]


def _linear_weights(folder) -> int:
    """How many weights the decoder's linears and the (untied) lm_head hold, from config.json."""
    config = json.loads((folder / "config.json").read_text())
    hidden, layers = config["hidden_size"], config["num_hidden_layers"]
    head_dim = hidden // config["num_attention_heads"]
    q, kv = config["num_attention_heads"] * head_dim, config["num_key_value_heads"] * head_dim
    per_layer = hidden * (q + 2 * kv) + q * hidden + 3 * hidden * config["intermediate_size"]
    lm_head = 0 if config.get("tie_word_embeddings") else config["vocab_size"] * hidden
    return layers * per_layer + lm_head
