"""The Triton attention kernels and backend: compiled on CUDA where there is a GPU, else on CPU tensors under
the Triton interpreter (TRITON_INTERPRET=1, set by tests/conftest.py before anything imports triton).

The unified kernel against a float32 torch reference over random batches: shuffled, non-contiguous block
tables; decode rows, verify rows and chunks on a cached context, whole prompts; GQA ratios 1-8; sliding
windows; head dims 64, 128 and 80 (padded in the kernel); float32, bfloat16, float16; key splits merged
by the second kernel. The pool starts as NaN and only the one-kernel KV write fills it, so a read of an
unwritten slot shows. Then the engine on `attention_backend="triton"` gives transformers' greedy tokens
through chunked prefill and prefix-cache hits, and the kernels compile for an sm_90 GPU without one.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass
from typing import Optional

import pytest
from triton_compile import assert_compiles_for_cuda
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

TOLERANCE = {torch.float32: 1e-4, torch.bfloat16: 3e-2, torch.float16: 4e-3}


@pytest.fixture(scope="module")
def kernels():
    """(attention, cache, device): the kernel modules, on CUDA where there is a GPU, else interpreted on CPU
    tensors (tests/conftest.py sets TRITON_INTERPRET=1 before anything imports triton)."""
    pytest.importorskip("triton")
    from llmctl.engine.kernels.triton import interpreter_enabled

    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if device.type == "cpu" and not interpreter_enabled():
        pytest.skip("no GPU, and triton was imported before TRITON_INTERPRET=1 could be set")
    from llmctl.engine.kernels.triton import attention, cache

    return attention, cache, device


@dataclass
class Case:
    rows: list[tuple[int, int]]  # (query tokens, context tokens) per row
    num_kv_heads: int
    group: int
    head_dim: int
    dtype: torch.dtype
    block_size: int
    window: Optional[int]
    num_splits: int
    seed: int
    softcap: Optional[float] = None  # Gemma 2's attention logit cap


@st.composite
def cases(draw) -> Case:
    rows = []
    for _ in range(draw(st.integers(1, 3))):
        context = draw(st.integers(1, 40))
        kind = draw(st.sampled_from(["decode", "verify", "chunk", "prompt"]))
        query = {"decode": 1, "verify": min(context, draw(st.integers(2, 5))), "prompt": context,
                 "chunk": draw(st.integers(1, context))}[kind]
        rows.append((query, context))
    return Case(rows=rows, num_kv_heads=draw(st.sampled_from([1, 2])), group=draw(st.sampled_from([1, 2, 4, 8])),
                head_dim=draw(st.sampled_from([64, 128, 80])),
                dtype=draw(st.sampled_from([torch.float32, torch.bfloat16, torch.float16])),
                block_size=draw(st.sampled_from([8, 16])), window=draw(st.sampled_from([None, None, 5, 24])),
                num_splits=draw(st.sampled_from([1, 1, 2, 4])), seed=draw(st.integers(0, 2**16)))


def reference(q: torch.Tensor, keys: list[torch.Tensor], values: list[torch.Tensor], rows, window,
              softcap: Optional[float] = None) -> torch.Tensor:
    """Row by row in float32: query i of a row at position context - query_len + i, a causal (windowed) softmax
    of the scores (capped as softcap * tanh(scores / softcap) with a cap)."""
    out, start = [], 0
    for (length, context), k, v in zip(rows, keys, values):
        group = q.shape[1] // k.shape[1]
        k, v = (x.float().repeat_interleave(group, dim=1) for x in (k, v))
        scores = torch.einsum("qhd,khd->hqk", q[start:start + length].float(), k) * q.shape[-1] ** -0.5
        if softcap is not None:
            scores = torch.tanh(scores / softcap) * softcap
        q_pos = (context - length + torch.arange(length)).unsqueeze(1)
        k_pos = torch.arange(context).unsqueeze(0)
        seen = k_pos <= q_pos
        if window is not None:
            seen &= k_pos > q_pos - window
        out.append(torch.einsum("hqk,khd->qhd", scores.masked_fill(~seen, float("-inf")).softmax(-1), v))
        start += length
    return torch.cat(out)


def shuffled_tables(case: Case, generator: torch.Generator) -> tuple[list[list[int]], int]:
    """Each row's blocks drawn from a shuffled pool (two spare blocks), one unneeded block on every table."""
    needed = [-(-context // case.block_size) for _, context in case.rows]
    num_blocks = sum(needed) + 2
    order = torch.randperm(num_blocks, generator=generator).tolist()
    tables, used = [], 0
    for count in needed:
        tables.append(order[used:used + count] + [order[-1]])
        used += count
    return tables, num_blocks


def write_contexts(write_kv, case: Case, tables, k_cache, v_cache, keys, values) -> None:
    """Every row's context K/V into the pool through the KV write kernel, tokens in shuffled order, padding
    tokens (slot -1) among them, K and V strided views of one packed tensor (as a fused qkv projection gives)."""
    slots = [table[i // case.block_size] * case.block_size + i % case.block_size
             for table, (_, context) in zip(tables, case.rows) for i in range(context)]
    k_all, v_all = torch.cat(keys), torch.cat(values)
    order = torch.randperm(len(slots), generator=torch.Generator().manual_seed(case.seed))
    packed = torch.cat([k_all[order], v_all[order]], dim=1)
    packed = torch.cat([packed, packed[:3]]).to(k_cache.device)  # three padding tokens
    slot_mapping = torch.cat([torch.tensor(slots)[order], torch.full((3,), -1)]).to(k_cache.device)
    heads = case.num_kv_heads
    write_kv(packed[:, :heads], packed[:, heads:], k_cache, v_cache, slot_mapping)
    flat_k, flat_v = (cache.view(-1, heads, case.head_dim).cpu() for cache in (k_cache, v_cache))
    assert torch.equal(flat_k[slots], k_all) and torch.equal(flat_v[slots], v_all)


def run_case(kernels, case: Case) -> None:
    attention, cache, device = kernels
    generator = torch.Generator().manual_seed(case.seed)
    heads, kv_heads, dim = case.num_kv_heads * case.group, case.num_kv_heads, case.head_dim
    tables, num_blocks = shuffled_tables(case, generator)
    keys = [torch.randn(context, kv_heads, dim, generator=generator).to(case.dtype) for _, context in case.rows]
    values = [torch.randn(context, kv_heads, dim, generator=generator).to(case.dtype) for _, context in case.rows]
    k_cache = torch.full((num_blocks, case.block_size, kv_heads, dim), float("nan"), dtype=case.dtype, device=device)
    v_cache = torch.full_like(k_cache, float("nan"))
    write_contexts(cache.write_kv, case, tables, k_cache, v_cache, keys, values)

    lengths = [length for length, _ in case.rows]
    num_tokens = sum(lengths)
    packed_q = torch.randn(num_tokens, heads + 2, dim, generator=generator).to(case.dtype)
    q = packed_q.to(device)[:, 1:-1]  # strided, as in a fused qkv projection
    plan = attention.launch_plan(case.group, kv_heads, len(case.rows), max(lengths),
                                 max(context for _, context in case.rows), 1)
    plan = attention.LaunchPlan(plan.block_m, plan.block_q, case.num_splits)
    as_int32 = dict(dtype=torch.int32, device=device)
    width = max(len(table) for table in tables)
    out = torch.full((num_tokens, heads, dim), float("nan"), dtype=case.dtype, device=device)
    attention.paged_attention(
        q, k_cache, v_cache, out, torch.tensor([table + [0] * (width - len(table)) for table in tables], **as_int32),
        torch.tensor([0] + lengths).cumsum(0).to(**as_int32),
        torch.tensor([context for _, context in case.rows], **as_int32), plan, dim ** -0.5, case.window,
        attention.split_buffers(plan, num_tokens, heads, dim, device), case.softcap)
    expected = reference(packed_q[:, 1:-1], keys, values, case.rows, case.window, case.softcap)
    diff = (out.cpu().float() - expected).abs().max().item()
    assert diff <= TOLERANCE[case.dtype], f"{case}: |diff| {diff}"


@settings(max_examples=15, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture,
                                                                 HealthCheck.too_slow])
@given(case=cases())
def test_unified_kernel_matches_a_float32_reference(kernels, case):
    run_case(kernels, case)


@pytest.mark.parametrize("case", [
    Case([(1, 40), (5, 30), (12, 12)], 2, 4, 64, torch.float32, 16, None, 1, 3, softcap=1.5),
    Case([(1, 40), (7, 33)], 1, 2, 80, torch.float32, 8, 24, 1, 4, softcap=2.0),
    Case([(1, 40)], 2, 2, 64, torch.float32, 8, None, 4, 5, softcap=1.0),
    Case([(3, 20), (20, 20)], 2, 2, 64, torch.bfloat16, 16, 5, 1, 6, softcap=3.0),
])
def test_soft_capped_scores_match_the_reference(kernels, case):
    """Gemma 2's attention logit soft-cap (caps small enough to change the softmax of randn scores) on decode,
    verify, chunk and prompt rows, with windows and key splits."""
    run_case(kernels, case)
    generator = torch.Generator().manual_seed(case.seed)
    q, k, v = (torch.randn(n, 4, 64, generator=generator) for n in (1, 30, 30))
    capped, plain = (reference(q, [k], [v], [(1, 30)], None, cap) for cap in (case.softcap, None))
    assert (capped - plain).abs().max() > 3 * TOLERANCE[torch.bfloat16]  # such a cap changes the outputs


def test_long_decode_rows_split_their_keys_and_short_or_many_rows_do_not(kernels):
    """The plan splits keys only for rows of one query tile whose programs leave the target unfilled, and
    never below MIN_KEYS_PER_SPLIT keys a split; prefill-sized rows get the larger query tile."""
    attention = kernels[0]
    plan = attention.launch_plan
    assert plan(4, 8, 1, 1, 8192, 264).num_splits == attention.MAX_SPLITS  # batch-1 decode, Llama-3-8B heads
    assert plan(4, 8, 1, 1, 600, 264).num_splits == 2  # 600 keys: two splits of >= 256
    assert plan(4, 8, 16, 1, 8192, 264).num_splits == 2  # 16 rows x 8 KV heads: 128 programs, 256 split
    assert plan(4, 8, 64, 1, 8192, 264).num_splits == 1
    assert plan(4, 8, 1, 2048, 8192, 264).num_splits == 1  # a prompt: many query tiles
    assert (plan(4, 8, 1, 1, 100, 264).block_m, plan(4, 8, 1, 2048, 100, 264).block_m) == (16, 64)
    assert plan(7, 4, 1, 1, 100, 264).block_q == 2  # 7 heads a group: 14 of the tile's 16 rows used


def test_backend_metadata_is_one_int32_copy_with_tables_trimmed_to_each_context(kernels):
    """Query starts, context lengths and block tables (each cut to its context's blocks, padded to the longest)
    are views of one int32 tensor: one host-to-device copy a step."""
    from llmctl.engine.layers.attention import CommonAttentionMetadata, TritonAttention

    backend = TritonAttention(8, 2, 64, None, dtype=torch.float32)
    batch = CommonAttentionMetadata([4, 5, 6], [1, 3, 20], [17, 40, 20], [[3, 9, 4], [7, 1, 2, 8], [5, 6]],
                                    torch.zeros(24, dtype=torch.long, device=kernels[2]), 16)
    meta = backend.build_metadata(batch)
    assert meta.query_starts.tolist() == [0, 1, 4, 24] and meta.context_lens.tolist() == [17, 40, 20]
    assert meta.block_tables.tolist() == [[3, 9, 0], [7, 1, 2], [5, 6, 0]]
    storages = {t.untyped_storage().data_ptr() for t in (meta.query_starts, meta.context_lens, meta.block_tables)}
    assert len(storages) == 1 and meta.block_tables.dtype == torch.int32
    assert (meta.plan.block_m, meta.plan.block_q, meta.partials) == (64, 16, None)  # a 20-token row x 4 heads


@pytest.mark.parametrize("arch, overrides", [
    ("llama", {}),
    # a sliding layer then a full one (window 16 < the prompts), a score scale and a soft-cap small enough to matter
    ("Gemma2Config", dict(head_dim=32, sliding_window=16, query_pre_attn_scalar=24, attn_logit_softcapping=2.0,
                          final_logit_softcapping=3.0)),
])
def test_engine_on_the_triton_backend_gives_transformers_greedy_tokens(kernels, tmp_path, arch, overrides):
    """Chunked prefill (a 50-token prompt in chunks of 32), a prefix-cache hit (a later prompt continues a
    cached 48-token prefix: fewer queries than keys), and decodes of several rows in one batch."""
    from conftest import make_tiny_model
    from test_parity import LogitRecorder, reference_logits
    from transformers import AutoModelForCausalLM

    from llmctl.engine import LLM, SamplingParams

    folder = make_tiny_model(tmp_path / "model", arch, **overrides)
    llm = LLM(str(folder), skip_tokenizer_init=True, dtype="float32", device=str(kernels[2]), attention_backend="triton",
              max_num_batched_tokens=32, num_kv_blocks=32, max_model_len=128, enable_prefix_caching=True)
    runner = llm.engine.executor.runner
    assert runner.attention.name == "triton" and runner.block_size == 16
    shared = [(7 * i + 3) % 500 for i in range(48)]
    batches = [[shared + [5, 6], [9, 8, 7]], [shared + [11, 12, 13, 14, 15]]]
    reference = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    for prompts in batches:
        recorders = [LogitRecorder() for _ in prompts]
        params = [SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True, logits_processors=[recorder])
                  for recorder in recorders]
        for prompt, output, recorder in zip(prompts, llm.generate(prompts, params), recorders):
            tokens = output.outputs[0].token_ids
            with torch.no_grad():
                expected = reference.generate(torch.tensor([prompt]), max_new_tokens=4, min_new_tokens=4,
                                              do_sample=False)[0, len(prompt):]
            assert tokens == expected.tolist()
            diff = (torch.stack(recorder.rows) - reference_logits(reference, prompt, tokens)).abs().max().item()
            assert diff < 1e-3, f"a {len(prompt)}-token prompt: |logit diff| {diff}"
    assert llm.engine.get_stats()["prefix_cache_hit_rate"] > 0


def compile_for_cuda(capability: int) -> None:
    """Compile the kernels (a bf16 attention variant with key splits, a window and a soft-cap, a float32 one with
    a padded head dim and a group of 7, the merge, the KV write) for an sm_`capability` GPU: no GPU needed, run where
    TRITON_INTERPRET is unset. Exits 3 where this triton has not the compiler entry points used here."""
    try:
        from triton.backends.compiler import GPUTarget
        from triton.compiler import ASTSource, compile
    except ImportError:
        sys.exit(3)
    from llmctl.engine.kernels.triton import attention, cache

    def build(kernel, element: str, constants: dict, warps: int = 4) -> None:
        names = kernel.arg_names
        signature = {name: "constexpr" if name in constants else
                     ("*i32" if name in ("block_tables_ptr", "query_starts_ptr", "context_lens_ptr") else
                      "*i64" if name == "slot_mapping_ptr" else "*fp32" if name.startswith("partial") else
                      element if name.endswith("_ptr") else "fp32" if name in ("scale_log2", "softcap_log2") else "i32")
                     for name in names}
        source = ASTSource(fn=kernel, signature=signature,
                           constexprs={(names.index(name),): value for name, value in constants.items()})
        assert "cubin" in compile(source, target=GPUTarget("cuda", capability, 32), options={"num_warps": warps}).asm

    for element, group, head_dim, splits, window, block_m, softcap in (("*bf16", 4, 128, 4, 4096, 16, True),
                                                                       ("*fp32", 7, 80, 1, 0, 64, False)):
        build(attention._paged_attention_kernel, element, dict(
            NUM_HEADS=8 * group, GROUP=group, HEAD_DIM=head_dim, HEAD_DIM_PADDED=128, BLOCK_SIZE=16,
            TILE_N=attention.TILE_N, BLOCK_M=block_m, BLOCK_Q=block_m // group, WINDOW=window, NUM_SPLITS=splits,
            SOFTCAP=softcap, IEEE=element == "*fp32", UPCAST=False))
    build(attention._merge_splits_kernel, "*bf16", dict(NUM_HEADS=32, HEAD_DIM=128, HEAD_DIM_PADDED=128, NUM_SPLITS=4))
    build(cache._write_kv_kernel, "*bf16", dict(NUM_KV_HEADS=8, HEADS_PADDED=8, HEAD_DIM=128, HEAD_DIM_PADDED=128,
                                                BLOCK_SIZE=16))


def test_kernels_compile_for_a_cuda_gpu(tmp_path):
    """The kernels the interpreter ran also compile to a cubin for Hopper (sm_90), in a process without the
    interpreter: no interpreter-only construct slipped in."""
    assert_compiles_for_cuda("test_triton_attention", tmp_path, TRITON_DEFAULT_FP_FUSION="1")
