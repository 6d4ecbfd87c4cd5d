"""The quantisation registry: a format defined in this file alone (a config class and a linear method) loads and
runs a checkpoint whose config.json names it, once one `QuantizationFormat` line adds it to a registry; the
registry is a value (extending it leaves the default one unchanged, activating it lasts one block), and a
quant_method no registry holds is refused by name."""

from __future__ import annotations

import json
import shutil
from dataclasses import dataclass

import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import load_file, save_file
from torch import nn

from test_parity import make_prompts
from test_quantization import assert_matches_reference

from llmctl.engine import LLM
from llmctl.engine.errors import EngineArgsError, ModelLoadError
from llmctl.engine.layers.linear import LinearBase, LinearMethod, copy_checked, new_parameter, register_bias
from llmctl.engine.layers.quantization import (DEFAULT_REGISTRY, FLAG, LinearMethods, QuantizationConfig,
                                               QuantizationFormat, active_registry, linear_methods_for)
from llmctl.engine.model_config import DECODER_LINEARS, ModelConfig

TOY = "toy-int8"


# ---- the whole format: a config class and a linear method ----------------------------------------------------

@dataclass(frozen=True)
class ToyInt8Config(QuantizationConfig):
    """Decoder linears stored as int8 codes (`weight`) with one float32 scale per output row (`weight_scale`);
    the lm_head in full precision."""

    @classmethod
    def from_quantization_config(cls, raw, source, linear_names) -> "ToyInt8Config":
        if raw.get("bits", 8) != 8:
            raise ModelLoadError(f"{source}: {TOY} {raw['bits']}-bit checkpoints are not supported (only 8-bit)")
        return cls()

    def linear_methods(self, target) -> LinearMethods:
        return LinearMethods(ToyInt8LinearMethod(), target.unquantized())

    def describe(self) -> str:
        return f"{TOY} per row"


class ToyInt8LinearMethod(LinearMethod):
    def create_weights(self, layer: LinearBase, bias: bool, dtype: torch.dtype) -> None:
        shards = dict(shard_ids=tuple(layer.output_offsets), output_offsets=layer.output_offsets)
        new_parameter(layer, "weight", torch.empty(layer.out_features, layer.in_features, dtype=torch.int8),
                      self.load_rows, **shards)
        new_parameter(layer, "weight_scale", torch.empty(layer.out_features), self.load_rows, **shards)
        register_bias(layer, bias, dtype, self.load_rows)

    @staticmethod
    def load_rows(param: nn.Parameter, loaded: torch.Tensor, shard_id) -> None:
        start, size = param.output_offsets[shard_id]
        copy_checked(param.data.narrow(0, start, size), loaded)

    def apply(self, layer: LinearBase, x: torch.Tensor) -> torch.Tensor:
        weight = layer.weight.float() * layer.weight_scale[:, None]
        return F.linear(x, weight.to(x.dtype), layer.bias)


TOY_REGISTRY = DEFAULT_REGISTRY.with_formats(QuantizationFormat(TOY, ToyInt8Config))


# ---- a checkpoint in that format ---------------------------------------------------------------------------

def toy_quantised(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    scale = weight.abs().amax(dim=1) / 127
    return torch.round(weight / scale[:, None]).clamp(-127, 127).to(torch.int8), scale


def toy_checkpoint(source, folder, bits: int = 8):
    """The tiny model with every decoder linear's weight as int8 codes and row scales, config.json naming TOY."""
    shutil.copytree(source, folder)
    tensors = load_file(folder / "model.safetensors")
    for name in [n for n in tensors if n.endswith(".weight") and any(f".{l}." in n for l in DECODER_LINEARS)]:
        tensors[name], tensors[name + "_scale"] = toy_quantised(tensors[name])
    save_file(tensors, folder / "model.safetensors", metadata={"format": "pt"})
    config = json.loads((folder / "config.json").read_text())
    config["quantization_config"] = {"quant_method": TOY, "bits": bits}
    (folder / "config.json").write_text(json.dumps(config))
    return folder


def toy_reference(source):
    """transformers' float32 model whose decoder linears hold the dequantised toy weights."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(source, dtype=torch.float32).eval()
    for layer in model.model.layers:
        for name in DECODER_LINEARS:
            linear = layer.get_submodule(name)
            codes, scale = toy_quantised(linear.weight.data)
            linear.weight = nn.Parameter(codes.float() * scale[:, None], requires_grad=False)
    return model


def test_a_format_registered_in_a_test_loads_and_runs_its_checkpoint(tiny_models, tmp_path):
    from transformers import AutoModelForCausalLM

    source = tiny_models["llama"]
    folder = toy_checkpoint(source, tmp_path / "toy")
    with TOY_REGISTRY.activated():
        llm = LLM(str(folder), skip_tokenizer_init=True, dtype="float32", device="cpu", max_model_len=400,
                  max_num_batched_tokens=96)
    model = llm.engine.executor.runner.model
    methods = {type(m.method) for name, m in model.named_modules() if isinstance(m, LinearBase) and "layers" in name}
    assert methods == {ToyInt8LinearMethod} and not isinstance(model.lm_head.method, ToyInt8LinearMethod)
    unquantised = AutoModelForCausalLM.from_pretrained(source, dtype=torch.float32).eval()
    assert_matches_reference(llm, toy_reference(source), unquantised, make_prompts(512)[:3], tolerance=1e-3)


def test_outside_its_registry_the_format_is_refused_by_name(tiny_models, tmp_path):
    folder = toy_checkpoint(tiny_models["llama"], tmp_path / "toy")
    with pytest.raises(ModelLoadError, match=f"quant_method '{TOY}' is not supported") as info:
        ModelConfig.from_pretrained(folder)
    assert "compressed-tensors, gptq, awq" in str(info.value) and "\n" not in str(info.value)
    assert isinstance(ModelConfig.from_pretrained(folder, registry=TOY_REGISTRY).quantization, ToyInt8Config)


def test_the_format_refuses_its_unsupported_variants_by_name(tiny_models, tmp_path):
    folder = toy_checkpoint(tiny_models["llama"], tmp_path / "toy4", bits=4)
    with pytest.raises(ModelLoadError, match=f"{TOY} 4-bit checkpoints are not supported"):
        ModelConfig.from_pretrained(folder, registry=TOY_REGISTRY)


def test_registries_are_values_and_activation_lasts_one_block():
    assert DEFAULT_REGISTRY.get_quantization_config(TOY) is None
    assert TOY_REGISTRY.get_quantization_config(TOY) is ToyInt8Config
    with pytest.raises(RuntimeError), TOY_REGISTRY.activated():
        assert active_registry() is TOY_REGISTRY
        raise RuntimeError
    assert active_registry() is DEFAULT_REGISTRY
    with pytest.raises(ValueError, match="registered twice: awq"):
        DEFAULT_REGISTRY.with_formats(QuantizationFormat("awq", ToyInt8Config))
    # the same name may be chosen by a flag and by a checkpoint: they are different formats
    assert DEFAULT_REGISTRY.with_formats(QuantizationFormat(TOY, ToyInt8Config, FLAG)).names(FLAG)[-1] == TOY


def test_linear_methods_for_refuses_quantising_a_quantised_checkpoint(tiny_models, tmp_path):
    config = ModelConfig.from_pretrained(toy_checkpoint(tiny_models["llama"], tmp_path / "toy"), registry=TOY_REGISTRY)
    with pytest.raises(EngineArgsError, match=rf"already quantised \({TOY}\); drop --quantization int8"):
        linear_methods_for(config, "int8", torch.device("cpu"), torch.float32)
    methods = linear_methods_for(config, None, torch.device("cpu"), torch.float32)
    assert isinstance(methods.linear, ToyInt8LinearMethod) and methods.lm_head is not None
