"""The fused Triton kernels (``actorserve_kernels.fused``) against the torch code they replace.

Without a GPU they run in Triton's interpreter (see tests/test_kernels.py), on fresh random
inputs each run (the seed is printed). References are the torch paths of
``services/gpu_worker/model/layers.py`` (run with autograd on, so the C++ CPU ops stay out
of them) and ``reshape_and_cache``, plus an fp32/fp64 recomputation where the kernel is
meant to round once. Tolerances found (bf16/fp16 in ulp of the output, fp32 relative):

* ``rms_norm``: fp32 within 3e-7 of ``RMSNorm``; bf16/fp16 equal to it but for about 1 in
  10^4 values, 1-2 ulp off (the fp32 sum of squares rounds differently, the normalised
  value is rounded 1 ulp apart, the weight carries it); ``x + residual`` equal.
* ``silu_and_mul``: fp32 within 3e-7 of ``F.silu(gate) * up``; bf16/fp16 within 1 ulp of
  it (about a quarter of the values differ: torch rounds ``silu(gate)`` first; in fp16
  where ``silu(gate)`` is subnormal, its rounding error times ``|up|``) and equal to the
  fp64 result rounded once (rarely 1 ulp off in fp16).
* ``rotary_and_cache``: bf16/fp16 equal to the rotation computed in fp32 and rounded
  once; against ``RotaryEmbedding.forward``, which rounds ``x * cos`` first, off by at most
  ~2 ulp of the terms' magnitude ``|x * cos| + |rot(x) * sin|`` (many ulp of the result
  where the terms cancel); fp32 within 3e-7 of it.
"""

from __future__ import annotations

import secrets

import pytest
import torch
import torch.nn.functional as F

from actorserve_kernels import reshape_and_cache, rms_norm, rotary_and_cache, silu_and_mul
from services.gpu_worker.model.layers import RMSNorm, RotaryEmbedding
from services.gpu_worker.model.layers import silu_and_mul as layers_silu_and_mul

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
# One ulp relative to the bottom of its binade (the most one ulp can be), and one ulp of
# the subnormals.
ULP = {dt: torch.finfo(dt).eps for dt in (torch.bfloat16, torch.float16)}
SUBNORMAL_ULP = {dt: torch.finfo(dt).eps * torch.finfo(dt).smallest_normal for dt in ULP}
FP32_TOL = {"rtol": 1e-6, "atol": 1e-6}


@pytest.fixture
def gen() -> torch.Generator:
    seed = secrets.randbits(32)
    print(f"seed {seed}")  # shown when the test fails
    return torch.Generator().manual_seed(seed)


def randn(*shape: int, gen: torch.Generator, dtype: torch.dtype, scale: float = 1.0):
    return (scale * torch.randn(*shape, generator=gen)).to(dtype).to(DEVICE)


def assert_within_ulp(
    actual: torch.Tensor,
    expected: torch.Tensor,
    min_equal: float,
    ulps: float = 1.0,
    subnormal_ulps: float = 1.0,
) -> None:
    """Every element within ``ulps`` ulp of ``expected`` (``subnormal_ulps`` ulp among the
    subnormals), and at least ``min_equal`` of them equal."""
    assert actual.dtype == expected.dtype and actual.shape == expected.shape
    a, e = actual.double(), expected.double()
    atol = subnormal_ulps * SUBNORMAL_ULP[actual.dtype]
    torch.testing.assert_close(a, e, rtol=ulps * ULP[actual.dtype], atol=atol)
    equal = float((a == e).double().mean())
    assert equal >= min_equal, f"only {equal:.3f} of the elements equal"


# ---------------------------------------------------------------- rms_norm


def torch_rms_norm(norm: RMSNorm, x: torch.Tensor, residual: torch.Tensor | None):
    """RMSNorm's torch path (autograd on keeps the C++ CPU op and the Triton branch out)."""
    with torch.enable_grad():
        res = norm(x, residual)
    return tuple(t.detach() for t in res) if isinstance(res, tuple) else res.detach()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize(
    "num_tokens, hidden, scale",
    [
        (5, 576, 1.0),  # SmolLM2's hidden size: not a power of two
        (3, 1000, 1e-3),  # mean(x^2) ~ eps: a wrong eps shows
        (2, 16384, 4.0),  # the largest hidden size handled in one block
    ],
)
@pytest.mark.parametrize("with_residual", [False, True])
def test_rms_norm(dtype, num_tokens, hidden, scale, with_residual, gen) -> None:
    eps = 1e-5
    norm = RMSNorm(hidden, eps).to(dtype=dtype, device=DEVICE)
    with torch.no_grad():
        norm.weight.copy_(1.0 + 0.5 * torch.randn(hidden, generator=gen))
    # Strided rows: x and the residual are column slices of wider buffers.
    x = randn(num_tokens, hidden + 24, gen=gen, dtype=dtype, scale=scale)[:, 8 : 8 + hidden]
    residual = None
    if with_residual:
        residual = randn(num_tokens, hidden + 8, gen=gen, dtype=dtype, scale=scale)[:, :hidden]
    x_before = x.clone()

    got = rms_norm(x, norm.weight.detach(), eps, residual)
    expected = torch_rms_norm(norm, x, residual)
    if with_residual:
        assert isinstance(got, tuple) and isinstance(expected, tuple)
        out, total = got
        assert torch.equal(total, x + residual)  # the add in the input dtype, rounded once
        exp_out = expected[0]
    else:
        assert isinstance(got, torch.Tensor) and isinstance(expected, torch.Tensor)
        out, exp_out = got, expected
    assert torch.equal(x, x_before)  # inputs are not written
    assert out.dtype == dtype and out.shape == (num_tokens, hidden) and out.is_contiguous()
    if dtype == torch.float32:
        torch.testing.assert_close(out, exp_out, **FP32_TOL)
    else:
        # Now and then the fp32 sums of squares round differently and the normalised value
        # (rounded before the weight multiplies it) is 1 ulp off; the rounded product with
        # the weight is then within 2 ulp.
        assert_within_ulp(out, exp_out, min_equal=0.99, ulps=2)


def test_rms_norm_rounds_like_the_reference(gen) -> None:
    """bf16: the normalised row is rounded before the weight multiplies it (as RMSNorm
    does), not once at the end: with a weight of 3 the two differ in many elements."""
    hidden = 576
    x = randn(4, hidden, gen=gen, dtype=torch.bfloat16)
    weight = torch.full((hidden,), 3.0, dtype=torch.bfloat16, device=DEVICE)
    out = rms_norm(x, weight, 1e-6)
    assert isinstance(out, torch.Tensor)
    xf = x.double()
    normed = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + 1e-6)
    twice = (normed.to(torch.bfloat16).double() * 3.0).to(torch.bfloat16)
    once = (normed * 3.0).to(torch.bfloat16)
    assert_within_ulp(out, twice, min_equal=0.99)
    assert float((out != once).double().mean()) > 0.05


# ---------------------------------------------------------------- silu_and_mul


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("inter", [1536, 1500, 64])  # 1500: a partial last block of 1024
def test_silu_and_mul(dtype, inter, gen) -> None:
    num_tokens = 5
    # Strided rows: a slice of a wider buffer.
    gate_up = randn(num_tokens, 2 * inter + 16, gen=gen, dtype=dtype, scale=3.0)[:, : 2 * inter]
    out = silu_and_mul(gate_up)
    gate, up = gate_up.chunk(2, dim=-1)
    expected = F.silu(gate) * up  # the torch path of layers.silu_and_mul
    assert out.dtype == dtype and out.shape == (num_tokens, inter)
    if dtype == torch.float32:
        torch.testing.assert_close(out, expected, **FP32_TOL)
    else:
        # torch rounds silu(gate) before the product: within 1 ulp, not equal (where
        # silu(gate) is subnormal in fp16, its rounding error times |up|).
        max_up = float(up.abs().max())
        assert_within_ulp(out, expected, min_equal=0.5, subnormal_ulps=1 + max_up)
        # The exact value rounded once.
        exact = (F.silu(gate.double()) * up.double()).to(dtype)
        assert_within_ulp(out, exact, min_equal=0.99)


# ---------------------------------------------------------------- rotary_and_cache


def rotate_fp32(qk: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """The neox rotation computed in fp32 and rounded once to ``qk``'s dtype."""
    x = qk.float()
    x1, x2 = x.chunk(2, dim=-1)
    return (x * cos.float() + torch.cat([x2, x1], dim=-1) * sin.float()).to(qk.dtype)


def torch_rotary(rope: RotaryEmbedding, qk: torch.Tensor, cos, sin) -> torch.Tensor:
    """``RotaryEmbedding.forward``'s torch path (autograd on: not the C++ op)."""
    with torch.enable_grad():
        return rope(qk.clone(), cos, sin).detach()


@pytest.mark.parametrize(
    "dtype, head_dim, num_q_heads, num_kv_heads, block_size",
    [
        (torch.float32, 64, 9, 3, 16),  # SmolLM2's heads, GQA 3
        (torch.bfloat16, 64, 9, 3, 16),
        (torch.bfloat16, 128, 4, 1, 1),  # block size 1, GQA 4
        (torch.float16, 128, 2, 2, 16),  # MHA
        (torch.float32, 80, 4, 2, 1),  # head_dim not a power of two
    ],
)
def test_rotary_and_cache(dtype, head_dim, num_q_heads, num_kv_heads, block_size, gen) -> None:
    num_tokens, num_slots, num_blocks = 7, 6, 8
    heads = num_q_heads + num_kv_heads
    rope = RotaryEmbedding(head_dim, 2048, 10000.0, None)
    positions = torch.randint(0, 2048, (num_tokens,), generator=gen).to(DEVICE)
    cos, sin = rope.cos_sin(positions, dtype)
    # The fused QKV output, with a spare head per row so that no stride is the packed one.
    qkv = randn(num_tokens, heads + num_kv_heads + 1, head_dim, gen=gen, dtype=dtype)
    qkv_before = qkv.clone()
    qk = qkv[:, :heads]
    v = qkv[:, heads : heads + num_kv_heads]
    # The caches are views into buffers with a guard block on each side.
    shape = (num_blocks + 2, block_size, num_kv_heads, head_dim)
    k_buf = randn(*shape, gen=gen, dtype=dtype)
    v_buf = randn(*shape, gen=gen, dtype=dtype)
    k_before, v_before = k_buf.clone(), v_buf.clone()
    # Token 2 is padding (-1); token 6 has no slot at all (past slot_mapping).
    slots = torch.randperm(num_blocks * block_size, generator=gen)[:num_slots]
    slots[2] = -1
    slots = slots.to(DEVICE)

    expected_qk = rotate_fp32(qk, cos, sin)
    torch_qk = torch_rotary(rope, qk, cos, sin)
    k_ref, v_ref = k_buf.clone(), v_buf.clone()
    reshape_and_cache(
        expected_qk[:num_slots, num_q_heads:], v[:num_slots], k_ref[1:-1], v_ref[1:-1], slots
    )

    got = rotary_and_cache(qk, v, cos, sin, num_q_heads, k_buf[1:-1], v_buf[1:-1], slots)
    assert got is qk

    # q and k rotated in place, every row (token 6 too); v and the spare head untouched.
    if dtype == torch.float32:
        torch.testing.assert_close(qk, expected_qk, **FP32_TOL)
        torch.testing.assert_close(qk, torch_qk, **FP32_TOL)
        torch.testing.assert_close(k_buf, k_ref, **FP32_TOL)
    else:
        assert torch.equal(qk, expected_qk)
        assert torch.equal(k_buf, k_ref)
        # torch rounds x * cos before adding: off by up to ~2 ulp of the terms' size.
        x = qkv_before[:, :heads].double()
        x1, x2 = x.chunk(2, dim=-1)
        terms = (x * cos.double()).abs() + (torch.cat([x2, x1], -1) * sin.double()).abs()
        assert bool(((qk.double() - torch_qk.double()).abs() <= 2 * ULP[dtype] * terms).all())
    assert torch.equal(qkv[:, heads:], qkv_before[:, heads:])
    assert torch.equal(v_buf, v_ref)

    # Explicitly: only the real slots changed; padding wrote nothing, nor did the guards.
    written = torch.zeros(num_blocks + 2, block_size, dtype=torch.bool, device=DEVICE)
    real = slots[slots >= 0]
    written[1:-1].view(-1)[real] = True
    assert torch.equal(k_buf[~written], k_before[~written])
    assert torch.equal(v_buf[~written], v_before[~written])
    assert int(written.sum()) == num_slots - 1
    # And each real slot holds its token's rotated k and raw v.
    for t in range(num_slots):
        s = int(slots[t])
        if s < 0:
            continue
        block, pos = 1 + s // block_size, s % block_size
        assert torch.equal(k_buf[block, pos], qk[t, num_q_heads:])
        assert torch.equal(v_buf[block, pos], qkv_before[t, heads : heads + num_kv_heads])


def test_rotary_and_cache_casts_to_cache_dtype(gen) -> None:
    """fp32 activations, a bf16 cache: the rotated k is rounded to nearest (not truncated)."""
    num_tokens, head_dim = 4, 64
    rope = RotaryEmbedding(head_dim, 512, 10000.0, None)
    cos, sin = rope.cos_sin(torch.arange(num_tokens, device=DEVICE) * 37, torch.float32)
    qkv = randn(num_tokens, 4, head_dim, gen=gen, dtype=torch.float32)
    qk, v = qkv[:, :3], qkv[:, 3:]
    expected = rotate_fp32(qk, cos, sin)
    v_expected = v.clone()
    k_cache = torch.zeros(2, 4, 1, head_dim, dtype=torch.bfloat16, device=DEVICE)
    v_cache = torch.zeros_like(k_cache)
    slots = torch.tensor([5, 0, 7, 2], device=DEVICE)
    rotary_and_cache(qk, v, cos, sin, 2, k_cache, v_cache, slots)
    torch.testing.assert_close(qk, expected, **FP32_TOL)
    flat_k, flat_v = k_cache.view(-1, 1, head_dim), v_cache.view(-1, 1, head_dim)
    idx = slots.tolist()
    assert_within_ulp(flat_k[idx], expected[:, 2:].to(torch.bfloat16), min_equal=0.99)
    assert torch.equal(flat_v[idx], v_expected.to(torch.bfloat16))
    assert int((flat_k.abs().sum((1, 2)) != 0).sum()) == num_tokens


def test_rotary_and_cache_no_slots(gen) -> None:
    """An empty slot_mapping: every row is rotated, nothing is cached."""
    qkv = randn(3, 3, 64, gen=gen, dtype=torch.float32)
    qk, v = qkv[:, :2], qkv[:, 2:]
    rope = RotaryEmbedding(64, 64, 10000.0, None)
    cos, sin = rope.cos_sin(torch.tensor([0, 5, 9], device=DEVICE), torch.float32)
    expected = rotate_fp32(qk, cos, sin)
    cache = torch.zeros(2, 4, 1, 64, device=DEVICE)
    slots = torch.empty(0, dtype=torch.int64, device=DEVICE)
    rotary_and_cache(qk, v, cos, sin, 1, cache, cache, slots)
    torch.testing.assert_close(qk, expected, **FP32_TOL)
    assert not bool(cache.any())


def test_rejects_bad_shapes() -> None:
    x = torch.zeros(2, 64, device=DEVICE)
    with pytest.raises(ValueError, match="weight"):
        rms_norm(x, torch.ones(32, device=DEVICE), 1e-6)
    with pytest.raises(ValueError, match="residual"):
        rms_norm(
            x, torch.ones(64, device=DEVICE), 1e-6, torch.zeros(2, 64, 2, device=DEVICE)[..., 0]
        )
    with pytest.raises(ValueError, match="gate_up"):
        silu_and_mul(torch.zeros(2, 63, device=DEVICE))
    qk = torch.zeros(3, 4, 64, device=DEVICE)
    v = torch.zeros(3, 1, 64, device=DEVICE)
    cos = torch.zeros(3, 1, 64, device=DEVICE)
    cache = torch.zeros(2, 4, 1, 64, device=DEVICE)
    slots = torch.zeros(3, dtype=torch.int64, device=DEVICE)
    with pytest.raises(ValueError, match="v "):
        rotary_and_cache(qk, v, cos, cos, 2, cache, cache, slots)  # 2 kv heads, v has 1
    with pytest.raises(ValueError, match="slot_mapping"):
        rotary_and_cache(qk, v, cos, cos, 3, cache, cache, torch.zeros(4, dtype=torch.int64))
    with pytest.raises(ValueError, match="cos"):
        rotary_and_cache(qk, v, cos[:2], cos, 3, cache, cache, slots)


# ---------------------------------------------------------------- layers.py dispatch


@pytest.mark.skipif(DEVICE.type != "cuda", reason="layers use the Triton kernels on CUDA only")
def test_layers_use_fused_kernels_on_cuda(gen) -> None:
    hidden = 576
    norm = RMSNorm(hidden, 1e-5).to(dtype=torch.bfloat16, device=DEVICE)
    x = randn(4, hidden, gen=gen, dtype=torch.bfloat16)
    residual = randn(4, hidden, gen=gen, dtype=torch.bfloat16)
    gate_up = randn(4, 2 * 1536, gen=gen, dtype=torch.bfloat16)
    with torch.inference_mode():
        out, total = norm(x, residual)
        act = layers_silu_and_mul(gate_up)
    # The Triton kernels' results (silu_and_mul: torch's differ in ~1/4 of the values)...
    fused_out, fused_total = rms_norm(x, norm.weight.detach(), 1e-5, residual)
    assert torch.equal(out, fused_out) and torch.equal(total, fused_total)
    assert torch.equal(act, silu_and_mul(gate_up))
    # ... within the tolerances above of the torch paths.
    exp_out, exp_total = torch_rms_norm(norm, x, residual)
    assert torch.equal(total, exp_total)
    assert_within_ulp(out, exp_out, min_equal=0.99, ulps=2)
    gate, up = gate_up.chunk(2, dim=-1)
    assert_within_ulp(act, F.silu(gate) * up, min_equal=0.5, subnormal_ulps=100.0)
