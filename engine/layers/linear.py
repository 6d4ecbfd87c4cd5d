"""CPU fast paths for linear layers: weights prepacked once for the CPU's GEMM libraries.

Plain `F.linear` reaches about a third of memory bandwidth at decode shapes on CPU. oneDNN
(bfloat16) and MKL (float32) kernels on prepacked weights are 1.3-2x faster with the same
results; `pack_linears` swaps them in after loading. CUDA and other dtypes keep `nn.Linear`.
"""

from __future__ import annotations

import logging
from typing import Optional

import torch
from torch import nn

logger = logging.getLogger(__name__)


class OneDNNLinear(nn.Module):
    """bfloat16 linear: for single-row inputs (decode at batch 1) the native GEMV or `torch.mv` on
    the plain weight, which stream it fastest here; a oneDNN-reordered copy for everything else."""

    def __init__(self, weight: torch.Tensor, bias: Optional[torch.Tensor], batch_hint: int):
        super().__init__()
        self.out_features, self.in_features = weight.shape
        self.weight = weight.detach().contiguous()
        self.packed = torch.ops.mkldnn._reorder_linear_weight(self.weight, max(batch_hint, 16))
        self.bias = bias.detach() if bias is not None else None
        self.kernels = None  # native CPU kernels (set by the runner): their GEMV serves single rows

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.shape[0] == 1 and self.kernels is not None and self.kernels.has_gemv and x.is_contiguous():
            return self.kernels.gemv(self.weight, x, self.bias)
        if x.shape[0] == 1:
            out = torch.mv(self.weight, x[0]).unsqueeze(0)
            return out if self.bias is None else out + self.bias
        return torch.ops.mkldnn._linear_pointwise(x, self.packed, self.bias, "none", [], "")


class MKLLinear(nn.Module):
    """float32 linear on an MKL-packed weight. MKL's packed GEMM serves only the row count it was
    packed for, so it is packed for single-row decode (where plain F.linear is slowest)."""

    def __init__(self, weight: torch.Tensor, bias: Optional[torch.Tensor], batch_hint: int):
        super().__init__()
        self.out_features, self.in_features = weight.shape
        self.weight = weight.detach()
        self.packed = torch.ops.mkl._mkl_reorder_linear_weight(self.weight, 1)
        self.bias = bias.detach() if bias is not None else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.shape[0] != 1:
            return torch.nn.functional.linear(x, self.weight, self.bias)
        return torch.ops.mkl._mkl_linear(x, self.packed, self.weight, self.bias, 1)


def _packer(dtype: torch.dtype):
    if dtype is torch.bfloat16 and torch.backends.mkldnn.is_available() and torch.ops.mkldnn._is_mkldnn_bf16_supported():
        return OneDNNLinear
    if dtype is torch.float32 and torch.backends.mkl.is_available() and hasattr(torch.ops.mkl, "_mkl_linear"):
        return MKLLinear
    return None


def pack_linears(model: nn.Module, device: torch.device, dtype: torch.dtype, batch_hint: int) -> int:
    """Replace every `nn.Linear` under `model` with its packed CPU version; returns how many."""
    packer = _packer(dtype) if device.type == "cpu" else None
    if packer is None:
        return 0
    count = 0
    for parent in list(model.modules()):
        for name, child in list(parent.named_children()):
            if type(child) is nn.Linear:
                replacement = packer(child.weight, child.bias, batch_hint)
                for attribute in ("shard_sizes",):
                    if hasattr(child, attribute):
                        setattr(replacement, attribute, getattr(child, attribute))
                setattr(parent, name, replacement)
                count += 1
    logger.info("packed %d linear layers for %s (%s)", count, dtype, packer.__name__)
    return count
