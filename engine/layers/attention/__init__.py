"""Paged attention over a flattened batch, behind one backend interface (`AttentionBackend`).

The runner describes each step's rows once (`CommonAttentionMetadata`); the backend builds its own
metadata from that and runs every layer's attention with it. `TorchAttention` (torch_backend.py, with
its kept decode K/V in decode_workspace.py) runs anywhere; `FlashAttention` (flash.py) uses
flash-attn's paged kernels on CUDA when the package imports; `TritonAttention` (triton_backend.py) runs
the in-tree Triton kernels on CUDA when triton imports; `select_backend` picks one.
"""

from __future__ import annotations

from typing import Optional

import torch

from llmctl.engine.errors import EngineArgsError
from llmctl.engine.kernels.triton import INTERPRET_ENV, triton_importable, triton_usable
from llmctl.engine.layers.attention.common import AttentionBackend, CommonAttentionMetadata
from llmctl.engine.layers.attention.flash import FlashAttention, FlashAttentionMetadata
from llmctl.engine.layers.attention.torch_backend import PrefillSpan, TorchAttention, TorchAttentionMetadata
from llmctl.engine.layers.attention.triton_backend import MAX_HEAD_DIM, TritonAttention, TritonAttentionMetadata

__all__ = ["AttentionBackend", "CommonAttentionMetadata", "FlashAttention",
           "FlashAttentionMetadata", "PrefillSpan", "TorchAttention", "TorchAttentionMetadata", "TritonAttention",
           "TritonAttentionMetadata", "select_backend"]


def select_backend(device: torch.device, dtype: torch.dtype, head_dim: Optional[int] = None, choice: str = "auto"):
    """The backend `choice` names (EngineArgs.attention_backend), refused where it cannot run; auto: flash-attn
    where its kernels can run this model, else Triton on CUDA (Ampere+) where triton imports, else torch."""
    if choice == "torch":
        return TorchAttention
    if choice == "flash-attn":
        problem = _flash_attn_problem(device, dtype, head_dim)
        if problem:
            raise EngineArgsError(f"--attention-backend flash-attn: {problem}")
        return FlashAttention
    if choice == "triton":
        problem = _triton_problem(device, head_dim)
        if problem:
            raise EngineArgsError(f"--attention-backend triton: {problem}")
        return TritonAttention
    if choice != "auto":
        raise EngineArgsError(f"unknown attention backend {choice!r}")
    if _flash_attn_problem(device, dtype, head_dim) is None:
        return FlashAttention
    if device.type == "cuda" and _triton_problem(device, head_dim) is None:
        return TritonAttention
    return TorchAttention


def _triton_problem(device: torch.device, head_dim: Optional[int]) -> Optional[str]:
    """Why the Triton backend cannot run here, or None."""
    if not triton_importable():
        return "the triton package does not import"
    if not triton_usable(device):
        return f"runs on CUDA (on {device.type} only under {INTERPRET_ENV}=1, for tests)"
    if device.type == "cuda" and torch.cuda.get_device_capability(device) < (8, 0):
        return "needs an Ampere or newer GPU (sm80+: bfloat16 tensor-core dots)"
    if head_dim is not None and head_dim > MAX_HEAD_DIM:
        return f"head_dim {head_dim} is over the kernel's {MAX_HEAD_DIM}"
    return None


def _flash_attn_problem(device: torch.device, dtype: torch.dtype, head_dim: Optional[int]) -> Optional[str]:
    """Why flash-attn's paged kernels cannot run this model here, or None."""
    if device.type != "cuda":
        return "needs CUDA"
    if dtype not in (torch.float16, torch.bfloat16):
        return f"needs float16 or bfloat16, got {str(dtype).replace('torch.', '')}"
    if torch.cuda.get_device_capability(device) < (8, 0):
        return "needs an Ampere or newer GPU (flash-attn 2 has sm80+ kernels only)"
    # Over 256 (its largest head dimension) flash-attn has no kernel; below that, a head dimension that is not a
    # multiple of 8 is padded inside flash_attn_varlen_func, i.e. the whole paged K/V pool is copied every call.
    if head_dim is not None and (head_dim > 256 or head_dim % 8):
        return f"head_dim {head_dim} is over 256 or not a multiple of 8"
    try:
        import inspect

        from flash_attn import flash_attn_varlen_func
    except Exception:  # noqa: BLE001 - a broken build (undefined symbol, missing CUDA lib) means "not available"
        return "the flash_attn package does not import"
    # The varlen kernel took a paged KV cache (block_table) only from flash-attn 2.5.x (2024); older builds
    # import fine and would fail at the first forward.
    if "block_table" not in inspect.signature(flash_attn_varlen_func).parameters:
        return "the installed flash-attn has no paged KV cache (block_table; 2.5+)"
    return None
