"""The native CPU kernels: paged decode attention against a plain-torch reference, argument checks,
and the build (cache reuse, opting out, no compiler)."""

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
       dim=st.sampled_from([32, 64, 128]), block_size=st.sampled_from([1, 8, 16, 32]),
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
@pytest.mark.parametrize("change, message", [
    (lambda a: {**a, "q": a["q"].half()}, "unsupported dtypes"),
    (lambda a: {**a, "k_pool": a["k_pool"].bfloat16()}, "unsupported dtypes"),
    (lambda a: {**a, "q": a["q"][..., :16]}, "disagree"),
    (lambda a: {**a, "block_tables": a["block_tables"].int()}, "int64"),
    (lambda a: {**a, "k_pool": a["k_pool"][:, :, :12], "v_pool": a["v_pool"][:, :, :12]}, "power of two"),
    (lambda a: {**a, "context_lens": a["context_lens"][:1]}, "int64"),
    (lambda a: {**a, "context_lens": a["context_lens"] + 1000}, "longer than its block table"),
])
def test_bad_arguments_are_refused_before_any_pointer_is_used(change, message):
    q, k_pool, v_pool, tables, lens = random_case(5, torch.float32, 3, 2, 2, 64, 16, 40)
    args = dict(q=q, k_pool=k_pool, v_pool=v_pool, block_tables=tables, context_lens=lens)
    with pytest.raises(ValueError, match=message):
        KERNELS.paged_decode_attention(**change(args), scale=0.125)


@needs_kernels
def test_unsupported_head_dim_is_reported_not_run():
    assert not KERNELS.supports_decode(torch.float32, 4, 2, 16)
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
