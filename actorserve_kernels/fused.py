"""Fused elementwise kernels of a decoder layer: RMSNorm (with the residual add), SwiGLU, and
rotary embedding with the KV-cache write.

On a GPU a decode step is bound by kernel launches, not by these ops' bytes: the torch
versions are 3-8 launches each (RMSNorm: add, cast, pow, mean, add, rsqrt, mul, cast, mul),
these are one.

Numerics. Every kernel loads its inputs, computes in fp32 and rounds each output once to
the output dtype, with two exceptions that copy the torch reference exactly
(``services/gpu_worker/model/layers.py``):

* ``rms_norm`` rounds ``x + residual`` to the input dtype before normalising it (the sum is
  also the next layer's residual), and rounds the normalised row to the input dtype before
  multiplying by the weight, as ``RMSNorm`` does. Against ``RMSNorm`` the only difference is
  the order of the sum of squares (fp32: a few ulp; bf16/fp16: now and then 1 ulp).
* ``silu_and_mul`` and ``rotary_and_cache`` round once where torch rounds twice in 16-bit
  dtypes (``F.silu(gate)`` then ``* up``; ``x * cos`` then ``addcmul``), so they are
  within 1 ulp of torch's bf16/fp16 results (and closer to the exact value), as the CPU C++
  ops are. In fp32 they agree with torch to a few fp32 ulp.

Triton's interpreter (3.9) converts fp32 to bf16 by truncating, where GPUs and torch round
to nearest even; when interpreting, bf16 outputs are therefore rounded by hand first
(``_round_bf16``), so the CPU tests check the rounding a GPU does. The kernels use
builtins only, as ``attention`` explains (``tl.reduce`` with ``_add_combine``; no
``tl.sum``, ``tl.sigmoid``).

``rotary_and_cache`` writes quantized caches (fp8, int8) as ``reshape_and_cache`` does
(``kv_cache`` explains how), from the rotated k as rounded to ``qk``'s dtype.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from actorserve_kernels import kv_quant
from actorserve_kernels.attention import (
    _INTERPRETING,
    _add_combine,
    _max_combine,
    _round_bf16,
    kv_cache_kind,
)
from actorserve_kernels.kv_cache import (
    _int8_row_scale,
    _quantize_fp8,
    _quantize_int8,
    check_last_dim_contiguous,
    write_constexprs,
)

_FLOAT_TYPES = (torch.float32, torch.bfloat16, torch.float16)


def _round_by_hand(dtype: torch.dtype) -> bool:
    """Whether fp32 -> ``dtype`` must be rounded by ``_round_bf16`` (interpreter, bf16)."""
    return _INTERPRETING and dtype == torch.bfloat16


# ---------------------------------------------------------------- RMSNorm


@triton.jit
def _rms_norm_kernel(
    out_ptr,  # [T, H]
    sum_ptr,  # [T, H]: x + residual, when HAS_RESIDUAL
    x_ptr,  # [T, H]
    residual_ptr,  # [T, H], when HAS_RESIDUAL
    weight_ptr,  # [H]
    eps,
    stride_x,
    stride_r,
    stride_o,
    stride_s,
    H: tl.constexpr,
    BLOCK_H: tl.constexpr,
    HAS_RESIDUAL: tl.constexpr,
    ROUND: tl.constexpr,  # outputs are bf16 and the interpreter truncates
):
    row = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, BLOCK_H)
    mask = offs < H
    x = tl.load(x_ptr + row * stride_x + offs, mask=mask, other=0.0).to(tl.float32)
    if HAS_RESIDUAL:
        r = tl.load(residual_ptr + row * stride_r + offs, mask=mask, other=0.0).to(tl.float32)
        # The sum in the input dtype, as torch's x + residual: it is what gets normalised.
        total = _round_bf16(x + r, ROUND).to(sum_ptr.dtype.element_ty)
        tl.store(sum_ptr + row * stride_s + offs, total, mask=mask)
        x = total.to(tl.float32)
    mean_sq = tl.reduce(x * x, 0, _add_combine) / H
    normed = x * tl.rsqrt(mean_sq + eps)
    # Rounded to the input dtype before the weight multiplies it (RMSNorm's order).
    normed = _round_bf16(normed, ROUND).to(out_ptr.dtype.element_ty).to(tl.float32)
    w = tl.load(weight_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    out = _round_bf16(normed * w, ROUND).to(out_ptr.dtype.element_ty)
    tl.store(out_ptr + row * stride_o + offs, out, mask=mask)


def _check_rows(name: str, t: torch.Tensor, shape: tuple[int, ...], dtype: torch.dtype) -> None:
    if tuple(t.shape) != shape or t.dtype != dtype or t.stride(-1) != 1:
        raise ValueError(
            f"{name} must be {list(shape)} {dtype} with a contiguous last dim, got "
            f"{list(t.shape)} {t.dtype} strides {t.stride()}"
        )


def rms_norm(
    x: torch.Tensor,
    weight: torch.Tensor,
    eps: float,
    residual: torch.Tensor | None = None,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """RMSNorm of each row of ``x`` [T, H] times ``weight`` [H]; with ``residual`` [T, H] it
    first adds it (fused add + norm) and returns ``(out, x + residual)``, else ``out``.

    ``x``, ``residual`` and ``weight`` share one dtype (fp32, bf16 or fp16); rows may be
    strided, the last dim must be contiguous. Outputs are new contiguous tensors. Numerics
    are those of ``RMSNorm.forward`` in ``services/gpu_worker/model/layers.py`` (module doc).
    """
    if x.dim() != 2 or x.dtype not in _FLOAT_TYPES:
        raise ValueError(
            f"rms_norm: x must be [T, H] fp32/bf16/fp16, got {list(x.shape)} {x.dtype}"
        )
    num_tokens, hidden = x.shape
    _check_rows("rms_norm: x", x, (num_tokens, hidden), x.dtype)
    _check_rows("rms_norm: weight", weight, (hidden,), x.dtype)
    if residual is not None:
        _check_rows("rms_norm: residual", residual, (num_tokens, hidden), x.dtype)
    out = torch.empty((num_tokens, hidden), dtype=x.dtype, device=x.device)
    total = torch.empty_like(out) if residual is not None else out
    if num_tokens > 0 and hidden > 0:
        block_h = triton.next_power_of_2(hidden)
        _rms_norm_kernel[(num_tokens,)](
            out,
            total,
            x,
            residual if residual is not None else x,  # not read
            weight,
            float(eps),
            x.stride(0),
            residual.stride(0) if residual is not None else 0,
            out.stride(0),
            total.stride(0),
            H=hidden,
            BLOCK_H=block_h,
            HAS_RESIDUAL=residual is not None,
            ROUND=_round_by_hand(x.dtype),
            # Whole rows in registers: 4-16 elements per thread (untuned).
            num_warps=min(max(block_h // 256, 1), 16),
        )
    return out if residual is None else (out, total)


# ---------------------------------------------------------------- SwiGLU


@triton.jit
def _silu_and_mul_kernel(
    out_ptr,  # [T, I]
    gate_up_ptr,  # [T, 2 * I]: gate | up
    inter,  # I
    stride_x,
    stride_o,
    BLOCK: tl.constexpr,
    ROUND: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < inter
    gate_ptrs = gate_up_ptr + row * stride_x + offs
    gate = tl.load(gate_ptrs, mask=mask, other=0.0).to(tl.float32)
    up = tl.load(gate_ptrs + inter, mask=mask, other=0.0).to(tl.float32)
    out = gate / (1.0 + tl.exp(-gate)) * up
    tl.store(
        out_ptr + row * stride_o + offs,
        _round_bf16(out, ROUND).to(out_ptr.dtype.element_ty),
        mask=mask,
    )


def silu_and_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """SwiGLU: ``silu(gate) * up`` for ``gate_up = [gate | up]`` [T, 2I] -> [T, I].

    fp32, bf16 or fp16; rows may be strided, the last dim must be contiguous. Computed in
    fp32 and rounded once (torch rounds ``silu(gate)`` first: within 1 ulp of it).
    """
    if gate_up.dim() != 2 or gate_up.dtype not in _FLOAT_TYPES or gate_up.shape[1] % 2:
        raise ValueError(
            f"silu_and_mul: gate_up must be [T, 2I] fp32/bf16/fp16, got "
            f"{list(gate_up.shape)} {gate_up.dtype}"
        )
    if gate_up.stride(-1) != 1:
        raise ValueError("silu_and_mul: gate_up must be contiguous in its last dim")
    num_tokens, inter = gate_up.shape[0], gate_up.shape[1] // 2
    out = torch.empty((num_tokens, inter), dtype=gate_up.dtype, device=gate_up.device)
    if num_tokens > 0 and inter > 0:
        block = min(triton.next_power_of_2(inter), 1024)
        _silu_and_mul_kernel[(num_tokens, triton.cdiv(inter, block))](
            out,
            gate_up,
            inter,
            gate_up.stride(0),
            out.stride(0),
            BLOCK=block,
            ROUND=_round_by_hand(gate_up.dtype),
        )
    return out


# ---------------------------------------------------------------- rotary + KV-cache write


@triton.jit
def _rotary_and_cache_kernel(
    qk_ptr,  # [T, NUM_Q_HEADS + NUM_KV_HEADS, 2 * HALF], rotated in place
    v_ptr,  # [>= num_slots, NUM_KV_HEADS, 2 * HALF]
    cos_ptr,  # [T, (1,) 2 * HALF]: cos | cos
    sin_ptr,  # [T, (1,) 2 * HALF]: -sin | sin
    key_cache_ptr,  # [num_blocks, BLOCK_SIZE, NUM_KV_HEADS, 2 * HALF (+ 4 for int8)]
    value_cache_ptr,  # [num_blocks, BLOCK_SIZE, NUM_KV_HEADS, 2 * HALF (+ 4 for int8)]
    slot_mapping_ptr,  # [num_slots] int, < 0 = padding
    k_scale_ptr,  # [1] fp32, when KV_KIND == "fp8" (else not read)
    v_scale_ptr,  # [1] fp32
    num_slots,
    stride_qk_tok,
    stride_qk_head,
    stride_v_tok,
    stride_v_head,
    stride_cos_tok,
    stride_sin_tok,
    stride_kc_block,
    stride_kc_pos,
    stride_kc_head,
    stride_vc_block,
    stride_vc_pos,
    stride_vc_head,
    NUM_Q_HEADS: tl.constexpr,
    NUM_KV_HEADS: tl.constexpr,
    HALF: tl.constexpr,  # head_dim // 2
    BLOCK_SIZE: tl.constexpr,
    HEADS_PADDED: tl.constexpr,
    HALF_PADDED: tl.constexpr,
    KV_HEADS_PADDED: tl.constexpr,
    HEAD_DIM_PADDED: tl.constexpr,
    ROUND_QK: tl.constexpr,  # qk is bf16 and the interpreter truncates
    ROUND_K_CACHE: tl.constexpr,
    ROUND_V_CACHE: tl.constexpr,
    KV_KIND: tl.constexpr,  # "auto" (cast to the cache dtype), "fp8" or "int8": kv_cache
    FP8_MAX: tl.constexpr,
    FP8_MANT: tl.constexpr,
    FP8_MIN_NORMAL: tl.constexpr,
    ROUND_FP8: tl.constexpr,
):
    tok = tl.program_id(0).to(tl.int64)

    # Rotate every q and k head of the token in place, as one [heads, head_dim / 2] tile
    # per half: out1 = x1 * cos1 + x2 * sin1, out2 = x2 * cos2 + x1 * sin2.
    offs_h = tl.arange(0, HEADS_PADDED)[:, None]
    offs_d = tl.arange(0, HALF_PADDED)[None, :]
    d_valid = offs_d < HALF
    mask = (offs_h < NUM_Q_HEADS + NUM_KV_HEADS) & d_valid
    x1_ptrs = qk_ptr + tok * stride_qk_tok + offs_h * stride_qk_head + offs_d
    x1 = tl.load(x1_ptrs, mask=mask, other=0.0).to(tl.float32)
    x2 = tl.load(x1_ptrs + HALF, mask=mask, other=0.0).to(tl.float32)
    cos_ptrs = cos_ptr + tok * stride_cos_tok + offs_d
    sin_ptrs = sin_ptr + tok * stride_sin_tok + offs_d
    cos1 = tl.load(cos_ptrs, mask=d_valid, other=0.0).to(tl.float32)
    cos2 = tl.load(cos_ptrs + HALF, mask=d_valid, other=0.0).to(tl.float32)
    sin1 = tl.load(sin_ptrs, mask=d_valid, other=0.0).to(tl.float32)
    sin2 = tl.load(sin_ptrs + HALF, mask=d_valid, other=0.0).to(tl.float32)
    out1 = _round_bf16(x1 * cos1 + x2 * sin1, ROUND_QK).to(qk_ptr.dtype.element_ty)
    out2 = _round_bf16(x2 * cos2 + x1 * sin2, ROUND_QK).to(qk_ptr.dtype.element_ty)
    tl.store(x1_ptrs, out1, mask=mask)
    tl.store(x1_ptrs + HALF, out2, mask=mask)

    # Rows past slot_mapping (padding of the batch) and slots < 0 are not cached.
    slot = tl.load(slot_mapping_ptr + tok, mask=tok < num_slots, other=-1).to(tl.int64)
    if slot >= 0:
        block = slot // BLOCK_SIZE
        pos = slot % BLOCK_SIZE
        # The k heads are rows NUM_Q_HEADS.. of the tile; they go to the cache as stored
        # in qk (rounded to its dtype), then cast to the cache's.
        k_mask = mask & (offs_h >= NUM_Q_HEADS)
        kc_rows = (
            key_cache_ptr
            + block * stride_kc_block
            + pos * stride_kc_pos
            + (offs_h - NUM_Q_HEADS) * stride_kc_head
        )
        kc_ptrs = kc_rows + offs_d
        k_ty = key_cache_ptr.dtype.element_ty
        if KV_KIND == "auto":
            k1 = _round_bf16(out1.to(tl.float32), ROUND_K_CACHE).to(k_ty)
            k2 = _round_bf16(out2.to(tl.float32), ROUND_K_CACHE).to(k_ty)
        elif KV_KIND == "fp8":
            k_scale = tl.load(k_scale_ptr)
            k1 = _quantize_fp8(out1, k_scale, FP8_MAX, FP8_MANT, FP8_MIN_NORMAL, ROUND_FP8)
            k2 = _quantize_fp8(out2, k_scale, FP8_MAX, FP8_MANT, FP8_MIN_NORMAL, ROUND_FP8)
            k1 = k1.to(k_ty)
            k2 = k2.to(k_ty)
        else:  # int8: one scale over both halves of each head's row
            x1 = tl.where(mask, out1.to(tl.float32), 0.0)
            x2 = tl.where(mask, out2.to(tl.float32), 0.0)
            absmax = tl.maximum(
                tl.reduce(tl.abs(x1), 1, _max_combine), tl.reduce(tl.abs(x2), 1, _max_combine)
            )
            k_row_scale = _int8_row_scale(absmax)[:, None]
            k1 = _quantize_int8(x1, k_row_scale)
            k2 = _quantize_int8(x2, k_row_scale)
            k_scale_ptrs = (kc_rows + 2 * HALF).to(tl.pointer_type(tl.float32))
            k_rows = (offs_h >= NUM_Q_HEADS) & (offs_h < NUM_Q_HEADS + NUM_KV_HEADS)
            tl.store(k_scale_ptrs, k_row_scale, mask=k_rows)
        tl.store(kc_ptrs, k1, mask=k_mask)
        tl.store(kc_ptrs + HALF, k2, mask=k_mask)

        offs_vh = tl.arange(0, KV_HEADS_PADDED)[:, None]
        offs_vd = tl.arange(0, HEAD_DIM_PADDED)[None, :]
        v_mask = (offs_vh < NUM_KV_HEADS) & (offs_vd < 2 * HALF)
        v = tl.load(v_ptr + tok * stride_v_tok + offs_vh * stride_v_head + offs_vd, mask=v_mask)
        vc_rows = (
            value_cache_ptr
            + block * stride_vc_block
            + pos * stride_vc_pos
            + offs_vh * stride_vc_head
        )
        v_ty = value_cache_ptr.dtype.element_ty
        if KV_KIND == "auto":
            v = _round_bf16(v.to(tl.float32), ROUND_V_CACHE).to(v_ty)
        elif KV_KIND == "fp8":
            v_scale = tl.load(v_scale_ptr)
            v = _quantize_fp8(v, v_scale, FP8_MAX, FP8_MANT, FP8_MIN_NORMAL, ROUND_FP8).to(v_ty)
        else:
            vf = tl.where(v_mask, v.to(tl.float32), 0.0)
            v_row_scale = _int8_row_scale(tl.reduce(tl.abs(vf), 1, _max_combine))[:, None]
            v = _quantize_int8(vf, v_row_scale)
            v_scale_ptrs = (vc_rows + 2 * HALF).to(tl.pointer_type(tl.float32))
            tl.store(v_scale_ptrs, v_row_scale, mask=offs_vh < NUM_KV_HEADS)
        tl.store(vc_rows + offs_vd, v, mask=v_mask)


def rotary_and_cache(
    qk: torch.Tensor,
    v: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    num_q_heads: int,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    k_scale: torch.Tensor | None = None,
    v_scale: torch.Tensor | None = None,
) -> torch.Tensor:
    """Neox rotary embedding of q and k in place, and k and v written to the paged cache.

    Args:
        qk: ``[T, num_q_heads + num_kv_heads, head_dim]``, q heads first; rotated in place
            (every row). Rows and heads may be strided (a view of a fused QKV output);
            ``head_dim`` must be contiguous and even.
        v: ``[>= len(slot_mapping), num_kv_heads, head_dim]``, strided like ``qk``.
        cos, sin: ``[T, 1, head_dim]`` (or ``[T, head_dim]``), as
            ``RotaryEmbedding.cos_sin`` makes them: ``cos | cos`` and ``-sin | sin``, so
            ``rotate(x) = x * cos + cat(x2, x1) * sin``.
        num_q_heads: how many of ``qk``'s heads are q heads.
        key_cache, value_cache: ``[num_blocks, block_size, num_kv_heads, head_dim]``, in
            any float dtype, or quantized (``kv_quant``): fp8, or int8
            ``[..., head_dim + 4]`` (``head_dim`` a multiple of 4).
        slot_mapping: ``[S]`` integer slots, ``S <= T``: token ``t < S`` goes to slot
            ``slot_mapping[t]`` (block ``s // block_size``, position ``s % block_size``);
            negative slots (padding) and tokens ``t >= S`` are rotated but not cached.
        k_scale, v_scale: the layer's fp32 scales (``[1]``, on the device) for an fp8
            cache (required); ignored otherwise.

    Equals ``RotaryEmbedding.forward`` followed by ``kv_cache.reshape_and_cache`` of the
    rotated k (cast to the cache dtype, or quantized as ``kv_quant.write`` does), except
    that the rotation is rounded once (module doc). Returns ``qk``.
    """
    if qk.dim() != 3 or qk.dtype not in _FLOAT_TYPES:
        raise ValueError(
            f"rotary_and_cache: qk must be [T, heads, head_dim] fp32/bf16/fp16, got "
            f"{list(qk.shape)} {qk.dtype}"
        )
    num_tokens, num_heads, head_dim = qk.shape
    num_kv_heads = num_heads - num_q_heads
    if num_q_heads < 0 or num_kv_heads < 1 or head_dim % 2:
        raise ValueError(
            f"rotary_and_cache: {num_q_heads} q heads of {num_heads}, head_dim {head_dim}"
        )
    if v.dim() != 3 or tuple(v.shape[1:]) != (num_kv_heads, head_dim):
        raise ValueError(
            f"rotary_and_cache: v {list(v.shape)} is not [T, {num_kv_heads}, {head_dim}]"
        )
    for name, t in (("cos", cos), ("sin", sin)):
        if (
            t.shape[0] != num_tokens
            or t.shape[-1] != head_dim
            or t.numel() != num_tokens * head_dim
        ):
            raise ValueError(
                f"rotary_and_cache: {name} {list(t.shape)} is not [{num_tokens}, 1, {head_dim}]"
            )
    kind = kv_cache_kind("rotary_and_cache", key_cache, value_cache, k_scale, v_scale)
    cache_shape = (num_kv_heads, kv_quant.row_width(kind, head_dim))
    if key_cache.shape != value_cache.shape or tuple(key_cache.shape[2:]) != cache_shape:
        raise ValueError(
            f"rotary_and_cache: caches {list(key_cache.shape)}/{list(value_cache.shape)} are "
            f"not [num_blocks, block_size, {num_kv_heads}, {cache_shape[1]}]"
        )
    quant = write_constexprs("rotary_and_cache", kind, key_cache, head_dim)
    num_slots = slot_mapping.shape[0] if slot_mapping.dim() == 1 else -1
    if not 0 <= num_slots <= num_tokens or slot_mapping.is_floating_point():
        raise ValueError(f"rotary_and_cache: slot_mapping must be [S <= {num_tokens}] integers")
    if v.shape[0] < num_slots:
        raise ValueError(f"rotary_and_cache: v has {v.shape[0]} rows, slot_mapping {num_slots}")
    check_last_dim_contiguous(
        "rotary_and_cache", qk=qk, v=v, cos=cos, sin=sin, key_cache=key_cache,
        value_cache=value_cache,
    )  # fmt: skip
    if num_tokens == 0:
        return qk
    heads_padded = triton.next_power_of_2(num_heads)
    half_padded = triton.next_power_of_2(head_dim // 2)
    _rotary_and_cache_kernel[(num_tokens,)](
        qk,
        v,
        cos,
        sin,
        key_cache,
        value_cache,
        slot_mapping,
        k_scale if kind == "fp8" else key_cache,  # not read unless fp8
        v_scale if kind == "fp8" else value_cache,
        num_slots,
        qk.stride(0),
        qk.stride(1),
        v.stride(0),
        v.stride(1),
        cos.stride(0),
        sin.stride(0),
        key_cache.stride(0),
        key_cache.stride(1),
        key_cache.stride(2),
        value_cache.stride(0),
        value_cache.stride(1),
        value_cache.stride(2),
        NUM_Q_HEADS=num_q_heads,
        NUM_KV_HEADS=num_kv_heads,
        HALF=head_dim // 2,
        BLOCK_SIZE=key_cache.shape[1],
        HEADS_PADDED=heads_padded,
        HALF_PADDED=half_padded,
        KV_HEADS_PADDED=triton.next_power_of_2(num_kv_heads),
        HEAD_DIM_PADDED=triton.next_power_of_2(head_dim),
        ROUND_QK=_round_by_hand(qk.dtype),
        ROUND_K_CACHE=_round_by_hand(key_cache.dtype),
        ROUND_V_CACHE=_round_by_hand(value_cache.dtype),
        **quant,
        num_warps=4 if heads_padded * half_padded <= 4096 else 8,
    )
    return qk
