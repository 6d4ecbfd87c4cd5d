"""Linears from a GGUF file: each (fused) layer's shards arrive as raw ggml blocks plus their type, and the
layer picks its run-time form once all are in.

- Q8_0 (blocks of 32: float16 d, 32 int8 q; w = q * d) -> 8-bit `GroupedIntWeight`, group 32, code q + 128;
- Q4_0 (float16 d, 16 bytes of nibbles: low nibbles the first 16 values; w = (q - 8) * d) -> 4-bit, group 32,
  symmetric at the midpoint 8;
- Q4_1 (d, m, nibbles; w = q * d + m) -> 4-bit group 32 with zero -m / d;
- Q4_K (super-blocks of 256: float16 d and dmin, 12 bytes of 6-bit sub-block scales and mins, 128 bytes of
  nibbles; w = d * sc * q - dmin * m per 32) -> 4-bit group 32 with scale d * sc and zero dmin * m / (d * sc);
- every other type (Q6_K, Q5_K, Q5_0, ... and F32/F16/BF16) is dequantised by the gguf package to the
  model dtype and runs as an unquantised linear (logged once per type): the engine has no grouped kernel
  for 5/6-bit codes, and Q6_K tensors are the minority of a Q4_K_M file (attn_v, ffn_down, output).
A fused layer whose shards mix 4- and 8-bit types runs dequantised too. With tensor parallelism every rank
decodes the layer's whole tensors and keeps its part (`rank_grouped_part`, or `rank_rows`/`rank_columns` of
the dequantised weight, as the unquantised method would have loaded it).
"""

from __future__ import annotations

import logging
from typing import Optional

import numpy as np
import torch
from torch import nn

from llmctl.engine.errors import ModelLoadError
from llmctl.engine.layers.linear import (LinearBase, LinearMethod, ShardId, copy_checked, new_parameter, rank_columns,
                                         rank_part, rank_rows, register_bias)
from llmctl.engine.layers.quantization import (GroupedIntWeight, apply_grouped_weight, grouped_row_operands,
                                               install_grouped_weight, rank_grouped_part)

logger = logging.getLogger(__name__)

QK = 32  # values per Q8_0/Q4_0/Q4_1 block and per Q4_K sub-block
QK_K = 256


def _float16(raw: np.ndarray) -> np.ndarray:
    return np.ascontiguousarray(raw).view(np.float16).astype(np.float32)[..., 0]


def _blocks(raw: np.ndarray, block_bytes: int) -> np.ndarray:
    rows = raw.shape[0]
    if raw.shape[1] % block_bytes:
        raise ModelLoadError(f"GGUF tensor rows of {raw.shape[1]} bytes are not whole {block_bytes}-byte blocks")
    return raw.reshape(rows, raw.shape[1] // block_bytes, block_bytes)


def _nibbles_32(qs: np.ndarray) -> np.ndarray:
    """[..., 16] bytes -> [..., 32] codes: the low nibbles are values 0..15, the high ones 16..31."""
    return np.concatenate([qs & 0x0F, qs >> 4], axis=-1)


def q8_0_grouped(raw: np.ndarray) -> tuple[np.ndarray, np.ndarray, Optional[np.ndarray]]:
    blocks = _blocks(raw, 2 + QK)
    codes = (blocks[..., 2:].view(np.int8).astype(np.int16) + 128).astype(np.uint8)
    return codes.reshape(raw.shape[0], -1), _float16(blocks[..., :2]), None


def q4_0_grouped(raw: np.ndarray) -> tuple[np.ndarray, np.ndarray, Optional[np.ndarray]]:
    blocks = _blocks(raw, 2 + QK // 2)
    return _nibbles_32(blocks[..., 2:]).reshape(raw.shape[0], -1), _float16(blocks[..., :2]), None


def q4_1_grouped(raw: np.ndarray) -> tuple[np.ndarray, np.ndarray, Optional[np.ndarray]]:
    blocks = _blocks(raw, 4 + QK // 2)
    scales, mins = _float16(blocks[..., :2]), _float16(blocks[..., 2:4])
    return _nibbles_32(blocks[..., 4:]).reshape(raw.shape[0], -1), scales, _zeros(-mins, scales)


def q4_k_grouped(raw: np.ndarray) -> tuple[np.ndarray, np.ndarray, Optional[np.ndarray]]:
    from gguf.quants import Q4_K

    blocks = _blocks(raw, 4 + 12 + QK_K // 2)
    rows, count = blocks.shape[:2]
    d, dmin = _float16(blocks[..., :2]), _float16(blocks[..., 2:4])
    sc, m = Q4_K.get_scale_min(blocks[..., 4:16].reshape(-1, 12))
    scales = d[..., None] * sc.reshape(rows, count, 8).astype(np.float32)
    offsets = dmin[..., None] * m.reshape(rows, count, 8).astype(np.float32)
    # 4 chunks of 32 bytes; chunk c: sub-block 2c in the low nibbles, 2c + 1 in the high ones
    qs = blocks[..., 16:].reshape(rows, count, 4, 1, 32) >> np.array([0, 4], dtype=np.uint8).reshape(1, 1, 1, 2, 1)
    codes = (qs & 0x0F).reshape(rows, -1)
    return codes, scales.reshape(rows, -1), _zeros(offsets.reshape(rows, -1), scales.reshape(rows, -1))


def _zeros(offsets: np.ndarray, scales: np.ndarray) -> Optional[np.ndarray]:
    """w = q * scale - offset as (q - zero) * scale: zero = offset / scale. None where a group has scale 0
    and an offset (a constant group the grouped form cannot hold)."""
    if np.any((scales == 0) & (offsets != 0)):
        return None
    return np.divide(offsets, scales, out=np.zeros_like(offsets), where=scales != 0)


# ggml type name -> (bits, decoder to (codes [rows, in], scales [rows, in / 32], zeros or None))
GROUPED_DECODERS = {"Q8_0": (8, q8_0_grouped), "Q4_0": (4, q4_0_grouped), "Q4_1": (4, q4_1_grouped),
                    "Q4_K": (4, q4_k_grouped)}
ASYMMETRIC = ("Q4_1", "Q4_K")


def dequantize_raw(raw: np.ndarray, type_name: str, in_features: int) -> torch.Tensor:
    """float32 [rows, in_features] of raw ggml rows, by the gguf package's reference dequantisers."""
    from gguf import GGMLQuantizationType
    from gguf.quants import dequantize

    try:
        values = dequantize(raw, GGMLQuantizationType[type_name])
    except NotImplementedError as exc:
        raise ModelLoadError(f"GGUF tensor type {type_name} cannot be loaded: {exc}") from None
    values = np.ascontiguousarray(values, dtype=np.float32)
    if not values.flags.writeable:  # an F32 tensor's view of the file's read-only memory map
        values = values.copy()
    return torch.from_numpy(values).reshape(raw.shape[0], in_features)


def grouped_weight(shards: list[tuple[str, np.ndarray]]) -> Optional[GroupedIntWeight]:
    """The (fused) layer's shards, in output order, as one grouped weight; None where their types do not
    all map onto one grouped form."""
    names = {name for name, _ in shards}
    if not names <= set(GROUPED_DECODERS) or len({GROUPED_DECODERS[n][0] for n in names}) != 1:
        return None
    parts = [GROUPED_DECODERS[name][1](raw) for name, raw in shards]
    if any(name in ASYMMETRIC for name in names):
        if any(n in ASYMMETRIC and zeros is None for (n, _), (_, _, zeros) in zip(shards, parts)):
            return None
        midpoint = float(1 << (GROUPED_DECODERS[shards[0][0]][0] - 1))
        zeros = torch.cat([torch.from_numpy(z) if z is not None else torch.full(s.shape, midpoint)
                           for _, s, z in parts]).float()
    else:
        zeros = None
    return GroupedIntWeight(codes=torch.from_numpy(np.concatenate([c for c, _, _ in parts])),
                            scales=torch.from_numpy(np.concatenate([s for _, s, _ in parts])), zeros=zeros,
                            bits=GROUPED_DECODERS[shards[0][0]][0], group_size=QK)


class GGUFLinearMethod(LinearMethod):
    """Loads `qweight` (raw ggml rows, uint8 [rows, bytes]) and `qweight_type` (the ggml type's number) per
    shard; after loading, a grouped integer weight where the types allow it, else the dequantised
    weight run by `unquantized` (the fastest unquantised method for the model dtype)."""

    shards_by_rank = True  # each rank decodes the whole tensors, then keeps its part

    def __init__(self, unquantized: LinearMethod):
        self.unquantized = unquantized
        self.dequantised_types: set[str] = set()  # logged once each

    def create_weights(self, layer: LinearBase, bias: bool, dtype: torch.dtype) -> None:
        staged: dict[ShardId, dict[str, object]] = {}
        shards = dict(shard_ids=tuple(layer.output_offsets), output_offsets=layer.checkpoint_output_offsets,
                      staged=staged)
        new_parameter(layer, "qweight", torch.empty(0, dtype=torch.uint8), self.stage_rows, **shards)
        new_parameter(layer, "qweight_type", torch.empty(0, dtype=torch.int64), self.stage_type, **shards)
        register_bias(layer, bias, dtype, self.load_bias)

    @staticmethod
    def stage_rows(param: nn.Parameter, loaded: torch.Tensor, shard_id: ShardId) -> None:
        rows = param.output_offsets[shard_id][1]
        if loaded.dim() != 2 or loaded.shape[0] != rows:
            raise ModelLoadError(f"a GGUF tensor of {tuple(loaded.shape)} bytes does not hold the {rows} rows "
                                 "its linear expects")
        param.staged.setdefault(shard_id, {})["raw"] = loaded.numpy()

    @staticmethod
    def stage_type(param: nn.Parameter, loaded: torch.Tensor, shard_id: ShardId) -> None:
        from gguf import GGMLQuantizationType

        param.staged.setdefault(shard_id, {})["type"] = GGMLQuantizationType(int(loaded)).name

    @staticmethod
    def load_bias(param: nn.Parameter, loaded: torch.Tensor, shard_id: ShardId) -> None:
        start, size = param.output_offsets[shard_id]
        copy_checked(param.data.narrow(0, start, size), rank_part(param, loaded, shard_id))

    def process_weights_after_loading(self, layer: LinearBase) -> None:
        staged = layer.qweight.staged
        shards = [(staged[shard]["type"], staged[shard]["raw"]) for shard in layer.output_offsets]
        weight = grouped_weight(shards)
        inputs = layer.checkpoint_in_features
        if weight is not None:
            if weight.in_features != inputs:
                raise ModelLoadError(f"a GGUF tensor of {weight.in_features} columns does not fit a linear of "
                                     f"{inputs} inputs")
            install_grouped_weight(layer, rank_grouped_part(layer, weight, "GGUF"))
            return
        full = rank_columns(layer, rank_rows(layer, torch.cat([dequantize_raw(raw, name, inputs)
                                                               for name, raw in shards])))
        for name in sorted({name for name, _ in shards} - {"F32", "F16", "BF16"} - self.dequantised_types):
            logger.info("GGUF %s linears are dequantised to %s on load (no grouped kernel for them)", name,
                        layer.params_dtype)
            self.dequantised_types.add(name)
        del layer.qweight, layer.qweight_type
        layer.weight = nn.Parameter(full.to(layer.params_dtype).contiguous(), requires_grad=False)
        self.unquantized.process_weights_after_loading(layer)

    def apply(self, layer: LinearBase, x: torch.Tensor) -> torch.Tensor:
        if hasattr(layer, "quant_layout"):
            return apply_grouped_weight(layer, x)
        return self.unquantized.apply(layer, x)

    def native_row_operands(self, layer: LinearBase):
        if hasattr(layer, "quant_layout"):
            return grouped_row_operands(layer)
        return self.unquantized.native_row_operands(layer)
