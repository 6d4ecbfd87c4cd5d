"""The step's K and V written into a paged pool in one kernel (vLLM's reshape_and_cache).

The pool layout is [num_blocks, block_size, kv_heads, head_dim]; token t goes to slot `slot_mapping[t]`,
i.e. block slot // block_size, offset slot % block_size. A negative slot (vLLM's mark for a padding
token) is skipped.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _write_kv_kernel(
    k_ptr, v_ptr, k_cache_ptr, v_cache_ptr, slot_mapping_ptr,
    k_stride_token, k_stride_head, v_stride_token, v_stride_head,
    cache_stride_block, cache_stride_slot, cache_stride_head,
    NUM_KV_HEADS: tl.constexpr, HEADS_PADDED: tl.constexpr, HEAD_DIM: tl.constexpr,
    HEAD_DIM_PADDED: tl.constexpr, BLOCK_SIZE: tl.constexpr,
):
    token = tl.program_id(0).to(tl.int64)
    slot = tl.load(slot_mapping_ptr + token).to(tl.int64)
    if slot < 0:
        return
    heads = tl.arange(0, HEADS_PADDED)
    dims = tl.arange(0, HEAD_DIM_PADDED)
    mask = (heads < NUM_KV_HEADS)[:, None] & (dims < HEAD_DIM)[None, :]
    dest = ((slot // BLOCK_SIZE) * cache_stride_block + (slot % BLOCK_SIZE) * cache_stride_slot
            + heads[:, None] * cache_stride_head + dims[None, :])
    keys = tl.load(k_ptr + token * k_stride_token + heads[:, None] * k_stride_head + dims[None, :], mask=mask)
    values = tl.load(v_ptr + token * v_stride_token + heads[:, None] * v_stride_head + dims[None, :], mask=mask)
    tl.store(k_cache_ptr + dest, keys, mask=mask)
    tl.store(v_cache_ptr + dest, values, mask=mask)


def write_kv(k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
             slot_mapping: torch.Tensor) -> None:
    """k, v [tokens, kv_heads, head_dim] into the pools at `slot_mapping` [tokens] (int64 or int32)."""
    num_tokens, num_kv_heads, head_dim = k.shape
    if k.stride(2) != 1 or v.stride(2) != 1 or k_cache.stride(3) != 1 or k_cache.stride() != v_cache.stride():
        raise ValueError("write_kv needs head_dim contiguous and K and V pools of one layout")
    if num_tokens == 0:
        return
    _write_kv_kernel[(num_tokens,)](
        k, v, k_cache, v_cache, slot_mapping, k.stride(0), k.stride(1), v.stride(0), v.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        NUM_KV_HEADS=num_kv_heads, HEADS_PADDED=triton.next_power_of_2(num_kv_heads), HEAD_DIM=head_dim,
        HEAD_DIM_PADDED=triton.next_power_of_2(head_dim), BLOCK_SIZE=k_cache.shape[1],
    )
