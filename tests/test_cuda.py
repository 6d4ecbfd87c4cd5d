"""CUDA paths (run by scripts/gpu_check.sh on a GPU host; skipped without CUDA)."""

from __future__ import annotations

import pytest
import torch

from llmctl.engine import LLM, SamplingParams

pytestmark = [pytest.mark.cuda,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]


def _reference_tokens(folder, prompt, dtype, new_tokens):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(folder, dtype=dtype).cuda().eval()
    with torch.no_grad():
        out = model.generate(torch.tensor([prompt], device="cuda"), max_new_tokens=new_tokens,
                             min_new_tokens=new_tokens, do_sample=False)
    return out[0, len(prompt):].tolist()


@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_cuda_float32_greedy_matches_transformers(tiny_models, arch):
    llm = LLM(str(tiny_models[arch]), skip_tokenizer_init=True, dtype="float32", device="cuda",
              max_model_len=512, max_num_batched_tokens=64, num_kv_blocks=64, block_size=16)
    prompts = [list(range(1, 1 + n)) for n in (1, 17, 100, 300)]
    outputs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=16, ignore_eos=True))
    for prompt, out in zip(prompts, outputs):
        assert out.outputs[0].token_ids == _reference_tokens(tiny_models[arch], prompt, torch.float32, 16)


def test_cuda_bfloat16_runs_with_the_selected_backend(tiny_models):
    llm = LLM(str(tiny_models["llama"]), skip_tokenizer_init=True, dtype="bfloat16", device="cuda",
              max_model_len=512)
    runner = llm.engine.runner
    assert runner.device.type == "cuda"
    assert runner.num_blocks > 0 and runner.kv_cache_bytes > 0
    outputs = llm.generate([[1, 2, 3], list(range(200))], SamplingParams(temperature=0, max_tokens=8, ignore_eos=True))
    assert all(len(o.outputs[0].token_ids) == 8 for o in outputs)
    assert llm.engine.block_manager.num_free_blocks == llm.engine.block_manager.num_blocks


def test_auto_device_picks_cuda(tiny_models):
    llm = LLM(str(tiny_models["llama"]), skip_tokenizer_init=True, max_model_len=256, num_kv_blocks=32)
    assert llm.engine.runner.device.type == "cuda"
