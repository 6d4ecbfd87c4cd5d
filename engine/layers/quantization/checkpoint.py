"""Linears that a checkpoint stores already quantised (GPTQ, AWQ): the shared part of their methods.

Such a checkpoint holds, per linear, integer codes packed into int32 words, per-group zeros (packed
the same way), per-group scales, and for GPTQ a `g_idx` (the group of each input). A method here
declares those tensors as the layer's parameters (`CheckpointTensor`: shape, dtype, which dimension
holds the outputs and how many outputs one element of it packs), loads each fused shard (q/k/v,
gate/up) into its slice of them, and after loading unpacks them into the engine's one quantised form,
`GroupedIntWeight` (grouped.py), which `install_grouped_weight` turns into the
layer's run-time layout (torch's int4/int8 CPU kernels where they apply); the checkpoint tensors are
dropped then, so only the installed form stays in memory. With tensor parallelism every rank loads the
linear's whole checkpoint tensors (the layer's `checkpoint_*` sizes), unpacks them, and installs only its
part (`rank_grouped_part`): packing along the outputs or the inputs never has to line up with a rank. The format
modules (`gptq.py`, `awq.py`) say only how their tensors are laid out and what the codes mean; their configs share
`PackedCheckpointConfig` (the lm_head stays in full precision).
"""

from __future__ import annotations

import logging
from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Optional, Sequence

import torch
from torch import nn

from llmctl.engine.errors import EngineArgsError, ModelLoadError
from llmctl.engine.layers.linear import LinearBase, ShardId, copy_checked, new_parameter, rank_part, register_bias
from llmctl.engine.layers.quantization.base import LinearMethods, LinearTarget, QuantizationConfig
from llmctl.engine.layers.quantization.grouped import (GroupedIntLinearMethod, GroupedIntWeight,
                                                       install_grouped_weight, rank_grouped_part)

logger = logging.getLogger(__name__)

BITS_PER_WORD = 32


@dataclass(frozen=True)
class CheckpointTensor:
    """One checkpoint tensor of a linear: its full (all shards) shape and dtype; `output_dim`, the
    dimension its shards are stacked along (None: every shard holds the whole tensor, e.g. g_idx), and
    `output_pack`, how many outputs one element along that dimension holds (8 for int4 codes packed
    into int32 words along the outputs)."""

    shape: tuple[int, ...]
    dtype: torch.dtype
    output_dim: Optional[int]
    output_pack: int = 1


def unpack_int32(packed: torch.Tensor, bits: int, dim: int, order: Optional[Sequence[int]] = None) -> torch.Tensor:
    """int32 words holding 32/bits codes each, the lowest bits first, along `dim` -> uint8 codes with that
    dimension 32/bits times longer. `order` (AWQ's interleaving): the word's k-th field holds element
    `order[k]` of its run of 32/bits elements."""
    per_word = BITS_PER_WORD // bits
    fields = torch.arange(per_word, dtype=torch.int32, device=packed.device) * bits
    if order is not None:
        if sorted(order) != list(range(per_word)):
            raise ValueError(f"packing order {list(order)} is not a permutation of 0..{per_word - 1}")
        fields = fields[torch.argsort(torch.tensor(order, device=packed.device))]  # field holding element j
    dim = dim % packed.dim()
    words = packed.to(torch.int32).unsqueeze(dim + 1)
    shape = [1] * words.dim()
    shape[dim + 1] = per_word
    codes = (words >> fields.view(shape)) & ((1 << bits) - 1)
    merged = list(packed.shape)
    merged[dim] *= per_word
    return codes.reshape(merged).to(torch.uint8)


class CheckpointQuantizedLinearMethod(GroupedIntLinearMethod, ABC):
    """A linear whose checkpoint tensors are quantised: subclasses name the tensors (`checkpoint_tensors`,
    the whole checkpoint's: `layer.checkpoint_in_features` / `checkpoint_out_features`) and turn them into a
    `GroupedIntWeight` (`grouped_weight`); the forward is the grouped form's (`GroupedIntLinearMethod`)."""

    shards_by_rank = True  # each rank unpacks the whole tensors, then keeps its part

    @abstractmethod
    def checkpoint_tensors(self, layer: LinearBase) -> dict[str, CheckpointTensor]:
        """The checkpoint tensors of this format, by name, for the whole (unsharded) layer."""

    @abstractmethod
    def grouped_weight(self, layer: LinearBase) -> GroupedIntWeight:
        """The loaded checkpoint tensors (layer parameters of their names) as a `GroupedIntWeight`."""

    @property
    def name(self) -> str:
        return type(self).__name__

    def create_weights(self, layer: LinearBase, bias: bool, dtype: torch.dtype) -> None:
        shards = tuple(layer.output_offsets)
        for tensor_name, spec in self.checkpoint_tensors(layer).items():
            self._check_shards_pack(layer, tensor_name, spec)
            new_parameter(layer, tensor_name, torch.empty(spec.shape, dtype=spec.dtype), self.weight_loader,
                          shard_ids=shards, output_offsets=layer.checkpoint_output_offsets,
                          output_dim=spec.output_dim, output_pack=spec.output_pack)
        register_bias(layer, bias, dtype, self.weight_loader, output_dim=0, output_pack=1)

    def _check_shards_pack(self, layer: LinearBase, tensor_name: str, spec: CheckpointTensor) -> None:
        for shard_id, (start, size) in layer.checkpoint_output_offsets.items():
            if start % spec.output_pack or size % spec.output_pack:
                where = "" if shard_id is None else f" (shard {shard_id!r})"
                raise ModelLoadError(f"{self.name}: a linear's {size} outputs{where} are not a multiple of the "
                                     f"{spec.output_pack} that one {tensor_name} element packs")

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor, shard_id: ShardId) -> None:
        """One checkpoint tensor into its shard's slice; a tensor without an output dimension (g_idx) has
        one row per shard, in shard order. The bias keeps this rank's rows (`rank_part`)."""
        loaded = rank_part(param, loaded, shard_id)
        if param.output_dim is None:
            target = param.data[list(param.output_offsets).index(shard_id)]
        else:
            start, size = param.output_offsets[shard_id]
            target = param.data.narrow(param.output_dim, start // param.output_pack, size // param.output_pack)
        copy_checked(target, loaded)

    def process_weights_after_loading(self, layer: LinearBase) -> None:
        # install_grouped_weight drops the checkpoint tensors: only the run-time form stays in memory
        install_grouped_weight(layer, rank_grouped_part(layer, self.grouped_weight(layer), self.name))


def regroup(per_group: torch.Tensor, group_size: int, in_features: int) -> torch.Tensor:
    """[groups, out] per-group values (checkpoint layout) -> [out, groups], checked against the inputs."""
    groups = in_features // group_size
    if per_group.shape[0] != groups:
        raise ModelLoadError(f"{per_group.shape[0]} groups for {in_features} inputs at group size {group_size}")
    return per_group.t().contiguous()


class PackedCheckpointConfig(QuantizationConfig):
    """A checkpoint whose decoder linears hold packed int32 tensors (GPTQ, AWQ; `quant_method` names it): the
    lm_head stays in full precision, and random (dummy) weights cannot fill the packed tensors."""

    quant_method: str

    @abstractmethod
    def linear_method(self) -> CheckpointQuantizedLinearMethod:
        """The decoder linears' method."""

    def linear_methods(self, target: LinearTarget) -> LinearMethods:
        if target.load_format == "dummy":
            raise EngineArgsError(f"--load-format dummy cannot fill a pre-quantised ({self.quant_method}) "
                                  "checkpoint's packed tensors (its g_idx must be a grouping); load its weights")
        method = self.linear_method()
        logger.info("linear layers: %s (%s)", type(method).__name__, self.describe())
        return LinearMethods(method, target.unquantized())
