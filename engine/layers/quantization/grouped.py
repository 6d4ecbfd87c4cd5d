"""Weight-only integer quantisation: the engine's one grouped form and its run-time layouts.

`GroupedIntWeight` is the canonical quantised linear weight every source converts to (on-the-fly int8/int4,
GPTQ, AWQ, compressed-tensors, GGUF Q8_0/Q4_0): integer codes 0..2^bits-1, one scale (and optionally one zero
point) per output row and group of `group_size` inputs,

    w[o, perm[j]] = (codes[o, j] - zero[o, j // group_size]) * scale[o, j // group_size]

(zero None: symmetric at the midpoint 2^(bits-1); perm None: the identity). `install_grouped_weight(layer, w)`
turns it into the fastest run-time layout this device offers and registers the layer's parameters;
`GroupedIntLinearMethod.apply` runs it. A checkpoint format is a `GroupedIntLinearMethod` subclass with its own
`create_weights`/weight loaders whose `process_weights_after_loading` unpacks its tensors into a
`GroupedIntWeight` and calls `install_grouped_weight`.

Run-time layouts (chosen in `_choose_layout`, CPU facts from ../shared/CPU-FACTS.md section 2):
- `native` (bfloat16 activations on CPU: every 4-, 6- and 8-bit weight whose groups are whole multiples of 8
  (4-bit) or 4 (6- and 8-bit) inputs, per row or grouped, symmetric or with zero points, GGUF's grouped types,
  GPTQ, AWQ; 8-bit codes from IQ4_NL's grid stored as 4-bit grid indices, `IQ4_CODES`; each run of output rows
  in the narrowest format its codes fit, `KernelParts`, so a fused GGUF layer of mixed types keeps each width):
  engine/kernels/quant.py's output-row-interleaved GEMV (AVX-512 or AVX2) for few rows; where
  the CPU has AMX its dequantising AMX GEMM from AMX_MIN_ROWS rows (the weight stays quantised in memory,
  dequantised per call into bf16 tiles every row reuses) and bf16's AMX kernel on those tiles from
  AMX_MAX_ROWS; without AMX, where the CPU has AVX512-BF16, its dequantising bf16 GEMM from `bf16_gemm_min_rows`
  (the weight dequantised per call a pair of 16-row blocks at a time); else the GEMV (the AVX-512 body's wide
  tiles up to GEMV_MAX_ROWS_AVX512, the AVX2 body's up to NATIVE_MAX_ROWS) and its dequantisation to bf16 + one
  GEMM above. At one row it beats torch's int8pack and int4pack (benchmarks/quant_kernels.py);
- `int8pack` (float32 activations; 8 bits, one group per row, symmetric): `torch._weight_int8pack_mm`
  (it crashes when the inputs are not a multiple of 16, so those fall through);
- `int4pack` (float32 activations; 4 bits, groups of 32/64/128/256, output rows a multiple of 16):
  tinygemm's packing (`torch._convert_weight_to_int4pack_for_cpu`) and `torch._weight_int4pack_mm_for_cpu`,
  whose w = (q - 8) * scale + offset takes any zero point as offset = (8 - zero) * scale;
- on CUDA, `int4pack-cuda` (tinygemm) and `int8pack-cuda` (cuda.py);
- `dequant`: everything else (other devices, other groupings): the codes stay packed (two 4-bit codes a
  byte) and are dequantised to the activation dtype for each call, exact but slow.
Activations should be bfloat16 on CPU: with float32 both torch kernels run about 5x slower.
Batches of BATCH_MIN_ROWS+ rows on CPU (prefill, batched decode) are compute-bound, where oneDNN's bf16 GEMM is
far ahead of torch's int8/int4 kernels: int8pack converts its codes per call and runs it (scales factored out),
native runs the dequantising GEMMs above (or the GEMV / dequantise + GEMM), and with `--quantization-batch-cache`
(`add_batch_weights`) every CPU layout keeps a bf16 copy in bf16's own layout for them instead (no
dequantisation per call, for 2 more bytes per weight).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch
import torch.nn.functional as F
from torch import nn

from llmctl.engine.errors import ModelLoadError
from llmctl.engine.kernels import cpu_kernels_for
from llmctl.engine.kernels.quant import IQ4_CODES, KernelWeight, QuantRowOperand, fits_float16, load_quant_kernels
from llmctl.engine.layers.linear import CheckpointSlice, LinearBase, LinearMethod, rank_rows
from llmctl.engine.layers.quantization.cuda import CUDA_LAYOUTS, apply_cuda_layout, cuda_layout, install_cuda_layout

# Scales are stored as float16 (GPTQ/AWQ/GGUF do): clamping to its smallest normal keeps an all-zero group's
# scale finite and costs at most 3e-5 absolute error in groups whose largest weight is below 4e-4 (int4).
FP16_TINY, FP16_MAX = torch.finfo(torch.float16).tiny, torch.finfo(torch.float16).max
INT4PACK_GROUPS = (32, 64, 128, 256)  # the group sizes torch's CPU int4 kernel accepts
# Row counts where the native layout changes kernel, each where the next one measured faster
# (benchmarks/quant_kernels.py --batched, benchmarks/batched_linears.py; figures in benchmarks/README.md):
NATIVE_MAX_ROWS = 48  # the AVX2 GEMV up to here, then dequantise + one GEMM
# the AVX-512 GEMV's wide tiles up to here (per code width; 6 bits and IQ4_CODES use the 8-bit arithmetic)
GEMV_MAX_ROWS_AVX512 = {8: 1024, 6: 1024, IQ4_CODES: 1024, 4: 512}
# With AVX512-BF16 (no AMX) `gemm_bf16` from here; 8-bit codes in x blocks of LONG_X_BLOCK+ inputs from _LONG
BF16_GEMM_MIN_ROWS = 32
BF16_GEMM_MIN_ROWS_LONG = 96
LONG_X_BLOCK = 192
AMX_MIN_ROWS = 16  # with AMX the dequantising `gemm_amx` (tiles every row reuses) from here
AMX_MAX_ROWS = 1024  # and bf16's own AMX kernel on the weight dequantised into its tiles from here
# 8-bit weights in x blocks of 64+ inputs: the GEMV's integer arithmetic on AMX-INT8 tiles (`gemm_amx_int8`,
# bitwise the GEMV, a byte a weight read) in [INT8_TILE_MIN_ROWS, INT8_TILE_MAX_ROWS); groups of 32 and 4-bit
# weights keep the dequantising kernel (their per-group epilogue costs more than dequantising)
INT8_TILE_MIN_ROWS = 8
INT8_TILE_MAX_ROWS = 96
# Batches of this many rows are compute-bound: bf16 GEMMs beat torch's int8pack/int4pack there (`_product`,
# `add_batch_weights`)
BATCH_MIN_ROWS = 16
# the code formats the AMX kernels take (on AMX CPUs 6-bit and IQ4_CODES ones run the GEMV, then from AMX_MIN_ROWS
# rows dequantise + one GEMM: `gemv_max_rows`)
AMX_BITS = (4, 8)
CPU_LAYOUTS = ("int8pack", "int4pack", "native")


@dataclass(frozen=True)
class GroupedIntWeight:
    """A quantised linear weight [out, in]: w[o, perm[j]] = (codes[o, j] - zero[o, j / g]) * scale[o, j / g].

    codes: uint8 [out, in], values 0..2^bits - 1 (one code a byte, unpacked);
    scales: float [out, in / group_size];
    zeros: float or integer [out, in / group_size] in code units, or None for symmetric codes centred at
        the midpoint 2^(bits - 1) (int4: 8, int8: 128);
    bits: 4, 6 (GGUF's 5- and 6-bit types) or 8; group_size: inputs per group (per output channel: group_size = in);
    perm: None, or int64 [in] for act-order checkpoints (GPTQ desc_act): column j of `codes` holds input
        perm[j], so the layer computes x[..., perm] against the grouped codes.
    """

    codes: torch.Tensor
    scales: torch.Tensor
    zeros: Optional[torch.Tensor]
    bits: int
    group_size: int
    perm: Optional[torch.Tensor] = None

    def __post_init__(self) -> None:
        problem = self._problem()
        if problem:
            raise ValueError(f"GroupedIntWeight: {problem}")

    def _problem(self) -> Optional[str]:
        if self.bits not in (4, 6, 8):
            return f"bits must be 4, 6 or 8, got {self.bits}"
        if self.codes.dtype != torch.uint8 or self.codes.dim() != 2:
            return f"codes must be a uint8 [out, in] tensor, got {self.codes.dtype} {tuple(self.codes.shape)}"
        out_features, in_features = self.codes.shape
        if self.group_size <= 0 or in_features % self.group_size:
            return f"group size {self.group_size} does not divide the {in_features} inputs"
        groups = (out_features, in_features // self.group_size)
        if not self.scales.is_floating_point() or tuple(self.scales.shape) != groups:
            return f"scales must be a float {groups} tensor, got {self.scales.dtype} {tuple(self.scales.shape)}"
        if self.zeros is not None and (self.zeros.is_complex() or tuple(self.zeros.shape) != groups):
            return f"zeros must be a real {groups} tensor or None, got {tuple(self.zeros.shape)}"
        if self.bits < 8 and self.codes.numel() and int(self.codes.max()) >= 1 << self.bits:
            return f"{self.bits}-bit codes must lie in 0..{(1 << self.bits) - 1}"
        if self.perm is not None:
            if self.perm.dtype != torch.int64 or tuple(self.perm.shape) != (in_features,):
                return f"perm must be int64 [{in_features}]"
            if not torch.equal(torch.sort(self.perm).values, torch.arange(in_features, device=self.perm.device)):
                return "perm is not a permutation of the inputs"
        return None

    @property
    def out_features(self) -> int:
        return self.codes.shape[0]

    @property
    def in_features(self) -> int:
        return self.codes.shape[1]

    @property
    def num_groups(self) -> int:
        return self.in_features // self.group_size

    @property
    def midpoint(self) -> int:
        return 1 << (self.bits - 1)

    def is_symmetric(self) -> bool:
        """No zeros, or zeros that all sit at the midpoint (GPTQ sym=True stores them anyway)."""
        return self.zeros is None or bool(torch.all(self.zeros == self.midpoint))

    def zero_points(self) -> torch.Tensor:
        """float32 [out, groups]: the zero of every group (the midpoint where `zeros` is None)."""
        if self.zeros is None:
            return torch.full(tuple(self.scales.shape), float(self.midpoint), device=self.scales.device)
        return self.zeros.float()

    def dequantize(self) -> torch.Tensor:
        """The float32 weight [out, in] in the layer's input order (the reference every layout matches)."""
        shape = (self.out_features, self.num_groups, self.group_size)
        grouped = (self.codes.float().view(shape) - self.zero_points()[..., None]) * self.scales.float()[..., None]
        weight = grouped.view(self.out_features, self.in_features)
        if self.perm is None:
            return weight
        restored = torch.empty_like(weight)
        restored[:, self.perm] = weight
        return restored

    def columns(self, part: CheckpointSlice, what: str) -> "GroupedIntWeight":
        """The weight of inputs [part.start, part.start + part.size) only (a row-parallel rank's part). Its
        groups must lie wholly inside or outside the part (after the act-order permutation, if any), else
        refused: `what` names the layer's method. One group per row (per channel) splits into a smaller one."""
        if part.start == 0 and part.size == self.in_features:
            return self
        inputs = torch.arange(self.in_features, device=self.codes.device)
        original = inputs if self.perm is None else self.perm  # the input each column holds
        kept = (original >= part.start) & (original < part.start + part.size)
        if self.num_groups == 1:
            group_size, kept_groups = part.size, torch.ones(1, dtype=torch.bool, device=kept.device)
        else:
            if part.size % self.group_size:
                raise ModelLoadError(f"{what}: a row-parallel linear's {part.size} inputs per tensor-parallel rank "
                                     f"are not a multiple of its group size {self.group_size} (a group would "
                                     "straddle two ranks); use a tensor-parallel size that divides the groups")
            per_group = kept.view(self.num_groups, self.group_size)
            kept_groups = per_group.all(dim=1)
            if not torch.equal(kept_groups, per_group.any(dim=1)):
                raise ModelLoadError(f"{what}: act-order (g_idx) groups of a row-parallel linear hold inputs of two "
                                     "tensor-parallel ranks; run this checkpoint with --tensor-parallel-size 1")
            group_size = self.group_size
        columns = kept.nonzero().squeeze(1)
        perm = None
        if self.perm is not None:
            perm = self.perm[columns] - part.start
            if torch.equal(perm, torch.arange(part.size, device=perm.device)):
                perm = None
        return GroupedIntWeight(codes=self.codes[:, columns].contiguous(), scales=self.scales[:, kept_groups],
                                zeros=None if self.zeros is None else self.zeros[:, kept_groups],
                                bits=self.bits, group_size=group_size, perm=perm)

    @classmethod
    def quantize(cls, weight: torch.Tensor, bits: int, group_size: int, symmetric: bool = True) -> "GroupedIntWeight":
        """Round-to-nearest quantisation of a float weight [out, in]. Symmetric: scale = max|w| / (2^(bits-1) - 1)
        per group, codes centred at the midpoint. Asymmetric: the group's [min, max] (widened to hold 0) spread
        over 0..2^bits - 1 with an integer zero point. Codes are rounded against the float16-rounded scale."""
        out_features, in_features = weight.shape
        if group_size <= 0 or in_features % group_size:
            raise ValueError(f"group size {group_size} does not divide the {in_features} inputs")
        groups = weight.detach().float().view(out_features, in_features // group_size, group_size)
        top = (1 << bits) - 1
        if symmetric:
            half = (1 << (bits - 1)) - 1
            scales = _float16_scales(groups.abs().amax(dim=-1) / half)
            signed = torch.round(groups / scales.float()[..., None]).clamp(-half - 1, half)
            codes, zeros = signed + (half + 1), None
        else:
            low, high = groups.amin(dim=-1).clamp(max=0), groups.amax(dim=-1).clamp(min=0)
            scales = _float16_scales((high - low) / top)
            zeros = torch.round(-low / scales.float()).clamp(0, top)
            codes = (torch.round(groups / scales.float()[..., None]) + zeros[..., None]).clamp(0, top)
        return cls(codes.to(torch.uint8).view(out_features, in_features), scales, zeros, bits, group_size)


def rank_grouped_part(layer: LinearBase, weight: GroupedIntWeight, what: str) -> GroupedIntWeight:
    """This rank's part of the whole checkpoint's `weight` (every shard's full rows, all inputs): the output
    rows `rank_part` would keep per shard, then a row-parallel layer's inputs (`GroupedIntWeight.columns`).
    Rows past a shard's end (the padded vocabulary) get scale 0, i.e. weight 0."""
    if layer.tp.is_single:
        return weight
    zeros = None if weight.zeros is None else rank_rows(layer, weight.zeros)
    rows = GroupedIntWeight(codes=rank_rows(layer, weight.codes), scales=rank_rows(layer, weight.scales), zeros=zeros,
                            bits=weight.bits, group_size=weight.group_size, perm=weight.perm)
    return rows if layer.checkpoint_cols is None else rows.columns(layer.checkpoint_cols, what)


def _float16_scales(scales: torch.Tensor) -> torch.Tensor:
    """float16 scales rounded up, so the group's largest weight still lands inside the code range."""
    wanted = scales.clamp(FP16_TINY, FP16_MAX)
    rounded = wanted.to(torch.float16)
    return torch.where(rounded.float() < wanted, torch.nextafter(rounded, rounded.new_tensor(FP16_MAX)), rounded)


# ---- run-time layouts -------------------------------------------------------------------------------

def _choose_layout(weight: GroupedIntWeight, dtype: torch.dtype, device: torch.device) -> str:
    if device.type == "cuda":
        return cuda_layout(weight, dtype) or "dequant"
    if device.type == "cpu" and dtype is torch.bfloat16:
        # the native kernels first: they beat torch's int8pack and int4pack (benchmarks/quant_kernels.py)
        kernels = load_quant_kernels()
        if (kernels is not None and kernels.unsupported(weight.bits, weight.group_size, weight.in_features) is None
                and fits_float16(weight.scales) and (weight.zeros is None or fits_float16(weight.zeros))):
            return "native"
    if device.type == "cpu" and dtype in (torch.bfloat16, torch.float32):
        if (weight.bits == 8 and weight.num_groups == 1 and weight.in_features % 16 == 0
                and weight.is_symmetric()):
            return "int8pack"
        if weight.bits == 4 and weight.group_size in INT4PACK_GROUPS and weight.out_features % 16 == 0:
            return "int4pack"
    return "dequant"


def pack_int4(codes: torch.Tensor) -> torch.Tensor:
    """uint8 [out, in] codes 0..15 -> uint8 [out, in / 2], input 2j in the low nibble and 2j + 1 in the high."""
    return codes[:, 0::2] | (codes[:, 1::2] << 4)


def unpack_int4(packed: torch.Tensor) -> torch.Tensor:
    """The inverse of `pack_int4`."""
    return torch.stack([packed & 0xF, packed >> 4], dim=-1).view(packed.shape[0], -1)


def _register(layer: nn.Module, name: str, tensor: Optional[torch.Tensor]) -> None:
    if tensor is None:
        setattr(layer, name, None)
    else:
        setattr(layer, name, nn.Parameter(tensor.contiguous(), requires_grad=False))


def install_grouped_weight(layer: LinearBase, weight: GroupedIntWeight, dtype: Optional[torch.dtype] = None) -> str:
    """Make `layer` run `weight`: packs it into the fastest layout for the activation `dtype` (default: the
    layer's `params_dtype`) on the codes' device and registers that layout's parameters, after removing every
    parameter the layer had except `bias` (the loading form: a full-precision weight, qweight/qzeros/...),
    so only the quantised form stays in memory. Returns the layout's name. Apply with
    `GroupedIntLinearMethod` (or `apply_grouped_weight`)."""
    dtype = dtype or layer.params_dtype
    if (weight.out_features, weight.in_features) != (layer.out_features, layer.in_features):
        raise ModelLoadError(f"a quantised weight of shape {(weight.out_features, weight.in_features)} does not fit "
                             f"a linear of {layer.in_features} inputs and {layer.out_features} outputs")
    layout = _choose_layout(weight, dtype, weight.codes.device)
    for name in [name for name in layer._parameters if name != "bias"]:
        delattr(layer, name)
    layer.quant_layout, layer.quant_bits, layer.quant_group_size = layout, weight.bits, weight.group_size
    _register(layer, "input_perm", weight.perm)
    if layout == "int8pack":
        signed = (weight.codes.to(torch.int16) - weight.midpoint).to(torch.int8)
        _register(layer, "weight", signed)
        _register(layer, "weight_scale", weight.scales[:, 0].to(dtype))
    elif layout == "int4pack":
        packed = torch._convert_weight_to_int4pack_for_cpu(weight.codes.to(torch.int32), 1)
        _register(layer, "weight", packed)
        _register(layer, "weight_scales_and_zeros", tinygemm_scales_and_offsets(weight, dtype))
    elif layout == "native":
        kernels = load_quant_kernels()
        packed = kernels.pack_parts(weight.codes, weight.scales, weight.zeros, weight.bits, weight.group_size)
        # the parts' flat storage; the parts (their checks and pointers, built once) are views of it, which keep it
        # alive even if a parameter's data were replaced later
        _register(layer, "weight", packed.codes)
        _register(layer, "weight_scale", packed.scales)
        _register(layer, "weight_zero", packed.zeros)
        layer.quant_kernels = kernels
        amx = cpu_kernels_for(weight.codes.device, torch.bfloat16)  # bf16's AMX kernel, for the largest batches
        layer.amx_kernels = amx if amx is not None and amx.has_amx else None
        layer.kernel_parts = packed
        layer.int8_tiles = tuple(part.bits == 8 and kernels.int8_tile_depth(part.group_size, 8) == 64
                                 for part in packed.parts)
    elif layout in CUDA_LAYOUTS:
        for name, tensor in install_cuda_layout(layer, weight, layout, dtype,
                                                tinygemm_scales_and_offsets(weight, dtype)).items():
            _register(layer, name, tensor)
    else:
        _register(layer, "weight", pack_int4(weight.codes) if weight.bits == 4 else weight.codes)
        _register(layer, "weight_scale", weight.scales)
        _register(layer, "weight_zero", None if weight.zeros is None else weight.zeros.float())
    return layout


def tinygemm_scales_and_offsets(weight: GroupedIntWeight, dtype: torch.dtype) -> torch.Tensor:
    """[in / group, out, 2] (scale, offset) pairs for tinygemm's int4 kernels (CPU and CUDA), whose
    w = (q - 8) * scale + offset takes any zero point as offset = (8 - zero) * scale."""
    scales = weight.scales.float()
    offsets = (weight.midpoint - weight.zero_points()) * scales
    return torch.stack([scales, offsets], dim=-1).transpose(0, 1).to(dtype)


def _dequantize_installed(layer: LinearBase, dtype: torch.dtype) -> torch.Tensor:
    codes = unpack_int4(layer.weight) if layer.quant_bits == 4 else layer.weight
    shape = (layer.out_features, layer.in_features // layer.quant_group_size, layer.quant_group_size)
    zeros = layer.weight_zero[..., None] if layer.weight_zero is not None else float(1 << (layer.quant_bits - 1))
    grouped = (codes.view(shape).float() - zeros) * layer.weight_scale.float()[..., None]
    return grouped.view(layer.out_features, layer.in_features).to(dtype)


def add_batch_weights(model: nn.Module, kernels=None) -> int:
    """`--quantization-batch-cache`: every quantised CPU linear with bfloat16 activations also keeps its weight
    dequantised to bf16 in the layout bf16's own linears run (`kernels`' AMX tiles where the CPU has AMX, else
    oneDNN's packing where its bf16 path runs, else the plain matrix) for batches of BATCH_MIN_ROWS+ rows, which then run as fast as an unquantised model's, for
    2 more bytes per weight. Without it a batch dequantises its weight per call and runs one GEMM on it (native
    layout) or converts its int8 codes (int8pack). Returns the bytes added."""
    amx = kernels if kernels is not None and getattr(kernels, "has_amx", False) else None
    added = 0
    for layer in model.modules():
        if (isinstance(layer, LinearBase) and getattr(layer, "quant_layout", None) in CPU_LAYOUTS
                and layer.params_dtype is torch.bfloat16):
            layer.batch_weight, layer.batch_layout = _batch_weight(_layer_weight(layer), amx)
            layer.batch_kernels = amx
            added += layer.batch_weight.numel() * layer.batch_weight.element_size()  # AMX tiles: padded
    return added


def _batch_weight(dense: torch.Tensor, amx) -> tuple[torch.Tensor, str]:
    """bf16's own layout for batches; oneDNN refuses to pack bf16 on CPUs without AVX512-BF16 or AVX-NE-CONVERT."""
    if amx is not None:
        return amx.pack_amx(dense), "amx"
    if torch.ops.mkldnn._is_mkldnn_bf16_supported():
        return torch.ops.mkldnn._reorder_linear_weight(dense, 64), "onednn"
    return dense, "dense"


def _layer_weight(layer: LinearBase) -> torch.Tensor:
    """bf16 [out, in]: the layer's own product on the identity, i.e. exactly the weights it computes with
    (act-order permutation included), each rounded to bf16 once."""
    eye = torch.eye(layer.in_features, dtype=torch.bfloat16)
    columns = [_product(layer, eye[start:start + 1024], None) for start in range(0, layer.in_features, 1024)]
    return torch.cat(columns).t().contiguous()


def apply_grouped_weight(layer: LinearBase, x: torch.Tensor) -> torch.Tensor:
    """The forward of a layer set up by `install_grouped_weight`."""
    rows = x.reshape(-1, x.shape[-1])
    batch_weight = getattr(layer, "batch_weight", None)
    if batch_weight is not None and rows.shape[0] >= BATCH_MIN_ROWS and rows.dtype is torch.bfloat16:
        rows = rows.contiguous()
        if layer.batch_layout == "amx":
            out = layer.batch_kernels.gemm_amx(batch_weight, rows, layer.out_features, layer.bias)
        elif layer.batch_layout == "onednn":
            out = torch.ops.mkldnn._linear_pointwise(rows, batch_weight, layer.bias, "none", [], "")
        else:
            out = F.linear(rows, batch_weight, layer.bias)
        return out.reshape(*x.shape[:-1], layer.out_features)
    return _product(layer, rows, layer.bias).reshape(*x.shape[:-1], layer.out_features)


def grouped_row_operands(layer: LinearBase) -> Optional[tuple[str, object, Optional[torch.Tensor]]]:
    """`LinearMethod.native_row_operands` of a layer set up by `install_grouped_weight`: one row of the native
    layout runs the quantised GEMV on the layer's kernel weight with its bias (`_product`), unless the inputs are
    permuted first (act order)."""
    if getattr(layer, "quant_layout", None) != "native" or layer.input_perm is not None:
        return None
    bias = layer.bias
    if bias is not None and (bias.dtype != torch.bfloat16 or not bias.is_contiguous()):
        return None
    return "quant", QuantRowOperand(layer.quant_kernels, layer.kernel_parts), bias


def _product(layer: LinearBase, rows: torch.Tensor, bias: Optional[torch.Tensor]) -> torch.Tensor:
    """rows [m, in] @ the layer's quantised weight.T (+ bias)."""
    if layer.input_perm is not None:
        rows = rows.index_select(1, layer.input_perm)
    layout = layer.quant_layout
    if layout == "int8pack" and rows.shape[0] >= BATCH_MIN_ROWS:
        # per-row scales factor out of the product and int8 codes are exact in bf16 and float32: one
        # conversion and one GEMM, far faster than int8pack on many rows
        out = F.linear(rows, layer.weight.to(rows.dtype)) * layer.weight_scale
    elif layout == "int8pack":
        out = torch._weight_int8pack_mm(rows.contiguous(), layer.weight, layer.weight_scale)
    elif layout == "int4pack":
        out = torch._weight_int4pack_mm_for_cpu(rows.contiguous(), layer.weight, layer.quant_group_size,
                                                layer.weight_scales_and_zeros)
    elif layout == "native":
        return _native_product(layer, rows.contiguous(), bias)
    elif layout in CUDA_LAYOUTS:
        out = apply_cuda_layout(layer, rows)
    else:
        out = F.linear(rows, _dequantize_installed(layer, rows.dtype))
    return out if bias is None else out + bias


def _native_product(layer: LinearBase, rows: torch.Tensor, bias: Optional[torch.Tensor]) -> torch.Tensor:
    """The native layout's product, each part of the weight's rows (`KernelParts`) by `_part_product`."""
    packed = layer.kernel_parts
    if len(packed.parts) == 1:
        return _part_product(layer, packed.parts[0], layer.int8_tiles[0], rows, bias)
    out = rows.new_empty(rows.shape[0], layer.out_features)
    for part, start, int8_tiles in zip(packed.parts, packed.starts, layer.int8_tiles):
        end = start + part.out_features
        out[:, start:end] = _part_product(layer, part, int8_tiles, rows, None if bias is None else bias[start:end])
    return out


def _part_product(layer: LinearBase, weight: KernelWeight, int8_tiles: bool, rows: torch.Tensor,
                  bias: Optional[torch.Tensor]) -> torch.Tensor:
    """The native layout's kernel for this many rows: the GEMV for few; on AMX CPUs, for 8-bit weights in long
    groups (`int8_tiles`), AMX-INT8 from INT8_TILE_MIN_ROWS to INT8_TILE_MAX_ROWS (bitwise the GEMV); otherwise from
    AMX_MIN_ROWS the dequantising AMX GEMM, from AMX_MAX_ROWS bf16's AMX kernel on the weight dequantised into
    its tiles (the same outputs bitwise as each other: a row's result is the same for every row count from
    AMX_MIN_ROWS); without AMX, where the CPU has AVX512-BF16, the dequantising bf16 GEMM from `bf16_gemm_min_rows`,
    else dequantise + one oneDNN GEMM from `gemv_max_rows`."""
    kernels, count = layer.quant_kernels, rows.shape[0]
    amx = kernels.has_amx and weight.bits in AMX_BITS
    if amx and INT8_TILE_MIN_ROWS <= count < INT8_TILE_MAX_ROWS and int8_tiles:
        return kernels.gemm_amx_int8(weight, rows, bias)
    if amx and count >= AMX_MIN_ROWS:
        if count < AMX_MAX_ROWS or getattr(layer, "amx_kernels", None) is None:
            return kernels.gemm_amx(weight, rows, bias)
        return layer.amx_kernels.gemm_amx(kernels.dequantize_amx(weight), rows, weight.out_features, bias)
    if kernels.has_bf16_gemm and count >= bf16_gemm_min_rows(kernels, weight):
        return kernels.gemm_bf16(weight, rows, bias)
    if count < gemv_max_rows(kernels, weight.bits):
        return kernels.gemv(weight, rows, bias)
    out = F.linear(rows, kernels.dequantize(weight))
    return out if bias is None else out + bias


def bf16_gemm_min_rows(kernels, weight: KernelWeight) -> int:
    """The row count from which `gemm_bf16` runs instead of the GEMV (CPUs with AVX512-BF16 and no AMX)."""
    if weight.bits == 8 and kernels.x_block(weight.group_size, 8) >= LONG_X_BLOCK:
        return BF16_GEMM_MIN_ROWS_LONG
    return BF16_GEMM_MIN_ROWS


def gemv_max_rows(kernels, bits: int) -> int:
    """The row count from which the native layout dequantises and runs one GEMM instead of the GEMV, for weights
    the batched kernels above do not take: without AMX and AVX512-BF16, any; with AMX, the code formats outside
    AMX_BITS (6-bit, IQ4_CODES), whose GEMM is then oneDNN's bf16 one on AMX tiles: from AMX_MIN_ROWS, where the
    dequantising AMX GEMM overtook the GEMV for 8-bit weights (and these formats' GEMV does more work a weight)."""
    if kernels.has_amx:
        return AMX_MIN_ROWS
    return GEMV_MAX_ROWS_AVX512[bits] if kernels.isa == 512 else NATIVE_MAX_ROWS


class GroupedIntLinearMethod(LinearMethod):
    """The forward of every integer-quantised linear. Subclasses say how the weights load
    (`create_weights` and loaders) and build a `GroupedIntWeight` in `process_weights_after_loading`."""

    quantized = True

    def apply(self, layer: LinearBase, x: torch.Tensor) -> torch.Tensor:
        return apply_grouped_weight(layer, x)

    def native_row_operands(self, layer: LinearBase) -> Optional[tuple[str, object, Optional[torch.Tensor]]]:
        return grouped_row_operands(layer)
