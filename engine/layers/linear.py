"""Linear layers built with their implementation: vLLM's LinearBase + LinearMethodBase, shorter.

A layer is constructed with a `LinearMethod`, which owns everything about its weights:
- `create_weights`: which parameters the layer has and how they are laid out. Every parameter
  carries `weight_loader(param, tensor, shard_id)` (fills it from one checkpoint tensor) and
  `shard_ids` (the shards a complete checkpoint must provide; the loader checks them all arrived);
- `process_weights_after_loading`: the run-time form, once every tensor is in (CPU prepacking);
- `apply`: the forward.
Fused layers name their output shards (`QKVLinear`: "q", "k", "v"; `MergedColumnLinear`: 0, 1, ...);
a shard id says where a checkpoint tensor lands. A new method (int8, int4, GPTQ's qweight/scales/zeros)
is one new class; a model only chooses it (`select_linear_method` for the unquantised ones, from
device and dtype).

Tensor parallelism (`TensorParallel`, engine/parallel.py) is the layer's, not the method's: a layer
built for rank r of N holds rank r's part only (`in_features`/`out_features` are the local sizes), and
its parameters carry which part of each checkpoint tensor that is (`checkpoint_rows` per shard,
`checkpoint_cols`). Every method's loader takes the checkpoint tensor through `rank_part`, which checks
the checkpoint's full shape and narrows it, so quantising methods shard exactly like the plain one.
Column layers (q/k/v by head, gate/up, lm_head by vocabulary) split outputs and need no communication;
row layers (o_proj, down_proj) split inputs and all-reduce their partial sums (Megatron-LM's layout).

CPU: plain `F.linear` reaches about a third of memory bandwidth at decode shapes. oneDNN (bfloat16)
and MKL (float32) kernels on prepacked weights are 1.3-2x faster with the same results
(../shared/CPU-FACTS.md section 1); where the CPU has AMX the native AMX kernel is faster still up to
512 rows and keeps one copy (`AMXLinearMethod`); CUDA and other dtypes use `UnquantizedLinearMethod`.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Hashable, Optional

import torch
import torch.nn.functional as F
from torch import nn

from llmctl.engine.errors import ModelLoadError
from llmctl.engine.parallel import TensorParallel

logger = logging.getLogger(__name__)

ShardId = Optional[Hashable]  # None: the whole (unfused) parameter


class WeightShapeError(ValueError):
    """A checkpoint tensor does not fit the parameter (shard) it is loaded into."""

    def __init__(self, got: tuple[int, ...], expected: tuple[int, ...]):
        super().__init__(f"shape {got}, expected {expected}")
        self.got, self.expected = got, expected


def copy_checked(target: torch.Tensor, loaded: torch.Tensor) -> None:
    if tuple(loaded.shape) != tuple(target.shape):
        raise WeightShapeError(tuple(loaded.shape), tuple(target.shape))
    with torch.no_grad():
        target.copy_(loaded)


@dataclass(frozen=True)
class CheckpointSlice:
    """The part of a checkpoint dimension of `full` entries this rank keeps: [start, start + size). A
    part running past `full` (the last ranks' share of a padded vocabulary) is zero-padded."""

    full: int
    start: int
    size: int

    @classmethod
    def whole(cls, full: int) -> "CheckpointSlice":
        return cls(full, 0, full)

    def take(self, tensor: torch.Tensor, dim: int) -> torch.Tensor:
        if self.start == 0 and self.size == self.full:
            return tensor
        kept = tensor.narrow(dim, self.start, max(min(self.size, self.full - self.start), 0))
        missing = self.size - kept.shape[dim]
        if missing == 0:
            return kept
        padding = list(tensor.shape)
        padding[dim] = missing
        return torch.cat([kept, tensor.new_zeros(padding)], dim=dim)


def rank_part(param: nn.Parameter, loaded: torch.Tensor, shard_id: ShardId) -> torch.Tensor:
    """This rank's part of checkpoint tensor `loaded` for shard `shard_id` of `param` (the tensor itself
    with one rank), after checking the checkpoint tensor's full shape. A parameter without tensor-parallel
    attributes takes the whole tensor. A row-parallel layer's bias is kept by rank 0 only (the others hold
    zeros), so the all-reduced sum adds it once."""
    rows = getattr(param, "checkpoint_rows", None)
    if rows is None:
        return loaded
    row = rows[shard_id]
    cols: Optional[CheckpointSlice] = param.checkpoint_cols if loaded.dim() == 2 else None
    expected = (row.full,) if loaded.dim() < 2 else (row.full, cols.full if cols else param.shape[1])
    if tuple(loaded.shape) != expected:
        raise WeightShapeError(tuple(loaded.shape), expected)
    part = row.take(loaded, 0)
    if cols is not None:
        part = cols.take(part, 1)
    if getattr(param, "zero_on_this_rank", False):
        part = torch.zeros_like(part)
    return part


def rank_rows(layer: "LinearBase", full: torch.Tensor) -> torch.Tensor:
    """This rank's output rows of `full`, whose dim 0 holds every shard's full checkpoint rows in shard order
    (`layer.checkpoint_output_offsets`): the same parts `rank_part` keeps, shard by shard."""
    if full.shape[0] != sum(part.full for part in layer.checkpoint_rows.values()):
        raise WeightShapeError(tuple(full.shape), (sum(p.full for p in layer.checkpoint_rows.values()),
                                                   *full.shape[1:]))
    parts = [part.take(full.narrow(0, layer.checkpoint_output_offsets[shard_id][0], part.full), 0)
             for shard_id, part in layer.checkpoint_rows.items()]
    return parts[0] if len(parts) == 1 else torch.cat(parts)


def rank_columns(layer: "LinearBase", full: torch.Tensor) -> torch.Tensor:
    """This rank's input columns of `full` [rows, checkpoint inputs] (a row-parallel layer's part)."""
    return full if layer.checkpoint_cols is None else layer.checkpoint_cols.take(full, 1)


def default_weight_loader(param: nn.Parameter, loaded: torch.Tensor, shard_id: ShardId = None) -> None:
    """Whole-tensor copy: embeddings, norms, and any parameter without a loader of its own."""
    if shard_id is not None:
        raise ValueError(f"an unfused parameter has no shard {shard_id!r}")
    copy_checked(param.data, loaded)


def new_parameter(layer: nn.Module, name: str, data: torch.Tensor, weight_loader, shard_ids: tuple,
                  **attributes) -> nn.Parameter:
    """Register `data` on `layer` as a frozen parameter carrying its loader, the shards a checkpoint
    must fill, and whatever else that loader reads (`attributes`)."""
    param = nn.Parameter(data, requires_grad=False)
    param.weight_loader, param.shard_ids = weight_loader, shard_ids
    for key, value in attributes.items():
        setattr(param, key, value)
    layer.register_parameter(name, param)
    return param


def register_weight_and_bias(layer: "LinearBase", weight: torch.Tensor, bias: bool, weight_loader) -> None:
    """`weight` (in whatever layout the method keeps) and an [out] bias or None, each filled shard by
    shard through `weight_loader`, which finds each shard's output rows in `param.output_offsets` and
    this rank's part of the checkpoint tensor with `rank_part`."""
    shards = dict(shard_ids=tuple(layer.output_offsets), output_offsets=layer.output_offsets,
                  checkpoint_rows=layer.checkpoint_rows)
    new_parameter(layer, "weight", weight, weight_loader, checkpoint_cols=layer.checkpoint_cols, **shards)
    register_bias(layer, bias, weight.dtype, weight_loader)


def register_bias(layer: "LinearBase", bias: bool, dtype: torch.dtype, weight_loader, **attributes) -> None:
    """An [out] bias of this rank's rows (or None), whose `weight_loader` takes each checkpoint shard through
    `rank_part`: a row-parallel layer's rank 0 keeps it, the others hold zeros."""
    if not bias:
        layer.bias = None
        return
    new_parameter(layer, "bias", torch.empty(layer.out_features, dtype=dtype), weight_loader,
                  shard_ids=tuple(layer.output_offsets), output_offsets=layer.output_offsets,
                  checkpoint_rows=layer.checkpoint_rows, checkpoint_cols=None,
                  zero_on_this_rank=layer.checkpoint_cols is not None and layer.tp.rank > 0, **attributes)


class LinearMethod:
    """How one kind of linear stores, loads, prepares and applies its weights (subclass all four)."""

    # Its weights are stored quantised: a mixture-of-experts layer then keeps one linear of this method per expert
    # (engine/layers/fused_moe/layer.py) instead of its fused full-precision expert tensors.
    quantized = False
    # It keeps only this rank's part (its loaders take each checkpoint tensor through `rank_part`, or it
    # narrows the whole unpacked weight after loading), so a tensor-parallel layer may use it.
    shards_by_rank = False

    def create_weights(self, layer: "LinearBase", bias: bool, dtype: torch.dtype) -> None:
        raise NotImplementedError

    def process_weights_after_loading(self, layer: "LinearBase") -> None:
        """Called once after every tensor is loaded (checkpoint or dummy weights)."""

    def apply(self, layer: "LinearBase", x: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError

    def native_row_operands(self, layer: "LinearBase") -> Optional[tuple[str, object, Optional[torch.Tensor]]]:
        """(kernel, weight operand, bias) where this method's forward of one row is a native CPU kernel on them
        (`"gemv"`: `gemv_bf16` on the plain weight, `"amx"`: `gemm_amx_bf16` on its tiles, `"quant"`: the
        quantised GEMV on a `kernels.quant.QuantRowOperand`), so the native decode step can call it directly;
        None otherwise."""
        return None

    def tie_weight(self, layer: "LinearBase", weight: nn.Parameter) -> None:
        """Share `weight` [out, in] (tied embeddings) instead of a weight of the layer's own."""
        raise ModelLoadError(f"{type(self).__name__} cannot share the embedding weight (tie_word_embeddings)")


class UnquantizedLinearMethod(LinearMethod):
    """A plain [out, in] weight (and bias) of the model's dtype, applied with `F.linear`."""

    shards_by_rank = True

    def create_weights(self, layer: "LinearBase", bias: bool, dtype: torch.dtype) -> None:
        weight = torch.empty(layer.out_features, layer.in_features, dtype=dtype)
        register_weight_and_bias(layer, weight, bias, self.weight_loader)

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor, shard_id: ShardId) -> None:
        """One checkpoint tensor into its rows: the whole parameter, or shard `shard_id` of a fused one."""
        start, size = param.output_offsets[shard_id]
        copy_checked(param.data.narrow(0, start, size), rank_part(param, loaded, shard_id))

    def apply(self, layer: "LinearBase", x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, layer.weight, layer.bias)

    def tie_weight(self, layer: "LinearBase", weight: nn.Parameter) -> None:
        if tuple(weight.shape) != (layer.out_features, layer.in_features):
            raise ModelLoadError(f"cannot tie a {tuple(weight.shape)} embedding to a "
                                 f"{(layer.out_features, layer.in_features)} output projection")
        layer.weight = weight


class OneDNNLinearMethod(UnquantizedLinearMethod):
    """bfloat16: for single-row inputs (decode at batch 1) the native GEMV (`kernels`) or `torch.mv` on the
    plain weight, which stream it fastest here; a oneDNN-reordered copy, packed for `batch_hint` rows, for
    everything else (about 2x F.linear's speed at M = 4)."""

    def __init__(self, batch_hint: int, kernels=None):
        self.batch_hint = max(batch_hint, 16)
        self.gemv = kernels if kernels is not None and kernels.has_gemv else None

    def create_weights(self, layer: "LinearBase", bias: bool, dtype: torch.dtype) -> None:
        super().create_weights(layer, bias, dtype)
        layer.packed = None

    def process_weights_after_loading(self, layer: "LinearBase") -> None:
        layer.packed = torch.ops.mkldnn._reorder_linear_weight(layer.weight.contiguous(), self.batch_hint)

    def apply(self, layer: "LinearBase", x: torch.Tensor) -> torch.Tensor:
        if x.shape[0] == 1 and self.gemv is not None and x.is_contiguous():
            return self.gemv.gemv(layer.weight, x, layer.bias)
        if x.shape[0] == 1:
            out = torch.mv(layer.weight, x[0]).unsqueeze(0)
            return out if layer.bias is None else out + layer.bias
        return torch.ops.mkldnn._linear_pointwise(x, layer.packed, layer.bias, "none", [], "")

    def native_row_operands(self, layer: "LinearBase") -> Optional[tuple[str, object, Optional[torch.Tensor]]]:
        return ("gemv", layer.weight, layer.bias) if self.gemv is not None and layer.weight.is_contiguous() else None


class AMXLinearMethod(UnquantizedLinearMethod):
    """bfloat16 on CPUs with AMX tiles: each weight held once, in the native AMX kernel's tile layout
    (`CpuKernels.pack_amx`), and that kernel run for every row count: at M = 1 it streams faster than the
    dpbf16 GEMV and up to 512 rows it matches or beats oneDNN's prepacked GEMM (benchmarks/small_m_linear.py);
    and each output row's value does not depend on the other rows (a verify row's linears equal one-token
    decodes', so bf16 greedy speculation is exact). Neither oneDNN's packed copy nor the plain weight is kept;
    a tied lm_head's weight stays the embedding's."""

    def __init__(self, kernels):
        self.kernels = kernels

    def create_weights(self, layer: "LinearBase", bias: bool, dtype: torch.dtype) -> None:
        super().create_weights(layer, bias, dtype)
        layer.amx_tiles, layer.weight_shared = None, False

    def tie_weight(self, layer: "LinearBase", weight: nn.Parameter) -> None:
        super().tie_weight(layer, weight)
        layer.amx_tiles, layer.weight_shared = None, True

    def process_weights_after_loading(self, layer: "LinearBase") -> None:
        layer.amx_tiles = self.kernels.pack_amx(layer.weight.data)
        if not layer.weight_shared:
            layer.weight = None  # the tiles are this layer's only copy

    def apply(self, layer: "LinearBase", x: torch.Tensor) -> torch.Tensor:
        rows = x.reshape(-1, x.shape[-1]).contiguous()
        out = self.kernels.gemm_amx(layer.amx_tiles, rows, layer.out_features, layer.bias)
        return out.view(*x.shape[:-1], layer.out_features)

    def native_row_operands(self, layer: "LinearBase") -> Optional[tuple[str, object, Optional[torch.Tensor]]]:
        return "amx", layer.amx_tiles, layer.bias


class MKLLinearMethod(UnquantizedLinearMethod):
    """float32 on an MKL-packed weight. MKL's packed GEMM serves only the row count it was packed for,
    so it is packed for single-row decode (where plain F.linear is slowest); other row counts use F.linear."""

    def create_weights(self, layer: "LinearBase", bias: bool, dtype: torch.dtype) -> None:
        super().create_weights(layer, bias, dtype)
        layer.packed = None

    def process_weights_after_loading(self, layer: "LinearBase") -> None:
        layer.packed = torch.ops.mkl._mkl_reorder_linear_weight(layer.weight, 1)

    def apply(self, layer: "LinearBase", x: torch.Tensor) -> torch.Tensor:
        if x.shape[0] != 1:
            return F.linear(x, layer.weight, layer.bias)
        return torch.ops.mkl._mkl_linear(x, layer.packed, layer.weight, layer.bias, 1)


def select_linear_method(device: torch.device, dtype: torch.dtype, kernels=None, batch_hint: int = 1) -> LinearMethod:
    """The fastest unquantised method here: for CPU bfloat16 the native AMX kernel where the CPU has AMX, else
    oneDNN; MKL for CPU float32; else F.linear. `kernels`: the native CPU kernels (or None): their AMX kernel,
    or their GEMV for single bf16 rows."""
    method: LinearMethod = UnquantizedLinearMethod()
    if device.type == "cpu":
        if dtype is torch.bfloat16 and kernels is not None and kernels.has_amx:
            method = AMXLinearMethod(kernels)
        elif (dtype is torch.bfloat16 and torch.backends.mkldnn.is_available()
                and torch.ops.mkldnn._is_mkldnn_bf16_supported()):
            method = OneDNNLinearMethod(batch_hint, kernels)
        elif dtype is torch.float32 and torch.backends.mkl.is_available() and hasattr(torch.ops.mkl, "_mkl_linear"):
            method = MKLLinearMethod()
    logger.info("linear layers: %s (%s on %s)", type(method).__name__, dtype, device)
    return method


# ---- layers ---------------------------------------------------------------------------------------

class LinearBase(nn.Module):
    """y = x W^T (+ b) with `in_features` inputs and outputs made of named shards, this rank's part of
    them: `output_sizes` maps each shard id (in order) to the part of its checkpoint rows this rank keeps,
    `input_part` (row-parallel layers) the part of the checkpoint's input columns."""

    def __init__(self, in_features: int, output_sizes: dict[ShardId, int | CheckpointSlice], bias: bool,
                 method: LinearMethod, dtype: torch.dtype, tp: TensorParallel = TensorParallel.single(),
                 input_part: Optional[CheckpointSlice] = None):
        super().__init__()
        if not tp.is_single and not method.shards_by_rank:
            raise ModelLoadError(f"{type(method).__name__} cannot be split over tensor-parallel ranks (its loaders "
                                 "take whole checkpoint tensors); run this checkpoint with --tensor-parallel-size 1")
        self.tp = tp
        self.checkpoint_cols = input_part
        self.in_features = input_part.size if input_part is not None else in_features
        self.checkpoint_rows: dict[ShardId, CheckpointSlice] = {
            shard_id: part if isinstance(part, CheckpointSlice) else CheckpointSlice.whole(part)
            for shard_id, part in output_sizes.items()}
        self.out_features = sum(part.size for part in self.checkpoint_rows.values())
        self.output_offsets: dict[ShardId, tuple[int, int]] = {}  # shard -> (first output row, rows)
        # the same for the whole checkpoint (every rank's rows): where pre-quantised methods load each shard
        self.checkpoint_output_offsets: dict[ShardId, tuple[int, int]] = {}
        start = full_start = 0
        for shard_id, part in self.checkpoint_rows.items():
            self.output_offsets[shard_id], start = (start, part.size), start + part.size
            self.checkpoint_output_offsets[shard_id], full_start = (full_start, part.full), full_start + part.full
        self.checkpoint_out_features = full_start
        self.checkpoint_in_features = input_part.full if input_part is not None else self.in_features
        self.method = method
        self.params_dtype = dtype  # the activations' dtype (a quantised method's weights have their own)
        method.create_weights(self, bias, dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.method.apply(self, x)

    def process_weights_after_loading(self) -> None:
        self.method.process_weights_after_loading(self)

    def extra_repr(self) -> str:
        shard = f", rank={self.tp.rank}/{self.tp.size}" if self.tp.size > 1 else ""
        return f"in={self.in_features}, out={self.out_features}, method={type(self.method).__name__}{shard}"


def _column_part(tp: TensorParallel, full: int, what: str) -> CheckpointSlice:
    start, size = tp.partition(full, what)
    return CheckpointSlice(full, start, size)


class ColumnLinear(LinearBase):
    """Outputs split over the ranks (each rank computes its part, no communication). `padded`: the
    vocabulary's split (lm_head), equal parts of ceil(out / size) whose rows past `out_features` are zero."""

    def __init__(self, in_features: int, out_features: int, bias: bool, method: LinearMethod, dtype: torch.dtype,
                 tp: TensorParallel = TensorParallel.single(), padded: bool = False):
        if padded:
            part = CheckpointSlice(out_features, *tp.padded_partition(out_features))
        else:
            part = _column_part(tp, out_features, "a column-parallel linear's outputs")
        super().__init__(in_features, {None: part}, bias, method, dtype, tp)


class RowLinear(LinearBase):
    """Inputs split over the ranks (o_proj, down_proj): each rank's partial product, summed by an
    all-reduce (hidden x dtype bytes per token). `reduce_results` False: the partial product is returned and
    the caller reduces once for several such layers (a mixture-of-experts layer's experts)."""

    def __init__(self, in_features: int, out_features: int, bias: bool, method: LinearMethod, dtype: torch.dtype,
                 tp: TensorParallel = TensorParallel.single(), reduce_results: bool = True):
        input_part = None if tp.is_single else _column_part(tp, in_features, "a row-parallel linear's inputs")
        super().__init__(in_features, {None: out_features}, bias, method, dtype, tp, input_part)
        self.reduce_results = reduce_results

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.method.apply(self, x)
        return self.tp.all_reduce(out) if self.reduce_results else out


class MergedColumnLinear(LinearBase):
    """Column linears side by side in one weight (gate and up); shard i is the i-th checkpoint tensor, each
    split over the ranks."""

    def __init__(self, in_features: int, sizes: list[int], bias: bool, method: LinearMethod, dtype: torch.dtype,
                 tp: TensorParallel = TensorParallel.single()):
        parts = {i: _column_part(tp, size, "a merged linear's outputs (the MLP's intermediate size)")
                 for i, size in enumerate(sizes)}
        super().__init__(in_features, parts, bias, method, dtype, tp)


class QKVLinear(LinearBase):
    """Query, key and value projections in one weight, shards "q", "k", "v". With several ranks each keeps
    its attention heads' rows (`head_dim` needed): an equal share of the query heads, and of the KV heads,
    or one KV head replicated when there are fewer KV heads than ranks (TensorParallel.kv_head_range)."""

    def __init__(self, in_features: int, q_size: int, kv_size: int, bias: bool, method: LinearMethod,
                 dtype: torch.dtype, tp: TensorParallel = TensorParallel.single(), head_dim: Optional[int] = None):
        if tp.is_single:
            parts: dict[ShardId, int | CheckpointSlice] = {"q": q_size, "k": kv_size, "v": kv_size}
        else:
            if head_dim is None:
                raise ValueError("a tensor-parallel QKVLinear needs head_dim")
            q_start, q_heads = tp.partition(q_size // head_dim, "attention heads")
            kv_start, kv_heads = tp.kv_head_range(kv_size // head_dim)
            q = CheckpointSlice(q_size, q_start * head_dim, q_heads * head_dim)
            kv = CheckpointSlice(kv_size, kv_start * head_dim, kv_heads * head_dim)
            parts = {"q": q, "k": kv, "v": kv}
        super().__init__(in_features, parts, bias, method, dtype, tp)


class LinearFactory:
    """Builds a model's linears with one method, dtype and tensor-parallel rank, so model code names
    (full, checkpoint) shapes only."""

    def __init__(self, method: LinearMethod, dtype: torch.dtype, tp: TensorParallel = TensorParallel.single()):
        self.method, self.dtype, self.tp = method, dtype, tp

    def column(self, in_features: int, out_features: int, bias: bool) -> ColumnLinear:
        return ColumnLinear(in_features, out_features, bias, self.method, self.dtype, self.tp)

    def vocab_column(self, in_features: int, vocab_size: int) -> ColumnLinear:
        """The output projection (lm_head): split by vocabulary in padded equal parts."""
        return ColumnLinear(in_features, vocab_size, False, self.method, self.dtype, self.tp, padded=True)

    def row(self, in_features: int, out_features: int, bias: bool, reduce_results: bool = True) -> RowLinear:
        return RowLinear(in_features, out_features, bias, self.method, self.dtype, self.tp, reduce_results)

    def merged(self, in_features: int, sizes: list[int], bias: bool) -> MergedColumnLinear:
        return MergedColumnLinear(in_features, sizes, bias, self.method, self.dtype, self.tp)

    def qkv(self, in_features: int, q_size: int, kv_size: int, bias: bool, head_dim: Optional[int] = None) -> QKVLinear:
        return QKVLinear(in_features, q_size, kv_size, bias, self.method, self.dtype, self.tp, head_dim)

    def tied(self, weight: nn.Parameter) -> ColumnLinear:
        """An output projection sharing `weight` [out, in] (tied embeddings; with several ranks this
        rank's vocabulary part, the same split as `vocab_column`): its own weights are built on the meta
        device (no memory) and replaced by the method's `tie_weight`."""
        with torch.device("meta"):
            layer = ColumnLinear(weight.shape[1], weight.shape[0], False, self.method, self.dtype)
        self.method.tie_weight(layer, weight)
        return layer
