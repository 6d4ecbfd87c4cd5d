"""CUDA-path logic checked on the CPU (no GPU needed).

The flash-attn backend's contract: the runner's varlen metadata (int32 cu_seqlens,
int32 block tables, the [num_blocks, block_size, kv_heads, head_dim] pool) fed to a plain-torch model of
`flash_attn_varlen_func` (bottom-right causal alignment, left window, paged keys) must give the torch
backend's results; `select_backend` picks flash-attn only where its kernels can run. The CUDA start-up
(profile forward, decode graphs within the budget, KV pool from the rest) run on the CPU with fake device memory
numbers; CudaMemory's local measurement and the leak sampler's device memory with torch.cuda's queries faked."""

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
    assert causal and softcap >= 0.0 and dropout_p == 0.0 and alibi_slopes is None
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
        if softcap:
            scores = torch.tanh(scores / softcap) * softcap
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


def _run(folder, configure=None, **engine):
    """Two generate calls: the second one's prompts share a 300-token prefix with one of the first, so
    their prefills start after cached blocks (fewer queries than keys). `configure(llm)` runs first."""
    llm = LLM(str(folder), skip_tokenizer_init=True, dtype="float32", device="cpu", max_model_len=1024,
              max_num_batched_tokens=96, enable_prefix_caching=True, **engine)
    if configure is not None:
        configure(llm)
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


GEMMA2 = dict(head_dim=32, num_hidden_layers=3, sliding_window=48, query_pre_attn_scalar=24,
              attn_logit_softcapping=2.0)  # per-layer windows, a score scale and soft-cap through flash's arguments


@pytest.mark.parametrize("arch, overrides", [("llama", {}), ("qwen3", {}), ("mistral", {"sliding_window": 48}),
                                             ("Gemma2Config", GEMMA2)])
def test_flash_metadata_matches_the_torch_backend(tmp_path, monkeypatch, arch, overrides):
    from conftest import make_tiny_model

    folder = make_tiny_model(tmp_path / arch, arch, **overrides)
    install_fake_flash(monkeypatch)
    flash_llm, flash_out, flash_rows = _run(folder, num_kv_blocks=16)
    runner = flash_llm.engine.executor.runner
    assert runner.attention.name == "flash-attn" and runner.block_size == 256
    assert runner.kv_caches[0].shape[1:] == (16, 256, 2, flash_llm.engine.model_config.head_dim)
    assert flash_llm.engine.get_stats()["prefix_cache_hit_rate"] > 0
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr("llmctl.engine.model_runner.select_backend", lambda *args: TorchAttention)
        torch_llm, torch_out, torch_rows = _run(folder, num_kv_blocks=256, block_size=16)
    assert torch_llm.engine.executor.runner.attention.name == "torch"
    for a, b, rows_a, rows_b in zip(flash_out, torch_out, flash_rows, torch_rows):
        assert a.outputs[0].token_ids == b.outputs[0].token_ids
        assert (rows_a - rows_b).abs().max().item() < 1e-4
        if a.prompt_logprobs is not None:
            for entry_a, entry_b in zip(a.prompt_logprobs[1:], b.prompt_logprobs[1:]):
                ((token, lp_a),) = entry_a.items()
                assert abs(lp_a - entry_b[token]) < 1e-4


def test_a_flash_attn_without_softcap_refuses_a_soft_capped_model(tmp_path, monkeypatch):
    from conftest import make_tiny_model

    from llmctl.engine.errors import EngineArgsError

    folder = make_tiny_model(tmp_path / "gemma2", "Gemma2Config", **GEMMA2)
    module = install_fake_flash(monkeypatch)
    module.flash_attn_varlen_func = lambda q, k, v, cu_seqlens_q, cu_seqlens_k, block_table=None: None  # pre-2.6
    with pytest.raises(EngineArgsError, match="no attention logit soft-capping .softcap"):
        LLM(str(folder), skip_tokenizer_init=True, dtype="float32", device="cpu", num_kv_blocks=16)


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
    monkeypatch.setitem(sys.modules, "triton", None)  # without triton, auto falls back to torch
    capability = [(9, 0)]
    monkeypatch.setattr(attention.torch.cuda, "get_device_capability", lambda device=None: capability[0])
    assert select_backend(cuda, torch.bfloat16, 128) is FlashAttention
    assert select_backend(cuda, torch.float16) is FlashAttention
    assert select_backend(cuda, torch.float32, 128) is TorchAttention
    assert select_backend(torch.device("cpu"), torch.bfloat16, 128) is TorchAttention
    assert select_backend(cuda, torch.bfloat16, 512) is TorchAttention  # over flash-attn's 256
    assert select_backend(cuda, torch.bfloat16, 80) is FlashAttention
    for padded in (4, 36, 100, 250):  # not a multiple of 8: flash-attn would copy the whole pool every call
        assert select_backend(cuda, torch.bfloat16, padded) is TorchAttention
    capability[0] = (7, 5)
    assert select_backend(cuda, torch.bfloat16, 128) is TorchAttention  # Turing: no flash-attn 2 kernels
    capability[0] = (8, 0)
    module.flash_attn_varlen_func = lambda q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k: q
    assert select_backend(cuda, torch.bfloat16, 128) is TorchAttention  # a flash-attn without block_table
    monkeypatch.setitem(sys.modules, "flash_attn", None)  # import fails
    assert select_backend(cuda, torch.bfloat16, 128) is TorchAttention


def test_select_backend_falls_back_to_triton_on_cuda_and_refuses_what_cannot_run(monkeypatch):
    """auto: triton where flash-attn cannot run (CUDA, Ampere+); each named backend is refused, with its reason,
    where it cannot run."""
    from llmctl.engine.errors import EngineArgsError
    from llmctl.engine.layers.attention import TritonAttention

    pytest.importorskip("triton")
    cuda, cpu = torch.device("cuda", 0), torch.device("cpu")
    capability = [(9, 0)]
    monkeypatch.setattr(attention.torch.cuda, "get_device_capability", lambda device=None: capability[0])
    monkeypatch.setitem(sys.modules, "flash_attn", None)
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    assert select_backend(cuda, torch.bfloat16, 128) is TritonAttention
    assert select_backend(cuda, torch.float32, 80) is TritonAttention
    assert select_backend(cuda, torch.bfloat16, 512) is TorchAttention  # over the kernel's register tiles
    assert select_backend(cpu, torch.bfloat16, 128) is TorchAttention
    capability[0] = (7, 5)
    assert select_backend(cuda, torch.bfloat16, 128) is TorchAttention
    with pytest.raises(EngineArgsError, match="triton: needs an Ampere or newer GPU"):
        select_backend(cuda, torch.float16, 128, "triton")
    assert select_backend(cpu, torch.float32, 64, "torch") is TorchAttention
    capability[0] = (8, 0)
    assert select_backend(cuda, torch.bfloat16, 128, "triton") is TritonAttention
    with pytest.raises(EngineArgsError, match="triton: runs on CUDA .*TRITON_INTERPRET=1"):
        select_backend(cpu, torch.float32, 64, "triton")
    with pytest.raises(EngineArgsError, match="triton: head_dim 512"):
        select_backend(cuda, torch.bfloat16, 512, "triton")
    with pytest.raises(EngineArgsError, match="flash-attn: needs CUDA"):
        select_backend(cpu, torch.bfloat16, 64, "flash-attn")
    with pytest.raises(EngineArgsError, match="flash-attn: the flash_attn package does not import"):
        select_backend(cuda, torch.bfloat16, 64, "flash-attn")
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    assert select_backend(cpu, torch.float32, 64, "triton") is TritonAttention
    monkeypatch.setitem(sys.modules, "triton", None)
    with pytest.raises(EngineArgsError, match="triton: the triton package does not import"):
        select_backend(cuda, torch.bfloat16, 128, "triton")


MIB, GIB = 1 << 20, 1 << 30


class FakeMemory:
    """DeviceMemory with made-up numbers for a runner on the CPU: `used` of `total` bytes are taken; the
    profile forward (the measured work that captures no graphs) peaks at `peak` bytes and gives them back;
    each graph capture keeps `per_row` bytes per row of its bucket. The measured work itself runs for real."""

    def __init__(self, total, used, peak, per_row, graphs):
        self.total, self.used, self.peak, self.per_row, self.graphs = total, used, peak, per_row, graphs
        self.events = []

    def free_and_total(self):
        return self.total - self.used, self.total

    def growth(self, work):
        captured = lambda: set(self.graphs[0].captured_sizes) if self.graphs else set()  # noqa: E731
        before = captured()
        work()
        new = captured() - before
        if not new:
            self.events.append("profile")
            return self.peak
        (size,) = new
        self.events.append(f"capture {size}")
        self.used += self.per_row * size
        return self.per_row * size


def cpu_runner_with_device_memory(monkeypatch, folder, total, used, peak, per_row, **engine):
    """An LLM on the CPU whose runner plans start-up as on CUDA: FakeMemory as the device memory and decode
    graphs (captured by CallingCapturer) unless enforce_eager. Returns (llm, memory, capturer)."""
    from test_cuda_graphs import CallingCapturer

    from llmctl.engine.cuda_graphs import DecodeGraphs

    graphs, capturer = [], CallingCapturer()
    memory = FakeMemory(total, used, peak, per_row, graphs)

    def decode_graphs(model, backend, device, dtype, max_num_seqs, mode):
        if engine.get("enforce_eager"):
            return None
        graphs.append(DecodeGraphs(model, backend, min(max_num_seqs, 256), device, dtype, capturer=capturer))
        return graphs[0]

    monkeypatch.setattr("llmctl.engine.model_runner.device_memory", lambda device: memory)
    monkeypatch.setattr("llmctl.engine.model_runner.maybe_decode_graphs", decode_graphs)
    llm = LLM(str(folder), skip_tokenizer_init=True, dtype="float32", device="cpu", **engine)
    return llm, memory, capturer


def test_startup_profiles_then_captures_graphs_within_the_budget_then_sizes_the_pool(tiny_models, monkeypatch,
                                                                                     caplog):
    """The CUDA start-up order run on the CPU with fake memory numbers (the profile forward and the graph
    bookkeeping for real): profile, every graph bucket the budget allows, then the KV pool from what is left."""
    import logging

    with caplog.at_level(logging.INFO, logger="llmctl.engine.cuda_graphs"):
        llm, memory, capturer = cpu_runner_with_device_memory(
            monkeypatch, tiny_models["qwen2"], total=100 * MIB, used=40 * MIB, peak=5 * MIB, per_row=MIB // 2,
            max_model_len=256, max_num_seqs=256, gpu_memory_utilization=0.9)
    runner = llm.engine.executor.runner
    reports = [r.getMessage() for r in caplog.records if r.getMessage().startswith("captured decode graphs")]
    assert len(reports) == 1 and reports[0].startswith("captured decode graphs for 3 batch sizes (1, 2, 4) in ")
    assert reports[0].endswith(" s, 4 MiB")  # 3.5 MiB, rounded
    # 90 MiB allowed, 40 in use, 5 for the profile peak: 45 MiB for graphs + KV. Graphs get at most 10% (4.5 MiB):
    # buckets 1, 2, 4 take 0.5 + 1 + 2 MiB; 8 is expected to take 4 more, so it and larger buckets run eagerly.
    assert memory.events == ["profile", "capture 1", "capture 2", "capture 4"]
    assert runner.graphs.captured_sizes == [1, 2, 4]
    left = 45 * MIB - 7 * MIB // 2
    per_block = runner.bytes_per_block * 3 // 2  # the torch backend's kept decode K/V is reserved too
    assert runner.num_blocks == left // per_block and runner.num_blocks < 256 * 17  # not capped here

    prompts = [[1, 2, 3], list(range(5, 40)), [7] * 17, [9] * 5, list(range(100, 160))]
    params = [SamplingParams(temperature=0, max_tokens=4 + 3 * i, ignore_eos=True, logits_processors=[Recorder()])
              for i in range(len(prompts))]
    tokens = [o.outputs[0].token_ids for o in llm.generate(prompts, params)]
    assert capturer.counter["replays"] > 0  # decode steps of 4 rows or fewer replayed the graphs
    eager, _, _ = cpu_runner_with_device_memory(
        monkeypatch, tiny_models["qwen2"], total=100 * MIB, used=40 * MIB, peak=5 * MIB, per_row=MIB // 2,
        max_model_len=256, max_num_seqs=256, gpu_memory_utilization=0.9, enforce_eager=True)
    eager_params = [SamplingParams(temperature=0, max_tokens=4 + 3 * i, ignore_eos=True, logits_processors=[Recorder()])
                    for i in range(len(prompts))]
    assert [o.outputs[0].token_ids for o in eager.generate(prompts, eager_params)] == tokens
    for ours, theirs in zip(params, eager_params):
        rows, expected = (torch.stack(p.logits_processors[0].rows) for p in (ours, theirs))
        assert torch.allclose(rows, expected, atol=1e-5)


def test_profile_forward_runs_the_worst_prefill_on_the_cpu(tmp_path, monkeypatch):
    """The profile step's forward is the largest chunk at the end of a max_model_len context: a cached prefix,
    so the masked prefill path (and, with a window, the windowed one) runs in it."""
    from llmctl.engine.layers.attention import TorchAttention

    seen = []
    prefill = TorchAttention._prefill

    def recording(self, q, k, v, k_cache, v_cache, span, window):
        seen.append((span.length, span.context_len))
        return prefill(self, q, k, v, k_cache, v_cache, span, window)

    monkeypatch.setattr(TorchAttention, "_prefill", recording)
    for arch, overrides in (("qwen3", {}), ("mistral", {"sliding_window": 48})):
        from conftest import make_tiny_model

        folder = make_tiny_model(tmp_path / arch, arch, **overrides)
        seen.clear()
        cpu_runner_with_device_memory(monkeypatch, folder, total=GIB, used=0, peak=0, per_row=0, max_model_len=300,
                                      max_num_batched_tokens=64, enforce_eager=True)
        assert seen == [(64, 300)] * 2  # both layers: 64 new tokens after a 236-token prefix


def test_pool_on_a_huge_device_is_capped_at_what_max_num_seqs_can_use(tiny_models, monkeypatch):
    llm, _, _ = cpu_runner_with_device_memory(
        monkeypatch, tiny_models["llama"], total=141 * GIB, used=GIB, peak=GIB, per_row=MIB, max_model_len=256,
        max_num_seqs=8)
    # 8 full 256-token contexts, one block of slack each; uncapped the budget would give ~10 million blocks
    assert llm.engine.executor.runner.num_blocks == 8 * (256 // 16 + 1)
    assert llm.engine.block_manager.num_blocks == 8 * 17


def test_pool_sizing_reserves_the_kept_decode_kv_and_never_goes_negative(tiny_models, monkeypatch):
    llm, memory, _ = cpu_runner_with_device_memory(
        monkeypatch, tiny_models["llama"], total=40 * GIB, used=10 * GIB, peak=GIB, per_row=0, max_model_len=256,
        max_num_seqs=8, gpu_memory_utilization=0.5, enforce_eager=True)
    runner = llm.engine.executor.runner
    runner.config.max_num_seqs = 10**9  # no cap: the budget decides
    memory.used = 21 * GIB // 2
    budget = 20 * GIB - 21 * GIB // 2 - GIB  # 50% of 40 GiB, less the 10.5 GiB in use, less the profile peak
    blocks = runner._plan_num_blocks(GIB)
    assert blocks * runner.bytes_per_block * 1.5 <= budget < (blocks + 1) * runner.bytes_per_block * 1.5
    monkeypatch.setattr(runner, "attention", FlashAttention.__new__(FlashAttention))  # keeps no decode K/V
    assert runner._plan_num_blocks(GIB) == budget // runner.bytes_per_block
    memory.used = 39 * GIB  # over budget already: a clear error, never a negative count
    from llmctl.engine.errors import EngineArgsError

    with pytest.raises(EngineArgsError, match="fewer than one 256-token sequence needs"):
        runner._plan_num_blocks(GIB)


@pytest.mark.parametrize("arch, overrides", [("qwen3", {}), ("mistral", {"sliding_window": 48})])
def test_masked_gqa_prefill_with_expanded_kv_heads_matches_enable_gqa(tmp_path, arch, overrides):
    """The CUDA form of masked GQA prefill (cached prefix, sliding window): K/V heads expanded to one per query
    head instead of enable_gqa, run on the CPU against the enable_gqa form, whole engine, both paths masked."""
    from conftest import make_tiny_model

    folder = make_tiny_model(tmp_path / arch, arch, **overrides)  # 4 query heads on 2 K/V heads
    results = []
    for expand in (False, True):
        def configure(llm, expand=expand):
            llm.engine.executor.runner.attention.expand_masked_gqa = expand

        llm, outputs, rows = _run(folder, configure, num_kv_blocks=256, block_size=16)
        assert llm.engine.get_stats()["prefix_cache_hit_rate"] > 0
        results.append((outputs, rows))
    (base_out, base_rows), (expanded_out, expanded_rows) = results
    assert [o.outputs[0].token_ids for o in base_out] == [o.outputs[0].token_ids for o in expanded_out]
    for a, b in zip(base_rows, expanded_rows):
        assert (a - b).abs().max().item() < 1e-5


def test_cuda_memory_growth_is_a_local_measurement(monkeypatch):
    """What a piece of work took, from the allocator's reserved bytes and the device's free bytes around it,
    without resetting the process's peak-memory statistics (other code reads them); torch.cuda's queries faked."""
    from llmctl.engine.device_memory import CudaMemory

    state = {"reserved": 100 * MIB, "free": 1000 * MIB}
    monkeypatch.setattr(torch.cuda, "reset_peak_memory_stats", lambda *args: pytest.fail("reset the peak stats"))
    monkeypatch.setattr(torch.cuda, "reset_max_memory_allocated", lambda *args: pytest.fail("reset the peak stats"))
    monkeypatch.setattr(torch.cuda, "synchronize", lambda device=None: None)
    monkeypatch.setattr(torch.cuda, "empty_cache", lambda: None)
    monkeypatch.setattr(torch.cuda, "memory_reserved", lambda device=None: state["reserved"])
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device=None: (state["free"], 2000 * MIB))
    memory = CudaMemory(torch.device("cuda", 1))

    def forward():  # 300 MiB through the allocator, 50 more by a library outside it
        state["reserved"] += 300 * MIB
        state["free"] -= 350 * MIB

    def while_another_process_freed():
        state["reserved"] += 200 * MIB
        state["free"] += 500 * MIB

    assert memory.growth(forward) == 350 * MIB
    assert memory.growth(while_another_process_freed) == 200 * MIB
    assert memory.growth(lambda: None) == 0
    assert memory.free_and_total() == (state["free"], 2000 * MIB)


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
