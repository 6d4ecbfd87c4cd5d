"""Rotary position embeddings (rotate-half convention) with the scalings of transformers' modeling_rope_utils:
linear, llama3, YaRN, dynamic NTK and LongRoPE (and a GGUF file's per-frequency divisors).

The tables are built once for positions [0, max_positions): a paged K was rotated when it was written, so one
set of frequencies must hold for a sequence's whole life. Dynamic NTK and LongRoPE, which transformers
recomputes from each forward's length, are therefore fixed by the engine's context length (`max_positions`):
dynamic NTK stretches the base only past `original_max_position_embeddings` (transformers' rule at that length;
within it, the plain frequencies), and LongRoPE takes its long factors when `max_positions` exceeds
`original_max_position_embeddings`, else its short ones, for every position (as vLLM does).
"""

from __future__ import annotations

import math
from typing import Any, Optional

import torch

SCALED_ROPE_TYPES = ("linear", "llama3", "yarn", "dynamic", "longrope", "rope_freqs")


def inverse_frequencies(head_dim: int, theta: float, scaling: Optional[dict[str, Any]],
                        max_positions: int) -> tuple[torch.Tensor, float]:
    """(inv_freq [head_dim / 2] float32, the factor cos and sin are multiplied by)."""
    rope_type = (scaling or {}).get("rope_type", "default")
    if rope_type == "yarn":
        return _yarn(head_dim, theta, scaling)
    if rope_type == "longrope":
        return _longrope(head_dim, theta, scaling, max_positions)
    if rope_type == "dynamic":
        original = scaling["original_max_position_embeddings"]
        factor, length = float(scaling["factor"]), max(max_positions, original)
        theta = theta * ((factor * length / original) - (factor - 1)) ** (head_dim / (head_dim - 2))
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim))
    if rope_type == "linear":
        inv_freq = inv_freq / float(scaling["factor"])
    elif rope_type == "llama3":
        inv_freq = _llama3_scale(inv_freq, scaling)
    elif rope_type == "rope_freqs":  # a GGUF file's per-frequency divisors (llama.cpp's rope_freqs tensor)
        inv_freq = inv_freq / torch.tensor(scaling["factors"], dtype=torch.float64)
    return inv_freq.float(), 1.0


def _llama3_scale(inv_freq: torch.Tensor, scaling: dict[str, Any]) -> torch.Tensor:
    factor = float(scaling["factor"])
    low = float(scaling.get("low_freq_factor", 1.0))
    high = float(scaling.get("high_freq_factor", 4.0))
    original = float(scaling.get("original_max_position_embeddings", 8192))
    low_wavelen, high_wavelen = original / low, original / high
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_wavelen, inv_freq / factor, inv_freq)
    smooth = (original / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    is_medium = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
    return torch.where(is_medium, smoothed, scaled)


def _yarn_mscale(scale: float, mscale: float = 1.0) -> float:
    return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0


def _yarn(dim: int, theta: float, scaling: dict[str, Any]) -> tuple[torch.Tensor, float]:
    """YaRN: interpolated low frequencies, extrapolated high ones, a linear ramp between (float32, as
    transformers computes it), and cos/sin scaled by the attention factor."""
    factor, original = float(scaling["factor"]), scaling["original_max_position_embeddings"]
    attention = scaling.get("attention_factor")
    if attention is None:
        mscale, mscale_all_dim = scaling.get("mscale"), scaling.get("mscale_all_dim")
        attention = (_yarn_mscale(factor, mscale) / _yarn_mscale(factor, mscale_all_dim) if mscale and mscale_all_dim
                     else _yarn_mscale(factor))

    def correction_dim(rotations: float) -> float:
        return (dim * math.log(original / (rotations * 2 * math.pi))) / (2 * math.log(theta))

    low, high = correction_dim(scaling.get("beta_fast") or 32), correction_dim(scaling.get("beta_slow") or 1)
    if scaling.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    high = high + 0.001 if low == high else high  # transformers' guard against a zero-width ramp
    ramp = torch.clamp((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low), 0, 1)
    pos_freqs = theta ** (torch.arange(0, dim, 2, dtype=torch.float32) / dim)
    extrapolated = 1 - ramp
    inv_freq = (1.0 / (factor * pos_freqs)) * (1 - extrapolated) + (1.0 / pos_freqs) * extrapolated
    return inv_freq, float(attention)


def _longrope(dim: int, theta: float, scaling: dict[str, Any], max_positions: int) -> tuple[torch.Tensor, float]:
    original = scaling["original_max_position_embeddings"]
    factor, attention = float(scaling["factor"]), scaling.get("attention_factor")
    if attention is None:
        attention = 1.0 if factor <= 1.0 else math.sqrt(1 + math.log(factor) / math.log(original))
    factors = scaling["long_factor"] if max_positions > original else scaling["short_factor"]
    if len(factors) != dim // 2:
        raise ValueError(f"longrope factors have {len(factors)} entries, expected head_dim / 2 = {dim // 2}")
    shape = torch.arange(0, dim, 2, dtype=torch.int64).float() / dim
    return 1.0 / (torch.tensor(factors, dtype=torch.float32) * theta ** shape), float(attention)


class RotaryEmbedding(torch.nn.Module):
    """Precomputed cos/sin tables indexed by absolute position."""

    def __init__(self, head_dim: int, max_positions: int, theta: float, scaling: Optional[dict[str, Any]]):
        super().__init__()
        self._spec = (head_dim, max_positions, theta, scaling)
        self.register_buffer("cos", torch.empty(max_positions, head_dim // 2), persistent=False)
        self.register_buffer("sin", torch.empty(max_positions, head_dim // 2), persistent=False)

    @torch.no_grad()
    def build_tables(self) -> None:
        """Fill cos/sin in float32 on the buffers' device (call after materialising the module)."""
        head_dim, max_positions, theta, scaling = self._spec
        inv_freq, attention_factor = inverse_frequencies(head_dim, theta, scaling, max_positions)
        angles = torch.outer(torch.arange(max_positions, dtype=torch.float32), inv_freq)
        self.cos = (angles.cos() * attention_factor).to(self.cos.device)
        self.sin = (angles.sin() * attention_factor).to(self.sin.device)

    def tables(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """cos/sin rows for this step's positions, shaped to broadcast over heads; computed once a step.
        Tables are float32; like transformers, the rotation itself runs in the activations' dtype."""
        return self.cos[positions].unsqueeze(1).to(dtype), self.sin[positions].unsqueeze(1).to(dtype)


def rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate-half RoPE on [tokens, heads, head_dim]."""
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)
