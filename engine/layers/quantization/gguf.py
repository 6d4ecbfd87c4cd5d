"""Linears from a GGUF file: each (fused) layer's shards arrive as raw ggml blocks plus their type, and the
layer picks its run-time form once all are in.

- Q8_0 (blocks of 32: float16 d, 32 int8 q; w = q * d) -> 8-bit `GroupedIntWeight`, group 32, code q + 128;
- Q4_0 (float16 d, 16 bytes of nibbles: low nibbles the first 16 values; w = (q - 8) * d) -> 4-bit, group 32,
  symmetric at the midpoint 8;
- Q4_1 (d, m, nibbles; w = q * d + m) -> 4-bit group 32 with zero -m / d;
- Q4_K (super-blocks of 256: float16 d and dmin, 12 bytes of 6-bit sub-block scales and mins, 128 bytes of
  nibbles; w = d * sc * q - dmin * m per 32) -> 4-bit group 32 with scale d * sc and zero dmin * m / (d * sc);
- the 5- and 6-bit types run as 6-bit codes (the kernels' 6-bit layout: 0.75 bytes a code, 8-bit arithmetic):
  Q5_0 (d, 32 high bits, nibbles; w = (q - 16) * d) -> group 32, code q + 16 (the midpoint 32); Q5_1 (d, m, ...;
  w = q * d + m) -> group 32 with zero -m / d; Q5_K (Q4_K's scales and mins, a high bit per value) -> group 32
  like Q4_K; Q6_K (super-blocks of 256: low nibbles, 2 high bits, an int8 scale per 16, float16 d;
  w = d * sc * (q - 32)) -> group 16, code q;
- IQ4_NL (d, nibbles indexing a 16-value non-linear grid) and IQ4_XS (IQ4_NL's grid, a 6-bit scale per 32
  against d) -> 8-bit codes, group 32, code grid[q] + 128, which the native kernels store as the 4-bit grid
  indices again (kernels/quant.py `IQ4_CODES`: 0.5 bytes a code). A Q4_K_M file is mostly Q4_K with Q6_K for
  attn_v, half the ffn_down and the output (and Q5_0/Q8_0 where rows are not whole 256-value super-blocks, as
  SmolLM's 576), so those run as 6-bit codes rather than dequantised bf16;
- every other type (Q2_K, Q3_K, the IQ types but IQ4_NL/IQ4_XS, and F32/F16/BF16) is dequantised by the gguf
  package to the model dtype and runs as an unquantised linear (logged once per type).
A fused layer's shards run as one grouped weight of the widest bits and the smallest group among them (codes
widened to 6 or 8 bits keep their values; a group of 32 is two groups of 16 with the same scale), so a Q4_K
q/k beside a Q6_K v is one 6-bit qkv, not a dequantised one. With tensor parallelism every rank decodes the
layer's whole tensors and keeps its part (`rank_grouped_part`, or `rank_rows`/`rank_columns` of the dequantised
weight, as the unquantised method would have loaded it).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any, Callable, NamedTuple, Optional, Sequence

import numpy as np
import torch
from torch import nn

from llmctl.engine.errors import ModelLoadError
from llmctl.engine.layers.linear import (LinearBase, LinearMethod, ShardId, copy_checked, new_parameter, rank_columns,
                                         rank_part, rank_rows, register_bias)
from llmctl.engine.layers.quantization.base import LinearMethods, LinearTarget, QuantizationConfig
from llmctl.engine.layers.quantization.grouped import (GroupedIntWeight, apply_grouped_weight,
                                                       grouped_row_operands, install_grouped_weight,
                                                       rank_grouped_part)

logger = logging.getLogger(__name__)

QK = 32  # values per Q8_0/Q4_0/Q4_1/Q5_0/Q5_1 block and per Q4_K/Q5_K sub-block
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


def _k_scales_offsets(blocks: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Q4_K/Q5_K super-blocks [rows, count, bytes] -> per 32 values d * sc and dmin * m [rows, count * 8]."""
    from gguf.quants import Q4_K

    rows, count = blocks.shape[:2]
    d, dmin = _float16(blocks[..., :2]), _float16(blocks[..., 2:4])
    sc, m = Q4_K.get_scale_min(blocks[..., 4:16].reshape(-1, 12))
    scales = d[..., None] * sc.reshape(rows, count, 8).astype(np.float32)
    offsets = dmin[..., None] * m.reshape(rows, count, 8).astype(np.float32)
    return scales.reshape(rows, -1), offsets.reshape(rows, -1)


def q4_k_grouped(raw: np.ndarray) -> tuple[np.ndarray, np.ndarray, Optional[np.ndarray]]:
    blocks = _blocks(raw, 4 + 12 + QK_K // 2)
    rows, count = blocks.shape[:2]
    scales, offsets = _k_scales_offsets(blocks)
    # 4 chunks of 32 bytes; chunk c: sub-block 2c in the low nibbles, 2c + 1 in the high ones
    qs = blocks[..., 16:].reshape(rows, count, 4, 1, 32) >> np.array([0, 4], dtype=np.uint8).reshape(1, 1, 1, 2, 1)
    return (qs & 0x0F).reshape(rows, -1), scales, _zeros(offsets, scales)


def _high_bits_32(qh: np.ndarray) -> np.ndarray:
    """[..., 4] bytes (a little-endian uint32) -> [..., 32] bits: bit j is value j's fifth bit (Q5_0, Q5_1)."""
    return np.unpackbits(qh, axis=-1, bitorder="little")


def q5_0_grouped(raw: np.ndarray) -> tuple[np.ndarray, np.ndarray, Optional[np.ndarray]]:
    blocks = _blocks(raw, 2 + 4 + QK // 2)
    q = _nibbles_32(blocks[..., 6:]) | (_high_bits_32(blocks[..., 2:6]) << 4)
    return (q + 16).reshape(raw.shape[0], -1), _float16(blocks[..., :2]), None


def q5_1_grouped(raw: np.ndarray) -> tuple[np.ndarray, np.ndarray, Optional[np.ndarray]]:
    blocks = _blocks(raw, 4 + 4 + QK // 2)
    scales, mins = _float16(blocks[..., :2]), _float16(blocks[..., 2:4])
    q = _nibbles_32(blocks[..., 8:]) | (_high_bits_32(blocks[..., 4:8]) << 4)
    return q.reshape(raw.shape[0], -1), scales, _zeros(-mins, scales)


def q5_k_grouped(raw: np.ndarray) -> tuple[np.ndarray, np.ndarray, Optional[np.ndarray]]:
    blocks = _blocks(raw, 4 + 12 + QK_K // 8 + QK_K // 2)
    rows, count = blocks.shape[:2]
    scales, offsets = _k_scales_offsets(blocks)
    # sub-block s: the low nibbles of qs chunk s // 2 (s even) or its high ones (s odd), and bit s of qh's 32 bytes
    qs = blocks[..., 48:].reshape(rows, count, 4, 1, 32) >> np.array([0, 4], dtype=np.uint8).reshape(1, 1, 1, 2, 1)
    qh = blocks[..., 16:48].reshape(rows, count, 1, 32) >> np.arange(8, dtype=np.uint8).reshape(1, 1, 8, 1)
    codes = ((qs & 0x0F).reshape(rows, count, 8, 32) | ((qh & 0x01) << 4)).reshape(rows, -1)
    return codes, scales, _zeros(offsets, scales)


def q6_k_grouped(raw: np.ndarray) -> tuple[np.ndarray, np.ndarray, Optional[np.ndarray]]:
    blocks = _blocks(raw, QK_K // 2 + QK_K // 4 + QK_K // 16 + 2)
    rows, count = blocks.shape[:2]
    d = _float16(blocks[..., -2:])
    sc = blocks[..., QK_K * 3 // 4:QK_K * 3 // 4 + 16].view(np.int8).astype(np.float32)
    # values 32 at a time: the low (then high) nibbles of ql's 64-byte halves, 2 bits of qh's 32-byte quarters
    ql = blocks[..., :QK_K // 2].reshape(rows, count, 2, 1, 64) >> np.array([0, 4], dtype=np.uint8).reshape(1, 1, 1, 2, 1)
    qh = blocks[..., QK_K // 2:QK_K * 3 // 4].reshape(rows, count, 2, 1, 32) >> np.array(
        [0, 2, 4, 6], dtype=np.uint8).reshape(1, 1, 1, 4, 1)
    q = (ql & 0x0F).reshape(rows, count, 8, 32) | ((qh & 0x03).reshape(rows, count, 8, 32) << 4)
    return q.reshape(rows, -1), (d[..., None] * sc).reshape(rows, -1), None


def _iq4_grid() -> np.ndarray:
    """IQ4_NL/IQ4_XS's non-linear 4-bit grid (the gguf package's, ggml's kvalues_iq4nl): a code indexes it."""
    from gguf.quants import IQ4_NL

    return np.array(IQ4_NL.kvalues, dtype=np.int16)


def iq4_nl_grouped(raw: np.ndarray) -> tuple[np.ndarray, np.ndarray, Optional[np.ndarray]]:
    blocks = _blocks(raw, 2 + QK // 2)
    codes = (_iq4_grid()[_nibbles_32(blocks[..., 2:])] + 128).astype(np.uint8)
    return codes.reshape(raw.shape[0], -1), _float16(blocks[..., :2]), None


def iq4_xs_grouped(raw: np.ndarray) -> tuple[np.ndarray, np.ndarray, Optional[np.ndarray]]:
    blocks = _blocks(raw, 2 + 2 + QK_K // 64 + QK_K // 2)
    rows, count = blocks.shape[:2]
    d = _float16(blocks[..., :2])
    # sub-block s's 6-bit scale: a nibble of scales_l byte s // 2, 2 bits of the 16-bit scales_h
    high = np.ascontiguousarray(blocks[..., 2:4]).view(np.uint16)[..., 0, None] >> (2 * np.arange(8, dtype=np.uint16))
    low = blocks[..., 4:8, None] >> np.array([0, 4], dtype=np.uint8)
    scales = (low.reshape(rows, count, 8) & 0x0F) | ((high & 0x03).astype(np.uint8) << 4)
    codes = (_iq4_grid()[_nibbles_32(blocks[..., 8:].reshape(rows, count, 8, 16))] + 128).astype(np.uint8)
    return codes.reshape(rows, -1), (d[..., None] * (scales.astype(np.float32) - 32)).reshape(rows, -1), None


def _zeros(offsets: np.ndarray, scales: np.ndarray) -> Optional[np.ndarray]:
    """w = q * scale - offset as (q - zero) * scale: zero = offset / scale. None where a group has scale 0
    and an offset (a constant group the grouped form cannot hold)."""
    if np.any((scales == 0) & (offsets != 0)):
        return None
    return np.divide(offsets, scales, out=np.zeros_like(offsets), where=scales != 0)


class GroupedDecoder(NamedTuple):
    bits: int  # of the codes it returns
    group: int  # inputs per scale
    decode: Callable[[np.ndarray], tuple[np.ndarray, np.ndarray, Optional[np.ndarray]]]


# ggml type name -> its decoder to (codes uint8 [rows, in], scales [rows, in / group], zeros or None: symmetric at
# the bits' midpoint)
GROUPED_DECODERS = {"Q8_0": GroupedDecoder(8, QK, q8_0_grouped), "Q4_0": GroupedDecoder(4, QK, q4_0_grouped),
                    "Q4_1": GroupedDecoder(4, QK, q4_1_grouped), "Q4_K": GroupedDecoder(4, QK, q4_k_grouped),
                    "Q5_0": GroupedDecoder(6, QK, q5_0_grouped), "Q5_1": GroupedDecoder(6, QK, q5_1_grouped),
                    "Q5_K": GroupedDecoder(6, QK, q5_k_grouped), "Q6_K": GroupedDecoder(6, 16, q6_k_grouped),
                    "IQ4_NL": GroupedDecoder(8, QK, iq4_nl_grouped), "IQ4_XS": GroupedDecoder(8, QK, iq4_xs_grouped)}
ASYMMETRIC = ("Q4_1", "Q4_K", "Q5_1", "Q5_K")


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


def _as_part(decoder: GroupedDecoder, raw: np.ndarray, bits: int,
             group: int) -> tuple[np.ndarray, np.ndarray, Optional[np.ndarray]]:
    """One shard decoded into a layer of `bits` codes and groups of `group` inputs (group divides its own)."""
    codes, scales, zeros = decoder.decode(raw)
    if decoder.bits < bits and zeros is None:  # symmetric: the midpoint moves (8 -> 32 or 128) with the codes
        codes = codes + np.uint8((1 << (bits - 1)) - (1 << (decoder.bits - 1)))
    repeat = decoder.group // group
    if repeat > 1:
        scales = np.repeat(scales, repeat, axis=-1)
        zeros = np.repeat(zeros, repeat, axis=-1) if zeros is not None else None
    return codes, scales, zeros


def grouped_weight(shards: list[tuple[str, np.ndarray]]) -> Optional[GroupedIntWeight]:
    """The (fused) layer's shards, in output order, as one grouped weight of the widest bits and the smallest
    group among them; None where a type has no grouped form (or an asymmetric group cannot be held)."""
    if not all(name in GROUPED_DECODERS for name, _ in shards):
        return None
    decoders = [GROUPED_DECODERS[name] for name, _ in shards]
    bits, group = max(d.bits for d in decoders), min(d.group for d in decoders)
    parts = [_as_part(decoder, raw, bits, group) for decoder, (_, raw) in zip(decoders, shards)]
    if any(name in ASYMMETRIC and zeros is None for (name, _), (_, _, zeros) in zip(shards, parts)):
        return None
    zeros = None
    if any(name in ASYMMETRIC for name, _ in shards):
        midpoint = float(1 << (bits - 1))
        zeros = torch.cat([torch.from_numpy(z) if z is not None else torch.full(s.shape, midpoint)
                           for _, s, z in parts]).float()
    return GroupedIntWeight(codes=torch.from_numpy(np.concatenate([c for c, _, _ in parts])),
                            scales=torch.from_numpy(np.concatenate([s for _, s, _ in parts])), zeros=zeros,
                            bits=bits, group_size=group)


class GGUFLinearMethod(LinearMethod):
    """Loads `qweight` (raw ggml rows, uint8 [rows, bytes]) and `qweight_type` (the ggml type's number) per
    shard; after loading, a grouped integer weight where the types allow it, else the dequantised
    weight run by `unquantized` (the fastest unquantised method for the model dtype)."""

    shards_by_rank = True  # each rank decodes the whole tensors, then keeps its part
    quantized = True

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


@dataclass(frozen=True)
class GGUFConfig(QuantizationConfig):
    """A .gguf file (each tensor names its own ggml type, so there are no options): the decoder linears and an
    untied output projection run `GGUFLinearMethod`; a tied lm_head is the embedding's, unquantised."""

    @classmethod
    def from_quantization_config(cls, raw: dict[str, Any], source: str, linear_names: Sequence[str]) -> "GGUFConfig":
        return cls()

    def linear_methods(self, target: LinearTarget) -> LinearMethods:
        if target.load_format == "dummy":  # random weights fill full-precision linears
            return LinearMethods(target.unquantized())
        lm_head = target.unquantized() if target.tie_word_embeddings else None
        return LinearMethods(GGUFLinearMethod(target.unquantized()), lm_head)

    def describe(self) -> str:
        return "gguf"
