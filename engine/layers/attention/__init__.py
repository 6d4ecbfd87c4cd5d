"""Paged attention over a flattened batch, behind one backend interface (`AttentionBackend`).

The runner describes each step's rows once (`CommonAttentionMetadata`); the backend builds its own
metadata from that and runs every layer's attention with it. `TorchAttention` (torch_backend.py, with
its kept decode K/V in decode_workspace.py) runs anywhere; `FlashAttention` (flash.py) uses
flash-attn's paged kernels on CUDA when the package imports; `select_backend` picks one.
"""

from __future__ import annotations

from typing import Optional

import torch

from llmctl.engine.layers.attention.common import AttentionBackend, CommonAttentionMetadata
from llmctl.engine.layers.attention.flash import FlashAttention, FlashAttentionMetadata
from llmctl.engine.layers.attention.torch_backend import PrefillSpan, TorchAttention, TorchAttentionMetadata

__all__ = ["AttentionBackend", "CommonAttentionMetadata", "FlashAttention", "FlashAttentionMetadata", "PrefillSpan",
           "TorchAttention", "TorchAttentionMetadata", "select_backend"]


def select_backend(device: torch.device, dtype: torch.dtype, head_dim: Optional[int] = None):
    """flash-attn on CUDA for 16-bit dtypes when its kernels can run this model, else the torch path."""
    if device.type != "cuda" or dtype not in (torch.float16, torch.bfloat16):
        return TorchAttention
    if torch.cuda.get_device_capability(device) < (8, 0):  # flash-attn 2 has Ampere+ kernels only
        return TorchAttention
    # Over 256 (its largest head dimension) flash-attn has no kernel; below that, a head dimension that is not a
    # multiple of 8 is padded inside flash_attn_varlen_func, i.e. the whole paged K/V pool is copied every call.
    if head_dim is not None and (head_dim > 256 or head_dim % 8):
        return TorchAttention
    try:
        import inspect

        from flash_attn import flash_attn_varlen_func
    except Exception:  # noqa: BLE001 - a broken build (undefined symbol, missing CUDA lib) means "not available"
        return TorchAttention
    # The varlen kernel took a paged KV cache (block_table) only from flash-attn 2.5.x (2024); older builds
    # import fine and would fail at the first forward.
    if "block_table" not in inspect.signature(flash_attn_varlen_func).parameters:
        return TorchAttention
    return FlashAttention
