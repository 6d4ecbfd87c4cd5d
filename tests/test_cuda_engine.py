"""The CUDA engine as users start it (scripts/gpu_check.sh's `engine` step runs this file with
`-W error::UserWarning`, so torch's "The CUDA Graph is empty" fails it; skipped without CUDA): default start-up on
cuda:0 (profile, every decode-graph bucket captured up front within --gpu-memory-utilization, then the KV pool),
graph against eager logits (piecewise graphs, and full decode graphs on the Triton backend), prefill with a cached
prefix and with a sliding window against the CPU float32 reference with SDPA's math kernel switched off, and an
engine on a second GPU against the same reference."""

from __future__ import annotations

import gc
import logging

import pytest
import torch
from test_parity import LogitRecorder, make_prompts, reference_logits

from llmctl.engine import LLM, SamplingParams
from llmctl.engine.layers.attention import TorchAttention

pytestmark = [pytest.mark.cuda, pytest.mark.filterwarnings("error::UserWarning"),
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]

MIB = 1 << 20


@pytest.fixture(autouse=True)
def _release_gpu_memory():
    """Engines sized from --gpu-memory-utilization read the free memory: give back what a test cached."""
    yield
    gc.collect()
    torch.cuda.empty_cache()


def _cpu_reference(folder):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()


def _generate_recording(llm, prompts, max_tokens=12):
    recorders = [LogitRecorder() for _ in prompts]
    params = [SamplingParams(temperature=0, max_tokens=max_tokens + i % 5, ignore_eos=True, logits_processors=[r])
              for i, r in enumerate(recorders)]
    outputs = llm.generate(prompts, params)
    return [o.outputs[0].token_ids for o in outputs], [torch.stack(r.rows).float().cpu() for r in recorders]


def _assert_matches_reference(folder, prompts, tokens, rows, tolerance):
    reference = _cpu_reference(folder)
    for prompt, out, ours in zip(prompts, tokens, rows):
        expected = reference_logits(reference, prompt, out)
        scale = expected.abs().max().item()
        assert (ours - expected).abs().max().item() < tolerance(scale), f"{len(prompt)}-token prompt"


def test_default_start_up_on_cuda0_captures_every_bucket_once_before_serving(tiny_models, caplog):
    """The defaults (graphs on, pool sized from --gpu-memory-utilization) crashed at start-up before."""
    with caplog.at_level(logging.INFO, logger="llmctl.engine.cuda_graphs"):
        llm = LLM(str(tiny_models["llama"]), skip_tokenizer_init=True, device="cuda:0", max_model_len=512,
                  max_num_seqs=64)
    runner = llm.engine.executor.runner
    graphs = runner.graphs
    assert runner.device == torch.device("cuda", 0) and graphs is not None
    assert graphs.captured_sizes == graphs.buckets == [1, 2, 4, 8, 16, 32, 48, 64]
    assert [r.getMessage().split(" in ")[0] for r in caplog.records if "captured decode graphs" in r.getMessage()] \
        == ["captured decode graphs for 8 batch sizes (1, 2, 4, 8, 16, 32, 48, 64)"]
    assert runner.num_blocks == 64 * (512 // runner.block_size + 1)  # capped at what 64 sequences can use
    captured = graphs.num_captured
    outputs = llm.generate([list(range(1, 1 + n)) for n in (3, 40, 200)],
                           SamplingParams(temperature=0, max_tokens=16, ignore_eos=True))
    assert all(len(o.outputs[0].token_ids) == 16 for o in outputs)
    assert graphs.num_captured == captured  # nothing captured while serving


def test_pool_and_graphs_stay_within_gpu_memory_utilization(tmp_path):
    """A budget of 1 GiB above what is in use: the pool takes what the profile step and the graphs leave,
    and a long batch afterwards still stays inside --gpu-memory-utilization."""
    from conftest import make_tiny_model

    # 2 layers x 2 K/V heads of 128: 2 KiB of bfloat16 K/V a token, so 1024 full 1024-token contexts (2 GiB)
    # exceed the budget
    folder = make_tiny_model(tmp_path / "wide", "mistral", head_dim=128)
    device = torch.device("cuda", 0)
    gc.collect()
    torch.cuda.empty_cache()
    free, total = torch.cuda.mem_get_info(device)
    utilization = (total - free + 1024 * MIB) / total
    llm = LLM(str(folder), skip_tokenizer_init=True, dtype="bfloat16", device="cuda:0", max_model_len=1024,
              max_num_seqs=1024, max_num_batched_tokens=1024, gpu_memory_utilization=utilization)
    runner = llm.engine.executor.runner
    assert runner.num_blocks < 1024 * (1024 // runner.block_size + 1)  # the budget, not the cap, decided
    kept = runner.attention.workspace_share  # the kept decode K/V is reserved too
    assert runner.kv_cache_bytes * (1 + kept) > 600 * MIB  # most of the budget went to the pool
    assert runner.graphs.num_captured >= 1
    kept_high = _record_kept_high_water(runner.attention)
    long_batch = [[(7 * i + j) % 500 + 1 for i in range(900)] for j in range(24)]  # 900 of a 512-token vocabulary
    torch.cuda.synchronize(device)
    torch.cuda.reset_peak_memory_stats(device)  # the test's own reading; the engine never reads peak statistics
    llm.generate(long_batch, SamplingParams(temperature=0, max_tokens=32, ignore_eos=True))
    torch.cuda.synchronize(device)
    # The engine drops the kept decode K/V when it goes idle, and the caching allocator keeps those segments:
    # what the process held at its peak is the memory outside the allocator plus the allocator's peak, and
    # the kept K/V may still grow from its high-water mark to its reserved share.
    free_after, _ = torch.cuda.mem_get_info(device)
    outside_allocator = total - free_after - torch.cuda.memory_reserved(device)
    peak = outside_allocator + torch.cuda.max_memory_reserved(device)
    still_reserved = max(runner.kv_cache_bytes * kept - kept_high(), 0)
    assert peak + still_reserved <= utilization * total + 64 * MIB, (
        f"peak {peak / MIB:.0f} MiB (outside the allocator {outside_allocator / MIB:.0f}) + kept K/V room "
        f"{still_reserved / MIB:.0f} MiB > budget {utilization * total / MIB:.0f} MiB + 64; KV pool "
        f"{runner.kv_cache_bytes / MIB:.0f} MiB, kept high-water {kept_high() / MIB:.0f} MiB")


def _record_kept_high_water(attention):
    """The torch backend's kept decode K/V at its largest over the steps that follow (read as each step plans
    its workspace; the engine releases it when idle): a function returning that many bytes."""
    high = [0]
    if not isinstance(attention, TorchAttention):
        return lambda: 0
    workspace = attention.workspaces[0]
    plan = workspace.plan

    def recording_plan(*args, **kwargs):
        high[0] = max(high[0], workspace.kept_bytes)
        return plan(*args, **kwargs)

    workspace.plan = recording_plan
    return lambda: max(high[0], workspace.kept_bytes)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_decode_graphs_replay_the_eager_logits(tiny_models, dtype):
    """Decode steps replay the graphs captured at start-up (pieces around eager attention): eager's logits."""
    prompts = make_prompts(512)[:5]
    results = []
    for enforce_eager in (True, False):
        llm = LLM(str(tiny_models["qwen2"]), skip_tokenizer_init=True, dtype=dtype, device="cuda:0",
                  max_model_len=400, max_num_seqs=8, enforce_eager=enforce_eager)
        graphs = llm.engine.executor.runner.graphs
        assert (graphs is None) == enforce_eager
        if graphs is not None:
            assert graphs.captured_sizes == [1, 2, 4, 8]
        results.append(_generate_recording(llm, prompts, max_tokens=10))
        del llm
    (eager_tokens, eager_logits), (graph_tokens, graph_logits) = results
    tolerance = 1e-4 if dtype == "float32" else 5e-2
    for ours, expected in zip(graph_logits, eager_logits):
        assert torch.allclose(ours, expected, atol=tolerance, rtol=tolerance)
    if dtype == "float32":
        assert graph_tokens == eager_tokens


@pytest.mark.parametrize("mode", ["full_decode_only", "full_and_piecewise"])
def test_full_decode_graphs_on_triton_replay_the_eager_logits(tiny_models, mode):
    """Whole decode steps (Triton attention and KV writes inside the graph, metadata in static buffers) captured
    after the pool, on it, for every bucket: the eager Triton engine's tokens and logits."""
    pytest.importorskip("triton")
    from llmctl.engine.cuda_graphs import GraphDispatch

    prompts = make_prompts(512)[:5]
    results = []
    for cudagraph_mode in ("none", mode):
        llm = LLM(str(tiny_models["qwen2"]), skip_tokenizer_init=True, dtype="float32", device="cuda:0",
                  attention_backend="triton", max_model_len=400, max_num_seqs=8, cudagraph_mode=cudagraph_mode)
        runner = llm.engine.executor.runner
        if cudagraph_mode == "none":
            assert runner.graphs is None
        else:
            assert isinstance(runner.graphs, GraphDispatch)
            full = runner.graphs.graph_sets[0]
            assert full.kind == "full decode graphs" and full.kv_caches is runner.kv_caches
            assert full.captured_sizes == [1, 2, 4, 8]
            assert len(runner.graphs.graph_sets) == (2 if mode == "full_and_piecewise" else 1)
        results.append(_generate_recording(llm, prompts, max_tokens=10))
        del llm
    (eager_tokens, eager_logits), (graph_tokens, graph_logits) = results
    assert graph_tokens == eager_tokens
    for ours, expected in zip(graph_logits, eager_logits):
        assert torch.allclose(ours, expected, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("arch, window", [("qwen3", None), ("mistral", 48)])
def test_prefill_with_cached_prefix_and_sliding_window_matches_cpu_reference_without_math_sdpa(
        tmp_path, monkeypatch, arch, window, dtype):
    """GQA (4 query heads on 2 K/V heads) prefill chunks after cached blocks, and with a 48-token window: the
    masked calls. With SDPA's math kernel disabled, a call that would fall back to it raises."""
    from conftest import make_tiny_model
    from torch.nn.attention import SDPBackend, sdpa_kernel

    folder = make_tiny_model(tmp_path / arch, arch, **({"sliding_window": window} if window else {}))
    monkeypatch.setattr("llmctl.engine.model_runner.select_backend", lambda *args: TorchAttention)
    llm = LLM(str(folder), skip_tokenizer_init=True, dtype=dtype, device="cuda:0", max_model_len=512,
              max_num_batched_tokens=64, num_kv_blocks=128, enable_prefix_caching=True)
    prompts = make_prompts(512)
    with sdpa_kernel([SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.CUDNN_ATTENTION]):
        tokens, rows = _generate_recording(llm, prompts)
        tokens2, rows2 = _generate_recording(llm, prompts[-3:])  # their prefixes are cached now
    assert llm.engine.get_stats()["prefix_cache_hit_rate"] > 0
    if dtype == "float32":
        tolerance = lambda scale: 2e-3  # noqa: E731 - TF32 is off by default for float32 matmuls
    else:
        tolerance = lambda scale: 0.05 * scale + 0.05  # noqa: E731
    _assert_matches_reference(folder, prompts + prompts[-3:], tokens + tokens2, rows + rows2, tolerance)


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two GPUs")
def test_second_gpu_engine_matches_the_cpu_reference_and_leaves_cuda0_alone(tiny_models):
    """Graphs captured for cuda:1 record its kernels (an empty graph would replay stale logits)."""
    before = torch.cuda.memory_allocated(0)
    llm = LLM(str(tiny_models["llama"]), skip_tokenizer_init=True, dtype="float32", device="cuda:1",
              max_model_len=512, max_num_seqs=8)
    runner = llm.engine.executor.runner
    assert runner.device == torch.device("cuda", 1) and runner.graphs.captured_sizes == [1, 2, 4, 8]
    prompts = [[1, 2, 3], list(range(100)), make_prompts(512)[6]]
    tokens, rows = _generate_recording(llm, prompts)
    _assert_matches_reference(tiny_models["llama"], prompts, tokens, rows, lambda scale: 2e-3)
    assert torch.cuda.memory_allocated(0) == before  # nothing was created on the default device
