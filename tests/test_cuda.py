"""CUDA paths (run by scripts/gpu_check.sh on a GPU host; skipped without CUDA): the engine on the GPU
against CPU float32 references (transformers and the engine itself), the torch attention fallback and,
where flash-attn imports, the flash-attn backend against it; seeded sampling with CUDA generators (start-up,
decode graphs, masked prefill, the memory budget and the second GPU: test_cuda_engine.py)."""

from __future__ import annotations

import gc

import pytest
import torch
from test_parity import LogitRecorder, make_prompts, reference_logits

from llmctl.engine import LLM, SamplingParams
from llmctl.engine.layers.attention import FlashAttention, TorchAttention, select_backend

pytestmark = [pytest.mark.cuda, pytest.mark.filterwarnings("error:The CUDA Graph is empty"),
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]


@pytest.fixture(autouse=True)
def _release_gpu_memory():
    """Engines sized from --gpu-memory-utilization read the free memory: give back what a test cached."""
    yield
    gc.collect()
    torch.cuda.empty_cache()


def _reference_tokens(folder, prompt, dtype, new_tokens):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(folder, dtype=dtype).cuda().eval()
    with torch.no_grad():
        out = model.generate(torch.tensor([prompt], device="cuda"), max_new_tokens=new_tokens,
                             min_new_tokens=new_tokens, do_sample=False)
    return out[0, len(prompt):].tolist()


def _cpu_reference(folder):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()


def _generate_recording(llm, prompts, max_tokens=12):
    recorders = [LogitRecorder() for _ in prompts]
    params = [SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True, logits_processors=[r])
              for r in recorders]
    outputs = llm.generate(prompts, params)
    return [o.outputs[0].token_ids for o in outputs], [torch.stack(r.rows).float().cpu() for r in recorders]


@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_cuda_float32_greedy_matches_transformers(tiny_models, arch):
    llm = LLM(str(tiny_models[arch]), skip_tokenizer_init=True, dtype="float32", device="cuda",
              max_model_len=512, max_num_batched_tokens=64, num_kv_blocks=64, block_size=16)
    prompts = [list(range(1, 1 + n)) for n in (1, 17, 100, 300)]
    outputs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=16, ignore_eos=True))
    for prompt, out in zip(prompts, outputs):
        assert out.outputs[0].token_ids == _reference_tokens(tiny_models[arch], prompt, torch.float32, 16)


@pytest.mark.parametrize("arch", ["llama", "mistral"])
def test_cuda_float32_logits_match_cpu_reference_with_chunks_and_prefix_cache(tiny_models, arch):
    """Continuous batching, chunked prefill and prefix-cache hits on the GPU; logits against transformers
    in float32 on the CPU (TF32 is off by default for float32 matmuls)."""
    llm = LLM(str(tiny_models[arch]), skip_tokenizer_init=True, dtype="float32", device="cuda",
              max_model_len=512, max_num_batched_tokens=64, num_kv_blocks=128, enable_prefix_caching=True)
    prompts = make_prompts(512)
    tokens, rows = _generate_recording(llm, prompts)
    tokens2, rows2 = _generate_recording(llm, prompts[-3:])  # again: their prefixes are cached now
    assert llm.engine.get_stats()["prefix_cache_hit_rate"] > 0
    reference = _cpu_reference(tiny_models[arch])
    for prompt, out, ours in zip(prompts + prompts[-3:], tokens + tokens2, rows + rows2):
        expected = reference_logits(reference, prompt, out)
        assert (ours - expected).abs().max().item() < 2e-3, f"{len(prompt)}-token prompt"
    assert llm.engine.block_manager.num_free_blocks == llm.engine.block_manager.num_blocks


def test_cuda_bfloat16_tracks_float32_reference_with_the_selected_backend(tiny_models):
    folder = tiny_models["llama"]
    llm = LLM(str(folder), skip_tokenizer_init=True, dtype="bfloat16", device="cuda", max_model_len=512)
    runner = llm.engine.executor.runner
    assert runner.device.type == "cuda" and runner.kv_caches[0].device == runner.device
    assert runner.num_blocks > 0 and runner.kv_cache_bytes > 0
    assert runner.attention.name == select_backend(runner.device, torch.bfloat16, 16).name
    prompts = [[1, 2, 3], list(range(200)), make_prompts(512)[5]]
    tokens, rows = _generate_recording(llm, prompts, max_tokens=8)
    reference = _cpu_reference(folder)
    for prompt, out, ours in zip(prompts, tokens, rows):
        expected = reference_logits(reference, prompt, out)
        scale = expected.abs().max().item()
        assert (ours - expected).abs().max().item() < 0.05 * scale + 0.05
    assert llm.engine.block_manager.num_free_blocks == llm.engine.block_manager.num_blocks


def test_cuda_prompt_logprobs_match_cpu_engine(tiny_models):
    prompt = [(7 * i + 3) % 500 for i in range(150)]
    params = SamplingParams(temperature=0, max_tokens=1, prompt_logprobs=2)
    results = []
    for device in ("cuda", "cpu"):
        llm = LLM(str(tiny_models["qwen3"]), skip_tokenizer_init=True, dtype="float32", device=device,
                  max_model_len=400, max_num_batched_tokens=32, num_kv_blocks=64)
        results.append(llm.generate([prompt], params)[0].prompt_logprobs)
    cuda, cpu = results
    assert cuda[0] is None and len(cuda) == len(prompt)
    for position in range(1, len(prompt)):
        assert abs(cuda[position][prompt[position]] - cpu[position][prompt[position]]) < 1e-3


def test_cuda_seeded_sampling_is_reproducible_and_uses_cuda_generators(tiny_models):
    llm = LLM(str(tiny_models["llama"]), skip_tokenizer_init=True, dtype="float32", device="cuda",
              max_model_len=256, num_kv_blocks=64)
    generator = llm.engine.executor.runner.make_generator(5)
    assert generator.device.type == "cuda"
    prompts = [[1, 2, 3], [4, 5, 6, 7]]

    def run(seed):
        params = SamplingParams(temperature=1.0, top_p=0.9, top_k=50, max_tokens=24, ignore_eos=True, seed=seed)
        return [o.outputs[0].token_ids for o in llm.generate(prompts, params)]

    first, again, other = run(11), run(11), run(12)
    assert first == again and first != other
    unseeded = llm.generate(prompts, SamplingParams(temperature=1.0, max_tokens=24, ignore_eos=True))
    assert all(len(o.outputs[0].token_ids) == 24 for o in unseeded)


@pytest.mark.skipif(torch.cuda.is_available() and torch.cuda.get_device_capability(0) < (8, 0),
                    reason="flash-attn 2 needs sm80+")
def test_flash_attn_backend_matches_torch_backend(tiny_models, monkeypatch):
    pytest.importorskip("flash_attn")
    if select_backend(torch.device("cuda", 0), torch.bfloat16, 32) is not FlashAttention:
        pytest.skip("this flash-attn has no paged varlen kernel")
    folder = tiny_models["qwen3"]  # head_dim 32, GQA 4/2
    prompts = make_prompts(512)
    kwargs = dict(skip_tokenizer_init=True, dtype="bfloat16", device="cuda", max_model_len=512,
                  max_num_batched_tokens=96, enable_prefix_caching=True, num_kv_blocks=16)
    flash = LLM(str(folder), **kwargs)
    assert flash.engine.executor.runner.attention.name == "flash-attn" and flash.engine.executor.runner.block_size == 256
    flash_tokens, flash_rows = _generate_recording(flash, prompts)
    del flash
    monkeypatch.setattr("llmctl.engine.model_runner.select_backend", lambda *args: TorchAttention)
    plain = LLM(str(folder), **{**kwargs, "block_size": 16, "num_kv_blocks": 256})
    assert plain.engine.executor.runner.attention.name == "torch"
    _, torch_rows = _generate_recording(plain, prompts)  # teacher-forced below, so tokens may differ in bf16
    reference = _cpu_reference(folder)
    for prompt, out, ours, theirs in zip(prompts, flash_tokens, flash_rows, torch_rows):
        expected = reference_logits(reference, prompt, out)
        scale = expected.abs().max().item()
        assert (ours - expected).abs().max().item() < 0.05 * scale + 0.05
        assert (ours[0] - theirs[0]).abs().max().item() < 0.05 * scale + 0.05  # same first step in both


def test_auto_device_picks_cuda(tiny_models):
    llm = LLM(str(tiny_models["llama"]), skip_tokenizer_init=True, max_model_len=256, num_kv_blocks=32)
    assert llm.engine.executor.runner.device.type == "cuda"
