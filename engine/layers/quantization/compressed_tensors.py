"""compressed-tensors checkpoints (`quant_method: compressed-tensors`, the format llm-compressor writes and
vLLM prefers): `pack-quantized` int4/int8 weight-only linears, symmetric or asymmetric, `group` or
`channel` strategy.

Per quantised linear the checkpoint holds (compressed_tensors' PackedQuantizationCompressor):
- `weight_packed` int32 [out, in * bits / 32]: the codes q + 2^(bits-1) (q in the signed range), element i of
  a row at bits [i * bits, (i + 1) * bits) of the row's little-endian word stream;
- `weight_scale` [out, groups] (channel: one group of all inputs);
- `weight_zero_point` int32 [out * bits / 32, groups] (asymmetric only): the zero points, offset the same
  way, packed along the output dimension;
- `weight_shape` int [2]: the unpacked [out, in].
w = (q - zp) * scale, i.e. (code - zero code) * scale, which is the engine's `GroupedIntWeight`. The weight
loaders unpack each (fused) shard into uint8 codes and zero codes on load; after loading the layer gets its
kernel-backed form from `install_grouped_weight`. With tensor parallelism every rank unpacks the whole
checkpoint tensors and installs its part (`rank_grouped_part`). The `compressed-tensors` package is not needed at run
time: it is the tests' reference packer.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass
from typing import Any, Optional, Sequence

import torch
from torch import nn

from llmctl.engine.errors import ModelLoadError
from llmctl.engine.layers.linear import (LinearBase, ShardId, WeightShapeError, copy_checked, new_parameter,
                                         rank_part, register_bias)
from llmctl.engine.layers.quantization.base import LinearMethods, LinearTarget, QuantizationConfig
from llmctl.engine.layers.quantization.grouped import (GroupedIntLinearMethod, GroupedIntWeight,
                                                       install_grouped_weight, rank_grouped_part)

SUPPORTED_FORMAT = "pack-quantized"
SUPPORTED_BITS = (4, 8)
SUPPORTED_STRATEGIES = ("group", "channel")
# "weight"/"static" activation ordering changes only how GPTQ calibrates, not what is stored.
STORAGE_NEUTRAL_ACTORDER = (None, "weight", "static")
LM_HEAD_PATTERNS = ("lm_head", "re:.*lm_head", "re:^lm_head$", "re:.*lm_head$")


@dataclass(frozen=True)
class CompressedTensorsConfig(QuantizationConfig):
    """The one weight scheme every targeted linear uses."""

    bits: int
    symmetric: bool
    group_size: Optional[int]  # None: channel strategy (one group of all inputs)
    lm_head_quantized: bool

    quant_method = "compressed-tensors"

    @classmethod
    def from_quantization_config(cls, config: dict[str, Any], source: str,
                                 linear_names: Sequence[str]) -> "CompressedTensorsConfig":
        """Validate config.json's quantization_config; everything this engine would not run as written is
        refused with the field named."""
        _refuse_extras(config)
        groups = config.get("config_groups") or {}
        if not isinstance(groups, dict) or len(groups) != 1:
            raise ModelLoadError(f"compressed-tensors: exactly one config group is supported, got {len(groups)} "
                                 f"({', '.join(map(str, groups)) or 'none'})")
        (name, group), = groups.items()
        fmt = group.get("format") or config.get("format")
        if fmt != SUPPORTED_FORMAT:
            raise ModelLoadError(f"compressed-tensors format {fmt!r} is not supported (supported: {SUPPORTED_FORMAT})")
        if group.get("targets") != ["Linear"]:
            raise ModelLoadError(f"compressed-tensors config group {name!r}: targets {group.get('targets')!r} are not "
                                 "supported (supported: [\"Linear\"])")
        for key in ("input_activations", "output_activations"):
            if group.get(key) is not None:
                raise ModelLoadError(f"compressed-tensors config group {name!r}: {key} quantisation is not supported "
                                     "(weight-only schemes are: W4A16, W8A16)")
        weights = group.get("weights")
        if not isinstance(weights, dict):
            raise ModelLoadError(f"compressed-tensors config group {name!r} quantises no weights")
        return cls(**_weight_args(name, weights), lm_head_quantized=_lm_head_quantized(config.get("ignore") or []))

    def linear_methods(self, target: LinearTarget) -> LinearMethods:
        lm_head = None if self.lm_head_quantized else target.unquantized()
        return LinearMethods(CompressedTensorsLinearMethod(self), lm_head)

    def describe(self) -> str:
        group = "per channel" if self.group_size is None else f"group {self.group_size}"
        return f"compressed-tensors {self.bits}-bit {group}, {'sym' if self.symmetric else 'asym'}"


def _refuse_extras(config: dict[str, Any]) -> None:
    for key in ("kv_cache_scheme", "sparsity_config", "transform_config"):
        if config.get(key):
            raise ModelLoadError(f"compressed-tensors {key} is not supported")


def _weight_args(group: str, weights: dict[str, Any]) -> dict[str, Any]:
    where = f"compressed-tensors config group {group!r} weights"
    if weights.get("type", "int") != "int":
        raise ModelLoadError(f"{where}: type {weights.get('type')!r} is not supported (supported: int)")
    bits = weights.get("num_bits")
    if bits not in SUPPORTED_BITS:
        raise ModelLoadError(f"{where}: num_bits {bits!r} is not supported (supported: 4, 8)")
    strategy = weights.get("strategy")
    if strategy not in SUPPORTED_STRATEGIES:
        raise ModelLoadError(f"{where}: strategy {strategy!r} is not supported (supported: group, channel)")
    if weights.get("dynamic"):
        raise ModelLoadError(f"{where}: dynamic weight quantisation is not supported")
    if weights.get("actorder") not in STORAGE_NEUTRAL_ACTORDER:
        raise ModelLoadError(f"{where}: actorder {weights.get('actorder')!r} is not supported "
                             "(supported: none, weight)")
    group_size = weights.get("group_size") if strategy == "group" else None
    if strategy == "group" and (not isinstance(group_size, int) or group_size <= 0):
        raise ModelLoadError(f"{where}: group strategy needs a positive group_size, got {group_size!r}")
    return dict(bits=bits, symmetric=bool(weights.get("symmetric", True)), group_size=group_size)


def _lm_head_quantized(ignore: list[Any]) -> bool:
    """The scheme targets every Linear; `ignore` may exempt only the output projection here (our fused
    q/k/v and gate/up layers cannot mix quantised and full-precision parts)."""
    others = [entry for entry in ignore if entry not in LM_HEAD_PATTERNS]
    if others:
        raise ModelLoadError(f"compressed-tensors ignore entries {others!r} are not supported (only lm_head may be "
                             "left unquantised)")
    return not ignore


# ---- unpacking -------------------------------------------------------------------------------------

def unpack_int32(packed: torch.Tensor, bits: int, columns: int) -> torch.Tensor:
    """int32 [rows, ceil(columns * bits / 32)] -> uint8 codes [rows, columns], compressed_tensors'
    `pack_to_int32` layout (element i at bit i * bits of the row's little-endian words)."""
    if packed.dtype is not torch.int32:
        raise ModelLoadError(f"packed weights must be int32, got {packed.dtype}")
    if sys.byteorder != "little":
        raise ModelLoadError("compressed-tensors unpacking needs a little-endian host")
    as_bytes = packed.contiguous().view(torch.uint8)
    if bits == 8:
        codes = as_bytes
    else:  # 4 bits: the low nibble is the earlier element
        codes = torch.stack((as_bytes & 0xF, as_bytes >> 4), dim=-1).view(packed.shape[0], -1)
    if codes.shape[1] < columns:
        raise WeightShapeError(tuple(packed.shape), (packed.shape[0], -(-columns * bits // 32)))
    return codes[:, :columns].contiguous()


class CompressedTensorsLinearMethod(GroupedIntLinearMethod):
    """`pack-quantized` weight-only linears: loads every shard's packed codes, scales and zero points into
    uint8 codes [out, in], float32 scales [out, groups] and uint8 zero codes [out, groups], then installs them
    as the engine's grouped integer weight (the whole checkpoint's, of which each tensor-parallel rank keeps
    its part)."""

    shards_by_rank = True

    def __init__(self, scheme: CompressedTensorsConfig):
        self.scheme = scheme

    def group_size(self, layer: LinearBase) -> int:
        inputs = layer.checkpoint_in_features
        group = self.scheme.group_size or inputs
        if inputs % group:
            raise ModelLoadError(f"compressed-tensors group_size {group} does not divide a linear's {inputs} inputs")
        return group

    def create_weights(self, layer: LinearBase, bias: bool, dtype: torch.dtype) -> None:
        inputs, outputs = layer.checkpoint_in_features, layer.checkpoint_out_features
        groups = inputs // self.group_size(layer)
        shards = dict(shard_ids=tuple(layer.output_offsets), output_offsets=layer.checkpoint_output_offsets)
        new_parameter(layer, "weight_packed", torch.empty(outputs, inputs, dtype=torch.uint8), self.load_packed,
                      **shards)
        new_parameter(layer, "weight_scale", torch.empty(outputs, groups, dtype=torch.float32), self.load_rows,
                      **shards)
        new_parameter(layer, "weight_shape", torch.empty(0, dtype=torch.int64), self.check_shape, **shards,
                      in_features=inputs)
        if not self.scheme.symmetric:
            new_parameter(layer, "weight_zero_point", torch.empty(outputs, groups, dtype=torch.uint8),
                          self.load_zero_points, **shards)
        register_bias(layer, bias, dtype, self.load_rows)

    def load_packed(self, param: nn.Parameter, loaded: torch.Tensor, shard_id: ShardId) -> None:
        start, size = param.output_offsets[shard_id]
        copy_checked(param.data.narrow(0, start, size), unpack_int32(loaded, self.scheme.bits, param.shape[1]))

    def load_zero_points(self, param: nn.Parameter, loaded: torch.Tensor, shard_id: ShardId) -> None:
        start, size = param.output_offsets[shard_id]
        # packed along the output rows: unpack the transpose, as compressed_tensors does
        codes = unpack_int32(loaded.t().contiguous(), self.scheme.bits, size).t()
        copy_checked(param.data.narrow(0, start, size), codes)

    @staticmethod
    def load_rows(param: nn.Parameter, loaded: torch.Tensor, shard_id: ShardId) -> None:
        """Scales (whole checkpoint rows) or the bias (this rank's rows, `rank_part`)."""
        start, size = param.output_offsets[shard_id]
        copy_checked(param.data.narrow(0, start, size), rank_part(param, loaded, shard_id))

    @staticmethod
    def check_shape(param: nn.Parameter, loaded: torch.Tensor, shard_id: ShardId) -> None:
        """`weight_shape` is metadata: the shard's unpacked [out, in] must be the layer's."""
        expected = (param.output_offsets[shard_id][1], param.in_features)
        if tuple(int(v) for v in loaded.flatten().tolist()) != expected:
            raise WeightShapeError(tuple(int(v) for v in loaded.flatten().tolist()), expected)

    def process_weights_after_loading(self, layer: LinearBase) -> None:
        zeros = None if self.scheme.symmetric else layer.weight_zero_point.data
        weight = GroupedIntWeight(codes=layer.weight_packed.data, scales=layer.weight_scale.data, zeros=zeros,
                                  bits=self.scheme.bits, group_size=self.group_size(layer))
        # drops the loading form's parameters
        install_grouped_weight(layer, rank_grouped_part(layer, weight, "compressed-tensors"))
