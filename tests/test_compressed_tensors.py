"""compressed-tensors `pack-quantized` checkpoints, packed by the compressed-tensors library itself (the
format llm-compressor writes): loaded by the engine, greedy tokens and logits match transformers running the
weights the library decompresses; the unpacker against the library's packer; unsupported schemes refused."""

from __future__ import annotations

import json

import pytest
import torch
from torch import nn

from test_parity import make_prompts, reference_logits
from test_quantization import NEW_TOKENS, run_greedy

from llmctl.engine import LLM
from llmctl.engine.errors import ModelLoadError
from llmctl.engine.layers.quantization.compressed_tensors import CompressedTensorsConfig, unpack_int32
from llmctl.engine.layers.linear import LinearBase


def quantised_linears(model):
    return [(name, m) for name, m in model.named_modules() if hasattr(m, "weight_scale")]


def compress_with_library(source, folder, *, bits: int, symmetric: bool, strategy: str, group_size=None,
                          ignore=("lm_head",)):
    """Quantise `source`'s linears with compressed_tensors (scales from each group's min/max by its own
    calculate_qparams), pack them with its ModelCompressor and save config.json + model.safetensors.
    Returns transformers' float32 model holding the weights the library decompresses."""
    from compressed_tensors.compressors import ModelCompressor
    from compressed_tensors.quantization import (QuantizationArgs, QuantizationConfig, QuantizationScheme,
                                                 apply_quantization_config)
    from compressed_tensors.quantization.utils import calculate_qparams
    from safetensors.torch import save_file
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(source, dtype=torch.float32).eval()
    args = QuantizationArgs(num_bits=bits, type="int", symmetric=symmetric, strategy=strategy, group_size=group_size)
    config = QuantizationConfig(config_groups={"group_0": QuantizationScheme(targets=["Linear"], weights=args)},
                                ignore=list(ignore), format="pack-quantized")
    apply_quantization_config(model, config)
    for _, module in quantised_linears(model):
        weight = module.weight.data
        groups = weight.view(weight.shape[0], -1, group_size or weight.shape[1])
        scale, zero_point = calculate_qparams(groups.amin(-1), groups.amax(-1), args)
        module.weight_scale.data.copy_(scale)
        if not symmetric:
            module.weight_zero_point.data.copy_(zero_point)
    compressor = ModelCompressor.from_pretrained_model(model, "pack-quantized")
    compressor.compress_model(model)
    folder.mkdir(parents=True)
    tied = {"lm_head.weight"} if model.config.tie_word_embeddings else set()
    tensors = {k: v.contiguous() for k, v in model.state_dict().items() if k not in tied}
    save_file(tensors, str(folder / "model.safetensors"))
    model.config.save_pretrained(folder)
    compressor.update_config(str(folder))
    compressor.decompress_model(model)
    reference = AutoModelForCausalLM.from_pretrained(source, dtype=torch.float32).eval()
    for name, module in quantised_linears(model):
        reference.get_submodule(name).weight = nn.Parameter(module.weight.data.float(), requires_grad=False)
    return reference


SCHEMES = {
    "w4a16-g32-sym": dict(bits=4, symmetric=True, strategy="group", group_size=32),
    "w4a16-g32-asym": dict(bits=4, symmetric=False, strategy="group", group_size=32),
    "w8a16-channel-sym": dict(bits=8, symmetric=True, strategy="channel"),
    "w8a16-g64-asym": dict(bits=8, symmetric=False, strategy="group", group_size=64),
}
# the run-time layout install_grouped_weight picks for each on CPU (float32 activations)
LAYOUTS = {"w4a16-g32-sym": "int4pack", "w4a16-g32-asym": "int4pack", "w8a16-channel-sym": "int8pack",
           "w8a16-g64-asym": "dequant"}


def decoder_layouts(llm) -> set:
    model = llm.engine.executor.runner.model
    assert not hasattr(model.lm_head, "quant_layout")  # exempted by `ignore`: full precision
    return {m.quant_layout for m in model.model.modules() if isinstance(m, LinearBase)}


def check_against_reference(llm, reference, unquantised=None, prompts=4):
    """Greedy tokens equal to transformers' `reference` and logits within 1e-2 (float32); with `unquantised`,
    also that the reference really differs from the full-precision model."""
    gap = 0.0
    for prompt, tokens, ours in run_greedy(llm, make_prompts(512)[:prompts]):
        with torch.no_grad():
            expected_tokens = reference.generate(torch.tensor([prompt]), max_new_tokens=NEW_TOKENS,
                                                 min_new_tokens=NEW_TOKENS, do_sample=False)[0, len(prompt):]
        assert tokens == expected_tokens.tolist()
        expected = reference_logits(reference, prompt, tokens)
        assert (ours - expected).abs().max().item() < 1e-2
        if unquantised is not None:
            gap = max(gap, (reference_logits(unquantised, prompt, tokens) - expected).abs().max().item())
    if unquantised is not None:
        assert gap > 1e-2, "the quantised reference should differ from full precision, or this test shows nothing"


# llama: untied lm_head (left unquantised by `ignore`); qwen2: tied lm_head, q/k/v biases
@pytest.mark.parametrize("arch, scheme", [("llama", "w4a16-g32-sym"), ("llama", "w4a16-g32-asym"),
                                          ("qwen2", "w8a16-channel-sym"), ("qwen2", "w8a16-g64-asym")])
def test_greedy_tokens_and_logits_match_the_library_dequantised_reference(tiny_models, tmp_path, arch, scheme):
    from transformers import AutoModelForCausalLM

    folder = tmp_path / "ct"
    reference = compress_with_library(tiny_models[arch], folder, **SCHEMES[scheme])
    quant_config = json.loads((folder / "config.json").read_text())["quantization_config"]
    assert quant_config["quant_method"] == "compressed-tensors" and quant_config["format"] == "pack-quantized"
    llm = LLM(str(folder), skip_tokenizer_init=True, dtype="float32", device="cpu", max_model_len=400,
              max_num_batched_tokens=96)
    assert decoder_layouts(llm) == {LAYOUTS[scheme]}
    unquantised = AutoModelForCausalLM.from_pretrained(tiny_models[arch], dtype=torch.float32).eval()
    check_against_reference(llm, reference, unquantised)


@pytest.mark.parametrize("bits", [4, 8])
def test_unpacker_inverts_the_library_packer(bits):
    from compressed_tensors.compressors.pack_quantized.helpers import pack_to_int32

    offset = 1 << (bits - 1)
    signed = torch.randint(-offset, offset, (24, 96), generator=torch.Generator().manual_seed(bits), dtype=torch.int8)
    packed = pack_to_int32(signed, bits)
    assert packed.shape == (24, 96 * bits // 32)
    assert torch.equal(unpack_int32(packed, bits, 96), (signed.to(torch.int16) + offset).to(torch.uint8))
    # zero points are packed along the output rows: the transpose unpacks them
    packed_rows = pack_to_int32(signed, bits, packed_dim=0)
    assert torch.equal(unpack_int32(packed_rows.t().contiguous(), bits, 24).t(),
                       (signed.to(torch.int16) + offset).to(torch.uint8))


def parse_scheme(config):
    return CompressedTensorsConfig.from_quantization_config(config, "config.json", ())


def scheme_config(**weights):
    base = dict(num_bits=4, type="int", symmetric=True, strategy="group", group_size=32)
    return {"quant_method": "compressed-tensors", "format": "pack-quantized", "ignore": ["lm_head"],
            "config_groups": {"group_0": {"targets": ["Linear"], "weights": {**base, **weights},
                                          "input_activations": None}}}


@pytest.mark.parametrize("change, message", [
    (dict(num_bits=3), "num_bits 3 is not supported"),
    (dict(strategy="tensor"), "strategy 'tensor' is not supported"),
    (dict(type="float"), "type 'float' is not supported"),
    (dict(actorder="group"), "actorder 'group' is not supported"),
    (dict(group_size=None), "group strategy needs a positive group_size"),
])
def test_unsupported_weight_schemes_are_refused_by_name(change, message):
    with pytest.raises(ModelLoadError, match=message):
        parse_scheme(scheme_config(**change))


def test_other_formats_and_activation_quantisation_are_refused():
    config = scheme_config()
    config["format"] = "float-quantized"
    with pytest.raises(ModelLoadError, match="format 'float-quantized' is not supported"):
        parse_scheme(config)
    config = scheme_config()
    config["config_groups"]["group_0"]["input_activations"] = {"num_bits": 8, "type": "int"}
    with pytest.raises(ModelLoadError, match="input_activations quantisation is not supported"):
        parse_scheme(config)
    config = scheme_config()
    config["ignore"] = ["lm_head", "re:.*mlp.gate$"]
    with pytest.raises(ModelLoadError, match="ignore entries"):
        parse_scheme(config)


def test_a_refused_scheme_fails_the_engine_load_in_one_line(tiny_models, tmp_path):
    folder = tmp_path / "ct"
    compress_with_library(tiny_models["llama"], folder, bits=4, symmetric=True, strategy="group", group_size=32)
    config = json.loads((folder / "config.json").read_text())
    config["quantization_config"]["config_groups"]["group_0"]["weights"]["num_bits"] = 2
    (folder / "config.json").write_text(json.dumps(config))
    with pytest.raises(ModelLoadError) as info:
        LLM(str(folder), skip_tokenizer_init=True, device="cpu", max_model_len=64, num_kv_blocks=8)
    assert "num_bits 2 is not supported" in str(info.value) and "\n" not in str(info.value)


def test_on_the_fly_quantization_of_a_quantised_checkpoint_is_refused(tiny_models, tmp_path):
    folder = tmp_path / "ct"
    compress_with_library(tiny_models["llama"], folder, bits=8, symmetric=True, strategy="channel")
    with pytest.raises(Exception, match=r"already quantised \(compressed-tensors\); drop --quantization int8"):
        LLM(str(folder), skip_tokenizer_init=True, device="cpu", max_model_len=64, num_kv_blocks=8,
            quantization="int8")
