"""GPTQ checkpoints (AutoGPTQ / GPTQModel / optimum layout), 4-bit and 8-bit.

Per linear with `in` inputs, `out` outputs, `b` bits (p = 32 / b codes per int32 word) and group size
`g` (-1: one group over all inputs, G = in / g groups):
- `qweight` int32 [in / p, out]: code of (input i, output o) in word [i / p, o], bits b * (i % p) upwards;
- `qzeros` int32 [G, out / p]: each group's zero point packed the same way along the outputs. The v1
  convention (`checkpoint_format` "gptq", AutoGPTQ's) stores zero - 1 and the reader adds 1 back (a
  stored 2^b - 1 reads as 2^b, exactly as AutoGPTQ's and vLLM's kernels read it); "gptq_v2"
  (GPTQModel's) stores the zero itself. Symmetric quantisation stores the midpoint 2^(b-1);
- `scales` float16 [G, out];
- `g_idx` int32 [in]: the group of each input. Without act-order it is i / g; with `desc_act` the
  inputs were quantised in another order, so the groups are scattered: the engine permutes the inputs
  (`perm`, inputs sorted by group) so each group is contiguous again, and each forward gathers the
  activations in that order;
and w[o, i] = (code - zero[g_idx[i], o]) * scale[g_idx[i], o]. Fused q/k/v and gate/up stack their
shards along the outputs; their g_idx must agree (they quantise the same input, so GPTQ gives them
the same order), else the checkpoint is refused.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Sequence

import torch

from llmctl.engine.errors import ModelLoadError
from llmctl.engine.layers.linear import LinearBase
from llmctl.engine.layers.quantization.checkpoint import (BITS_PER_WORD, CheckpointQuantizedLinearMethod,
                                                         CheckpointTensor, PackedCheckpointConfig, regroup,
                                                         unpack_int32)
from llmctl.engine.layers.quantization.grouped import GroupedIntWeight

GPTQ_BITS = (4, 8)
# checkpoint_format -> what the reader adds to a stored zero
ZERO_OFFSETS = {"gptq": 1, "gptq_v2": 0}


def group_size_of(group_size: int, in_features: int) -> int:
    """The inputs per group (-1: all of them); refused where it does not divide the inputs."""
    group = in_features if group_size == -1 else group_size
    if in_features % group:
        raise ModelLoadError(f"group size {group} does not divide a linear's {in_features} inputs")
    return group


def _int(raw: dict[str, Any], key: str, default: Any, source: str) -> int:
    value = raw.get(key, default)
    if isinstance(value, bool) or not isinstance(value, int):
        raise ModelLoadError(f"{source}: quantization_config.{key} must be an integer, got {value!r}")
    return value


def _bool(raw: dict[str, Any], key: str, default: bool, source: str) -> bool:
    value = raw.get(key, default)
    if not isinstance(value, bool):
        raise ModelLoadError(f"{source}: quantization_config.{key} must be true or false, got {value!r}")
    return value


def check_group_size(method: str, group_size: int, source: str) -> None:
    if group_size != -1 and group_size <= 0:
        raise ModelLoadError(f"{source}: {method} group_size must be positive or -1, got {group_size}")


@dataclass(frozen=True)
class GPTQConfig(PackedCheckpointConfig):
    """config.json's quantization_config for quant_method "gptq", validated."""

    bits: int
    group_size: int  # -1: one group over all of a linear's inputs
    desc_act: bool
    sym: bool
    checkpoint_format: str  # "gptq" (v1: zeros stored minus one) or "gptq_v2"

    quant_method = "gptq"

    @classmethod
    def from_quantization_config(cls, raw: dict[str, Any], source: str, linear_names: Sequence[str]) -> "GPTQConfig":
        bits = _int(raw, "bits", None, source)
        if bits not in GPTQ_BITS:
            why = " (3-bit codes straddle int32 words)" if bits == 3 else ""
            raise ModelLoadError(f"{source}: GPTQ {bits}-bit checkpoints are not supported{why}; supported: "
                                 f"{', '.join(f'{b}-bit' for b in GPTQ_BITS)}")
        group_size = _int(raw, "group_size", 128, source)
        check_group_size("GPTQ", group_size, source)
        # transformers/optimum write checkpoint_format, GPTQModel's quantize_config format
        checkpoint_format = str(raw.get("checkpoint_format") or raw.get("format") or "gptq")
        if raw.get("is_marlin_format") or checkpoint_format not in ZERO_OFFSETS:
            named = "marlin" if raw.get("is_marlin_format") else checkpoint_format
            raise ModelLoadError(f"{source}: GPTQ checkpoint_format {named!r} is not supported (supported: "
                                 f"{', '.join(ZERO_OFFSETS)})")
        if str(raw.get("pack_dtype", "int32")).removeprefix("torch.") != "int32":
            raise ModelLoadError(f"{source}: GPTQ pack_dtype {raw['pack_dtype']!r} is not supported (codes packed "
                                 "into int32 words are)")
        if raw.get("lm_head"):
            raise ModelLoadError(f"{source}: a GPTQ checkpoint with a quantised lm_head (lm_head: true) is not "
                                 "supported")
        if raw.get("dynamic"):
            raise ModelLoadError(f"{source}: GPTQ per-module overrides (dynamic) are not supported")
        _check_all_quantized(raw.get("modules_in_block_to_quantize"), linear_names, source)
        return cls(bits=bits, group_size=group_size, desc_act=_bool(raw, "desc_act", False, source),
                   sym=_bool(raw, "sym", True, source), checkpoint_format=checkpoint_format)

    def linear_method(self) -> "GPTQLinearMethod":
        return GPTQLinearMethod(self)

    def describe(self) -> str:
        group = "per channel" if self.group_size == -1 else f"group {self.group_size}"
        order = ", act-order" if self.desc_act else ""
        return f"gptq {self.bits}-bit {group}, {'sym' if self.sym else 'asym'}{order} ({self.checkpoint_format})"


def _check_all_quantized(blocks: Any, linear_names: Sequence[str], source: str) -> None:
    """modules_in_block_to_quantize (lists of module names inside a decoder layer): every decoder linear
    must be among them, since a linear left in full precision would need a second method."""
    if not blocks:
        return
    listed = {name for block in blocks for name in (block if isinstance(block, list) else [block])}
    missing = sorted({name.split(".", 3)[-1] for name in linear_names} - listed)
    if missing:
        raise ModelLoadError(f"{source}: GPTQ modules_in_block_to_quantize leaves {', '.join(missing)} unquantised; "
                             "partly quantised checkpoints are not supported")


class GPTQLinearMethod(CheckpointQuantizedLinearMethod):
    """qweight / qzeros / scales / g_idx as the checkpoint holds them, unpacked once after loading."""

    def __init__(self, config: GPTQConfig):
        self.config = config

    def create_weights(self, layer: LinearBase, bias: bool, dtype: torch.dtype) -> None:
        super().create_weights(layer, bias, dtype)
        if not self.config.desc_act:
            # Without act-order g_idx is i / group: a checkpoint that omits it loads with that one, and one
            # that has it is still read (and must then group its inputs evenly).
            inputs = layer.checkpoint_in_features
            layer.g_idx.data.copy_(torch.arange(inputs) // group_size_of(self.config.group_size, inputs))
            layer.g_idx.shard_ids = ()

    def checkpoint_tensors(self, layer: LinearBase) -> dict[str, CheckpointTensor]:
        per_word = BITS_PER_WORD // self.config.bits
        inputs, outputs = layer.checkpoint_in_features, layer.checkpoint_out_features
        if inputs % per_word:
            raise ModelLoadError(f"GPTQ: a linear's {inputs} inputs are not a multiple of the {per_word} codes "
                                 "an int32 word packs")
        groups = inputs // group_size_of(self.config.group_size, inputs)
        return {
            "qweight": CheckpointTensor((inputs // per_word, outputs), torch.int32, output_dim=1),
            "qzeros": CheckpointTensor((groups, outputs // per_word), torch.int32, output_dim=1,
                                       output_pack=per_word),
            "scales": CheckpointTensor((groups, outputs), torch.float32, output_dim=1),
            "g_idx": CheckpointTensor((len(layer.output_offsets), inputs), torch.int32, output_dim=None),
        }

    def grouped_weight(self, layer: LinearBase) -> GroupedIntWeight:
        bits, inputs = self.config.bits, layer.checkpoint_in_features
        group = group_size_of(self.config.group_size, inputs)
        codes = unpack_int32(layer.qweight.data, bits, dim=0).t()  # [out, in]
        zeros = unpack_int32(layer.qzeros.data, bits, dim=1).to(torch.int16) + ZERO_OFFSETS[self.config.checkpoint_format]
        scales = regroup(layer.scales.data, group, inputs)
        zeros = regroup(zeros, group, inputs)
        perm = act_order_permutation(shared_g_idx(layer), group)
        if perm is not None:
            codes = codes[:, perm]
        midpoint = 1 << (bits - 1)
        return GroupedIntWeight(codes=codes.contiguous(), scales=scales,
                                zeros=None if bool((zeros == midpoint).all()) else zeros,
                                bits=bits, group_size=group, perm=perm)


def shared_g_idx(layer: LinearBase) -> torch.Tensor:
    """The one g_idx of a (fused) layer: every shard's must be the same."""
    rows = layer.g_idx.data
    for shard, row in zip(layer.output_offsets, rows):
        if not torch.equal(row, rows[0]):
            first = next(iter(layer.output_offsets))
            raise ModelLoadError(f"GPTQ: fused shards {first!r} and {shard!r} have different g_idx (act-order "
                                 "input orders); one fused linear needs one")
    return rows[0].long()


def act_order_permutation(g_idx: torch.Tensor, group: int):
    """None where g_idx is the plain i / group; else the input order that makes every group contiguous
    (each group must hold exactly `group` inputs)."""
    inputs = g_idx.numel()
    plain = torch.arange(inputs, device=g_idx.device) // group
    if torch.equal(g_idx, plain):
        return None
    groups = inputs // group
    if int(g_idx.min()) < 0 or int(g_idx.max()) >= groups:
        raise ModelLoadError(f"GPTQ: g_idx holds groups outside 0..{groups - 1}")
    counts = torch.bincount(g_idx, minlength=groups)
    if not bool((counts == group).all()):
        raise ModelLoadError(f"GPTQ: g_idx puts {counts.min().item()}..{counts.max().item()} inputs in a group, "
                             f"expected {group} each")
    return torch.argsort(g_idx, stable=True)
