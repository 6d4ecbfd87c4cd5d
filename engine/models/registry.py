"""Which module tree serves a `ModelConfig`: the MoE classes, Phi-3's, Gemma 2/3's, else llama.py's (Gemma 1 by
flags)."""

from __future__ import annotations

from llmctl.engine.model_config import ModelConfig
from llmctl.engine.models.gemma import Gemma2ForCausalLM, Gemma3ForCausalLM
from llmctl.engine.models.llama import LlamaForCausalLM
from llmctl.engine.models.moe import MixtralForCausalLM, MoEForCausalLM
from llmctl.engine.models.phi3 import Phi3ForCausalLM


def model_class(config: ModelConfig) -> type[LlamaForCausalLM]:
    if config.moe is not None:
        return MixtralForCausalLM if config.architecture == "MixtralForCausalLM" else MoEForCausalLM
    classes = {"Phi3ForCausalLM": Phi3ForCausalLM, "Gemma2ForCausalLM": Gemma2ForCausalLM,
               "Gemma3ForCausalLM": Gemma3ForCausalLM}
    return classes.get(config.architecture, LlamaForCausalLM)
