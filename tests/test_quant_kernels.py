"""The canonical quantised form (`GroupedIntWeight`) and every run-time layout `install_grouped_weight` picks,
each against the float32 reference `GroupedIntWeight.dequantize()`."""

from __future__ import annotations

import pytest
import torch

from llmctl.engine.args import ON_THE_FLY_QUANTIZATIONS
from llmctl.engine.errors import ModelLoadError
from llmctl.engine.kernels import quant as quant_module
from llmctl.engine.kernels.quant import (IQ4_CODES, IQ4_GRID, KernelWeight, PartPlan, deinterleave_codes,
                                         deinterleave_groups, interleave_codes, interleave_groups, load_quant_kernels,
                                         plan_parts)
from llmctl.engine.layers.linear import ColumnLinear, UnquantizedLinearMethod
from llmctl.engine.kernels import load_cpu_kernels
from llmctl.engine.layers.quantization import DEFAULT_REGISTRY, FLAG
from llmctl.engine.layers.quantization.grouped import (AMX_MAX_ROWS, AMX_MIN_ROWS, BF16_GEMM_MIN_ROWS,
                                                       BF16_GEMM_MIN_ROWS_LONG, INT8_TILE_MAX_ROWS, INT8_TILE_MIN_ROWS,
                                                       NATIVE_MAX_ROWS, GroupedIntLinearMethod, GroupedIntWeight,
                                                       bf16_gemm_min_rows, gemv_max_rows, install_grouped_weight,
                                                       pack_int4, unpack_int4)


def random_grouped(out_features, in_features, bits, group_size, *, asymmetric=False, permuted=False, seed=0):
    generator = torch.Generator().manual_seed(seed)
    groups = (out_features, in_features // group_size)
    codes = torch.randint(0, 1 << bits, (out_features, in_features), generator=generator).to(torch.uint8)
    scales = (torch.rand(groups, generator=generator) * 0.02 + 0.001).to(torch.float16)
    zeros = torch.randint(0, 1 << bits, groups, generator=generator).float() if asymmetric else None
    perm = torch.randperm(in_features, generator=generator) if permuted else None
    return GroupedIntWeight(codes, scales, zeros, bits, group_size, perm)


def make_layer(weight: GroupedIntWeight, dtype=torch.bfloat16, bias=False):
    # built as an unquantised linear (its loading form), then the grouped weight replaces its parameters
    layer = ColumnLinear(weight.in_features, weight.out_features, bias, UnquantizedLinearMethod(), dtype)
    if bias:
        layer.bias.data.normal_()
    layer.method = GroupedIntLinearMethod()
    return layer, install_grouped_weight(layer, weight)


def test_the_registered_quantization_values_are_the_engine_args_choices():
    # EngineArgs keeps its own list so that the CLI validates without importing torch
    assert set(DEFAULT_REGISTRY.names(FLAG)) == set(ON_THE_FLY_QUANTIZATIONS)


@pytest.mark.parametrize("bits, group, symmetric", [(8, 64, True), (8, 32, False), (4, 32, True), (4, 16, False)])
def test_quantize_round_trips_its_own_dequantisation(bits, group, symmetric):
    weight = torch.randn(24, 128) * 0.05
    weight[3, :group] = 0.0  # an all-zero group keeps a finite scale and dequantises to zeros
    quantised = GroupedIntWeight.quantize(weight, bits, group, symmetric)
    assert quantised.codes.dtype is torch.uint8 and int(quantised.codes.max()) < (1 << bits)
    assert quantised.scales.dtype is torch.float16
    restored = quantised.dequantize()
    assert torch.all(restored[3, :group] == 0)
    # round to nearest: every weight within half a step of its group's scale (asymmetric: the zero point is
    # rounded too, so a weight at the range's end may be clamped by up to one step)
    step = quantised.scales.float().repeat_interleave(group, dim=1)
    error = (restored - weight).abs() / step
    assert error.max() <= (0.5 if symmetric else 1.0) + 1e-3 and error.mean() < 0.3


def test_asymmetric_int4_beats_symmetric_on_a_shifted_weight():
    weight = torch.rand(16, 64) * 0.1 + 0.05  # all positive: symmetric wastes half its codes
    error = {sym: (GroupedIntWeight.quantize(weight, 4, 32, sym).dequantize() - weight).abs().mean()
             for sym in (True, False)}
    assert error[False] < 0.6 * error[True]


def test_permuted_weight_dequantises_in_input_order():
    weight = random_grouped(8, 64, 4, 32, permuted=True)
    plain = GroupedIntWeight(weight.codes, weight.scales, None, 4, 32).dequantize()
    assert torch.equal(weight.dequantize()[:, weight.perm], plain)


def test_int4_packing_round_trips():
    codes = torch.randint(0, 16, (5, 12), dtype=torch.uint8)
    packed = pack_int4(codes)
    assert packed.shape == (5, 6) and torch.equal(packed[0, 0], codes[0, 0] | (codes[0, 1] << 4))
    assert torch.equal(unpack_int4(packed), codes)


HAS_KERNELS = load_quant_kernels() is not None


@pytest.mark.parametrize("shape, bits, group, asymmetric, permuted, layouts", [
    # (float32 layout, bfloat16 layout, bfloat16 layout without the native kernels)
    ((32, 64), 8, 64, False, False, ("int8pack", "native", "int8pack")),
    ((32, 64), 8, 64, False, True, ("int8pack", "native", "int8pack")),
    ((32, 64), 8, 32, True, False, ("dequant", "native", "dequant")),      # grouped int8 with zeros (GPTQ 8-bit)
    ((40, 256), 8, 32, False, False, ("dequant", "native", "dequant")),    # GGUF Q8_0: symmetric, groups of 32
    ((48, 512), 6, 16, False, False, ("dequant", "native", "dequant")),    # GGUF Q6_K: 6-bit codes, groups of 16
    ((32, 256), 6, 16, True, False, ("dequant", "native", "dequant")),     # Q4_K beside Q6_K in one fused layer
    ((40, 256), 6, 32, True, False, ("dequant", "native", "dequant")),     # GGUF Q5_1/Q5_K
    ((48, 512), 8, 16, False, False, ("dequant", "native", "dequant")),    # Q6_K beside Q8_0: 8-bit groups of 16
    ((32, 40), 8, 40, False, False, ("dequant", "native", "dequant")),     # inputs int8pack does not take
    ((32, 42), 8, 42, False, False, ("dequant", "dequant", "dequant")),    # groups not whole 4-input chunks
    ((32, 128), 4, 32, False, False, ("int4pack", "native", "int4pack")),
    ((48, 128), 4, 64, True, True, ("int4pack", "native", "int4pack")),
    ((24, 64), 4, 32, True, False, ("dequant", "native", "dequant")),      # outputs not a multiple of 16
    ((16, 576), 4, 576, False, True, ("dequant", "native", "dequant")),    # one group per row (GPTQ group_size -1)
    ((32, 64), 4, 16, False, False, ("dequant", "native", "dequant")),     # a group size torch lacks
    ((32, 36), 4, 12, False, False, ("dequant", "dequant", "dequant")),    # groups not whole 8-input chunks
])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
# 20: the native layout's AMX GEMM where the CPU has AMX (AMX_MIN_ROWS), else its GEMV; 48: dequantise + GEMM
# without AMX (NATIVE_MAX_ROWS)
@pytest.mark.parametrize("rows", [1, 3, 20, 48])
def test_each_layout_matches_the_dequantised_reference(shape, bits, group, asymmetric, permuted, layouts, dtype, rows):
    weight = random_grouped(*shape, bits, group, asymmetric=asymmetric, permuted=permuted)
    layer, chosen = make_layer(weight, dtype, bias=True)
    assert chosen == layouts[0 if dtype is torch.float32 else 1 if HAS_KERNELS else 2]
    x = torch.randn(rows, 2, shape[1]).to(dtype)
    expected = x.float() @ weight.dequantize().T + layer.bias.float()
    got = layer(x)
    assert got.shape == (rows, 2, shape[0]) and got.dtype == dtype
    tolerance = 2e-4 if dtype is torch.float32 else 2e-2
    assert (got.float() - expected).abs().max().item() <= tolerance * expected.abs().max().item() + 1e-5


def test_install_replaces_the_loading_parameters():
    weight = random_grouped(32, 64, 4, 32)
    layer, layout = make_layer(weight, dtype=torch.float32, bias=True)
    names = dict(layer.named_parameters())
    assert layout == "int4pack" and set(names) == {"bias", "weight", "weight_scales_and_zeros"}
    assert names["weight"].dtype is torch.uint8 and names["weight"].numel() == 32 * 64 // 2
    if HAS_KERNELS:  # the native layout holds the codes (two 4-bit codes a byte) and float16 scales only
        layer, layout = make_layer(random_grouped(24, 64, 4, 32), bias=True)
        names = dict(layer.named_parameters())
        assert layout == "native" and set(names) == {"bias", "weight", "weight_scale"}
        assert names["weight"].dtype is torch.uint8 and names["weight"].numel() == 32 * 64 // 2  # 2 blocks of 16
        assert names["weight_scale"].dtype is torch.float16 and names["weight_scale"].numel() == 32 * 2


def test_install_refuses_a_weight_of_another_shape():
    layer = ColumnLinear(64, 32, False, UnquantizedLinearMethod(), torch.bfloat16)
    with pytest.raises(ModelLoadError, match=r"shape \(16, 64\) does not fit a linear of 64 inputs and 32 outputs"):
        install_grouped_weight(layer, random_grouped(16, 64, 4, 32))


@pytest.mark.parametrize("change, message", [
    (dict(bits=3), "bits must be 4, 6 or 8"),
    (dict(group_size=48), "group size 48 does not divide the 64 inputs"),
    (dict(codes=torch.full((8, 64), 16, dtype=torch.uint8)), "4-bit codes must lie in 0..15"),
    (dict(codes=torch.full((8, 64), 64, dtype=torch.uint8), bits=6), "6-bit codes must lie in 0..63"),
    (dict(codes=torch.zeros(8, 64, dtype=torch.int32)), "codes must be a uint8"),
    (dict(scales=torch.ones(8, 3)), r"scales must be a float \(8, 2\) tensor"),
    (dict(zeros=torch.ones(8, 1)), r"zeros must be a real \(8, 2\) tensor"),
    (dict(perm=torch.zeros(64, dtype=torch.int64)), "perm is not a permutation"),
])
def test_malformed_grouped_weights_are_refused(change, message):
    fields = dict(codes=torch.zeros(8, 64, dtype=torch.uint8), scales=torch.ones(8, 2), zeros=None, bits=4,
                  group_size=32)
    fields.update(change)
    with pytest.raises(ValueError, match=message):
        GroupedIntWeight(**fields)


# ---- the native kernels (engine/kernels/quant_*.c), both bodies --------------------------------------------

def kernels_or_skip(target):
    kernels = load_quant_kernels(target)
    if kernels is None:
        pytest.skip(f"the {target} quant kernels do not build or run here")
    return kernels


@pytest.mark.parametrize("bits", [4, 6, 8])
@pytest.mark.parametrize("out_features, in_features", [(16, 64), (37, 576), (5, 24)])
def test_the_interleaved_layout_round_trips(bits, out_features, in_features):
    codes = torch.randint(0, 1 << bits, (out_features, in_features), dtype=torch.uint8)
    packed = interleave_codes(codes, bits)
    assert torch.equal(deinterleave_codes(packed, bits, out_features), codes)
    if bits == 6:  # the 8-bit layout's chunks, each in 48 bytes: nibbles two a byte, then the high 2 bits
        eight = interleave_codes(codes, 8)
        assert packed.shape == eight.shape[:2] + (48,)
        assert torch.equal(packed[..., :32], (eight[..., 0::2] & 15) | (eight[..., 1::2] & 15) << 4)
        row, byte = 3, 2  # row 3's bytes 4 * 3 + j: their high bits at bits 2j of high byte 3
        assert int(packed[0, 1, 32 + row] >> 2 * byte) & 3 == int(eight[0, 1, 4 * row + byte]) >> 4
        return
    step = 4 if bits == 8 else 8  # inputs per 64-byte chunk of 16 rows
    assert packed.shape == (-(-out_features // 16), in_features // step, 64) and packed.dtype is torch.uint8
    assert torch.equal(deinterleave_codes(packed, bits, out_features), codes)
    # chunk 1 of block 0, row 3: 16-bit word 2 * 3 + e holds (8 bits) inputs e and 2 + e in its bytes,
    # (4 bits) inputs 2t + e in nibble t
    for e in (0, 1):
        word = int(packed[0, 1, 4 * 3 + 2 * e]) | int(packed[0, 1, 4 * 3 + 2 * e + 1]) << 8
        parts = [(word >> bits * t) & ((1 << bits) - 1) for t in range(step // 2)]
        assert parts == [int(codes[3, step + 2 * t + e]) for t in range(step // 2)]
    scales = torch.randn(out_features, 3).half()
    grouped = interleave_groups(scales)
    assert grouped.shape == (-(-out_features // 16), 3, 16) and torch.equal(grouped[0, 2, 3], scales[3, 2])
    assert torch.all(grouped[-1, :, (out_features - 1) % 16 + 1:] == 0)  # padded rows: scale 0
    assert torch.equal(deinterleave_groups(grouped, out_features), scales)


def iq4_grouped(out_features, in_features, group_size, *, asymmetric=False, seed=0):
    """8-bit codes as GGUF's IQ4_NL/IQ4_XS load: every code one of IQ4_GRID's 16."""
    weight = random_grouped(out_features, in_features, 8, group_size, asymmetric=asymmetric, seed=seed)
    generator = torch.Generator().manual_seed(seed + 1)
    indices = torch.randint(0, 16, (out_features, in_features), generator=generator)
    codes = torch.tensor(IQ4_GRID, dtype=torch.uint8)[indices]
    return GroupedIntWeight(codes, weight.scales, weight.zeros, 8, group_size)


@pytest.mark.parametrize("out_features, in_features", [(16, 64), (37, 576), (5, 24)])
def test_iq4_grid_codes_store_as_grid_indices(out_features, in_features):
    codes = iq4_grouped(out_features, in_features, in_features).codes
    packed = interleave_codes(codes, IQ4_CODES)
    # the 8-bit layout's chunks, each byte replaced by its grid index, two a byte as the 6-bit format's nibbles
    indices = torch.tensor([IQ4_GRID.index(int(c)) for c in codes.flatten()], dtype=torch.uint8).view(codes.shape)
    assert packed.shape == (-(-out_features // 16), in_features // 4, 32) and packed.is_contiguous()
    assert torch.equal(packed, interleave_codes(indices, 6)[..., :32])
    assert torch.equal(deinterleave_codes(packed, IQ4_CODES, out_features), codes)
    off_grid = codes.clone()
    off_grid[-1, -1] = 128  # the midpoint itself is not on IQ4_NL's grid
    with pytest.raises(ValueError, match="must all lie in IQ4_GRID"):
        interleave_codes(off_grid, IQ4_CODES)


@pytest.mark.parametrize("target", ["native", "avx2", "skylake-avx512"])
@pytest.mark.parametrize("group, asymmetric, shape", [(32, False, (40, 576)), (256, True, (37, 512)),
                                                      (4, False, (19, 36))])
def test_iq4_grid_codes_run_as_the_8_bit_layout_bitwise(target, group, asymmetric, shape):
    """8-bit codes that all lie on IQ4_NL's grid packed as IQ4_CODES (half the bytes), as `pack_parts` chooses for
    them: every kernel gives the 8-bit layout's outputs bit for bit: the one-row stream, narrow and wide tiles, the
    dequantiser and the bf16 GEMM."""
    if target == "skylake-avx512" and not {"avx512f", "avx512bw", "avx512vl", "avx512dq", "avx512cd"} <= cpu_flags():
        pytest.skip("this CPU cannot run a Skylake-X AVX-512 build")
    kernels = kernels_or_skip(target)
    weight = iq4_grouped(*shape, group, asymmetric=asymmetric)
    (grid,) = kernels.pack_parts(weight.codes, weight.scales, weight.zeros, 8, group).parts
    assert grid.bits == IQ4_CODES and grid.codes.shape[-1] == 32
    eight = KernelWeight(interleave_codes(weight.codes, 8), grid.scales, grid.zeros, 8, group, shape[1], shape[0])
    bias = torch.randn(shape[0]).bfloat16()
    for rows in (1, 3, 19, 40):
        x = torch.randn(rows, shape[1]).bfloat16()
        got, expected = (kernels.gemv(weight_, x, bias).view(torch.int16) for weight_ in (grid, eight))
        assert torch.equal(got, expected)
        if kernels.has_bf16_gemm:
            assert torch.equal(kernels.gemm_bf16(grid, x, bias), kernels.gemm_bf16(eight, x, bias))
    assert torch.equal(kernels.dequantize(grid), weight.dequantize().to(torch.bfloat16))


def test_only_codes_on_the_iq4_grid_change_format():
    on_grid = iq4_grouped(16, 64, 32)
    assert plan_parts(on_grid.codes, on_grid.scales, None, 8, 32) == [PartPlan(0, 16, IQ4_CODES, 0)]
    int8 = GroupedIntWeight.quantize(torch.randn(300, 64), 8, 64)  # on the fly: codes off the grid (128 is)
    assert plan_parts(int8.codes, int8.scales, None, 8, 64) == [PartPlan(0, 300, 8, 0)]
    late = on_grid.codes.repeat(20, 1)
    late[-1, 0] = 2  # one code off the grid in the last block: too few rows saved to split
    assert plan_parts(late, torch.ones(320, 2), None, 8, 32) == [PartPlan(0, 320, 8, 0)]


def q4_k_beside_q6_k(q_rows=2048, v_rows=192, k=576):
    """A fused GGUF qkv as it loads: Q4_K q/k (4-bit codes, zeros, scales of 32 repeated to Q6_K's groups of 16)
    beside a Q6_K v (6-bit codes symmetric at 32, stored as zeros)."""
    generator = torch.Generator().manual_seed(3)
    q = torch.randint(0, 16, (q_rows, k), generator=generator).to(torch.uint8)
    v = torch.randint(0, 64, (v_rows, k), generator=generator).to(torch.uint8)
    q_scales = (torch.rand(q_rows, k // 32, generator=generator) * 0.01 + 0.001).repeat_interleave(2, dim=1)
    q_zeros = (torch.rand(q_rows, k // 32, generator=generator) * 8).repeat_interleave(2, dim=1)
    v_scales = torch.rand(v_rows, k // 16, generator=generator) * 0.01 + 0.001
    scales = torch.cat([q_scales, v_scales]).half().float()
    zeros = torch.cat([q_zeros, torch.full((v_rows, k // 16), 32.0)]).half().float()
    return GroupedIntWeight(torch.cat([q, v]), scales, zeros, 6, 16)


def test_rows_whose_codes_fit_fewer_bits_become_parts_of_their_own():
    weight = q4_k_beside_q6_k()
    # the q/k rows save (0.75 - 0.5) bytes a code over 2048 x 576 (288 KiB): above PART_MIN_SAVED_BYTES
    assert 0.25 * 2048 * 576 > quant_module.PART_MIN_SAVED_BYTES > 0.25 * 1024 * 576
    assert plan_parts(weight.codes, weight.scales, weight.zeros, 6, 16) == [PartPlan(0, 2048, 4, 0),
                                                                          PartPlan(2048, 2240, 6, 0)]
    # symmetric 8-bit codes: Q4_0 rows widened (q + 120) return to 4 bits at their own midpoint 8
    generator = torch.Generator().manual_seed(4)
    widened = torch.randint(0, 16, (1024, 576), generator=generator).to(torch.uint8) + 120
    wide = torch.randint(1, 256, (48, 576), generator=generator).to(torch.uint8)
    codes = torch.cat([widened, wide])
    assert plan_parts(codes, torch.ones(1072, 18), None, 8, 32) == [PartPlan(0, 1024, 4, 120),
                                                                    PartPlan(1024, 1072, 8, 0)]
    # IQ4 grid rows beside others; a narrow run saving too little stays in the weight's format
    grid = iq4_grouped(1024, 576, 32).codes
    assert plan_parts(torch.cat([grid, wide]), torch.ones(1072, 18), None, 8, 32) == [
        PartPlan(0, 1024, IQ4_CODES, 0), PartPlan(1024, 1072, 8, 0)]
    assert plan_parts(torch.cat([grid[:64], wide]), torch.ones(112, 18), None, 8, 32) == [PartPlan(0, 112, 8, 0)]
    # a run saving too little beside another part is a part anyway: it keeps its own format (IQ4_XS q/k beside
    # a Q5_K v)
    five_bit = torch.randint(0, 32, (64, 576), generator=generator).to(torch.uint8)
    assert plan_parts(torch.cat([grid, five_bit]), torch.ones(1088, 18), torch.zeros(1088, 18), 8, 32) == [
        PartPlan(0, 1024, IQ4_CODES, 0), PartPlan(1024, 1088, 6, 0)]
    # every row narrower: one part whatever it saves
    assert plan_parts(grid[:16], torch.ones(16, 18), None, 8, 32) == [PartPlan(0, 16, IQ4_CODES, 0)]


@pytest.mark.parametrize("target", ["native", "avx2"])
def test_a_weight_in_parts_runs_each_part_in_its_own_format_and_groups(target):
    kernels = kernels_or_skip(target)
    weight = q4_k_beside_q6_k()
    packed = kernels.pack_parts(weight.codes, weight.scales, weight.zeros, 6, 16)
    assert [(p.bits, p.group_size, p.out_features) for p in packed.parts] == [(4, 32, 2048), (6, 16, 192)]
    assert packed.starts == (0, 2048) and packed.out_features == 2240
    # one flat storage, the parts views of it: the q/k rows' groups of 32 restored (half the scale bytes)
    assert packed.codes.numel() == 2048 * 576 // 2 + 192 * 576 * 3 // 4
    assert packed.scales.numel() == 2048 * 18 + 192 * 36 == packed.zeros.numel()
    assert packed.parts[1].codes.data_ptr() == packed.codes.data_ptr() + 2048 * 576 // 2
    reference = weight.dequantize()
    for rows in (1, 5):
        x = torch.randn(rows, 576).bfloat16()
        got = torch.cat([kernels.gemv(part, x) for part in packed.parts], dim=1)
        expected = x.float() @ reference.T
        assert (got.float() - expected).abs().max().item() <= 8e-3 * expected.abs().max().item()


def test_a_layer_in_parts_is_its_parts_products_side_by_side(monkeypatch):
    kernels = kernels_or_skip("native")
    weight = q4_k_beside_q6_k(q_rows=64, v_rows=32, k=64)
    layer, layout = make_layer(weight, bias=True)  # saves too little to split
    assert layout == "native" and len(layer.kernel_parts.parts) == 1
    monkeypatch.setattr(quant_module, "PART_MIN_SAVED_BYTES", 0)
    layer, layout = make_layer(weight, bias=True)
    parts = layer.kernel_parts.parts
    assert [(p.bits, p.group_size) for p in parts] == [(4, 32), (6, 16)] and layer.int8_tiles == (False, False)
    for rows in (1, 3, BF16_GEMM_MIN_ROWS, NATIVE_MAX_ROWS):
        x = torch.randn(rows, 64).bfloat16()
        got = layer(x)
        if rows < AMX_MIN_ROWS:  # the GEMV on every CPU: each part's own, bitwise
            expected = torch.cat([kernels.gemv(part, x, layer.bias[start:start + part.out_features])
                                  for part, start in zip(parts, layer.kernel_parts.starts)], dim=1)
            assert torch.equal(got, expected), rows
        assert (got.float() - (x.float() @ weight.dequantize().T + layer.bias.float())).abs().max() < 0.05


@pytest.mark.parametrize("target", ["native", "avx2"])
@pytest.mark.parametrize("bits, group, asymmetric, shape", [
    (8, 576, False, (37, 576)), (8, 32, True, (37, 576)), (8, 64, False, (37, 576)), (4, 32, False, (37, 576)),
    (4, 64, True, (37, 576)), (4, 192, True, (37, 576)), (4, 576, False, (37, 576)),
    (8, 1536, False, (200, 1536)),  # per row over 1536 inputs: x blocks of 256 inside the one group
    (8, 4, True, (19, 36)), (4, 8, False, (5, 24)),  # the smallest groups, one partial block of rows
    (4, 8, True, (21, 40)),  # five chunks: one row's byte planes four chunks a vector, then one alone
    (4, 32, False, (20, 8224)),  # one row past the 8192 inputs prepared on the stack: heap buffers
    (6, 16, False, (37, 576)), (6, 32, True, (37, 576)), (6, 4, True, (19, 36)),  # GGUF Q6_K, Q5_K; the smallest
])
def test_kernel_matches_the_dequantised_reference(target, bits, group, asymmetric, shape):
    kernels = kernels_or_skip(target)
    out_features, in_features = shape
    weight = GroupedIntWeight.quantize(torch.randn(*shape) * 0.05, bits, group, not asymmetric)
    packed = kernels.pack(weight.codes, weight.scales, weight.zeros, bits, group)
    reference = weight.dequantize()
    bias = torch.randn(out_features).bfloat16()
    for rows in (1, 2, 3, 4, 5, 9, 17):
        x = torch.randn(rows, in_features).bfloat16()
        expected = x.float() @ reference.T + bias.float()
        got = kernels.gemv(packed, x, bias)
        assert got.dtype is torch.bfloat16 and got.shape == (rows, out_features)
        # bf16 rounding of the output (2^-8 relative) is the only difference
        assert (got.float() - expected).abs().max().item() <= 8e-3 * expected.abs().max().item()
        assert torch.allclose(kernels.gemv(packed, x).float() + bias.float(), expected, rtol=1e-2,
                              atol=1e-2 * expected.abs().max().item())


@pytest.mark.parametrize("target", ["native", "avx2"])
@pytest.mark.parametrize("bits, group, asymmetric, in_features", [
    (8, 32, True, 576), (8, 576, False, 576), (4, 32, False, 576), (4, 64, True, 576), (4, 576, False, 576),
    (8, 4, False, 36), (4, 8, True, 24), (6, 16, False, 576), (6, 32, True, 576), (6, 4, True, 36)])
def test_kernel_dequantises_to_the_reference_in_bfloat16(target, bits, group, asymmetric, in_features):
    kernels = kernels_or_skip(target)
    weight = GroupedIntWeight.quantize(torch.randn(21, in_features) * 0.05, bits, group, not asymmetric)
    got = kernels.dequantize(kernels.pack(weight.codes, weight.scales, weight.zeros, bits, group))
    assert got.dtype is torch.bfloat16 and torch.equal(got, weight.dequantize().to(torch.bfloat16))


@pytest.mark.parametrize("bits, group, in_features", [(4, 32, 576), (8, 576, 576), (8, 1536, 1536), (4, 8, 24),
                                                     (6, 16, 576), (6, 4, 36), (4, 64, 576), (4, 128, 512),
                                                     (4, 256, 512), (4, 576, 576), (4, 192, 576), (8, 32, 576),
                                                     (8, 64, 576), (8, 256, 512), (6, 32, 576),
                                                     (8, 512, 1024), (4, 512, 1024)])  # 2 x blocks a group
def test_the_avx512_and_avx2_bodies_agree_bitwise(bits, group, in_features):
    """The AVX-512 body converts activation blocks 16 a vector, the AVX2 body one at a time (the scalar rules):
    the same codes, scales and sums, so the same outputs bit for bit; blocks of zeros, of a magnitude past 3e38,
    an infinity or a NaN included (those take the scalar rules in both)."""
    native, avx2 = kernels_or_skip("native"), kernels_or_skip("avx2")
    if native.isa != 512:
        pytest.skip("the native body is the AVX2 one here")
    weight = GroupedIntWeight.quantize(torch.randn(40, in_features) * 0.05, bits, group, True)
    packed = [k.pack(weight.codes, weight.scales, weight.zeros, bits, group) for k in (native, avx2)]
    # 19 rows: two of the AVX-512 body's 8-row wide tiles (its 40 outputs: a pair of blocks and a lone one), then
    # its narrow tiles
    x = (torch.randn(19, in_features) * torch.logspace(-3, 3, in_features)).bfloat16()
    x[1], x[2, 5], x[3, 7], x[4, 1] = 0, float("inf"), float("nan"), 3.3e38
    bias = torch.randn(40).bfloat16()
    got = [k.gemv(w, x, bias).view(torch.int16) for k, w in zip((native, avx2), packed)]
    assert torch.equal(got[0], got[1])
    # one row: the AVX-512 body's one-stream path (x blocks of 4 to 64 chunks at fixed counts; 4 bits: byte planes)
    for row in x[:5]:
        got = [k.gemv(w, row[None], bias).view(torch.int16) for k, w in zip((native, avx2), packed)]
        assert torch.equal(got[0], got[1])


def cpu_flags() -> set[str]:
    try:
        with open("/proc/cpuinfo") as info:
            return next((set(line.split(":", 1)[1].split()) for line in info if line.startswith("flags")), set())
    except OSError:
        return set()


@pytest.mark.parametrize("bits, group, asymmetric", [(4, 32, False), (6, 16, False), (6, 32, True), (8, 64, True)])
def test_the_avx512_body_without_vnni_vbmi_and_bf16_agrees_bitwise(bits, group, asymmetric):
    """Skylake-X to Ice Lake: the AVX-512 body built without VNNI (pair dot products as madd + add), VBMI (6-bit
    chunks' high bits spread by shifts) and AVX512-BF16 (the dequantiser's own rounding) gives this CPU's build's
    outputs bit for bit."""
    if not {"avx512f", "avx512bw", "avx512vl", "avx512dq", "avx512cd"} <= cpu_flags():
        pytest.skip("this CPU cannot run a Skylake-X AVX-512 build")
    native, older = kernels_or_skip("native"), kernels_or_skip("skylake-avx512")
    if native.isa != 512:
        pytest.skip("the native body is the AVX2 one here")
    assert older.isa == 512 and not older.has_bf16_gemm and not older.has_amx
    weight = random_grouped(40, 576, bits, group, asymmetric=asymmetric)
    packed = [k.pack(weight.codes, weight.scales, weight.zeros, bits, group) for k in (native, older)]
    for rows in (1, 3, 19):  # the one-row stream, narrow tiles, wide tiles
        x = torch.randn(rows, 576).bfloat16()
        got = [k.gemv(w, x).view(torch.int16) for k, w in zip((native, older), packed)]
        assert torch.equal(got[0], got[1]), rows
    assert torch.equal(older.dequantize(packed[1]), weight.dequantize().to(torch.bfloat16))


@pytest.mark.parametrize("target", ["native", "avx2"])
@pytest.mark.parametrize("rows", [1, 3])
def test_the_chained_gemv_is_the_gemv_whatever_comes_next(target, rows):
    # decode_stack_bf16 calls quant_gemv_bf16_chain by address with the linear it runs next: its threads then
    # prefetch that weight's start, which must not change a bit of this one's outputs (nor fault on a next
    # weight the layout does not cover)
    import ctypes

    kernels = kernels_or_skip(target)
    pointer, int64 = ctypes.c_void_p, ctypes.c_int64
    chain = ctypes.CFUNCTYPE(ctypes.c_int, pointer, pointer, pointer, ctypes.c_int, pointer, pointer, pointer, int64,
                             int64, int64, int64, ctypes.c_int, pointer, pointer, pointer, ctypes.c_int, int64, int64,
                             int64)(kernels.chain_gemv_address)
    weight = GroupedIntWeight.quantize(torch.randn(40, 576) * 0.05, 4, 32, False)
    packed = kernels.pack(weight.codes, weight.scales, weight.zeros, 4, 32)
    following = GroupedIntWeight.quantize(torch.randn(576, 1536) * 0.05, 8, 64, False)
    after = kernels.pack(following.codes, following.scales, following.zeros, 8, 64)
    x, bias = torch.randn(rows, 576).bfloat16(), torch.randn(40).bfloat16()
    expected = kernels.gemv(packed, x, bias)
    codes, scales, zeros, bits = after.arguments
    grid = iq4_grouped(576, 1536, 32)
    grid_next = kernels.pack(grid.codes, grid.scales, None, 8, 32)
    for next_weight in ((codes, scales, zeros, bits, 576, 1536, 64), (None, None, None, 0, 0, 0, 0),
                        (*grid_next.arguments, 576, 1536, 32),  # IQ4_CODES: its chunks are 32 bytes
                        (codes, scales, zeros, 5, 576, 1536, 64)):  # a next weight of bits the layout lacks: none
        got = torch.empty_like(expected)
        assert chain(*packed.arguments, x.data_ptr(), bias.data_ptr(), got.data_ptr(), rows, 40, 576, 32,
                     torch.get_num_threads(), *next_weight) == 1
        assert torch.equal(got.view(torch.int16), expected.view(torch.int16))


@pytest.mark.parametrize("target", ["native", "avx2"])
@pytest.mark.parametrize("bits, group, k", [(4, 32, 576), (8, 64, 1536), (4, 128, 8704)])  # 8704: x on the heap
def test_the_threads_shares_of_a_row_make_the_gemv(target, bits, group, k):
    # decode_stack_bf16's one-region step calls quant_gemv_bf16_share by address, once per thread of its region:
    # the shares, whatever the team's size, write every output of the GEMV bitwise and nothing else
    import ctypes

    kernels = kernels_or_skip(target)
    pointer, int64, c_int = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int
    share = ctypes.CFUNCTYPE(c_int, pointer, pointer, pointer, c_int, pointer, pointer, pointer, int64, int64, int64,
                             c_int, c_int, pointer, pointer, pointer, c_int, int64, int64,
                             int64)(kernels.share_gemv_address)
    weight = GroupedIntWeight.quantize(torch.randn(72, k) * 0.05, bits, group, bits == 4)
    packed = kernels.pack(weight.codes, weight.scales, weight.zeros, bits, group)
    x, bias = torch.randn(1, k).bfloat16(), torch.randn(72).bfloat16()
    expected = kernels.gemv(packed, x, bias)
    for threads in (1, 2, 3, 7):  # 72 rows: 5 blocks of 16, fewer than 7 threads
        got = torch.full_like(expected, float("nan"))
        for me in range(threads):
            assert share(*packed.arguments, x.data_ptr(), bias.data_ptr(), got.data_ptr(), 72, k, group, me, threads,
                         None, None, None, 0, 0, 0, 0) == 1
        assert torch.equal(got.view(torch.int16), expected.view(torch.int16)), threads
    codes, scales, zeros, bits = packed.arguments
    assert share(codes, scales, zeros, 5, x.data_ptr(), None, got.data_ptr(), 72, k, group, 0, 1,
                 None, None, None, 0, 0, 0, 0) == 0  # bits the layout lacks: nothing computed
    assert share(*packed.arguments, x.data_ptr(), None, got.data_ptr(), 72, k, group, 2, 2,
                 None, None, None, 0, 0, 0, 0) == 0  # no such thread


@pytest.mark.parametrize("target", ["native", "avx2"])
def test_activations_are_scaled_per_block_not_per_row(target):
    # inputs 0..31 are 10^4 times inputs 32..63; row 0's weights on the large inputs are all 0, so its output
    # depends on the small inputs alone: one int16 scale for the whole row would round them all to 0
    kernels = kernels_or_skip(target)
    codes = torch.randint(0, 256, (16, 64), dtype=torch.uint8)
    codes[0, :32] = 128  # the midpoint: weight 0
    weight = GroupedIntWeight(codes, torch.full((16, 2), 0.01, dtype=torch.float16), None, 8, 32)
    x = torch.cat([torch.randn(1, 32) * 1e3, torch.randn(1, 32) * 0.1], dim=1).bfloat16()
    expected = x.float() @ weight.dequantize().T
    got = kernels.gemv(kernels.pack(weight.codes, weight.scales, None, 8, 32), x).float()
    assert (got[0, 0] - expected[0, 0]).abs() <= 8e-3 * expected[0, 0].abs()
    assert (got - expected).abs().max() <= 8e-3 * expected.abs().max()


@pytest.mark.parametrize("bits, group, in_features, message", [
    (4, 12, 36, "4-bit groups must be a multiple of 8 inputs, got 12"),
    (8, 6, 36, "8-bit groups must be a multiple of 4 inputs, got 6"),
    (4, 48, 64, "group size 48 does not divide the 64 inputs"),
    (3, 32, 64, "3-bit codes are not supported"),
])
def test_kernel_refuses_shapes_its_layouts_lack(bits, group, in_features, message):
    kernels = kernels_or_skip("native")
    codes = torch.zeros(8, in_features, dtype=torch.uint8)
    with pytest.raises(ValueError, match=message):
        kernels.pack(codes, torch.ones(8, max(1, in_features // group)), None, bits, group)


def test_kernel_refuses_inputs_it_cannot_read():
    kernels = kernels_or_skip("native")
    packed = kernels.pack(torch.zeros(8, 64, dtype=torch.uint8), torch.ones(8, 2), None, 4, 32)
    for x in (torch.zeros(1, 64), torch.zeros(1, 32, dtype=torch.bfloat16), torch.zeros(2, 128, dtype=torch.bfloat16)[:, ::2]):
        with pytest.raises(ValueError, match=r"the input must be a contiguous bf16 \[m, 64\] CPU tensor"):
            kernels.gemv(packed, x)
    with pytest.raises(ValueError, match=r"the bias must be a contiguous bf16 \[8\]"):
        kernels.gemv(packed, torch.zeros(1, 64, dtype=torch.bfloat16), torch.zeros(8))


# ---- the AMX dequantising GEMM (quant_gemm_amx_bf16) ---------------------------------------------------------

def amx_kernels_or_skip():
    kernels, cpu = kernels_or_skip("native"), load_cpu_kernels()
    if not kernels.has_amx or cpu is None or not cpu.has_amx:
        pytest.skip("no AMX tiles on this CPU (or the kernel refuses them)")
    return kernels, cpu


@pytest.mark.parametrize("bits, group, asymmetric, shape", [
    (8, 576, False, (96, 576)), (8, 32, True, (40, 576)), (4, 32, False, (64, 576)), (4, 64, True, (37, 576)),
    (4, 8, False, (17, 40)),   # groups smaller than a 32-input tile step, K padded to 64, one block in the last pair
    (8, 4, True, (33, 36)),    # the smallest 8-bit groups, K padded
    (4, 1536, False, (48, 1536)),
])
def test_amx_gemm_is_the_bf16_amx_kernel_on_the_dequantised_weight_bitwise(bits, group, asymmetric, shape):
    kernels, cpu = amx_kernels_or_skip()
    out_features, in_features = shape
    weight = GroupedIntWeight.quantize(torch.randn(*shape) * 0.05, bits, group, not asymmetric)
    packed = kernels.pack(weight.codes, weight.scales, weight.zeros, bits, group)
    dense = weight.dequantize().to(torch.bfloat16)  # the reference dequantisation, rounded once
    tiles = cpu.pack_amx(dense)
    bias = torch.randn(out_features).bfloat16()
    for rows in (1, 2, 15, 16, 17, 40, 64, 80, 100):  # 80, 100: 3-4 row items, the last a lone 16-row tile
        x = torch.randn(rows, in_features).bfloat16()
        for b in (None, bias):
            got = kernels.gemm_amx(packed, x, b)
            assert got.dtype is torch.bfloat16 and got.shape == (rows, out_features)
            assert torch.equal(got, cpu.gemm_amx(tiles, x, out_features, b))
        expected = x.float() @ weight.dequantize().T + bias.float()
        assert (got.float() - expected).abs().max().item() <= 8e-3 * expected.abs().max().item()
        # against the M = 1 kernel's rows (int16 activations: within tolerance, not bitwise)
        assert torch.allclose(got.float(), kernels.gemv(packed, x, bias).float(), rtol=1e-2,
                              atol=1e-2 * expected.abs().max().item())



@pytest.mark.parametrize("bits", [8, 4])
def test_amx_gemm_groups_the_fused_dequantisation_cannot_take_stay_bitwise(bits):
    # the tiles' (q - zero) * scale is one fused multiply-add only where a group's scales are all positive and
    # finite and its zeros integers (4 bits: with the codes in a float's mantissa only for zeros in [0, 16]);
    # negative scales (GGUF Q4_0's d), zero scales (padded rows, empty groups), fractional zeros (Q4_1, Q4_K) and
    # codes equal to their zero (a -0 weight under a negative scale) take the subtract and multiply, mixed with
    # fused groups in one block
    kernels, cpu = amx_kernels_or_skip()
    out_features, in_features, group = 40, 96, 32
    generator = torch.Generator().manual_seed(3)
    groups = (out_features, in_features // group)
    codes = torch.randint(0, 1 << bits, (out_features, in_features), generator=generator).to(torch.uint8)
    scales = torch.rand(groups, generator=generator) * 0.02 + 0.001
    scales[::3] *= -1.0
    scales[5, 1] = 0.0
    zeros = torch.randint(0, 1 << bits, groups, generator=generator).float()
    zeros[1::4] += torch.rand(zeros[1::4].shape, generator=generator)
    zeros[2, 0], zeros[7, 2], zeros[10, 1] = 20.0, -3.0, 1025.0  # integers outside the codes: still fused
    zeros = zeros.half().float()  # the kernel's float16 zeros are the reference's
    hit = (zeros[:, 0].frac() == 0) & (zeros[:, 0] >= 0) & (zeros[:, 0] < 1 << bits)  # codes equal to their zero
    codes[hit, :group] = zeros[hit, 0].to(torch.uint8)[:, None]
    weight = GroupedIntWeight(codes, scales.half(), zeros, bits, group)
    packed = kernels.pack(weight.codes, weight.scales, weight.zeros, bits, group)
    tiles = cpu.pack_amx(weight.dequantize().to(torch.bfloat16))
    assert torch.equal(kernels.dequantize_amx(packed), tiles)
    for rows in (16, 48):
        x = torch.randn(rows, in_features, generator=generator).bfloat16()
        assert torch.equal(kernels.gemm_amx(packed, x), cpu.gemm_amx(tiles, x, out_features))


@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("kernel, bits, group, shape", [
    ("gemm_amx", 4, 32, (200, 192)),
    ("gemm_amx_int8", 8, 576, (200, 576)),  # 70 rows: two 64-row passes over the weight
])
def test_amx_gemm_rows_do_not_depend_on_the_rest_of_the_call(threads, kernel, bits, group, shape):
    kernels, _ = amx_kernels_or_skip()
    weight = GroupedIntWeight.quantize(torch.randn(*shape) * 0.05, bits, group, False)
    packed = kernels.pack(weight.codes, weight.scales, weight.zeros, bits, group)
    x = torch.randn(70, shape[1]).bfloat16()
    run = getattr(kernels, kernel)
    previous = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        whole = run(packed, x)
        one_by_one = torch.cat([run(packed, x[i:i + 1].contiguous()) for i in range(70)])
    finally:
        torch.set_num_threads(previous)
    assert torch.equal(whole, one_by_one)


@pytest.mark.parametrize("target", ["native", "avx2"])
@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("bits, group, asymmetric, shape", [
    (8, 576, False, (200, 576)),   # 13 blocks: six pairs and a lone one per wide tile row
    (4, 32, True, (72, 96)),
    (8, 12, True, (40, 96)),       # 3 and 1 chunks an x block: the one-row stream's lone last chunk
    (4, 8, False, (48, 64)),
    (6, 16, True, (200, 96)),
])
def test_gemv_rows_do_not_depend_on_the_rest_of_the_call(target, threads, bits, group, asymmetric, shape):
    # 70 rows: the AVX-512 body's 8-row wide tiles, then its narrow ones for the last 6
    kernels = kernels_or_skip(target)
    weight = random_grouped(*shape, bits, group, asymmetric=asymmetric)
    packed = kernels.pack(weight.codes, weight.scales, weight.zeros, bits, group)
    generator = torch.Generator().manual_seed(3)
    x = (torch.randn(70, shape[1], generator=generator) * torch.rand(70, 1, generator=generator) * 4).bfloat16()
    bias = torch.randn(shape[0], generator=generator).bfloat16()
    previous = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        whole = kernels.gemv(packed, x, bias)
        one_by_one = torch.cat([kernels.gemv(packed, x[i:i + 1].contiguous(), bias) for i in range(70)])
    finally:
        torch.set_num_threads(previous)
    assert torch.equal(whole.view(torch.int16), one_by_one.view(torch.int16))


@pytest.mark.parametrize("bits", [4, 6, IQ4_CODES])
def test_a_layer_runs_the_kernel_its_row_count_calls_for(bits):
    kernels = kernels_or_skip("native")
    if bits == IQ4_CODES:
        weight = iq4_grouped(48, 128, 32, asymmetric=True)
    else:
        weight = random_grouped(48, 128, bits, 32, asymmetric=True)
    layer, layout = make_layer(weight, bias=True)
    assert layout == "native" and len(layer.kernel_parts.parts) == 1
    (part,) = layer.kernel_parts.parts
    assert part.bits == bits
    gemv_rows, gemm_from = gemv_max_rows(kernels, bits), bf16_gemm_min_rows(kernels, part)
    # 6-bit and IQ4_CODES codes: the GEMV, then dequantise + one GEMM, on AMX CPUs
    amx = kernels.has_amx and bits in (4, 8)
    for rows in sorted({1, AMX_MIN_ROWS - 1, AMX_MIN_ROWS, gemm_from - 1, gemm_from,
                        NATIVE_MAX_ROWS, gemv_rows - 1, gemv_rows, AMX_MAX_ROWS}):
        x = torch.randn(rows, 128).bfloat16()
        got = layer(x)
        if amx and rows >= AMX_MIN_ROWS:  # bitwise the same whichever AMX kernel runs
            expected = kernels.gemm_amx(part, x, layer.bias)
        elif kernels.has_bf16_gemm and rows >= gemm_from:
            expected = kernels.gemm_bf16(part, x, layer.bias)
        elif rows < (AMX_MIN_ROWS if amx else gemv_rows):
            expected = kernels.gemv(part, x, layer.bias)
        else:
            expected = torch.nn.functional.linear(x, kernels.dequantize(part)) + layer.bias
        assert torch.equal(got, expected), rows


@pytest.mark.parametrize("bits, group, asymmetric, shape", [(8, 64, False, (130, 64)), (4, 8, True, (17, 40))])
def test_dequantising_into_amx_tiles_is_pack_amx_of_the_reference(bits, group, asymmetric, shape):
    kernels, cpu = amx_kernels_or_skip()
    weight = GroupedIntWeight.quantize(torch.randn(*shape) * 0.05, bits, group, not asymmetric)
    tiles = kernels.dequantize_amx(kernels.pack(weight.codes, weight.scales, weight.zeros, bits, group))
    assert torch.equal(tiles, cpu.pack_amx(weight.dequantize().to(torch.bfloat16)))


def bf16_gemm_kernels_or_skip():
    kernels = kernels_or_skip("native")
    if not kernels.has_bf16_gemm:
        pytest.skip("no AVX512-BF16 GEMM here (no AVX512-BF16, or AMX runs the batches)")
    return kernels


@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("bits, group, asymmetric, shape", [
    (8, 576, False, (200, 576)),  # per channel; 13 blocks: a lone last block
    (8, 32, True, (40, 96)),      # Q8_0-like groups with zero points
    (4, 32, False, (64, 576)),
    (4, 64, True, (37, 128)),
    (4, 8, True, (17, 24)),       # the smallest 4-bit groups
    (6, 16, False, (37, 576)),    # GGUF Q6_K
    (6, 32, True, (40, 96)),      # GGUF Q5_K
])
def test_bf16_gemm_multiplies_by_the_dequantised_weight(threads, bits, group, asymmetric, shape):
    kernels = bf16_gemm_kernels_or_skip()
    out_features, in_features = shape
    weight = random_grouped(out_features, in_features, bits, group, asymmetric=asymmetric)
    packed = kernels.pack(weight.codes, weight.scales, weight.zeros, bits, group)
    dequantised = kernels.dequantize(packed)
    assert torch.equal(dequantised, weight.dequantize().to(torch.bfloat16))
    bias = torch.randn(out_features).bfloat16()
    previous = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        # one-hot rows read the weights it computes with, bitwise: each input's column, in pair order
        eye = torch.eye(in_features, dtype=torch.bfloat16)
        assert torch.equal(kernels.gemm_bf16(packed, eye), dequantised.T)
        x = torch.randn(35, in_features).bfloat16()  # four 8-row tiles and a partial one
        got = kernels.gemm_bf16(packed, x, bias)
        one_by_one = torch.cat([kernels.gemm_bf16(packed, x[i:i + 1].contiguous(), bias) for i in range(35)])
    finally:
        torch.set_num_threads(previous)
    assert got.dtype is torch.bfloat16 and got.shape == (35, out_features)
    assert torch.equal(got, one_by_one)
    expected = x.double() @ dequantised.double().T + bias.double()
    assert (got.double() - expected).abs().max().item() <= 8e-3 * expected.abs().max().item()


def test_the_avx2_build_has_no_batched_gemms():
    kernels = kernels_or_skip("avx2")
    assert not kernels.has_amx and not kernels.has_bf16_gemm
    packed = kernels.pack(torch.zeros(16, 64, dtype=torch.uint8), torch.ones(16, 2), None, 4, 32)
    with pytest.raises(ValueError, match="no AMX tiles"):
        kernels.gemm_amx(packed, torch.zeros(16, 64, dtype=torch.bfloat16))
    with pytest.raises(ValueError, match="no AMX tiles"):
        kernels.dequantize_amx(packed)
    with pytest.raises(ValueError, match="no AVX512-BF16 GEMM"):
        kernels.gemm_bf16(packed, torch.zeros(32, 64, dtype=torch.bfloat16))


# ---- AMX-INT8 on the codes (quant_gemm_amx_int8): the GEMV's arithmetic on tiles -----------------------------

@pytest.mark.parametrize("bits, group, asymmetric, shape", [
    (8, 576, False, (100, 576)),   # per channel: x blocks of 192, 64-input tiles; n not a multiple of 32
    (8, 1536, False, (48, 1536)),  # x blocks of 256
    (8, 128, True, (40, 256)),     # GPTQ-like groups with zero points
    (8, 32, True, (33, 96)),       # Q8_0-like groups: half-depth tiles; one block in the last pair
    (4, 32, False, (80, 256)),     # nibbles expanded to tile rows
    (4, 128, True, (37, 512)),
])
def test_amx_int8_gemm_is_the_gemv_bitwise(bits, group, asymmetric, shape):
    kernels, _ = amx_kernels_or_skip()
    out_features, in_features = shape
    weight = random_grouped(out_features, in_features, bits, group, asymmetric=asymmetric)
    packed = kernels.pack(weight.codes, weight.scales, weight.zeros, bits, group)
    bias = torch.randn(out_features).bfloat16()
    generator = torch.Generator().manual_seed(1)
    for rows in (1, 2, 15, 16, 17, 40, 64, 65):
        # rows of very different magnitudes: each x block's int16 scale is its own
        x = (torch.randn(rows, in_features, generator=generator) * torch.rand(rows, 1, generator=generator) * 8).bfloat16()
        if rows == 17:  # a block with a magnitude past 3e38 takes the scalar quantisation in both kernels
            x[3, 7] = 3.2e38
        for b in (None, bias):
            got = kernels.gemm_amx_int8(packed, x, b)
            assert got.dtype is torch.bfloat16 and got.shape == (rows, out_features)
            assert torch.equal(got.view(torch.int16), kernels.gemv(packed, x, b).view(torch.int16)), (rows, b is None)
    expected = x.float() @ weight.dequantize().T + bias.float()
    assert (got.float() - expected).abs().max().item() <= 8e-3 * expected.abs().max().item()


def test_int8_tile_depth_follows_the_kernels_x_blocks():
    # the C x_block_of: the group up to 256 inputs, else its largest divisor that fits and is whole chunks
    depth = kernels_or_skip("native").int8_tile_depth
    assert depth(16, 8) == 0 and depth(32, 4) == 32 and depth(576, 8) == 64 and depth(1536, 8) == 64
    assert depth(96, 8) == 32 and depth(1600, 8) == 0  # 1600: x blocks of 200 inputs
    assert depth(64, 3) == 0


def test_amx_int8_refuses_x_blocks_it_cannot_tile():
    kernels, _ = amx_kernels_or_skip()
    weight = random_grouped(16, 64, 8, 16)
    packed = kernels.pack(weight.codes, weight.scales, weight.zeros, 8, 16)
    with pytest.raises(ValueError, match="refused 8-bit weights"):
        kernels.gemm_amx_int8(packed, torch.zeros(16, 64, dtype=torch.bfloat16))


def test_only_8_bit_codes_in_long_x_blocks_keep_the_gemv_past_the_bf16_gemms_rows():
    # the GEMV's float epilogue comes once per x block: per-channel int8 (x blocks of 192 inputs at 576, 256 at
    # 1536) keeps it to BF16_GEMM_MIN_ROWS_LONG rows, GGUF Q8_0's 32-input groups and 4-bit weights do not
    kernels = kernels_or_skip("native")
    cases = [(8, 576, 576, BF16_GEMM_MIN_ROWS_LONG), (8, 1536, 1536, BF16_GEMM_MIN_ROWS_LONG),
             (8, 32, 576, BF16_GEMM_MIN_ROWS), (8, 64, 576, BF16_GEMM_MIN_ROWS), (4, 32, 576, BF16_GEMM_MIN_ROWS),
             (4, 576, 576, BF16_GEMM_MIN_ROWS), (6, 16, 576, BF16_GEMM_MIN_ROWS)]
    for bits, group, in_features, expected in cases:
        weight = random_grouped(32, in_features, bits, group)
        packed = kernels.pack(weight.codes, weight.scales, weight.zeros, bits, group)
        assert bf16_gemm_min_rows(kernels, packed) == expected, (bits, group, in_features)
    assert kernels.x_block(576, 8) == 192 and kernels.x_block(1536, 8) == 256 and kernels.x_block(32, 8) == 32


def test_a_per_channel_int8_layer_gives_every_row_the_gemvs_result_below_the_tile_limit():
    kernels = kernels_or_skip("native")
    layer, layout = make_layer(random_grouped(96, 576, 8, 576), bias=True)
    assert layout == "native" and layer.int8_tiles == (True,)
    (part,) = layer.kernel_parts.parts
    for rows in sorted({1, INT8_TILE_MIN_ROWS - 1, INT8_TILE_MIN_ROWS, 64, INT8_TILE_MAX_ROWS - 1}):
        x = torch.randn(rows, 576).bfloat16()
        got = layer(x)
        if kernels.has_amx or rows < (bf16_gemm_min_rows(kernels, part) if kernels.has_bf16_gemm
                                      else gemv_max_rows(kernels, 8)):
            assert torch.equal(got, kernels.gemv(part, x, layer.bias)), rows
        if kernels.has_amx and rows >= INT8_TILE_MIN_ROWS:
            assert torch.equal(got, kernels.gemm_amx_int8(part, x, layer.bias)), rows
    # grouped int8 in 32s (GGUF Q8_0) keeps the dequantising kernel
    grouped, _ = make_layer(random_grouped(32, 64, 8, 32))
    assert grouped.int8_tiles == (False,)
