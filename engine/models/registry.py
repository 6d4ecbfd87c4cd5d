"""Which module tree serves a `ModelConfig`: the MoE classes, Phi-3's, else llama.py's (Gemma 1 by flags)."""

from __future__ import annotations

from llmctl.engine.model_config import ModelConfig
from llmctl.engine.models.llama import LlamaForCausalLM
from llmctl.engine.models.moe import MixtralForCausalLM, MoEForCausalLM
from llmctl.engine.models.phi3 import Phi3ForCausalLM


def model_class(config: ModelConfig) -> type[LlamaForCausalLM]:
    if config.moe is not None:
        return MixtralForCausalLM if config.architecture == "MixtralForCausalLM" else MoEForCausalLM
    return Phi3ForCausalLM if config.architecture == "Phi3ForCausalLM" else LlamaForCausalLM
