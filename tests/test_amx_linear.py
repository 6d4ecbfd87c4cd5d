"""The native AMX bf16 linear (`gemm_amx_bf16`, `AMXLinearMethod`): each row of an M-row product bitwise
equal to that row's one-row product (a verify row's linears equal one-token decodes'), within bf16 rounding
of a float32 product and of F.linear, the tile layout, argument checks, and the method's single weight copy."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st

from llmctl.engine.kernels import load_cpu_kernels
from llmctl.engine.layers.linear import AMXLinearMethod, ColumnLinear, QKVLinear, select_linear_method

KERNELS = load_cpu_kernels()
needs_amx = pytest.mark.skipif(KERNELS is None or not KERNELS.has_amx, reason="no AMX tiles on this CPU")


def case(seed: int, m: int, n: int, k: int, with_bias: bool):
    generator = torch.Generator().manual_seed(seed)
    weight = torch.randn(n, k, generator=generator).bfloat16()
    x = torch.randn(m, k, generator=generator).bfloat16()
    bias = torch.randn(n, generator=generator).bfloat16() if with_bias else None
    return weight, x, bias


def bits(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.int16)


def assert_rows_are_single_row_products(weight, x, bias, rows=None):
    """`rows` (default all): the rows compared one by one."""
    packed = KERNELS.pack_amx(weight)
    together = KERNELS.gemm_amx(packed, x, weight.shape[0], bias)
    rows = list(range(x.shape[0])) if rows is None else rows
    alone = torch.cat([KERNELS.gemm_amx(packed, x[i:i + 1], weight.shape[0], bias) for i in rows])
    assert together.shape == (x.shape[0], weight.shape[0]) and together.dtype == torch.bfloat16
    assert torch.equal(bits(together[rows]), bits(alone))
    return together


def assert_near_float32(ours, weight, x, bias):
    expected = x.float() @ weight.float().T + (bias.float() if bias is not None else 0.0)
    # float32 accumulation, one bf16 rounding of the result (plus the bias add's)
    assert torch.allclose(ours.float(), expected, rtol=2 ** -7, atol=1e-2 * (weight.shape[1] ** 0.5))


@needs_amx
@settings(max_examples=12, deadline=None)
@given(seed=st.integers(0, 2**16), m=st.integers(1, 24), n=st.integers(1, 150), k=st.integers(1, 200),
       with_bias=st.booleans())
def test_each_row_is_bitwise_its_one_row_product(seed, m, n, k, with_bias):
    weight, x, bias = case(seed, m, n, k, with_bias)
    assert_near_float32(assert_rows_are_single_row_products(weight, x, bias), weight, x, bias)


@needs_amx
@pytest.mark.parametrize("m,n,k", [(5, 960, 576), (37, 192, 576), (600, 97, 33)])  # 600: two passes of rows
def test_rows_at_model_shapes_and_past_one_pass(m, n, k):
    weight, x, bias = case(m, m, n, k, True)
    rows = sorted({0, 1, 15, 16, 17, 31, 32, m // 2, 511, 512, 513, m - 1} & set(range(m)))
    ours = assert_rows_are_single_row_products(weight, x, bias, rows)
    assert_near_float32(ours, weight, x, bias)
    assert torch.allclose(ours.float(), F.linear(x, weight, bias).float(), rtol=2 ** -6, atol=0.1)


@needs_amx
@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("m,n,k", [
    (33, 96, 64),     # three row tiles: a pair and a lone last tile
    (47, 130, 40),    # the same with padded rows and columns
    (300, 64, 700),   # pair-major (K > 640) over two chunks of rows, a lone last tile
    (300, 1100, 64),  # row-major over two blocks of outputs, its epilogue written during the next item
    (1040, 70, 32),   # passes of 512, 512 and 16 rows
])
def test_every_blocking_of_many_rows_keeps_rows_bitwise_one_row_products(m, n, k, threads):
    weight, x, bias = case(m + n + k, m, n, k, True)
    packed = KERNELS.pack_amx(weight)
    previous = torch.get_num_threads()
    try:
        torch.set_num_threads(threads)
        together = KERNELS.gemm_amx(packed, x, n, bias)
        torch.set_num_threads(1)
        # every tile boundary of the first 64 rows and of the passes, and a stride through the rest
        rows = sorted(set(range(min(m, 64))) | set(range(0, m, 7)) | {r for r in (511, 512, 1023, 1024) if r < m}
                      | {m - 1})
        alone = torch.cat([KERNELS.gemm_amx(packed, x[i:i + 1], n, bias) for i in rows])
    finally:
        torch.set_num_threads(previous)
    assert torch.equal(bits(together[rows]), bits(alone))
    assert_near_float32(together, weight, x, bias)


@needs_amx
def test_the_thread_count_does_not_change_a_bit():
    weight, x, bias = case(7, 21, 300, 96, True)
    packed = KERNELS.pack_amx(weight)
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = KERNELS.gemm_amx(packed, x, 300, bias)
        torch.set_num_threads(2)
        two = KERNELS.gemm_amx(packed, x, 300, bias)
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(bits(one), bits(two))


@needs_amx
def test_the_tile_layout():
    weight = torch.arange(70 * 40, dtype=torch.float32).view(70, 40).bfloat16()
    tiles = KERNELS.pack_amx(weight)
    assert tiles.shape == (4, 2, 2, 16, 16, 2)  # 70 outputs padded to 128 (4 pairs of 32), 40 inputs to 64
    pair, step, tile, p, j, e = 1, 0, 1, 3, 5, 1
    assert tiles[pair, step, tile, p, j, e] == weight[pair * 32 + tile * 16 + j, step * 32 + 2 * p + e]
    assert tiles[2, 1, 0, 15, 0, 1].item() == 0 and tiles[3].abs().sum().item() == 0  # padding is zeros


@needs_amx
def test_bad_arguments_are_refused():
    weight, x, _ = case(0, 2, 64, 64, False)
    packed = KERNELS.pack_amx(weight)
    with pytest.raises(ValueError, match="gemm_amx"):
        KERNELS.gemm_amx(packed, x.float(), 64)
    with pytest.raises(ValueError, match="gemm_amx"):
        KERNELS.gemm_amx(packed, torch.randn(2, 32).bfloat16(), 64)  # not the packed weight's K
    with pytest.raises(ValueError, match="gemm_amx"):
        KERNELS.gemm_amx(weight, x, 64)  # a plain weight, not pack_amx's tiles
    with pytest.raises(ValueError, match="bias"):
        KERNELS.gemm_amx(packed, x, 64, torch.zeros(3, dtype=torch.bfloat16))


# ---- the linear method -----------------------------------------------------------------------------

@needs_amx
def test_bf16_cpu_linears_use_it_and_keep_one_copy():
    method = select_linear_method(torch.device("cpu"), torch.bfloat16, KERNELS)
    assert isinstance(method, AMXLinearMethod)
    layer = QKVLinear(64, 48, 16, bias=True, method=method, dtype=torch.bfloat16)
    weight, bias = torch.randn(80, 64).bfloat16(), torch.randn(80).bfloat16()
    for shard, (start, size) in layer.output_offsets.items():
        layer.weight.weight_loader(layer.weight, weight[start:start + size], shard)
        layer.bias.weight_loader(layer.bias, bias[start:start + size], shard)
    layer.process_weights_after_loading()
    assert layer.weight is None and layer.amx_tiles is not None  # the tiles are the only copy
    x = torch.randn(5, 64).bfloat16()
    verify_row = layer(x)
    decodes = torch.cat([layer(x[i:i + 1]) for i in range(5)])
    assert torch.equal(bits(verify_row), bits(decodes))
    assert torch.allclose(verify_row.float(), F.linear(x, weight, bias).float(), rtol=2 ** -6, atol=0.1)
    assert layer(x.view(1, 5, 64)).shape == (1, 5, 80)


@needs_amx
def test_a_tied_output_projection_keeps_the_embedding():
    method = AMXLinearMethod(KERNELS)
    embedding = torch.nn.Parameter(torch.randn(100, 64).bfloat16(), requires_grad=False)
    with torch.device("meta"):
        layer = ColumnLinear(64, 100, False, method, torch.bfloat16)
    method.tie_weight(layer, embedding)
    layer.process_weights_after_loading()
    assert layer.weight is embedding
    x = torch.randn(3, 64).bfloat16()
    assert torch.allclose(layer(x).float(), (x.float() @ embedding.float().T), rtol=2 ** -7, atol=0.1)
