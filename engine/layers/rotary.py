"""Rotary position embeddings (rotate-half convention) with Llama-3 and linear scaling."""

from __future__ import annotations

import math
from typing import Any, Optional

import torch


def inverse_frequencies(head_dim: int, theta: float, scaling: Optional[dict[str, Any]]) -> torch.Tensor:
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim))
    rope_type = (scaling or {}).get("rope_type", "default")
    if rope_type == "linear":
        return (inv_freq / float(scaling["factor"])).float()
    if rope_type == "llama3":
        return _llama3_scale(inv_freq, scaling).float()
    if rope_type == "rope_freqs":  # a GGUF file's per-frequency divisors (llama.cpp's rope_freqs tensor)
        return (inv_freq / torch.tensor(scaling["factors"], dtype=torch.float64)).float()
    return inv_freq.float()


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
        inv_freq = inverse_frequencies(head_dim, theta, scaling)
        angles = torch.outer(torch.arange(max_positions, dtype=torch.float32), inv_freq)
        self.cos = angles.cos().to(self.cos.device)
        self.sin = angles.sin().to(self.sin.device)

    def tables(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """cos/sin rows for this step's positions, shaped to broadcast over heads; computed once a step.
        Tables are float32; like transformers, the rotation itself runs in the activations' dtype."""
        return self.cos[positions].unsqueeze(1).to(dtype), self.sin[positions].unsqueeze(1).to(dtype)


def rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate-half RoPE on [tokens, heads, head_dim]."""
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)
