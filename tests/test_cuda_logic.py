"""CUDA-path logic checked on the CPU (no GPU needed).

The flash-attn backend's contract: the runner's varlen metadata (int32 cu_seqlens,
int32 block tables, the [num_blocks, block_size, kv_heads, head_dim] pool) fed to a plain-torch model of
`flash_attn_varlen_func` (bottom-right causal alignment, left window, paged keys) must give the torch
backend's results; `select_backend` picks flash-attn only where its kernels can run. The KV pool sizing
from --gpu-memory-utilization and the leak sampler's device memory, with torch.cuda's queries faked."""

from __future__ import annotations

import sys
import types

import pytest
import torch

from llmctl.engine import LLM, SamplingParams
from llmctl.engine.layers import attention
from llmctl.engine.layers.attention import FlashAttention, TorchAttention, select_backend


def reference_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, dropout_p=0.0,
                     softmax_scale=None, causal=False, window_size=(-1, -1), softcap=0.0, alibi_slopes=None,
                     deterministic=False, return_attn_probs=False, block_table=None):
    """flash-attn 2's documented semantics, written out: query i of a sequence with sq queries and sk keys
    sits at key position sk - sq + i (causal masks are aligned to the bottom right)."""
    assert cu_seqlens_q.dtype == cu_seqlens_k.dtype == torch.int32
    assert block_table is not None and block_table.dtype == torch.int32 and block_table.stride(-1) == 1
    assert k.dim() == 4 and k.shape == v.shape and k.shape[1] % 256 == 0, "paged K/V: [blocks, 256n, hkv, d]"
    assert q.stride(-1) == k.stride(-1) == v.stride(-1) == 1
    assert causal and softcap == 0.0 and dropout_p == 0.0 and alibi_slopes is None
    assert block_table.shape[0] == cu_seqlens_q.numel() - 1
    page, heads, kv_heads = k.shape[1], q.shape[1], k.shape[2]
    left = window_size[0]
    out = torch.empty_like(q)
    starts_q, starts_k = cu_seqlens_q.tolist(), cu_seqlens_k.tolist()
    assert max_seqlen_q == max(b - a for a, b in zip(starts_q, starts_q[1:]))
    assert max_seqlen_k == max(b - a for a, b in zip(starts_k, starts_k[1:]))
    for i in range(len(starts_q) - 1):
        sq, sk = starts_q[i + 1] - starts_q[i], starts_k[i + 1] - starts_k[i]
        positions = torch.arange(sk)
        slots = block_table[i].long()[positions // page] * page + positions % page
        keys = k.reshape(-1, kv_heads, k.shape[-1])[slots].repeat_interleave(heads // kv_heads, dim=1)
        values = v.reshape(-1, kv_heads, v.shape[-1])[slots].repeat_interleave(heads // kv_heads, dim=1)
        query = q[starts_q[i]:starts_q[i + 1]]
        scores = torch.einsum("qhd,khd->hqk", query.float(), keys.float()) * softmax_scale
        q_pos = (sk - sq + torch.arange(sq)).unsqueeze(1)
        allowed = positions.unsqueeze(0) <= q_pos  # causal: right window 0
        if left >= 0:
            allowed &= positions.unsqueeze(0) >= q_pos - left
        scores = scores.masked_fill(~allowed, float("-inf"))
        out[starts_q[i]:starts_q[i + 1]] = torch.einsum("hqk,khd->qhd", scores.softmax(-1), values.float()).to(q.dtype)
    return out


def install_fake_flash(monkeypatch):
    """A `flash_attn` module whose varlen function is the reference above; the runner picks FlashAttention.
    (Installed after transformers has built the test model: transformers probes the real package.)"""
    module = types.ModuleType("flash_attn")
    module.flash_attn_varlen_func = reference_varlen
    monkeypatch.setitem(sys.modules, "flash_attn", module)
    monkeypatch.setattr("llmctl.engine.model_runner.select_backend", lambda *args: FlashAttention)
    return module


class Recorder:
    def __init__(self):
        self.rows = []

    def __call__(self, ids, row):
        self.rows.append(row.clone())
        return row


def _run(folder, **engine):
    """Two generate calls: the second one's prompts share a 300-token prefix with one of the first, so
    their prefills start after cached blocks (fewer queries than keys)."""
    llm = LLM(str(folder), skip_tokenizer_init=True, dtype="float32", device="cpu", max_model_len=1024,
              max_num_batched_tokens=96, enable_prefix_caching=True, **engine)
    shared = [(5 * i + 1) % 500 for i in range(300)]
    batches = [[[3], list(range(1, 40)), shared + [7, 8, 9], [(3 * i) % 500 for i in range(600)]],
               [shared + [11] * 50, shared[:280] + [2] * 5]]
    outputs, rows = [], []
    for prompts in batches:
        recorders = [Recorder() for _ in prompts]
        # prompt log-probs turn the prefix cache off for their request: ask for them on unshared prompts only
        params = [SamplingParams(temperature=0, max_tokens=6 + i, ignore_eos=True, logits_processors=[r],
                                 prompt_logprobs=0 if len(p) in (39, 600) else None)
                  for i, (p, r) in enumerate(zip(prompts, recorders))]
        outputs += llm.generate(prompts, params)
        rows += [torch.stack(r.rows) for r in recorders]
    return llm, outputs, rows


@pytest.mark.parametrize("arch, overrides", [("llama", {}), ("qwen3", {}), ("mistral", {"sliding_window": 48})])
def test_flash_metadata_matches_the_torch_backend(tmp_path, monkeypatch, arch, overrides):
    from conftest import make_tiny_model

    folder = make_tiny_model(tmp_path / arch, arch, **overrides)
    install_fake_flash(monkeypatch)
    flash_llm, flash_out, flash_rows = _run(folder, num_kv_blocks=16)
    runner = flash_llm.engine.runner
    assert runner.attention.name == "flash-attn" and runner.block_size == 256
    assert runner.kv_caches[0].shape[1:] == (16, 256, 2, flash_llm.engine.model_config.head_dim)
    assert flash_llm.engine.get_stats()["prefix_cache_hit_rate"] > 0
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr("llmctl.engine.model_runner.select_backend", lambda *args: TorchAttention)
        torch_llm, torch_out, torch_rows = _run(folder, num_kv_blocks=256, block_size=16)
    assert torch_llm.engine.runner.attention.name == "torch"
    for a, b, rows_a, rows_b in zip(flash_out, torch_out, flash_rows, torch_rows):
        assert a.outputs[0].token_ids == b.outputs[0].token_ids
        assert (rows_a - rows_b).abs().max().item() < 1e-4
        if a.prompt_logprobs is not None:
            for entry_a, entry_b in zip(a.prompt_logprobs[1:], b.prompt_logprobs[1:]):
                ((token, lp_a),) = entry_a.items()
                assert abs(lp_a - entry_b[token]) < 1e-4


def test_flash_backend_refuses_small_blocks(tiny_models, monkeypatch):
    from llmctl.engine.errors import EngineArgsError

    install_fake_flash(monkeypatch)
    with pytest.raises(EngineArgsError, match="multiple of 256"):
        LLM(str(tiny_models["llama"]), skip_tokenizer_init=True, dtype="float32", device="cpu", block_size=16,
            num_kv_blocks=64)


def test_select_backend_needs_cuda_16_bit_ampere_and_a_paged_flash_attn(monkeypatch):
    cuda = torch.device("cuda", 0)
    module = types.ModuleType("flash_attn")
    module.flash_attn_varlen_func = reference_varlen
    monkeypatch.setitem(sys.modules, "flash_attn", module)
    capability = [(9, 0)]
    monkeypatch.setattr(attention.torch.cuda, "get_device_capability", lambda device=None: capability[0])
    assert select_backend(cuda, torch.bfloat16, 128) is FlashAttention
    assert select_backend(cuda, torch.float16) is FlashAttention
    assert select_backend(cuda, torch.float32, 128) is TorchAttention
    assert select_backend(torch.device("cpu"), torch.bfloat16, 128) is TorchAttention
    assert select_backend(cuda, torch.bfloat16, 512) is TorchAttention  # over flash-attn's 256
    capability[0] = (7, 5)
    assert select_backend(cuda, torch.bfloat16, 128) is TorchAttention  # Turing: no flash-attn 2 kernels
    capability[0] = (8, 0)
    module.flash_attn_varlen_func = lambda q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k: q
    assert select_backend(cuda, torch.bfloat16, 128) is TorchAttention  # a flash-attn without block_table
    monkeypatch.setitem(sys.modules, "flash_attn", None)  # import fails
    assert select_backend(cuda, torch.bfloat16, 128) is TorchAttention


def test_cuda_pool_sizing_reserves_the_kept_decode_kv(tiny_models, monkeypatch):
    llm = LLM(str(tiny_models["llama"]), skip_tokenizer_init=True, dtype="float32", device="cpu", num_kv_blocks=64,
              max_model_len=256, gpu_memory_utilization=0.5)
    runner = llm.engine.runner
    calls = []
    gib = 1 << 30
    monkeypatch.setattr(torch.cuda, "empty_cache", lambda: calls.append("empty_cache"))
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device=None: calls.append("mem_get_info") or (30 * gib, 40 * gib))
    monkeypatch.setattr(runner, "_profile_activation_bytes", lambda: gib)
    budget = 20 * gib - 10 * gib - gib  # 50% of 40 GiB, less the 10 GiB in use, less the activation peak
    blocks = runner._cuda_blocks()
    assert calls[:2] == ["empty_cache", "mem_get_info"]  # cached blocks go back before free memory is read
    assert blocks * runner.bytes_per_block * 1.5 <= budget < (blocks + 1) * runner.bytes_per_block * 1.5
    monkeypatch.setattr(runner, "attention", FlashAttention.__new__(FlashAttention))  # keeps no decode K/V
    assert runner._cuda_blocks() == budget // runner.bytes_per_block
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device=None: (1 * gib, 40 * gib))
    assert runner._cuda_blocks() == 0  # over budget already: no blocks, never a negative count


def test_leak_sampler_sums_device_memory_over_every_gpu(monkeypatch):
    from llmctl.profiling import leak

    allocated, reserved = {0: 5, 1: 700}, {0: 8, 1: 1024}
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    monkeypatch.setattr(torch.cuda, "memory_allocated", lambda device=None: allocated[device])
    monkeypatch.setattr(torch.cuda, "memory_reserved", lambda device=None: reserved[device])
    assert leak.cuda_bytes() == (705, 1032)  # the engine on cuda:1 counts although cuda:0 is current
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: False)
    assert leak.cuda_bytes() == (None, None)  # a workload that never touched CUDA: no figures
