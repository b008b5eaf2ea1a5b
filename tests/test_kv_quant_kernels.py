"""Quantized KV caches (``--kv-cache-dtype``) in the Triton kernels, against ``kv_quant``.

Without a GPU the kernels run in Triton's interpreter (see tests/test_kernels.py), on fresh
random inputs each run (the seed is printed). What is checked, for fp8 e4m3, fp8 e5m2 and
int8 caches with fp32 and bf16 models (and plain caches, for the write):

* ``reshape_and_cache`` and ``rotary_and_cache`` store exactly the bytes of the reference
  (``kv_quant.quantize`` scattered into the slots, as ``kv_quant.write`` does): fp8 bytes,
  int8 values and the 4 bytes of each row's scale; padding slots and the guard blocks
  around the cache are untouched. The inputs span the formats' range: fp8 rows saturate
  at the top and fall into the subnormals at the bottom; an all-zero int8 row gets the
  smallest scale. fp8 rounding is also checked on every fp8 value, every midpoint (ties
  go to even) and the fp32 neighbours of each midpoint; the scales are read from their
  tensors at each launch (updated in place, the next write uses the new value).
* The round trip (kernel write, ``kv_quant.dequantize``) per element, derived from the
  formats: with ``y = x / scale`` (fp32) and ``M`` mantissa bits, round to nearest moves
  ``y`` by at most half an ulp, ``2^-(M+1) |y|`` in the normal range and half the
  subnormal step ``2^(e_min - M - 1)`` below it (e4m3: ``2^-4`` and ``2^-10``; e5m2:
  ``2^-3`` and ``2^-17``); times the scale, plus fp32 slack of a few ``2^-24 |x|``:
  ``|x - deq| <= 2^-(M+1) |x| + 2^(e_min - M - 1) scale`` (beyond ``max * scale`` it
  saturates to ``+-max * scale``). int8: ``|x - deq| <= scale / 2`` (plus the fp32 slack),
  ``scale = absmax / 127``, and the row's largest element comes back to fp32 rounding.
  The bounds are tight: the largest relative error seen is within 20 % of them.
* ``paged_attention`` over a quantized cache equals, bit for bit in the interpreter, the
  plain kernel over the cache dequantized to the model's dtype (the kernel dequantizes in
  fp32 and rounds to the query's dtype, as a plain cache would hold it), and a float64
  brute-force attention over the dequantized K/V to 1e-5 (fp32 queries; bf16: the plain
  kernel's bf16 tolerance), for prefill chunks over cached prefixes, decodes, split-KV
  (4 splits) and GQA.
"""

from __future__ import annotations

import secrets

import pytest
import torch

from actorserve_kernels import kv_quant, paged_attention, reshape_and_cache, rotary_and_cache
from services.gpu_worker.model.layers import RotaryEmbedding
from tests.test_kernels import MIXED, make_batch, reference_attention

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
QUANTIZED = ["fp8_e4m3", "fp8_e5m2", "int8"]
MODEL_DTYPES = [torch.float32, torch.bfloat16]
MODEL_IDS = ["fp32", "bf16"]


@pytest.fixture
def gen() -> torch.Generator:
    seed = secrets.randbits(32)
    print(f"seed {seed}")  # shown when the test fails
    return torch.Generator().manual_seed(seed)


def fp8_format(dtype: torch.dtype) -> tuple[float, int, float]:
    """(largest finite value, mantissa bits, smallest normal) of an fp8 dtype."""
    info = torch.finfo(dtype)
    return info.max, round(-torch.log2(torch.tensor(info.eps)).item()), info.smallest_normal


def fp8_scale(dtype: torch.dtype, saturate_above: float) -> torch.Tensor:
    """A layer scale with which ``|x| > saturate_above`` saturates."""
    return torch.tensor([saturate_above / fp8_format(dtype)[0]], device=DEVICE)


def as_bytes(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(torch.uint8)


def random_cache(shape: tuple[int, ...], dtype: torch.dtype, gen: torch.Generator):
    """Random bytes (any dtype: fp8 NaNs and int8 rows with odd scales included)."""
    nbytes = torch.empty((), dtype=dtype).element_size()
    raw = torch.randint(0, 256, (*shape[:-1], shape[-1] * nbytes), generator=gen)
    return raw.to(torch.uint8).view(dtype).to(DEVICE)


def reference_write(key, value, key_cache, value_cache, slots, k_scale, v_scale) -> None:
    """``kv_quant.write`` of the tokens whose slot is >= 0, scattering the quantized rows as
    bytes (torch's CPU ``index_copy_`` has no fp8 kernel)."""
    real = slots >= 0
    for x, cache, scale in ((key, key_cache, k_scale), (value, value_cache, v_scale)):
        rows = kv_quant.quantize(x[real], cache.dtype, scale)
        heads, width = cache.shape[2:]
        as_rows = cache.view(torch.uint8).view(-1, heads, width * cache.element_size())
        as_rows[slots[real]] = rows.contiguous().view(torch.uint8)


def spread_rows(num_tokens: int, heads: int, head_dim: int, gen: torch.Generator, dtype):
    """Rows of very different magnitudes (1e-9 .. 1e3 by token), token 1 all zeros."""
    x = torch.randn(num_tokens, heads, head_dim, generator=gen)
    x *= torch.logspace(-9, 3, num_tokens)[torch.randperm(num_tokens, generator=gen)][:, None, None]
    x[1] = 0.0
    return x.to(dtype)


def cache_and_scales(name: str, model_dtype: torch.dtype):
    dtype = kv_quant.storage_dtype(name, model_dtype)
    if kv_quant.kind(torch.empty(0, dtype=dtype)) != "fp8":
        return dtype, None, None
    # Saturating at 1 and 10: the largest rows of spread_rows saturate, the smallest are
    # subnormal (e4m3: below 2^-6 * scale ~ 3e-5; e5m2: below 2^-14 * scale ~ 2e-9).
    return dtype, fp8_scale(dtype, 1.0), fp8_scale(dtype, 10.0)


# ---------------------------------------------------------------- the writes


@pytest.mark.parametrize("model_dtype", MODEL_DTYPES, ids=MODEL_IDS)
@pytest.mark.parametrize("name", ["auto", *QUANTIZED])
def test_reshape_and_cache_writes_the_reference_bytes(name, model_dtype, gen) -> None:
    num_blocks, block_size, heads, head_dim, num_tokens = 5, 8, 3, 64, 24
    cache_dtype, k_scale, v_scale = cache_and_scales(name, model_dtype)
    width = kv_quant.row_width(name, head_dim)
    # Views into buffers of random bytes with a guard block on each side.
    shape = (num_blocks + 2, block_size, heads, width)
    k_buf, v_buf = random_cache(shape, cache_dtype, gen), random_cache(shape, cache_dtype, gen)
    k_before, v_before = k_buf.clone(), v_buf.clone()
    slots = torch.randperm(num_blocks * block_size, generator=gen)[:num_tokens]
    slots[torch.randperm(num_tokens, generator=gen)[:4]] = -1
    # Strided rows, as slices of a fused QKV output.
    kv = torch.stack([spread_rows(num_tokens, heads, head_dim, gen, model_dtype)] * 2, dim=1)
    kv[:, 1] = kv[:, 1].flip(0)  # V's magnitudes by token differ from K's
    key, value = kv[:, 0].to(DEVICE), kv[:, 1].to(DEVICE)
    slots = slots.to(DEVICE)

    k_ref, v_ref = k_buf.clone(), v_buf.clone()
    reference_write(key, value, k_ref[1:-1], v_ref[1:-1], slots, k_scale, v_scale)
    reshape_and_cache(key, value, k_buf[1:-1], v_buf[1:-1], slots, k_scale, v_scale)

    assert torch.equal(as_bytes(k_buf), as_bytes(k_ref))
    assert torch.equal(as_bytes(v_buf), as_bytes(v_ref))
    # Explicitly: the padding tokens and the guard blocks wrote nothing.
    changed = (as_bytes(k_buf) != as_bytes(k_before)).flatten(2).any(-1)
    written = torch.zeros_like(changed)
    written[1:-1].view(-1)[slots[slots >= 0]] = True
    assert not bool((changed & ~written).any())
    assert torch.equal(as_bytes(v_buf)[~written], as_bytes(v_before)[~written])


@pytest.mark.parametrize("cache_dtype", [torch.float8_e4m3fn, torch.float8_e5m2])
def test_fp8_rounds_to_nearest_even(cache_dtype) -> None:
    """Every finite fp8 value, every midpoint between neighbours (ties to even) and the
    fp32 numbers on either side of it, both signs, and values past the largest: the bytes
    of torch's ``.to(fp8)`` of the clamped value (scale 1, so nothing else rounds)."""
    fmax = fp8_format(cache_dtype)[0]
    values = torch.arange(256, dtype=torch.int32).to(torch.uint8).view(cache_dtype).float()
    values = values[values.isfinite() & (values >= 0)].unique()
    mids = (values[1:] + values[:-1]) / 2
    past = torch.tensor([fmax * 1.01, fmax * 1.5, 1e30, 1e-30, 1e-45])
    x = torch.cat(
        [values, mids, mids.nextafter(torch.tensor(0.0)), mids.nextafter(torch.tensor(1e9)), past]
    )
    x = torch.cat([x, -x])
    x = torch.cat([x, x.new_zeros(-x.numel() % 64)]).view(-1, 1, 64).to(DEVICE)
    num_tokens = x.shape[0]
    cache = torch.zeros(num_tokens, 1, 1, 64, dtype=cache_dtype, device=DEVICE)
    slots = torch.arange(num_tokens, device=DEVICE)
    one = torch.ones(1, device=DEVICE)
    reshape_and_cache(x, x, cache, cache.clone(), slots, one, one)
    expected = x.clamp(-fmax, fmax).to(cache_dtype)
    assert torch.equal(as_bytes(cache.view(num_tokens, 1, 64)), as_bytes(expected))


def test_fp8_scales_are_read_on_the_device(gen) -> None:
    """The kernels load the scale tensors' current value (a CUDA graph replays with the
    same tensors after ``--calculate-kv-scales`` updates them in place)."""
    key = torch.randn(4, 2, 64, generator=gen).to(DEVICE)
    cache = torch.zeros(1, 4, 2, 64, dtype=torch.float8_e4m3fn, device=DEVICE)
    k_scale, v_scale = torch.tensor([0.01], device=DEVICE), torch.tensor([0.02], device=DEVICE)
    slots = torch.arange(4, device=DEVICE)
    for _ in range(2):
        v_cache = cache.clone()
        reshape_and_cache(key, key, cache, v_cache, slots, k_scale, v_scale)
        for got, scale in ((cache, k_scale), (v_cache, v_scale)):
            expected = kv_quant.quantize(key, cache.dtype, scale)
            assert torch.equal(as_bytes(got[0]), as_bytes(expected))
        k_scale.mul_(3.0)
        v_scale.copy_(k_scale)


@pytest.mark.parametrize("model_dtype", MODEL_DTYPES, ids=MODEL_IDS)
@pytest.mark.parametrize("name", ["auto", *QUANTIZED])
def test_rotary_and_cache_writes_the_reference_bytes(name, model_dtype, gen) -> None:
    """The fused write equals rotating (the kernel's rotation, which test_fused_kernels
    checks) then ``kv_quant.write``."""
    num_tokens, num_slots, num_blocks, block_size = 7, 6, 4, 4
    hq, hkv, head_dim = 4, 2, 64
    cache_dtype, k_scale, v_scale = cache_and_scales(name, model_dtype)
    rope = RotaryEmbedding(head_dim, 2048, 10000.0, None)
    cos, sin = rope.cos_sin(torch.randint(0, 2048, (num_tokens,), generator=gen), model_dtype)
    qkv = torch.cat(
        [
            torch.randn(num_tokens, hq, head_dim, generator=gen).to(model_dtype),
            spread_rows(num_tokens, 2 * hkv, head_dim, gen, model_dtype),
        ],
        dim=1,
    ).to(DEVICE)
    qk, v = qkv[:, : hq + hkv], qkv[:, hq + hkv :]
    shape = (num_blocks + 2, block_size, hkv, kv_quant.row_width(name, head_dim))
    k_buf, v_buf = random_cache(shape, cache_dtype, gen), random_cache(shape, cache_dtype, gen)
    k_ref, v_ref = k_buf.clone(), v_buf.clone()
    # Token 2 is padding, token 6 is past slot_mapping: rotated, not cached.
    slots = torch.randperm(num_blocks * block_size, generator=gen)[:num_slots]
    slots[2] = -1
    slots = slots.to(DEVICE)
    v_before = v[:num_slots].clone()

    rotary_and_cache(
        qk, v, cos, sin, hq, k_buf[1:-1], v_buf[1:-1], slots, k_scale=k_scale, v_scale=v_scale
    )
    reference_write(
        qk[:num_slots, hq:], v_before, k_ref[1:-1], v_ref[1:-1], slots, k_scale, v_scale
    )
    assert torch.equal(as_bytes(k_buf), as_bytes(k_ref))
    assert torch.equal(as_bytes(v_buf), as_bytes(v_ref))


# ---------------------------------------------------------------- the round trip


@pytest.mark.parametrize("model_dtype", MODEL_DTYPES, ids=MODEL_IDS)
@pytest.mark.parametrize("name", QUANTIZED)
def test_round_trip_error_bound(name, model_dtype, gen) -> None:
    num_tokens, heads, head_dim = 64, 2, 64
    cache_dtype, k_scale, _ = cache_and_scales(name, model_dtype)
    x = spread_rows(num_tokens, heads, head_dim, gen, model_dtype).to(DEVICE)
    cache = torch.zeros(num_tokens, 1, heads, kv_quant.row_width(name, head_dim))
    cache = cache.to(cache_dtype).to(DEVICE)
    slots = torch.arange(num_tokens, device=DEVICE)
    reshape_and_cache(x, x, cache, cache.clone(), slots, k_scale, k_scale)
    stored = cache.view(num_tokens, heads, -1)
    x = x.double()
    deq = kv_quant.dequantize(stored, k_scale, torch.float64)
    err = (x - deq).abs()
    slack = 2.0**-20 * x.abs()  # fp32 division and multiplication, a few 2^-24 |x|
    if name == "int8":
        row_scale = stored[..., head_dim:].contiguous().view(torch.float32).double()
        absmax = x.abs().amax(-1, keepdim=True)
        assert torch.allclose(row_scale, absmax.clamp_min(1e-12) / 127, rtol=2**-22, atol=0)
        assert bool((err <= row_scale / 2 * (1 + 2**-15) + slack).all())
        nonzero = absmax.squeeze(-1) > 0  # the row's largest element comes back
        peak = x.abs().argmax(-1, keepdim=True)
        assert torch.allclose(
            deq.gather(-1, peak)[nonzero], x.gather(-1, peak)[nonzero], rtol=2**-20, atol=0
        )
        assert bool((deq[1] == 0).all())  # the zero row
        tightness = float((err / row_scale).max() / 0.5)
    else:
        fmax, mant, min_normal = fp8_format(cache_dtype)
        scale = float(k_scale)
        rel, floor = 2.0 ** -(mant + 1), min_normal * 2.0 ** -(mant + 1) * scale
        inside = x.abs() <= fmax * scale
        bound = rel * x.abs() + floor * (1 + 2**-20) + slack
        assert bool((err <= bound)[inside].all())
        # Past the largest value: saturated, not inf or NaN.
        saturated = (torch.full_like(k_scale, fmax) * k_scale).double()  # as dequantize
        assert bool((deq[~inside] == x[~inside].sign() * saturated).all())
        subnormal = (x.abs() > 0) & (x.abs() < min_normal * scale)
        assert int((~inside).sum()) > 0 and int(subnormal.sum()) > 0
        normal = inside & (x.abs() >= min_normal * scale)
        tightness = float((err[normal] / x.abs()[normal]).max() / rel)
    assert tightness > 0.8, f"the bound is loose: the largest error is {tightness:.2f} of it"


# ---------------------------------------------------------------- attention


def quantized_batch(batch: dict, name: str, model_dtype: torch.dtype) -> tuple[dict, dict]:
    """``batch`` (fp32 caches, NaN in unowned slots) with its caches quantized, and the same
    batch with those caches dequantized to ``model_dtype`` (unowned slots NaN or garbage)."""
    cache_dtype = kv_quant.storage_dtype(name, model_dtype)
    scales: dict[str, torch.Tensor | None] = {"k_scale": None, "v_scale": None}
    if name != "int8":  # K values around N(0, 1), V spread wider: both use the fp8 range
        scales = {"k_scale": fp8_scale(cache_dtype, 3.0), "v_scale": fp8_scale(cache_dtype, 5.0)}
    quantized, plain = dict(batch), dict(batch)
    for cache, scale in (("key_cache", "k_scale"), ("value_cache", "v_scale")):
        values = batch[cache] * (1.0 if cache == "key_cache" else 1.7)
        quantized[cache] = kv_quant.quantize(values, cache_dtype, scales[scale])
        plain[cache] = kv_quant.dequantize(quantized[cache], scales[scale], model_dtype)
    quantized["query"] = plain["query"] = batch["query"].to(model_dtype)
    return quantized | scales, plain


SCENARIOS = {
    # prefill from scratch, a chunk over a prefix ending mid-block, decodes; GQA 3
    "mixed-gqa3": (MIXED, 8, (6, 2), None),
    # split-KV decodes (forced to 4; short contexts leave splits empty); GQA 4
    "split4-decode-gqa4": ([(90, 1), (5, 1), (0, 1), (40, 1)], 16, (8, 2), 4),
    # split-KV with prefill rows too, MHA
    "split4-mixed-mha": ([(13, 5), (40, 1), (0, 3)], 16, (2, 2), 4),
}


@pytest.mark.parametrize("model_dtype", MODEL_DTYPES, ids=MODEL_IDS)
@pytest.mark.parametrize("name", QUANTIZED)
@pytest.mark.parametrize("scenario", list(SCENARIOS))
def test_paged_attention_over_quantized_cache(scenario, name, model_dtype, gen) -> None:
    seqs, block_size, (hq, hkv), num_splits = SCENARIOS[scenario]
    batch = make_batch(
        seqs,
        block_size=block_size,
        num_q_heads=hq,
        num_kv_heads=hkv,
        head_dim=64,
        dtype=torch.float32,
        gen=gen,
    )
    quantized, plain = quantized_batch(batch, name, model_dtype)
    out = paged_attention(**quantized, num_splits=num_splits)
    assert not out.isnan().any(), "NaN leaked from unowned slots"

    # The plain kernel over the dequantized cache: the same values in the same dots.
    same = paged_attention(**plain, num_splits=num_splits)
    if DEVICE.type == "cpu":
        assert torch.equal(out, same)
    else:
        torch.testing.assert_close(out, same, rtol=1e-6, atol=1e-6)

    ref = reference_attention(plain)
    if model_dtype == torch.float32:
        torch.testing.assert_close(out.double(), ref, rtol=1e-5, atol=1e-5)
    else:
        err = float((out.double() - ref).norm() / ref.norm())
        assert err < 1e-2, f"relative error {err:.2e}"


# ---------------------------------------------------------------- errors


def test_rejects_bad_quantized_caches() -> None:
    key = torch.zeros(2, 1, 64, device=DEVICE)
    slots = torch.tensor([0, 1], device=DEVICE)
    fp8 = torch.zeros(1, 4, 1, 64, dtype=torch.float8_e4m3fn, device=DEVICE)
    scale = torch.ones(1, device=DEVICE)
    with pytest.raises(ValueError, match="needs k_scale"):
        reshape_and_cache(key, key, fp8, fp8.clone(), slots)
    with pytest.raises(ValueError, match="v_scale must be one fp32"):
        reshape_and_cache(key, key, fp8, fp8.clone(), slots, scale, scale.double())
    with pytest.raises(ValueError, match="key_cache .* != value_cache"):
        reshape_and_cache(key, key, fp8, fp8.view(torch.int8), slots, scale, scale)
    int8 = torch.zeros(1, 4, 1, 64, dtype=torch.int8, device=DEVICE)  # no room for scales
    with pytest.raises(ValueError, match="68"):
        reshape_and_cache(key, key, int8, int8.clone(), slots)
    odd = torch.zeros(2, 1, 66, device=DEVICE)
    int8 = torch.zeros(1, 4, 1, 70, dtype=torch.int8, device=DEVICE)
    with pytest.raises(ValueError, match="multiple of 4"):
        reshape_and_cache(odd, odd, int8, int8.clone(), slots)
    qk = torch.zeros(2, 2, 66, device=DEVICE)
    cos = torch.zeros(2, 1, 66, device=DEVICE)
    with pytest.raises(ValueError, match="multiple of 4"):
        rotary_and_cache(qk, odd, cos, cos, 1, int8, int8.clone(), slots)
    with pytest.raises(ValueError, match="needs k_scale"):
        rotary_and_cache(qk[..., :64], key, cos[..., :64], cos[..., :64], 1, fp8, fp8, slots)

    gen = torch.Generator().manual_seed(0)
    kw = dict(block_size=16, num_q_heads=2, num_kv_heads=1, head_dim=64, gen=gen)
    batch = make_batch([(0, 2)], dtype=torch.float32, **kw)
    quantized, _ = quantized_batch(batch, "fp8", torch.float32)
    with pytest.raises(ValueError, match="needs v_scale"):
        paged_attention(**(quantized | {"v_scale": None}))
    quantized, _ = quantized_batch(batch, "int8", torch.float32)
    quantized["key_cache"] = quantized["value_cache"] = quantized["key_cache"][..., :64]
    with pytest.raises(ValueError, match="cache rows of 64"):
        paged_attention(**quantized)
