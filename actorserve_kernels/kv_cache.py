"""Paged KV-cache write: scatter the batch's new K/V rows into their cache slots.

Slot ``s`` is position ``s % block_size`` of physical block ``s // block_size`` (vLLM's
``slot_mapping``). One program per token copies all of its KV heads at once, as a
``[num_kv_heads, head_dim]`` tile; a negative slot marks a padding token and is skipped.

Quantized caches (``--kv-cache-dtype``) are written as ``kv_quant`` stores them, bit for
bit (the tests hold the kernels to ``kv_quant.write``); the cache tensor's dtype picks the
variant (``KV_KIND``), so a plain cache runs the same code as before:

* fp8 (e4m3 or e5m2): ``fp8(clamp(x / scale, +-max))`` with the layer's scale, loaded from
  its device tensor. The division is IEEE (``div_rn``; Triton's ``/`` is approximate on
  GPUs), the conversion rounds to nearest even. Triton's interpreter (3.9) converts fp32
  to fp8 wrongly: it truncates below the format's smallest normal, rounds ties away from
  zero, and a mantissa that rounds up into the next binade loses the carry when the
  exponent is odd (1.98 -> 1.0 in e4m3, about 2 % of random normal values). So when
  interpreting, the value is first rounded to the fp8 grid by hand (``_round_fp8``), from
  which the interpreter's conversion is exact. (Its fp8 -> fp32 is exact.)
* int8: each (token, head) row's scale ``max(absmax, 1e-12) / 127`` is computed in the
  program (one reduction over the row, in fp32), the row stored as
  ``clamp(rint(x / scale), +-127)`` followed by the 4 bytes of the scale (an fp32 store
  through the row's int8 pointer + ``head_dim``, which is 4-aligned: ``head_dim`` must be a
  multiple of 4).
"""

from __future__ import annotations

import math
from typing import Any

import torch
import triton
import triton.language as tl

from actorserve_kernels import kv_quant
from actorserve_kernels.attention import _INTERPRETING, _max_combine, kv_cache_kind


@triton.jit
def _round_fp8(y, MANT: tl.constexpr, MIN_NORMAL: tl.constexpr, ROUND: tl.constexpr):
    """fp32 ``y`` (within the fp8 format's range) rounded to the nearest value of an fp8
    format with ``MANT`` mantissa bits and smallest normal ``MIN_NORMAL`` (ties to even),
    still fp32, when ROUND (the interpreter's own conversion is wrong)."""
    if ROUND:
        # Normal range: round the fp32 mantissa to MANT bits (a carry bumps the exponent).
        bits = y.to(tl.uint32, bitcast=True)
        drop: tl.constexpr = 23 - MANT
        half: tl.constexpr = (1 << (drop - 1)) - 1
        normal = ((bits + (half + ((bits >> drop) & 1))) >> drop << drop).to(
            tl.float32, bitcast=True
        )
        # Subnormals, multiples of MIN_NORMAL * 2^-MANT: the fp32 addition of a number whose
        # ulp is that step rounds |y| there (ties to even), the subtraction is exact; then
        # y's sign (-0.0 included).
        magic: tl.constexpr = MIN_NORMAL * (1 << drop)
        a = tl.abs(y)
        sub = ((a + magic) - magic).to(tl.uint32, bitcast=True) | (bits & 0x80000000)
        y = tl.where(a < MIN_NORMAL, sub.to(tl.float32, bitcast=True), normal)
    return y


@triton.jit
def _quantize_fp8(
    x,
    scale,
    FP8_MAX: tl.constexpr,
    FP8_MANT: tl.constexpr,
    FP8_MIN_NORMAL: tl.constexpr,
    ROUND_FP8: tl.constexpr,
):
    """``clamp(x / scale, +-FP8_MAX)`` in fp32, on the fp8 grid when ROUND_FP8 (convert with
    ``.to(cache dtype)``)."""
    y = tl.math.div_rn(x.to(tl.float32), scale)
    y = tl.minimum(tl.maximum(y, -FP8_MAX), FP8_MAX)
    return _round_fp8(y, FP8_MANT, FP8_MIN_NORMAL, ROUND_FP8)


@triton.jit
def _int8_row_scale(absmax):
    """A row's int8 scale from its fp32 absmax: ``max(absmax, 1e-12) / 127``."""
    return tl.math.div_rn(tl.maximum(absmax, 1e-12), 127.0)


@triton.jit
def _quantize_int8(x, row_scale):
    """fp32 ``x`` [R, C] over its rows' scales [R, 1]: ``clamp(rint(x / scale), +-127)``."""
    y = tl.math.div_rn(x, row_scale)
    # Round half to even, as torch.round: exact for |y| < 2^22 (|y| <= 127 here).
    y = (y + 12582912.0) - 12582912.0
    return tl.minimum(tl.maximum(y, -127.0), 127.0).to(tl.int8)


def write_constexprs(fn: str, kind: str, cache: torch.Tensor, head_dim: int) -> dict[str, Any]:
    """The write kernels' quantization constexprs for a cache of ``kind``."""
    if kind == "int8" and head_dim % 4:
        raise ValueError(f"{fn}: an int8 KV cache needs head_dim a multiple of 4, not {head_dim}")
    if kind != "fp8":  # fixed values: one specialization per kind
        return dict(KV_KIND=kind, FP8_MAX=0.0, FP8_MANT=0, FP8_MIN_NORMAL=0.0, ROUND_FP8=False)
    info = torch.finfo(cache.dtype)
    return dict(
        KV_KIND=kind,
        FP8_MAX=float(info.max),
        FP8_MANT=round(-math.log2(info.eps)),
        FP8_MIN_NORMAL=float(info.smallest_normal),
        ROUND_FP8=_INTERPRETING,
    )


@triton.jit
def _reshape_and_cache_kernel(
    key_ptr,  # [T, num_kv_heads, head_dim]
    value_ptr,  # [T, num_kv_heads, head_dim]
    key_cache_ptr,  # [num_blocks, BLOCK_SIZE, num_kv_heads, head_dim (+ 4 for int8)]
    value_cache_ptr,  # [num_blocks, BLOCK_SIZE, num_kv_heads, head_dim (+ 4 for int8)]
    slot_mapping_ptr,  # [T] int64, < 0 = padding
    k_scale_ptr,  # [1] fp32, when KV_KIND == "fp8" (else not read)
    v_scale_ptr,  # [1] fp32
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
    KV_KIND: tl.constexpr,  # "auto" (cast to the cache dtype), "fp8" or "int8"
    FP8_MAX: tl.constexpr,
    FP8_MANT: tl.constexpr,
    FP8_MIN_NORMAL: tl.constexpr,
    ROUND_FP8: tl.constexpr,  # interpreting: round to the fp8 grid by hand
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
    if KV_KIND == "auto":
        tl.store(kc + offs_d, k.to(key_cache_ptr.dtype.element_ty), mask=mask)
        tl.store(vc + offs_d, v.to(value_cache_ptr.dtype.element_ty), mask=mask)
    elif KV_KIND == "fp8":
        k_q = _quantize_fp8(k, tl.load(k_scale_ptr), FP8_MAX, FP8_MANT, FP8_MIN_NORMAL, ROUND_FP8)
        v_q = _quantize_fp8(v, tl.load(v_scale_ptr), FP8_MAX, FP8_MANT, FP8_MIN_NORMAL, ROUND_FP8)
        tl.store(kc + offs_d, k_q.to(key_cache_ptr.dtype.element_ty), mask=mask)
        tl.store(vc + offs_d, v_q.to(value_cache_ptr.dtype.element_ty), mask=mask)
    else:  # int8: the row's values, then its fp32 scale
        kf = tl.where(mask, k.to(tl.float32), 0.0)
        vf = tl.where(mask, v.to(tl.float32), 0.0)
        k_row_scale = _int8_row_scale(tl.reduce(tl.abs(kf), 1, _max_combine))[:, None]
        v_row_scale = _int8_row_scale(tl.reduce(tl.abs(vf), 1, _max_combine))[:, None]
        tl.store(kc + offs_d, _quantize_int8(kf, k_row_scale), mask=mask)
        tl.store(vc + offs_d, _quantize_int8(vf, v_row_scale), mask=mask)
        row_mask = offs_h < NUM_KV_HEADS
        tl.store((kc + HEAD_DIM).to(tl.pointer_type(tl.float32)), k_row_scale, mask=row_mask)
        tl.store((vc + HEAD_DIM).to(tl.pointer_type(tl.float32)), v_row_scale, mask=row_mask)


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
    k_scale: torch.Tensor | None = None,
    v_scale: torch.Tensor | None = None,
) -> None:
    """Write ``key``/``value`` ``[T, num_kv_heads, head_dim]`` into the paged caches in place.

    ``key_cache``/``value_cache`` are ``[num_blocks, block_size, num_kv_heads, head_dim]``;
    ``slot_mapping`` is ``[T]`` integer slots, negative for padding tokens (not written).
    The rows of ``key``/``value`` may be strided views (e.g. slices of a fused QKV output);
    only ``head_dim`` must be contiguous. Values are cast to the cache dtype, or quantized
    as ``kv_quant.write`` does when the caches are fp8 (``k_scale``/``v_scale``: the
    layer's fp32 scales, ``[1]`` on the device, required) or int8 (``[..., head_dim + 4]``,
    a scale per row computed here; ``head_dim`` a multiple of 4).
    """
    num_tokens, num_kv_heads, head_dim = key.shape
    if value.shape != key.shape:
        raise ValueError(f"reshape_and_cache: key {tuple(key.shape)} != value {tuple(value.shape)}")
    kind = kv_cache_kind("reshape_and_cache", key_cache, value_cache, k_scale, v_scale)
    width = kv_quant.row_width(kind, head_dim)
    if key_cache.shape != value_cache.shape or key_cache.shape[2:] != (num_kv_heads, width):
        raise ValueError(
            f"reshape_and_cache: caches {tuple(key_cache.shape)}/{tuple(value_cache.shape)} do "
            f"not match [num_blocks, block_size, {num_kv_heads}, {width}]"
        )
    if slot_mapping.shape != (num_tokens,):
        raise ValueError(f"reshape_and_cache: slot_mapping must be [{num_tokens}]")
    check_last_dim_contiguous(
        "reshape_and_cache", key=key, value=value, key_cache=key_cache, value_cache=value_cache
    )
    quant = write_constexprs("reshape_and_cache", kind, key_cache, head_dim)
    if num_tokens == 0:
        return
    _reshape_and_cache_kernel[(num_tokens,)](
        key,
        value,
        key_cache,
        value_cache,
        slot_mapping,
        k_scale if kind == "fp8" else key_cache,  # not read unless fp8
        v_scale if kind == "fp8" else value_cache,
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
        **quant,
    )
