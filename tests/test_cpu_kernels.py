"""The native CPU kernels: paged decode attention against a plain-torch reference, the fused
elementwise ops against the torch ops they replace, argument checks, and the build (cache reuse,
opting out, no compiler)."""

from __future__ import annotations

import logging

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from llmctl.engine import kernels as kernels_module
from llmctl.engine.kernels import load_cpu_kernels

KERNELS = load_cpu_kernels()
needs_kernels = pytest.mark.skipif(KERNELS is None, reason="no C compiler or no AVX-512 here: the torch path runs")


def reference_attention(q, k_pool, v_pool, tables, lens, scale, window=None):
    seqs, heads, dim = q.shape
    kv_heads, _, block_size, _ = k_pool.shape
    out = torch.empty(seqs, heads, dim)
    for s in range(seqs):
        length = int(lens[s])
        positions = torch.arange(max(0, length - window) if window else 0, length)
        blocks = tables[s][positions // block_size]
        keys = k_pool[:, blocks, positions % block_size].float()  # [kv_heads, n, dim]
        values = v_pool[:, blocks, positions % block_size].float()
        queries = q[s].float().view(kv_heads, heads // kv_heads, dim)
        probs = (torch.einsum("hgd,hnd->hgn", queries, keys) * scale).softmax(-1)
        out[s] = torch.einsum("hgn,hnd->hgd", probs, values).reshape(heads, dim)
    return out


def random_case(seed, dtype, seqs, kv_heads, group, dim, block_size, max_len):
    generator = torch.Generator().manual_seed(seed)
    lens = torch.randint(1, max_len + 1, (seqs,), generator=generator)
    width = -(-max_len // block_size)
    num_blocks = seqs * width + 3
    # every sequence gets its own blocks, in shuffled order (the pool is paged, not contiguous)
    tables = torch.randperm(num_blocks, generator=generator)[: seqs * width].view(seqs, width)
    k_pool = (torch.randn(kv_heads, num_blocks, block_size, dim, generator=generator) * 2).to(dtype)
    v_pool = torch.randn(kv_heads, num_blocks, block_size, dim, generator=generator).to(dtype)
    q = torch.randn(seqs, kv_heads * group, dim, generator=generator).to(dtype)
    return q, k_pool, v_pool, tables, lens


@needs_kernels
@settings(max_examples=40, deadline=None)
@given(seed=st.integers(0, 2**16), dtype=st.sampled_from([torch.float32, torch.bfloat16]),
       seqs=st.integers(1, 9), kv_heads=st.integers(1, 4), group=st.sampled_from([1, 2, 3, 4, 8, 16]),
       dim=st.sampled_from([16, 32, 48, 64, 128]), block_size=st.sampled_from([1, 8, 16, 32]),
       max_len=st.integers(1, 300), window=st.sampled_from([None, 1, 7, 64]))
def test_paged_decode_attention_matches_the_reference(seed, dtype, seqs, kv_heads, group, dim, block_size, max_len,
                                                      window):
    q, k_pool, v_pool, tables, lens = random_case(seed, dtype, seqs, kv_heads, group, dim, block_size, max_len)
    scale = dim ** -0.5
    ours = KERNELS.paged_decode_attention(q, k_pool, v_pool, tables, lens, scale, window)
    expected = reference_attention(q, k_pool, v_pool, tables, lens, scale, window)
    assert ours.dtype == dtype and ours.shape == q.shape
    tolerance = 2e-5 if dtype is torch.float32 else 1.6e-2  # bf16: the output's own rounding
    assert (ours.float() - expected).abs().max().item() <= tolerance * max(1.0, expected.abs().max().item())


@needs_kernels
def test_a_non_contiguous_query_is_read_correctly():
    q, k_pool, v_pool, tables, lens = random_case(3, torch.float32, 4, 2, 3, 64, 16, 50)
    wide = torch.cat([q, torch.zeros_like(q)], dim=-1)[..., :64]  # same values, non-contiguous
    assert not wide.is_contiguous()
    ours = KERNELS.paged_decode_attention(wide, k_pool, v_pool, tables, lens, 0.125)
    assert torch.allclose(ours, reference_attention(q, k_pool, v_pool, tables, lens, 0.125), atol=2e-5)


@needs_kernels
def test_a_query_viewed_inside_a_fused_qkv_row_is_read_in_place():
    q, k_pool, v_pool, tables, lens = random_case(4, torch.bfloat16, 5, 3, 3, 64, 16, 70)
    qkv = torch.cat([q.reshape(5, -1), torch.randn(5, 2 * 3 * 64).bfloat16()], dim=-1)
    view = qkv[:, : 9 * 64].view(5, 9, 64)  # rows 960 elements apart, heads contiguous
    assert view.stride() == (qkv.shape[1], 64, 1)
    ours = KERNELS.paged_decode_attention(view, k_pool, v_pool, tables, lens, 0.125)
    assert torch.equal(ours, KERNELS.paged_decode_attention(q, k_pool, v_pool, tables, lens, 0.125))


@needs_kernels
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_write_kv_stores_strided_rows_at_their_slots(dtype):
    tokens, kv_heads, dim, blocks, block_size = 11, 3, 64, 6, 16
    qkv = torch.randn(tokens, (9 + 2 * kv_heads) * dim).to(dtype)
    k = qkv[:, 9 * dim: (9 + kv_heads) * dim].view(tokens, kv_heads, dim)
    v = qkv[:, (9 + kv_heads) * dim:].view(tokens, kv_heads, dim)
    slots = torch.randperm(blocks * block_size)[:tokens]
    pools = [torch.zeros(kv_heads, blocks, block_size, dim, dtype=dtype) for _ in range(4)]
    KERNELS.write_kv(k, v, pools[0], pools[1], slots)
    for pool, new in ((pools[2], k), (pools[3], v)):  # the torch backend's own write
        pool.view(kv_heads, -1, dim).index_copy_(1, slots, new.transpose(0, 1))
    assert torch.equal(pools[0], pools[2]) and torch.equal(pools[1], pools[3])


@needs_kernels
def test_write_kv_refuses_slots_outside_the_pool_and_mismatched_tensors():
    k = torch.randn(2, 3, 64)
    pools = torch.zeros(3, 4, 16, 64), torch.zeros(3, 4, 16, 64)
    with pytest.raises(ValueError, match="outside the pool"):
        KERNELS.write_kv(k, k, *pools, torch.tensor([0, 64]))
    with pytest.raises(ValueError, match="outside the pool"):
        KERNELS.write_kv(k, k, *pools, torch.tensor([-1, 3]))
    with pytest.raises(ValueError, match="dtype"):
        KERNELS.write_kv(k, k.bfloat16(), *pools, torch.tensor([0, 1]))
    with pytest.raises(ValueError, match="shape"):
        KERNELS.write_kv(k, k, pools[0], torch.zeros(3, 4, 8, 64), torch.tensor([0, 1]))
    with pytest.raises(ValueError, match="int64"):
        KERNELS.write_kv(k, k, *pools, torch.tensor([0, 1], dtype=torch.int32))


@needs_kernels
@pytest.mark.parametrize("change, message", [
    (lambda a: {**a, "q": a["q"].half()}, "unsupported dtypes"),
    (lambda a: {**a, "k_pool": a["k_pool"].bfloat16()}, "unsupported dtypes"),
    (lambda a: {**a, "q": a["q"][..., :16]}, "disagree"),
    (lambda a: {**a, "block_tables": a["block_tables"].int()}, "int64"),
    (lambda a: {**a, "k_pool": a["k_pool"][:, :, :12], "v_pool": a["v_pool"][:, :, :12]}, "power of two"),
    (lambda a: {**a, "context_lens": a["context_lens"][:1]}, "int64"),
    (lambda a: {**a, "context_lens": a["context_lens"] + 1000}, "longer than its block table"),
    (lambda a: {**a, "context_lens": a["context_lens"] * 0}, "at least the new token"),
    (lambda a: {**a, "block_tables": a["block_tables"] + 10_000}, "outside the pool"),
])
def test_bad_arguments_are_refused_before_any_pointer_is_used(change, message):
    q, k_pool, v_pool, tables, lens = random_case(5, torch.float32, 3, 2, 2, 64, 16, 40)
    args = dict(q=q, k_pool=k_pool, v_pool=v_pool, block_tables=tables, context_lens=lens)
    with pytest.raises(ValueError, match=message):
        KERNELS.paged_decode_attention(**change(args), scale=0.125)


@needs_kernels
def test_unsupported_head_dim_is_reported_not_run():
    assert not KERNELS.supports_decode(torch.float32, 4, 2, 24)
    assert KERNELS.supports_decode(torch.float32, 4, 2, 16)
    assert not KERNELS.supports_decode(torch.float16, 4, 2, 64)
    assert not KERNELS.supports_decode(torch.float32, 64, 2, 64)  # a group of 32 queries per KV head
    assert KERNELS.supports_decode(torch.bfloat16, 9, 3, 64)


@pytest.fixture
def kernel_log():
    """Warnings of the kernel loader, captured on its own logger (CLI tests elsewhere reconfigure logging)."""
    records: list[logging.LogRecord] = []
    handler = logging.Handler(logging.WARNING)
    handler.emit = records.append
    kernels_module.logger.addHandler(handler)
    yield records
    kernels_module.logger.removeHandler(handler)


@pytest.fixture
def fresh_loader(monkeypatch, tmp_path):
    monkeypatch.setenv("LLMCTL_CACHE_DIR", str(tmp_path))
    load_cpu_kernels.cache_clear()
    yield tmp_path
    load_cpu_kernels.cache_clear()


@needs_kernels
def test_the_build_is_cached_and_reused(fresh_loader):
    assert load_cpu_kernels() is not None
    built = list((fresh_loader / "kernels").glob("cpu_kernels-*.so"))
    assert len(built) == 1 and not list((fresh_loader / "kernels").glob("tmp*"))
    stamp = built[0].stat().st_mtime_ns
    load_cpu_kernels.cache_clear()
    assert load_cpu_kernels() is not None
    assert built[0].stat().st_mtime_ns == stamp  # loaded from the cache, not rebuilt


def test_an_edited_header_rebuilds(fresh_loader, tmp_path):
    """The cache key holds every header beside the sources, not only the .c files."""
    if kernels_module.find_compiler() is None or kernels_module.disabled():
        pytest.skip("no C compiler, or the kernels are disabled")
    source, header = tmp_path / "answer.c", tmp_path / "answer.h"
    source.write_text('#include "answer.h"\nint answer(void) { return ANSWER; }\n')
    flags = tuple(f for f in kernels_module.FLAGS if f != "-march=native")
    for value in (1, 2):
        header.write_text(f"#define ANSWER {value}\n")
        assert kernels_module.build_library([source], flags, "the header test").answer() == value


def test_opting_out_or_lacking_a_compiler_gives_none(fresh_loader, monkeypatch, kernel_log):
    monkeypatch.setenv(kernels_module.DISABLE_ENV, "1")
    assert load_cpu_kernels() is None and not kernel_log
    load_cpu_kernels.cache_clear()
    monkeypatch.delenv(kernels_module.DISABLE_ENV)
    monkeypatch.setenv("CC", str(fresh_loader / "no-such-compiler"))
    assert load_cpu_kernels() is None
    assert len(kernel_log) == 1 and "torch path" in kernel_log[0].getMessage()


def test_a_failing_compiler_gives_none(fresh_loader, monkeypatch, kernel_log):
    fake = fresh_loader / "cc"
    fake.write_text("#!/bin/sh\n[ \"$1\" = --version ] && echo fake 1.0 && exit 0\necho 'error: broken' >&2\nexit 1\n")
    fake.chmod(0o755)
    monkeypatch.setenv("CC", str(fake))
    assert load_cpu_kernels() is None
    assert len(kernel_log) == 1 and "error: broken" in kernel_log[0].getMessage()
    assert not list((fresh_loader / "kernels").glob("*.so"))


# ---- fused elementwise kernels: the torch path's results, in one pass ----------------------------
def hf_rms_norm(x, weight, eps):
    """Hugging Face Llama's RMSNorm: normalise in float32, cast back, then scale."""
    normed = x.float() * torch.rsqrt(x.float().pow(2).mean(-1, keepdim=True) + eps)
    return weight * normed.to(x.dtype)


@needs_kernels
@settings(max_examples=30, deadline=None)
@given(seed=st.integers(0, 2**16), dtype=st.sampled_from([torch.float32, torch.bfloat16]),
       rows=st.integers(1, 40), dim=st.integers(1, 700), with_residual=st.booleans())
def test_rms_norm_matches_hugging_face(seed, dtype, rows, dim, with_residual):
    generator = torch.Generator().manual_seed(seed)
    x = (torch.randn(rows, dim, generator=generator) * 3).to(dtype)
    weight = torch.randn(dim, generator=generator).to(dtype)
    residual = torch.randn(rows, dim, generator=generator).to(dtype) if with_residual else None
    stream = (residual + x) if with_residual else x
    expected = hf_rms_norm(stream, weight, 1e-6)
    kept = residual.clone() if with_residual else None
    ours = KERNELS.rms_norm(x, weight, 1e-6, kept)
    if with_residual:
        assert torch.equal(kept, stream)  # the residual stream was updated in place, rounded like torch's add
    # bf16: the float32 sum of squares may differ in its last bit, which can move a rounding by a step
    tolerance = 1e-5 if dtype is torch.float32 else 2 ** -6
    assert torch.allclose(ours.float(), expected.float(), rtol=tolerance, atol=1e-5)


@needs_kernels
@settings(max_examples=30, deadline=None)
@given(seed=st.integers(0, 2**16), dtype=st.sampled_from([torch.float32, torch.bfloat16]),
       rows=st.integers(1, 20), size=st.integers(1, 400))
def test_silu_and_mul_matches_torch(seed, dtype, rows, size):
    generator = torch.Generator().manual_seed(seed)
    gate_up = (torch.randn(rows, 2 * size, generator=generator) * 6).to(dtype)
    gate_up[0, 0] = -200.0  # far outside the exp's range: still finite
    gate, up = gate_up.split(size, dim=-1)
    expected = (torch.nn.functional.silu(gate) * up).float()
    ours = KERNELS.silu_and_mul(gate_up).float()
    assert torch.isfinite(ours).all()
    # float32: the polynomial exp's 1e-7 error; bf16: at most one rounding step apart
    tolerance = 1e-5 if dtype is torch.float32 else 2 ** -7
    assert torch.allclose(ours, expected, rtol=tolerance, atol=1e-6)


@needs_kernels
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("head_dim", [32, 64, 128, 40])
def test_rotary_in_place_equals_the_torch_rotation(dtype, head_dim):
    from llmctl.engine.layers.rotary import rotate

    tokens, heads, extra = 9, 5, 3 * head_dim  # extra: the V part of a fused qkv row, left untouched
    qkv = torch.randn(tokens, heads * head_dim + extra).to(dtype)
    angles = torch.randn(tokens, head_dim // 2) * 20
    cos, sin = angles.cos().to(dtype).unsqueeze(1), angles.sin().to(dtype).unsqueeze(1)
    expected = rotate(qkv[:, : heads * head_dim].view(tokens, heads, head_dim), cos, sin).reshape(tokens, -1)
    ours = qkv.clone()
    KERNELS.rotary_(ours, heads, head_dim, cos, sin)
    assert torch.equal(ours[:, heads * head_dim:], qkv[:, heads * head_dim:])
    if dtype is torch.bfloat16:
        assert torch.equal(ours[:, : heads * head_dim], expected)  # the same roundings as the torch ops
    else:
        assert torch.allclose(ours[:, : heads * head_dim], expected, atol=1e-6)


@needs_kernels
def test_fused_ops_refuse_bad_arguments():
    x = torch.randn(4, 64)
    with pytest.raises(ValueError, match="last dimension"):
        KERNELS.rms_norm(x, torch.ones(32), 1e-6)
    with pytest.raises(ValueError, match="weight"):
        KERNELS.rms_norm(x, torch.ones(64, dtype=torch.bfloat16), 1e-6)
    with pytest.raises(ValueError, match="residual"):
        KERNELS.rms_norm(x, torch.ones(64), 1e-6, torch.zeros(4, 32))
    with pytest.raises(ValueError, match="contiguous"):
        KERNELS.silu_and_mul(torch.randn(64, 4).t())
    with pytest.raises(ValueError, match="float32/bfloat16"):
        KERNELS.silu_and_mul(torch.randn(4, 64).half())
    with pytest.raises(ValueError, match="rotary_"):
        KERNELS.rotary_(x, 3, 32, torch.ones(4, 16), torch.ones(4, 16))  # 3 heads of 32 exceed a 64-wide row
    with pytest.raises(ValueError, match="cos/sin"):
        KERNELS.rotary_(x, 2, 32, torch.ones(4, 16, dtype=torch.bfloat16), torch.ones(4, 16))


needs_gemv = pytest.mark.skipif(KERNELS is None or not KERNELS.has_gemv, reason="no AVX512-BF16 GEMV here")


@needs_gemv
@settings(max_examples=30, deadline=None)
@given(seed=st.integers(0, 2**16), n=st.integers(1, 70), k=st.integers(1, 300), with_bias=st.booleans())
def test_gemv_matches_a_float32_product(seed, n, k, with_bias):
    generator = torch.Generator().manual_seed(seed)
    weight = torch.randn(n, k, generator=generator).bfloat16()
    x = torch.randn(1, k, generator=generator).bfloat16()
    bias = torch.randn(n, generator=generator).bfloat16() if with_bias else None
    expected = weight.float() @ x[0].float() + (bias.float() if with_bias else 0.0)
    ours = KERNELS.gemv(weight, x, bias)
    assert ours.shape == (1, n) and ours.dtype == torch.bfloat16
    # float32 accumulation, one bf16 rounding of the result (plus the bias add's)
    assert torch.allclose(ours[0].float(), expected, rtol=2 ** -7, atol=1e-2 * (k ** 0.5))


@needs_gemv
def test_gemv_refuses_bad_arguments():
    weight, x = torch.randn(8, 64).bfloat16(), torch.randn(1, 64).bfloat16()
    with pytest.raises(ValueError, match="gemv"):
        KERNELS.gemv(weight.float(), x)
    with pytest.raises(ValueError, match="gemv"):
        KERNELS.gemv(weight, torch.randn(2, 64).bfloat16())
    with pytest.raises(ValueError, match="gemv"):
        KERNELS.gemv(weight.t(), torch.randn(1, 8).bfloat16())
    with pytest.raises(ValueError, match="bias"):
        KERNELS.gemv(weight, x, torch.zeros(4, dtype=torch.bfloat16))


@needs_gemv
def test_single_row_linears_use_the_gemv_and_agree_with_the_batched_path():
    from llmctl.engine.layers.linear import ColumnLinear, OneDNNLinearMethod

    layer = ColumnLinear(64, 96, True, OneDNNLinearMethod(batch_hint=16, kernels=KERNELS), torch.bfloat16)
    layer.weight.weight_loader(layer.weight, torch.randn(96, 64).bfloat16(), None)
    layer.bias.weight_loader(layer.bias, torch.randn(96).bfloat16(), None)
    layer.process_weights_after_loading()
    x = torch.randn(1, 64).bfloat16()
    batched = layer(torch.cat([x, x]))[:1]  # two rows: oneDNN's packed GEMM
    assert torch.allclose(layer(x).float(), batched.float(), rtol=2 ** -7, atol=2e-2)
