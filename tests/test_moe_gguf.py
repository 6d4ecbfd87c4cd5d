"""Mixture-of-experts GGUF files written by the `gguf` package's writer as llama.cpp's converter writes them
(Mixtral as "llama" with expert metadata, "qwen2moe" with its shared expert and gate, "qwen3moe"; experts stacked
per projection in `blk.N.ffn_{gate,up,down}_exps`, routers in `ffn_gate_inp`): the engine's greedy tokens and
logits match transformers holding the weights the file holds (F32/F16 exact, Q8_0 and Q4_0 dequantised), each
expert a GGUF linear of its own that runs on the file's codes."""

from __future__ import annotations

import pytest
import torch

from gguf_writer import saved_reference_model, write_gguf
from test_compressed_tensors import check_against_reference
from test_moe import MOE_CONFIGS, TINY

from llmctl.engine import LLM
from llmctl.engine.gguf_loader import GGUFFile
from llmctl.engine.layers.fused_moe import FusedMoE

# vocabulary 512: check_against_reference's prompts; every layer sparse (GGUF has no mlp_only_layers)
OVERRIDES = dict(vocab_size=512, mlp_only_layers=[])


@pytest.fixture(scope="module")
def sources(tmp_path_factory):
    import transformers

    root = tmp_path_factory.mktemp("moe-gguf-sources")
    folders = {}
    for seed, (arch, (config_name, extra)) in enumerate(MOE_CONFIGS.items()):
        config = getattr(transformers, config_name)(**{**TINY, **extra, **OVERRIDES})
        torch.manual_seed(10 + seed)
        transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32).save_pretrained(root / arch)
        folders[arch] = root / arch
    return folders


# Mixtral: llama q/k rows permuted in the file, experts' intermediate 96; Qwen2-MoE: shared expert (48 rows, so no
# Q4_0) and its gate; Qwen3-MoE: q/k norms, renormalised top-k
@pytest.mark.parametrize("arch, kind, layout", [("mixtral", "Q8_0", "dequant"), ("mixtral", "F32", "float"),
                                                ("qwen2_moe", "F16", "float"), ("qwen3_moe", "Q4_0", "int4pack")])
def test_greedy_tokens_and_logits_match_the_reference(sources, tmp_path, arch, kind, layout):
    from transformers import AutoModelForCausalLM

    path = tmp_path / f"{arch}-{kind}.gguf"
    held = write_gguf(sources[arch], path, {}, default_type=kind)
    assert GGUFFile(path).quantization_label() == f"gguf {kind}"  # the experts' type counted
    llm = LLM(str(path), skip_tokenizer_init=True, dtype="float32", device="cpu", max_model_len=400,
              max_num_batched_tokens=96)
    blocks = [m for m in llm.engine.executor.runner.model.modules() if isinstance(m, FusedMoE)]
    assert len(blocks) == TINY["num_hidden_layers"] and all(block.per_expert for block in blocks)
    experts = [linear for block in blocks for linear in (*block.w13, *block.w2)]
    assert {getattr(linear, "quant_layout", "float") for linear in experts} == {layout}
    unquantised = None
    if kind not in ("F32", "F16"):
        unquantised = AutoModelForCausalLM.from_pretrained(sources[arch], dtype=torch.float32).eval()
    check_against_reference(llm, saved_reference_model(sources[arch], held, tmp_path / "reference"), unquantised,
                            prompts=2)


def test_the_routing_facts_come_from_the_metadata(sources, tmp_path):
    path = tmp_path / "qwen2moe.gguf"
    write_gguf(sources["qwen2_moe"], path, {}, default_type="F32")
    config = GGUFFile(path).model_config()
    assert config.architecture == "Qwen2MoeForCausalLM"
    moe = config.moe
    assert (moe.num_experts, moe.top_k, moe.intermediate_size, moe.shared_expert_intermediate_size) == (8, 2, 32, 48)
    assert moe.renormalize is False and moe.sparse_layers == (0, 1)
