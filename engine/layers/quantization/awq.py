"""AWQ checkpoints in the GEMM layout (AutoAWQ's `WQLinear_GEMM`, the one vLLM loads), 4-bit.

Per linear with `in` inputs, `out` outputs and group size g (G = in / g groups):
- `qweight` int32 [in, out / 8]: the codes of outputs 8j..8j+7 of input i in word [i, j], interleaved:
  the word's k-th 4-bit field (bits 4k upwards) holds output 8j + AWQ_PACK_ORDER[k];
- `qzeros` int32 [G, out / 8]: each group's zero point (the zero itself, no offset), packed the same way;
- `scales` float16 [G, out];
and w[o, i] = (code - zero[i / g, o]) * scale[i / g, o]. Fused q/k/v and gate/up stack their shards along
the outputs. The GEMV layouts (`version` gemv, gemv_fast) pack along the inputs and are refused.
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
from llmctl.engine.layers.quantization.gptq import check_group_size, group_size_of
from llmctl.engine.layers.quantization.grouped import GroupedIntWeight

AWQ_BITS = 4
AWQ_PACK_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)
AWQ_VERSIONS = ("gemm",)


@dataclass(frozen=True)
class AWQConfig(PackedCheckpointConfig):
    """config.json's quantization_config for quant_method "awq", validated (AutoAWQ's and transformers'
    key names: bits / w_bit, group_size / q_group_size)."""

    group_size: int  # -1: one group over all of a linear's inputs
    bits: int = AWQ_BITS

    quant_method = "awq"

    @classmethod
    def from_quantization_config(cls, raw: dict[str, Any], source: str, linear_names: Sequence[str]) -> "AWQConfig":
        bits = raw.get("bits", raw.get("w_bit"))
        if bits != AWQ_BITS:
            raise ModelLoadError(f"{source}: AWQ {bits}-bit checkpoints are not supported (only 4-bit)")
        version = str(raw.get("version", "gemm")).lower()
        if version not in AWQ_VERSIONS:
            raise ModelLoadError(f"{source}: AWQ version {version!r} is not supported (its layout differs); "
                                 f"supported: {', '.join(AWQ_VERSIONS)}")
        if raw.get("zero_point", True) is not True:
            raise ModelLoadError(f"{source}: AWQ without zero points (zero_point: false) is not supported")
        group_size = raw.get("group_size", raw.get("q_group_size", 128))
        if isinstance(group_size, bool) or not isinstance(group_size, int):
            raise ModelLoadError(f"{source}: AWQ group_size must be an integer, got {group_size!r}")
        check_group_size("AWQ", group_size, source)
        kept = [entry for entry in raw.get("modules_to_not_convert") or []
                if any(str(entry) in name for name in linear_names)]
        if kept:
            raise ModelLoadError(f"{source}: AWQ modules_to_not_convert keeps decoder linears ({', '.join(kept)}) "
                                 "unquantised; partly quantised checkpoints are not supported")
        return cls(group_size=group_size)

    def linear_method(self) -> "AWQLinearMethod":
        return AWQLinearMethod(self)

    def describe(self) -> str:
        group = "per channel" if self.group_size == -1 else f"group {self.group_size}"
        return f"awq 4-bit {group} (gemm)"


class AWQLinearMethod(CheckpointQuantizedLinearMethod):
    """qweight / qzeros / scales as the checkpoint holds them, unpacked once after loading."""

    def __init__(self, config: AWQConfig):
        self.config = config

    def checkpoint_tensors(self, layer: LinearBase) -> dict[str, CheckpointTensor]:
        per_word = BITS_PER_WORD // AWQ_BITS
        inputs, outputs = layer.checkpoint_in_features, layer.checkpoint_out_features
        groups = inputs // group_size_of(self.config.group_size, inputs)
        return {
            "qweight": CheckpointTensor((inputs, outputs // per_word), torch.int32, output_dim=1, output_pack=per_word),
            "qzeros": CheckpointTensor((groups, outputs // per_word), torch.int32, output_dim=1, output_pack=per_word),
            "scales": CheckpointTensor((groups, outputs), torch.float32, output_dim=1),
        }

    def grouped_weight(self, layer: LinearBase) -> GroupedIntWeight:
        inputs = layer.checkpoint_in_features
        group = group_size_of(self.config.group_size, inputs)
        codes = unpack_int32(layer.qweight.data, AWQ_BITS, dim=1, order=AWQ_PACK_ORDER).t()  # [out, in]
        zeros = unpack_int32(layer.qzeros.data, AWQ_BITS, dim=1, order=AWQ_PACK_ORDER)
        return GroupedIntWeight(codes=codes.contiguous(), scales=regroup(layer.scales.data, group, inputs),
                                zeros=regroup(zeros, group, inputs), bits=AWQ_BITS, group_size=group)
