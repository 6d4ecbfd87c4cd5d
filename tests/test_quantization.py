"""Quantisation: pre-quantised checkpoints (config.json's quantization_config) are refused by name, and
`--quantization int8` quantises a full-precision checkpoint on load, matching a plain-torch (transformers)
model that runs the same dequantised weights."""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from torch import nn

from test_generate_cli import run_cli
from test_parity import LogitRecorder, make_prompts, reference_logits

from llmctl.engine import LLM, SamplingParams
from llmctl.engine.errors import EngineArgsError, ModelLoadError
from llmctl.engine.kernels.quant import load_quant_kernels
from llmctl.engine.layers.linear import AMXLinearMethod, LinearBase, OneDNNLinearMethod, UnquantizedLinearMethod
from llmctl.engine.layers.quantization.grouped import GroupedIntWeight
from llmctl.engine.layers.quantization.on_the_fly import ON_THE_FLY_SCHEMES

NEW_TOKENS = 12
QUANT_CONFIGS = {  # GPTQ, AWQ and compressed-tensors load (their own tests hold their refusals)
    "mystery-quant": {"quant_method": "mystery-quant"},
    "bitsandbytes": {"quant_method": "bitsandbytes", "load_in_4bit": True},
    "unnamed": {"bits": 8},
}


def with_quantization_config(source, folder, quant_config):
    shutil.copytree(source, folder)
    config = json.loads((folder / "config.json").read_text())
    config["quantization_config"] = quant_config
    (folder / "config.json").write_text(json.dumps(config))
    return folder


@pytest.mark.parametrize("method", sorted(QUANT_CONFIGS))
def test_pre_quantised_checkpoint_is_refused_by_name(tiny_models, tmp_path, method):
    folder = with_quantization_config(tiny_models["llama"], tmp_path / "q", QUANT_CONFIGS[method])
    with pytest.raises(ModelLoadError) as info:
        LLM(str(folder), skip_tokenizer_init=True, device="cpu", max_model_len=64, num_kv_blocks=8)
    message = str(info.value)
    assert f"quant_method {method!r} is not supported" in message and "--quantization (int8, int4" in message
    assert "\n" not in message


@pytest.mark.parametrize("method", ["mystery-quant"])
def test_generate_refuses_a_pre_quantised_checkpoint_in_one_line(tiny_chat_model, tmp_path, method):
    folder = with_quantization_config(tiny_chat_model, tmp_path / "q", QUANT_CONFIGS[method])
    proc = run_cli("generate", "hi", "-m", str(folder), "--max-tokens", "2")
    assert proc.returncode == 2
    error_lines = [line for line in proc.stderr.splitlines() if line.strip()]
    assert len(error_lines) == 1 and f"quant_method {method!r} is not supported" in error_lines[0]


def test_unknown_quantization_is_refused():
    with pytest.raises(EngineArgsError, match="quantization must be one of int8, int4, .*, got 'marlin'"):
        LLM(quantization="marlin")
    with pytest.raises(EngineArgsError, match="--quantization gptq names a pre-quantised format, but the checkpoint "
                                              "is not pre-quantised"):
        LLM(quantization="gptq")


@pytest.mark.parametrize("how", ["flag", "env"])
def test_generate_refuses_an_unknown_quantization(tiny_chat_model, how):
    args = ("generate", "hi", "-m", str(tiny_chat_model), "--max-tokens", "2")
    if how == "flag":
        proc = run_cli(*args, "--quantization", "int3")
    else:
        proc = run_cli(*args, env_extra={"LLMCTL_QUANTIZATION": "int3"})
    assert proc.returncode == 2
    error_lines = [line for line in proc.stderr.splitlines() if line.strip()]
    assert len(error_lines) == 1 and "quantization must be one of int8, int4" in error_lines[0] and "got 'int3'" in error_lines[0]


def test_generate_runs_int8(tiny_chat_model):
    proc = run_cli("generate", "hi", "-m", str(tiny_chat_model), "--quantization", "int8", "--max-tokens", "3",
                   "--json", "--dtype", "bfloat16")
    assert proc.returncode == 0, proc.stderr
    assert json.loads(proc.stdout.splitlines()[-1])


def dequantised(weight: torch.Tensor, quantization: str) -> torch.Tensor:
    bits, group, symmetric = ON_THE_FLY_SCHEMES[quantization]
    return GroupedIntWeight.quantize(weight, bits, group or weight.shape[1], symmetric).dequantize()


def dequantised_reference(folder, weight_dtype: torch.dtype, quantization: str = "int8"):
    """transformers' model in float32 whose decoder linears and lm_head hold the dequantised weights
    (quantised from the checkpoint's weights cast to `weight_dtype`, as the engine loads them)."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    linears = [m for name, m in model.named_modules() if isinstance(m, nn.Linear)]
    assert any(m is model.lm_head for m in linears)
    for linear in linears:
        weight = dequantised(linear.weight.data.to(weight_dtype), quantization)
        linear.weight = nn.Parameter(weight, requires_grad=False)  # a new parameter: unties lm_head
    return model


def run_greedy(llm: LLM, prompts):
    recorders = [LogitRecorder() for _ in prompts]
    params = [SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, ignore_eos=True, logits_processors=[r])
              for r in recorders]
    outputs = llm.generate(prompts, params)
    return [(p, o.outputs[0].token_ids, torch.stack(r.rows)) for p, o, r in zip(prompts, outputs, recorders)]


# llama: untied lm_head; qwen2: tied lm_head, q/k/v biases
@pytest.mark.parametrize("arch, quantization", [("llama", "int8"), ("qwen2", "int8"), ("llama", "int4-g32"),
                                                ("qwen2", "int4-g64"), ("llama", "int4-g32-asym")])
def test_float32_matches_the_dequantised_reference(tiny_models, arch, quantization):
    from transformers import AutoModelForCausalLM

    folder = tiny_models[arch]
    llm = LLM(str(folder), skip_tokenizer_init=True, dtype="float32", device="cpu", quantization=quantization,
              max_model_len=400, max_num_batched_tokens=96)
    reference = dequantised_reference(folder, torch.float32, quantization)
    unquantised = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    assert_matches_reference(llm, reference, unquantised, make_prompts(512)[:5], tolerance=1e-3)


def assert_matches_reference(llm: LLM, reference, unquantised, prompts, tolerance: float) -> None:
    """The engine's greedy tokens are the (dequantised) reference model's, its logits within `tolerance`;
    the reference differs from the `unquantised` model by more than that, or the comparison shows nothing."""
    gap = 0.0
    for prompt, tokens, ours in run_greedy(llm, prompts):
        with torch.no_grad():
            expected_tokens = reference.generate(torch.tensor([prompt]), max_new_tokens=NEW_TOKENS,
                                                 min_new_tokens=NEW_TOKENS, do_sample=False)[0, len(prompt):]
        assert tokens == expected_tokens.tolist()
        expected = reference_logits(reference, prompt, tokens)
        assert (ours - expected).abs().max().item() < tolerance
        gap = max(gap, (reference_logits(unquantised, prompt, tokens) - expected).abs().max().item())
    assert gap > 1e-2, "the quantised reference should differ from full precision, or this test shows nothing"


@pytest.mark.parametrize("quantization", ["int8", "int4-g32", "int4-g64-asym"])
def test_bfloat16_tracks_the_dequantised_reference(tiny_models, quantization):
    folder = tiny_models["qwen2"]
    llm = LLM(str(folder), skip_tokenizer_init=True, dtype="bfloat16", device="cpu", quantization=quantization,
              max_model_len=400)
    reference = dequantised_reference(folder, torch.bfloat16, quantization)
    for prompt, tokens, ours in run_greedy(llm, make_prompts(512)[:4]):
        expected = reference_logits(reference, prompt, tokens)
        scale = expected.abs().max().item()
        assert (ours.float() - expected).abs().max().item() < 0.05 * scale + 0.05


def bf16_runner(tiny_models, **kwargs):
    llm = LLM(str(tiny_models["llama"]), skip_tokenizer_init=True, dtype="bfloat16", device="cpu",
              max_model_len=64, num_kv_blocks=8, **kwargs)
    return llm.engine.executor.runner


def parameter_bytes(runner) -> int:
    """Parameters and buffers (the RoPE tables) once, without the linear methods' packed copies (a bf16 linear
    whose only copy is its AMX tiles counted at its plain size)."""
    tensors = [*runner.model.parameters(), *runner.model.buffers()]
    dropped = [m for m in runner.model.modules() if isinstance(m, LinearBase) and m.weight is None]
    return sum(t.numel() * t.element_size() for t in tensors) + sum(2 * m.in_features * m.out_features for m in dropped)


def test_bf16_weight_bytes_count_every_copy(tiny_models):
    full = bf16_runner(tiny_models)
    linears = [m for m in full.model.modules() if isinstance(m, LinearBase)]
    assert linears
    if isinstance(linears[0].method, AMXLinearMethod):
        # one copy each, the AMX tiles (outputs padded to 64, inputs to 32); a tied lm_head's tiles beside
        # the embedding it shares
        kept = sum(t.numel() * t.element_size() for t in [*full.model.parameters(), *full.model.buffers()])
        tiles = sum(m.amx_tiles.numel() * 2 for m in linears)
        assert all((m.weight is None) != m.weight_shared for m in linears)
        assert full.weight_bytes == kept + tiles
        assert sum(m.amx_tiles.numel() for m in linears) == sum(
            -(-m.out_features // 64) * 64 * -(-m.in_features // 32) * 32 for m in linears)
    elif isinstance(linears[0].method, OneDNNLinearMethod):
        assert all(m.packed is not None for m in linears)
        # the oneDNN method keeps each linear twice: the plain weight (one row) and a packed copy (more rows)
        assert full.weight_bytes == parameter_bytes(full) + sum(2 * m.weight.numel() for m in linears)
    else:  # a CPU whose oneDNN has no bf16 path (no AVX512-BF16 / AVX-NE-CONVERT): F.linear on the weight alone
        assert isinstance(linears[0].method, UnquantizedLinearMethod)
        assert full.weight_bytes == parameter_bytes(full)


def test_fp32_weight_bytes_count_a_packed_copy_at_its_weights_size(tiny_models):
    """The MKL method keeps each fp32 linear twice (the weight, and its pack for one row), and the pack counts at
    the weight's size: MKL's own numel is its reserved buffer (5.5 MiB for a 64 x 64 weight)."""
    llm = LLM(str(tiny_models["llama"]), skip_tokenizer_init=True, dtype="float32", device="cpu", max_model_len=64,
              num_kv_blocks=8)
    runner = llm.engine.executor.runner
    linears = [m for m in runner.model.modules() if isinstance(m, LinearBase)]
    packs = [m for m in linears if getattr(m, "packed", None) is not None]
    assert runner.weight_bytes == parameter_bytes(runner) + sum(m.weight.numel() * 4 for m in packs)


def quantised_linear_bytes(linear) -> int:
    return sum(t.numel() * t.element_size() for t in linear.parameters())


def padded_rows(linear) -> int:
    return -(-linear.out_features // 16) * 16  # the native layout's blocks of 16 output rows


def test_int8_weights_are_stored_quantised(tiny_models):
    full, int8 = bf16_runner(tiny_models), bf16_runner(tiny_models, quantization="int8")
    linears = [m for m in int8.model.modules() if isinstance(m, LinearBase)]
    native = load_quant_kernels() is not None
    assert linears and all(m.quant_layout == ("native" if native else "int8pack") for m in linears)
    for m in linears:  # one byte a weight, one 16-bit scale per output row, no packed copy
        rows = padded_rows(m) if native else m.out_features
        assert m.weight.element_size() == 1 and m.weight.numel() == rows * m.in_features
        assert m.weight_scale.element_size() == 2 and m.weight_scale.numel() == rows
    linear_elements = sum(m.in_features * m.out_features for m in linears)
    stored = sum(quantised_linear_bytes(m) for m in linears)
    assert int8.weight_bytes == parameter_bytes(full) - 2 * linear_elements + stored
    assert int8.weight_bytes < 0.7 * full.weight_bytes  # bf16 held once (AMX) or twice (oneDNN)


def test_int4_weights_are_stored_packed(tiny_models):
    full, int4 = bf16_runner(tiny_models), bf16_runner(tiny_models, quantization="int4-g32")
    linears = [m for m in int4.model.modules() if isinstance(m, LinearBase)]
    native = load_quant_kernels() is not None
    assert linears and all(m.quant_layout == ("native" if native else "int4pack") for m in linears)
    for m in linears:  # half a byte a weight, plus (native) a float16 scale or (int4pack) a bf16 scale and offset
        rows, groups = padded_rows(m) if native else m.out_features, m.in_features // 32
        assert m.weight.dtype is torch.uint8 and m.weight.numel() == rows * m.in_features // 2
        scales = m.weight_scale if native else m.weight_scales_and_zeros
        assert scales.element_size() == 2 and scales.numel() == rows * groups * (1 if native else 2)
    linear_elements = sum(m.in_features * m.out_features for m in linears)
    stored = sum(quantised_linear_bytes(m) for m in linears)
    assert int4.weight_bytes == parameter_bytes(full) - 2 * linear_elements + stored


def test_int4_group_that_does_not_divide_the_inputs_is_refused(tiny_models):
    with pytest.raises(ModelLoadError, match="int4 group size 128 does not divide a linear's 64 inputs"):
        LLM(str(tiny_models["llama"]), skip_tokenizer_init=True, device="cpu", max_model_len=64, num_kv_blocks=8,
            quantization="int4")
