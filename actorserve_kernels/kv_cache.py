"""Paged KV-cache write: scatter the batch's new K/V rows into their cache slots.

Slot ``s`` is position ``s % block_size`` of physical block ``s // block_size`` (vLLM's
``slot_mapping``). One program per token copies all of its KV heads at once, as a
``[num_kv_heads, head_dim]`` tile; a negative slot marks a padding token and is skipped.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _reshape_and_cache_kernel(
    key_ptr,  # [T, num_kv_heads, head_dim]
    value_ptr,  # [T, num_kv_heads, head_dim]
    key_cache_ptr,  # [num_blocks, BLOCK_SIZE, num_kv_heads, head_dim]
    value_cache_ptr,  # [num_blocks, BLOCK_SIZE, num_kv_heads, head_dim]
    slot_mapping_ptr,  # [T] int64, < 0 = padding
    stride_k_tok,
    stride_k_head,
    stride_v_tok,
    stride_v_head,
    stride_kc_block,
    stride_kc_pos,
    stride_kc_head,
    stride_vc_block,
    stride_vc_pos,
    stride_vc_head,
    NUM_KV_HEADS: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    HEADS_PADDED: tl.constexpr,
    HEAD_DIM_PADDED: tl.constexpr,
):
    tok = tl.program_id(0).to(tl.int64)
    slot = tl.load(slot_mapping_ptr + tok).to(tl.int64)
    if slot < 0:
        return
    block = slot // BLOCK_SIZE
    pos = slot % BLOCK_SIZE
    offs_h = tl.arange(0, HEADS_PADDED)[:, None]
    offs_d = tl.arange(0, HEAD_DIM_PADDED)[None, :]
    mask = (offs_h < NUM_KV_HEADS) & (offs_d < HEAD_DIM)

    k = tl.load(key_ptr + tok * stride_k_tok + offs_h * stride_k_head + offs_d, mask=mask)
    v = tl.load(value_ptr + tok * stride_v_tok + offs_h * stride_v_head + offs_d, mask=mask)
    kc = key_cache_ptr + block * stride_kc_block + pos * stride_kc_pos + offs_h * stride_kc_head
    vc = value_cache_ptr + block * stride_vc_block + pos * stride_vc_pos + offs_h * stride_vc_head
    tl.store(kc + offs_d, k.to(key_cache_ptr.dtype.element_ty), mask=mask)
    tl.store(vc + offs_d, v.to(value_cache_ptr.dtype.element_ty), mask=mask)


def check_last_dim_contiguous(fn: str, **tensors: torch.Tensor) -> None:
    """ValueError naming the first of ``tensors`` whose last dim is not contiguous."""
    for name, t in tensors.items():
        if t.stride(-1) != 1:
            raise ValueError(f"{fn}: {name} must be contiguous in its last dim")


def reshape_and_cache(
    key: torch.Tensor,
    value: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    """Write ``key``/``value`` ``[T, num_kv_heads, head_dim]`` into the paged caches in place.

    ``key_cache``/``value_cache`` are ``[num_blocks, block_size, num_kv_heads, head_dim]``;
    ``slot_mapping`` is ``[T]`` integer slots, negative for padding tokens (not written).
    The rows of ``key``/``value`` may be strided views (e.g. slices of a fused QKV output);
    only ``head_dim`` must be contiguous. Values are cast to the cache dtype.
    """
    num_tokens, num_kv_heads, head_dim = key.shape
    if value.shape != key.shape:
        raise ValueError(f"reshape_and_cache: key {tuple(key.shape)} != value {tuple(value.shape)}")
    if key_cache.shape != value_cache.shape or key_cache.shape[2:] != (num_kv_heads, head_dim):
        raise ValueError(
            f"reshape_and_cache: caches {tuple(key_cache.shape)}/{tuple(value_cache.shape)} do "
            f"not match [num_blocks, block_size, {num_kv_heads}, {head_dim}]"
        )
    if slot_mapping.shape != (num_tokens,):
        raise ValueError(f"reshape_and_cache: slot_mapping must be [{num_tokens}]")
    check_last_dim_contiguous(
        "reshape_and_cache", key=key, value=value, key_cache=key_cache, value_cache=value_cache
    )
    if num_tokens == 0:
        return
    _reshape_and_cache_kernel[(num_tokens,)](
        key,
        value,
        key_cache,
        value_cache,
        slot_mapping,
        key.stride(0),
        key.stride(1),
        value.stride(0),
        value.stride(1),
        key_cache.stride(0),
        key_cache.stride(1),
        key_cache.stride(2),
        value_cache.stride(0),
        value_cache.stride(1),
        value_cache.stride(2),
        NUM_KV_HEADS=num_kv_heads,
        HEAD_DIM=head_dim,
        BLOCK_SIZE=key_cache.shape[1],
        HEADS_PADDED=triton.next_power_of_2(num_kv_heads),
        HEAD_DIM_PADDED=triton.next_power_of_2(head_dim),
    )
