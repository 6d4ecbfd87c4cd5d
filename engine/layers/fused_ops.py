"""The decoder layer's elementwise ops (RMSNorm, residual add + RMSNorm, SiLU*mul, GeGLU, RoPE), chosen once per
model by `select_layer_ops`: the native CPU kernels where they are built, the Triton kernels on CUDA where
triton imports, torch ops otherwise. The model holds one `LayerOps` and never asks which it is.

Each implementation returns the same values up to rounding; `add_rms_norm` and `rotary` may work in place
(the caller treats the residual it passes as consumed, and the rotated heads as views of the input).
"""

from __future__ import annotations

import contextlib
import logging
from typing import Optional, Protocol

import torch
import torch.nn.functional as F

from llmctl.engine.layers.rotary import rotate

logger = logging.getLogger(__name__)


class LayerOps(Protocol):
    name: str
    kernels: object  # the native CPU kernels these ops run on (the model's native decode step needs them), or None

    def rms_norm(self, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor: ...

    def add_rms_norm(self, x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor,
                     eps: float) -> tuple[torch.Tensor, torch.Tensor]:
        """(RMSNorm(residual + x), residual + x)."""

    def silu_and_mul(self, gate_up: torch.Tensor) -> torch.Tensor:
        """silu(gate) * up for rows laid out as [gate | up]."""

    def gelu_tanh_and_mul(self, gate_up: torch.Tensor) -> torch.Tensor:
        """gelu_tanh(gate) * up (GeGLU, Gemma's MLP) for rows laid out as [gate | up]."""

    def rotary(self, x: torch.Tensor, heads: int, head_dim: int, cos: torch.Tensor,
               sin: torch.Tensor) -> torch.Tensor:
        """Rotate-half RoPE of the first `heads` heads of each row of the 2-D `x`, as [tokens, heads, head_dim]."""


def gelu_tanh_and_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """torch's GeGLU: every implementation runs it (no native or Triton kernel yet)."""
    gate, up = gate_up.chunk(2, dim=-1)
    return F.gelu(gate, approximate="tanh") * up


def _heads(x: torch.Tensor, heads: int, head_dim: int) -> torch.Tensor:
    return x[:, : heads * head_dim].view(x.shape[0], heads, head_dim)


class TorchLayerOps:
    name, kernels = "torch", None

    def rms_norm(self, x, weight, eps):
        return F.rms_norm(x, (x.shape[-1],), weight, eps)

    def add_rms_norm(self, x, residual, weight, eps):
        residual = residual + x
        return F.rms_norm(residual, (x.shape[-1],), weight, eps), residual

    def silu_and_mul(self, gate_up):
        gate, up = gate_up.chunk(2, dim=-1)
        return F.silu(gate) * up

    def gelu_tanh_and_mul(self, gate_up):
        return gelu_tanh_and_mul(gate_up)

    def rotary(self, x, heads, head_dim, cos, sin):
        return rotate(_heads(x, heads, head_dim), cos, sin)


class NativeCpuLayerOps(TorchLayerOps):
    """The native CPU kernels (`CpuKernels`); a norm of strided rows (a q/k view into qkv) runs torch's."""

    name = "native"

    def __init__(self, kernels):
        self.kernels = kernels

    def rms_norm(self, x, weight, eps):
        return self.kernels.rms_norm(x, weight, eps) if x.is_contiguous() else super().rms_norm(x, weight, eps)

    def add_rms_norm(self, x, residual, weight, eps):
        if not x.is_contiguous():
            return super().add_rms_norm(x, residual, weight, eps)
        return self.kernels.rms_norm(x, weight, eps, residual), residual  # residual updated in place

    def silu_and_mul(self, gate_up):
        return self.kernels.silu_and_mul(gate_up)

    def rotary(self, x, heads, head_dim, cos, sin):
        self.kernels.rotary_(x, heads, head_dim, cos, sin)
        return _heads(x, heads, head_dim)


class TritonLayerOps:
    """The Triton kernels of engine/kernels/triton for tensors on `device` (CUDA; CPU under TRITON_INTERPRET=1)."""

    name, kernels = "triton", None

    def __init__(self, device: torch.device):
        from llmctl.engine.kernels.triton import activation, norm, rope

        self._norm, self._activation, self._rope = norm, activation, rope
        # Triton launches on the current CUDA device, not the tensors': `--device cuda:1` without set_device
        self._on_device = torch.cuda.device(device) if device.type == "cuda" else contextlib.nullcontext()

    def rms_norm(self, x, weight, eps):
        with self._on_device:
            return self._norm.rms_norm(x, weight, eps)

    def add_rms_norm(self, x, residual, weight, eps):
        with self._on_device:
            return self._norm.fused_add_rms_norm(x, residual, weight, eps)  # residual updated in place

    def silu_and_mul(self, gate_up):
        with self._on_device:
            return self._activation.silu_and_mul(gate_up)

    def gelu_tanh_and_mul(self, gate_up):
        return gelu_tanh_and_mul(gate_up)

    def rotary(self, x, heads, head_dim, cos, sin):
        with self._on_device:
            self._rope.rotary_(x, heads, head_dim, cos, sin)
        return _heads(x, heads, head_dim)


def triton_layer_ops(device: torch.device) -> Optional[TritonLayerOps]:
    """The Triton ops where they can run on `device` (CUDA, a GPU Triton compiles for: sm80+), else None."""
    if device.type != "cuda" or torch.cuda.get_device_capability(device) < (8, 0):
        return None
    try:
        ops = TritonLayerOps(device)
    except Exception as exc:  # noqa: BLE001 - a missing or broken triton build means "not available"
        logger.info("Triton layer ops unavailable (%s): torch ops", exc)
        return None
    logger.info("layer ops: Triton kernels (fused residual add + RMSNorm, SiLU*mul, RoPE) on %s", device)
    return ops


def select_layer_ops(device: torch.device, kernels=None) -> LayerOps:
    """The native CPU kernels when given (the runner builds them for CPU models), else Triton on CUDA, else torch."""
    if kernels is not None:
        return NativeCpuLayerOps(kernels)
    return triton_layer_ops(device) or TorchLayerOps()
