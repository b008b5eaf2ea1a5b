"""How a quantized KV cache stores K and V (``--kv-cache-dtype``, whose names
``services/config/engine.py:KV_CACHE_DTYPES`` lists), and the torch reference.

Every kernel that writes or reads the paged cache (the Triton kernels, the C++ CPU op, the
torch backend) follows this one description, and the tests hold each to the functions here.

- ``auto``: the model's dtype, ``[num_blocks, block_size, num_kv_heads, head_dim]``.
- ``fp8`` (= ``fp8_e4m3``) and ``fp8_e5m2``, vLLM's: the same shape in
  ``torch.float8_e4m3fn`` / ``torch.float8_e5m2``; one scale per layer for K and one for
  V (fp32 tensors of shape [1], so a CUDA graph reads their current value). Stored
  ``fp8(clamp(x / scale))`` (round to nearest even, saturating at the format's largest
  finite value), read ``float(stored) * scale``.
- ``int8`` (ours, for CPUs without fast fp8): symmetric, a scale per token and KV head.
  Each (token, head) row is ``head_dim`` int8 values followed by the 4 bytes of its fp32
  scale, so the cache is int8 ``[num_blocks, block_size, num_kv_heads, head_dim + 4]``:
  a block carries its scales, and whatever moves blocks (prefix caching, offload, p2p)
  moves them as bytes. ``scale = max(absmax(row), 1e-12) / 127``, stored
  ``clamp(round(x / scale), -127, 127)``, read ``stored * scale``.
"""

from __future__ import annotations

import torch

from services.model_arch import kv_row_bytes

_STORAGE = {
    "fp8": torch.float8_e4m3fn,
    "fp8_e4m3": torch.float8_e4m3fn,
    "fp8_e5m2": torch.float8_e5m2,
    "int8": torch.int8,
}
FP8_DTYPES = (torch.float8_e4m3fn, torch.float8_e5m2)
INT8_SCALE_BYTES = 4  # the fp32 scale after each row's int8 values
_INT8_MIN_ABSMAX = 1e-12


def storage_dtype(kv_cache_dtype: str, model_dtype: torch.dtype) -> torch.dtype:
    """The torch dtype of the cache tensors."""
    return _STORAGE.get(kv_cache_dtype, model_dtype)


def row_width(kv_cache_dtype: str, head_dim: int) -> int:
    """Elements of one (token, head) row in the cache's last dim."""
    return head_dim + INT8_SCALE_BYTES if kv_cache_dtype == "int8" else head_dim


def row_bytes(kv_cache_dtype: str, head_dim: int, model_dtype: torch.dtype) -> int:
    """Bytes of one (token, head) row: what a block's size is made of."""
    return kv_row_bytes(kv_cache_dtype, head_dim, torch.empty((), dtype=model_dtype).element_size())


def kind(cache: torch.Tensor) -> str:
    """What a cache tensor holds: "auto" (plain), "fp8" or "int8"."""
    if cache.dtype in FP8_DTYPES:
        return "fp8"
    return "int8" if cache.dtype == torch.int8 else "auto"


def as_bytes(cache: torch.Tensor) -> torch.Tensor:
    """An fp8 tensor as uint8 (the same bytes), anything else as it is: torch's CPU index,
    stack and cat ops have no fp8 kernels, and moving blocks needs only their bytes."""
    return cache.view(torch.uint8) if cache.dtype in FP8_DTYPES else cache


def fp8_max(dtype: torch.dtype) -> float:
    return float(torch.finfo(dtype).max)


def quantize(x: torch.Tensor, cache_dtype: torch.dtype, scale: torch.Tensor | None) -> torch.Tensor:
    """``x`` [..., head_dim] as the cache stores it (``scale``: the layer's, for fp8)."""
    if cache_dtype in FP8_DTYPES:
        assert scale is not None, "an fp8 cache needs its layer's scale"
        limit = fp8_max(cache_dtype)
        return (x.float() / scale.float()).clamp(-limit, limit).to(cache_dtype)
    if cache_dtype == torch.int8:
        xf = x.float()
        row_scale = xf.abs().amax(dim=-1, keepdim=True).clamp_min(_INT8_MIN_ABSMAX) / 127.0
        q = torch.round(xf / row_scale).clamp_(-127, 127).to(torch.int8)
        scale_bytes = row_scale.contiguous().view(torch.int8)  # [..., 4]
        return torch.cat([q, scale_bytes], dim=-1)
    return x.to(cache_dtype)


def dequantize(
    stored: torch.Tensor, scale: torch.Tensor | None, out_dtype: torch.dtype
) -> torch.Tensor:
    """Cache rows [..., row_width] back to values [..., head_dim] in ``out_dtype``."""
    if stored.dtype in FP8_DTYPES:
        assert scale is not None, "an fp8 cache needs its layer's scale"
        return (stored.float() * scale.float()).to(out_dtype)
    if stored.dtype == torch.int8:
        head_dim = stored.shape[-1] - INT8_SCALE_BYTES
        row_scale = stored[..., head_dim:].contiguous().view(torch.float32)  # [..., 1]
        return (stored[..., :head_dim].float() * row_scale).to(out_dtype)
    return stored.to(out_dtype)


def write(
    key: torch.Tensor,
    value: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    slots: torch.Tensor,
    k_scale: torch.Tensor | None = None,
    v_scale: torch.Tensor | None = None,
) -> None:
    """Reference write: token ``t``'s K/V rows quantized into ``slots[t]`` (all >= 0)."""
    heads, width = key_cache.shape[2:]
    for cache, x, scale in ((key_cache, key, k_scale), (value_cache, value, v_scale)):
        rows = quantize(x, cache.dtype, scale)
        as_bytes(cache).view(-1, heads, width).index_copy_(0, slots, as_bytes(rows))
