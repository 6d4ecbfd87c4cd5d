"""The canonical quantised form (`GroupedIntWeight`) and every run-time layout `install_grouped_weight` picks,
each against the float32 reference `GroupedIntWeight.dequantize()`."""

from __future__ import annotations

import pytest
import torch

from llmctl.engine.args import ON_THE_FLY_QUANTIZATIONS
from llmctl.engine.errors import ModelLoadError
from llmctl.engine.kernels.quant import load_quant_kernels, pack_q4, unpack_q4
from llmctl.engine.layers.linear import ColumnLinear, UnquantizedLinearMethod
from llmctl.engine.layers.quantization import (ON_THE_FLY_SCHEMES, GroupedIntLinearMethod, GroupedIntWeight,
                                                install_grouped_weight, pack_int4, unpack_int4)


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


def test_the_on_the_fly_names_are_the_engine_args_choices():
    # fp8 (CUDA, sm_89+) is the one on-the-fly choice that is not a grouped-int scheme
    assert set(ON_THE_FLY_SCHEMES) | {"fp8"} == set(ON_THE_FLY_QUANTIZATIONS)


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


NATIVE = "native" if load_quant_kernels() is not None else "dequant"  # bf16 layouts that need the kernels


@pytest.mark.parametrize("shape, bits, group, asymmetric, permuted, layouts", [
    # (float32 layout, bfloat16 layout)
    ((32, 64), 8, 64, False, False, ("int8pack", "int8pack")),
    ((32, 64), 8, 64, False, True, ("int8pack", "int8pack")),
    ((32, 64), 8, 32, True, False, ("dequant", NATIVE)),      # grouped int8 with zeros (GPTQ 8-bit)
    ((40, 256), 8, 32, False, False, ("dequant", NATIVE)),    # GGUF Q8_0: symmetric, groups of 32
    ((32, 40), 8, 40, False, False, ("dequant", "dequant")),  # inputs no kernel takes
    ((32, 128), 4, 32, False, False, ("int4pack", "int4pack")),
    ((48, 128), 4, 64, True, True, ("int4pack", "int4pack")),
    ((24, 64), 4, 32, True, False, ("dequant", NATIVE)),      # outputs not a multiple of 16
    ((16, 576), 4, 576, False, True, ("dequant", NATIVE)),    # one group per row (GPTQ group_size -1)
    ((32, 64), 4, 16, False, False, ("dequant", "dequant")),  # a group size no kernel takes
])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows", [1, 3, 40])  # 40: the native layout's dequantise-then-GEMM rows (NATIVE_MAX_ROWS)
def test_each_layout_matches_the_dequantised_reference(shape, bits, group, asymmetric, permuted, layouts, dtype, rows):
    weight = random_grouped(*shape, bits, group, asymmetric=asymmetric, permuted=permuted)
    layer, chosen = make_layer(weight, dtype, bias=True)
    assert chosen == layouts[dtype is torch.bfloat16]
    x = torch.randn(rows, 2, shape[1]).to(dtype)
    expected = x.float() @ weight.dequantize().T + layer.bias.float()
    got = layer(x)
    assert got.shape == (rows, 2, shape[0]) and got.dtype == dtype
    tolerance = 2e-4 if dtype is torch.float32 else 2e-2
    assert (got.float() - expected).abs().max().item() <= tolerance * expected.abs().max().item() + 1e-5


def test_install_replaces_the_loading_parameters():
    weight = random_grouped(32, 64, 4, 32)
    layer, _ = make_layer(weight, bias=True)
    names = dict(layer.named_parameters())
    assert set(names) == {"bias", "weight", "weight_scales_and_zeros"}
    assert names["weight"].dtype is torch.uint8 and names["weight"].numel() == 32 * 64 // 2


def test_install_refuses_a_weight_of_another_shape():
    layer = ColumnLinear(64, 32, False, UnquantizedLinearMethod(), torch.bfloat16)
    with pytest.raises(ModelLoadError, match=r"shape \(16, 64\) does not fit a linear of 64 inputs and 32 outputs"):
        install_grouped_weight(layer, random_grouped(16, 64, 4, 32))


@pytest.mark.parametrize("change, message", [
    (dict(bits=3), "bits must be 4 or 8"),
    (dict(group_size=48), "group size 48 does not divide the 64 inputs"),
    (dict(codes=torch.full((8, 64), 16, dtype=torch.uint8)), "4-bit codes must lie in 0..15"),
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


# ---- the native kernels (engine/kernels/quant_kernels.c), both bodies ---------------------------------------

def kernels_or_skip(target):
    kernels = load_quant_kernels(target)
    if kernels is None:
        pytest.skip(f"the {target} quant kernels do not build or run here")
    return kernels


@pytest.mark.parametrize("in_features", [64, 128, 576, 1536])
def test_the_4_bit_kernel_layout_round_trips(in_features):
    codes = torch.randint(0, 16, (7, in_features), dtype=torch.uint8)
    packed = pack_q4(codes)
    assert packed.shape == (7, in_features // 2)
    assert torch.equal(unpack_q4(packed, in_features), codes)
    if in_features >= 128:  # word w of a 128-input block holds inputs w, 32 + w, 64 + w, 96 + w
        word = int(packed[0, 2]) | int(packed[0, 3]) << 8
        assert [(word >> 4 * t) & 0xF for t in range(4)] == [int(codes[0, 1 + 32 * t]) for t in range(4)]


@pytest.mark.parametrize("target", ["native", "avx2"])
@pytest.mark.parametrize("bits, group, asymmetric", [(8, 576, False), (8, 32, True), (8, 64, False), (4, 32, False),
                                                     (4, 64, True), (4, 192, True), (4, 576, False)])
def test_kernel_matches_the_dequantised_reference(target, bits, group, asymmetric):
    kernels = kernels_or_skip(target)
    weight = GroupedIntWeight.quantize(torch.randn(37, 576) * 0.05, bits, group, not asymmetric)
    packed = kernels.pack(weight.codes, weight.scales, weight.zeros, bits, group)
    reference = weight.dequantize()
    bias = torch.randn(37).bfloat16()
    for rows in (1, 2, 3, 4, 5, 9):
        x = torch.randn(rows, 576).bfloat16()
        expected = x.float() @ reference.T + bias.float()
        got = kernels.gemv(packed, x, bias)
        assert got.dtype is torch.bfloat16 and got.shape == (rows, 37)
        # bf16 rounding of the output (2^-8 relative) is the only difference
        assert (got.float() - expected).abs().max().item() <= 8e-3 * expected.abs().max().item()
        assert torch.allclose(kernels.gemv(packed, x).float() + bias.float(), expected, rtol=1e-2,
                              atol=1e-2 * expected.abs().max().item())


@pytest.mark.parametrize("target", ["native", "avx2"])
@pytest.mark.parametrize("bits, group, asymmetric", [(8, 32, True), (4, 32, False), (4, 64, True), (4, 576, False)])
def test_kernel_dequantises_to_the_reference_in_bfloat16(target, bits, group, asymmetric):
    kernels = kernels_or_skip(target)
    weight = GroupedIntWeight.quantize(torch.randn(21, 576) * 0.05, bits, group, not asymmetric)
    got = kernels.dequantize(kernels.pack(weight.codes, weight.scales, weight.zeros, bits, group))
    assert got.dtype is torch.bfloat16 and torch.equal(got, weight.dequantize().to(torch.bfloat16))


@pytest.mark.parametrize("bits, group, in_features, message", [
    (4, 32, 96, "4-bit weights need a multiple of 64 inputs, got 96"),
    (4, 16, 64, "4-bit groups must be 32 or a multiple of 64 inputs, got 16"),
    (8, 24, 96, "8-bit groups must be a multiple of 16 inputs, got 24"),
])
def test_kernel_refuses_shapes_its_layouts_lack(bits, group, in_features, message):
    kernels = kernels_or_skip("native")
    codes = torch.zeros(8, in_features, dtype=torch.uint8)
    with pytest.raises(ValueError, match=message):
        kernels.pack(codes, torch.ones(8, in_features // group), None, bits, group)


def test_kernel_refuses_inputs_it_cannot_read():
    kernels = kernels_or_skip("native")
    packed = kernels.pack(torch.zeros(8, 64, dtype=torch.uint8), torch.ones(8, 2), None, 4, 32)
    for x in (torch.zeros(1, 64), torch.zeros(1, 32, dtype=torch.bfloat16), torch.zeros(2, 128, dtype=torch.bfloat16)[:, ::2]):
        with pytest.raises(ValueError, match=r"the input must be a contiguous bf16 \[m, 64\] CPU tensor"):
            kernels.gemv(packed, x)
    with pytest.raises(ValueError, match=r"the bias must be a contiguous bf16 \[8\]"):
        kernels.gemv(packed, torch.zeros(1, 64, dtype=torch.bfloat16), torch.zeros(8))
