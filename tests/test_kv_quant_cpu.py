"""The C++ CPU ops over a quantized KV cache (``--kv-cache-dtype``; the storage format and
its torch reference are ``actorserve_kernels/kv_quant.py``).

- ``paged_attention_rows`` on fp8 (e4m3fn, e5m2) and int8 caches: every code read as torch
  converts it; attention equal to a float64 reference over ``kv_quant.dequantize``d K/V
  (up to fp32 accumulation order), and bit-equal to the op on an fp32 cache holding those
  values (the op dequantizes each element to exactly that fp32 value);
- ``write_kv_cache`` and ``decode_layers``: K/V quantized on write bit for bit as
  ``kv_quant.write`` quantizes them.

Fresh random inputs each run (the seed is in every failure message); the output is
poisoned with NaN and every cache slot no sequence owns holds a NaN code, so an unwritten
row, or a read past a context's end, fails. The build's ISA is the machine's; to test the
AVX2 path on an AVX-512 machine: ``ACTORSERVE_CPU_FLAGS=-mno-avx512f pytest ...`` (and
``-mno-avx512f -mno-f16c -mno-avx2`` for the scalar fallbacks).
"""

from __future__ import annotations

import secrets

import pytest
import torch

from actorserve_kernels import kv_quant
from actorserve_kernels.cpu import (
    QUANT_TYPES,
    load_cpu_ops,
    paged_attention_rows,
    quant_linear,
    quant_pack,
    rms_norm,
    rotary_embedding_,
    silu_and_mul,
    write_kv_cache,
)

pytestmark = pytest.mark.skipif(not load_cpu_ops(), reason="no C++ compiler to build the ops")

KV_DTYPES = ["fp8_e4m3", "fp8_e5m2", "int8"]
BLOCK = 16
# Context lengths: 1, inside a block, at and just past block boundaries, many blocks (the
# last one partial), and long enough for several position ranges when split.
CONTEXTS = [1, 5, 15, 16, 17, 32, 33, 100, 257, 700]


def _bits(t: torch.Tensor) -> torch.Tensor:
    """The bytes of ``t`` (equality of these: bit for bit, NaN included)."""
    return t.contiguous().view(torch.uint8)


def _fp8_scale(x: torch.Tensor, dtype: torch.dtype, headroom: float) -> torch.Tensor:
    """A layer scale as --calculate-kv-scales would measure it (absmax / the format's max),
    times ``headroom`` (< 1: the largest values saturate)."""
    amax = float(x[~x.isnan()].abs().max())
    return torch.tensor([amax / kv_quant.fp8_max(dtype) * headroom], dtype=torch.float32)


def _paged(
    ctx_lens: list[int], heads: tuple[int, int], head_dim: int, gen: torch.Generator
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """fp32 K and V caches [blocks, BLOCK, kv_heads, head_dim] for sequences of ``ctx_lens``
    in random pages (one spare block), NaN wherever no sequence owns the slot, and the
    block table (int32, -1 past each sequence's pages). Values span many binades (each
    token's rows scaled by 2^U(-8, 2)), so fp8 denormals and int8 row scales vary."""
    kv_heads = heads[1]
    blocks_per_seq = [-(-n // BLOCK) for n in ctx_lens]
    num_blocks = sum(blocks_per_seq) + 1
    perm = torch.randperm(num_blocks, generator=gen).tolist()
    shape = (num_blocks, BLOCK, kv_heads, head_dim)
    caches = [torch.full(shape, float("nan")), torch.full(shape, float("nan"))]
    table = torch.full((len(ctx_lens), max(blocks_per_seq) + 1), -1, dtype=torch.int32)
    for i, (n, nb) in enumerate(zip(ctx_lens, blocks_per_seq, strict=True)):
        ids, perm = perm[:nb], perm[nb:]
        table[i, :nb] = torch.tensor(ids, dtype=torch.int32)
        for cache in caches:
            x = torch.randn(n, kv_heads, head_dim, generator=gen)
            x *= torch.exp2(torch.rand(n, 1, 1, generator=gen) * 10 - 8)
            for j, b in enumerate(ids):
                lo, hi = j * BLOCK, min((j + 1) * BLOCK, n)
                cache[b, : hi - lo] = x[lo:hi]
    return caches[0], caches[1], table


def _quantized(
    kv_cache_dtype: str, k: torch.Tensor, v: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
    """The caches quantized by the reference (NaN slots stay NaN codes / NaN row scales)
    and their fp8 scales (None for int8)."""
    dtype = kv_quant.storage_dtype(kv_cache_dtype, torch.float32)
    k_scale = v_scale = None
    if dtype in kv_quant.FP8_DTYPES:
        k_scale, v_scale = _fp8_scale(k, dtype, 1.0), _fp8_scale(v, dtype, 0.7)
    return (
        kv_quant.quantize(k, dtype, k_scale),
        kv_quant.quantize(v, dtype, v_scale),
        k_scale,
        v_scale,
    )


def _reference(
    query: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    table: torch.Tensor,
    reqs: torch.Tensor,
    ctx: torch.Tensor,
    scale: float,
) -> torch.Tensor:
    """Float64 attention of each query row over its request's first ctx positions."""
    block_size, kv_heads, head_dim = k.shape[1:]
    group = query.shape[1] // kv_heads
    out = torch.empty(query.shape, dtype=torch.float64)
    for i in range(query.shape[0]):
        n = int(ctx[i])
        pages = table[int(reqs[i]), : -(-n // block_size)].long()
        ks = k[pages].reshape(-1, kv_heads, head_dim)[:n].double().repeat_interleave(group, 1)
        vs = v[pages].reshape(-1, kv_heads, head_dim)[:n].double().repeat_interleave(group, 1)
        scores = torch.einsum("hd,khd->hk", query[i].double(), ks) * scale
        out[i] = torch.einsum("hk,khd->hd", scores.softmax(-1), vs)
    return out


def _attend(
    query: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    table: torch.Tensor,
    reqs: torch.Tensor,
    ctx: torch.Tensor,
    scale: float,
    **scales: float,
) -> torch.Tensor:
    out = torch.full_like(query, float("nan"))
    rows = torch.arange(query.shape[0])
    paged_attention_rows(out, query, k_cache, v_cache, table, rows, reqs, ctx, scale, **scales)
    return out


@pytest.mark.parametrize("scale", [1.0, 0.37, 3e-3, 2.0**-20])
@pytest.mark.parametrize("dtype", kv_quant.FP8_DTYPES, ids=["e4m3fn", "e5m2"])
def test_every_fp8_code_reads_as_torch_converts(dtype: torch.dtype, scale: float) -> None:
    """All 256 codes (denormals, +-0, the largest, e5m2's infinities, NaNs) as V of a
    one-position context, whose output is V itself: float(code) * scale bit for bit, as
    ``kv_quant.dequantize`` gives it (-0 comes out +0: the accumulator starts at +0)."""
    codes = torch.arange(256, dtype=torch.int32).to(torch.uint8).view(dtype).view(1, 1, 4, 64)
    k_cache = torch.zeros(1, 1, 4, 64, dtype=dtype)
    query = torch.randn(1, 8, 64)  # GQA 2: both heads of a group read the same row
    one = torch.tensor([1])
    out = _attend(query, k_cache, codes, torch.zeros(1, 1, dtype=torch.int32), one - 1, one,
                  0.125, k_scale=0.5, v_scale=scale)  # fmt: skip
    ref = kv_quant.dequantize(codes, torch.tensor([scale]), torch.float32)[0, 0] + 0.0
    assert torch.equal(_bits(out.view(4, 2, 64)), _bits(ref[:, None].expand(4, 2, 64)))


def test_every_int8_value_reads_as_stored_times_row_scale() -> None:
    """All 256 int8 values (-128 included, which the writer never stores) in rows of
    varied scales, as V of a one-position context: stored * row scale bit for bit."""
    gen = torch.Generator().manual_seed(secrets.randbits(32))
    values = torch.arange(-128, 128, dtype=torch.int32).to(torch.int8).view(4, 64)
    row_scales = torch.tensor([1.0, 3e-5, 0.0123, 7.5]) * torch.rand(4, generator=gen).add(0.5)
    rows = torch.cat([values, row_scales[:, None].view(torch.int8)], dim=-1).view(1, 1, 4, 68)
    k_cache = kv_quant.quantize(torch.randn(1, 1, 4, 64, generator=gen), torch.int8, None)
    query = torch.randn(1, 4, 64, generator=gen)
    one = torch.tensor([1])
    out = _attend(query, k_cache, rows, torch.zeros(1, 1, dtype=torch.int32), one - 1, one, 0.125)
    ref = kv_quant.dequantize(rows, None, torch.float32)[0, 0] + 0.0
    assert torch.equal(_bits(out[0]), _bits(ref))


@pytest.mark.parametrize("query_dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize(
    "heads", [(9, 3), (8, 1), (4, 4), (10, 2)], ids=lambda h: f"{h[0]}q{h[1]}kv"
)
@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("kv_cache_dtype", KV_DTYPES)
def test_attention_over_quantized_cache(
    kv_cache_dtype: str, head_dim: int, heads: tuple[int, int], query_dtype: torch.dtype
) -> None:
    """Decode rows over contexts of every kind of length: the float64 reference over the
    dequantized K/V (fp32 queries: 1e-5 relative; bf16: the output's rounding), and the
    op on an fp32 cache of the dequantized values, bit for bit (bf16: that, rounded)."""
    seed = secrets.randbits(32)
    gen = torch.Generator().manual_seed(seed)
    k, v, table = _paged(CONTEXTS, heads, head_dim, gen)
    kq, vq, k_scale, v_scale = _quantized(kv_cache_dtype, k, v)
    kd = kv_quant.dequantize(kq, k_scale, torch.float32)
    vd = kv_quant.dequantize(vq, v_scale, torch.float32)
    query = torch.randn(len(CONTEXTS), heads[0], head_dim, generator=gen).to(query_dtype)
    reqs, ctx = torch.arange(len(CONTEXTS)), torch.tensor(CONTEXTS)
    scales = {} if k_scale is None else {"k_scale": float(k_scale), "v_scale": float(v_scale)}
    out = _attend(query, kq, vq, table, reqs, ctx, head_dim**-0.5, **scales)
    assert out.dtype == query_dtype and not out.isnan().any(), f"NaN read (seed {seed})"

    ref = _reference(query, kd, vd, table, reqs, ctx, head_dim**-0.5)
    if query_dtype == torch.float32:
        err = float((out.double() - ref).norm() / ref.norm())
        assert err < 1e-5, f"relative error {err:.2e} (seed {seed})"
    else:  # within bf16's rounding of the exact result
        excess = (out.double() - ref).abs() - 2.0**-8 * ref.abs()
        assert float(excess.max()) < 1e-5 * float(ref.abs().max()), f"seed {seed}"

    plain = _attend(query.float(), kd, vd, table, reqs, ctx, head_dim**-0.5)
    assert torch.equal(out, plain.to(query_dtype)), f"differs from the fp32 cache (seed {seed})"


@pytest.mark.parametrize("threads", [3, 8])
@pytest.mark.parametrize("kv_cache_dtype", KV_DTYPES)
def test_few_rows_split_by_position(kv_cache_dtype: str, threads: int) -> None:
    """Fewer rows than threads: each row cut into (KV head, position range) parts merged
    by their softmax maxima; bit-equal to the op on the fp32 cache of the same values."""
    seed = secrets.randbits(32)
    gen = torch.Generator().manual_seed(seed)
    k, v, table = _paged([1000, 70, 5], (9, 3), 64, gen)
    kq, vq, k_scale, v_scale = _quantized(kv_cache_dtype, k, v)
    kd = kv_quant.dequantize(kq, k_scale, torch.float32)
    vd = kv_quant.dequantize(vq, v_scale, torch.float32)
    scales = {} if k_scale is None else {"k_scale": float(k_scale), "v_scale": float(v_scale)}
    query = torch.randn(2, 9, 64, generator=gen)
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        for reqs in ([0], [1], [2], [0, 2]):
            r = torch.tensor(reqs)
            ctx = torch.tensor([1000, 70, 5])[r]
            q = query[: len(reqs)]
            out = _attend(q, kq, vq, table, r, ctx, 0.125, **scales)
            assert torch.equal(out, _attend(q, kd, vd, table, r, ctx, 0.125)), f"seed {seed}"
            ref = _reference(q, kd, vd, table, r, ctx, 0.125)
            assert float((out.double() - ref).norm() / ref.norm()) < 1e-5, f"seed {seed}"
    finally:
        torch.set_num_threads(before)


@pytest.mark.parametrize("src_dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("kv_cache_dtype", KV_DTYPES)
def test_write_kv_cache_quantizes_as_the_reference(
    kv_cache_dtype: str, src_dtype: torch.dtype
) -> None:
    """``write_kv_cache`` against ``kv_quant.write``, byte for byte: random rows over many
    binades, int8 rows whose values fall on .5 after the division (round half to even),
    values fp8 saturates, rows of zeros, NaN rows; slots -1 skipped."""
    seed = secrets.randbits(32)
    gen = torch.Generator().manual_seed(seed)
    tokens, heads, head_dim = 40, 3, 64
    x = torch.randn(2, tokens, heads, head_dim, generator=gen)
    x *= torch.exp2(torch.rand(2, tokens, heads, 1, generator=gen) * 40 - 30)
    ties = torch.arange(head_dim, dtype=torch.float32) - 31.5  # x / (127 / 127) = k + .5
    ties[0] = 127.0
    x[:, 0, 0] = ties
    x[:, 1, 1] = ties * 0.25  # scale 0.25: still exact ties
    x[:, 2] = 0.0
    x[:, 3, 2, 5] = float("nan")
    x[:, 4, 0, :3] = torch.tensor([1e30, -1e30, 3e-40])  # saturate; an fp32 denormal
    key, value = (t.to(src_dtype) for t in x)
    dtype = kv_quant.storage_dtype(kv_cache_dtype, src_dtype)
    k_scale = v_scale = None
    scales: dict[str, float] = {}
    if dtype in kv_quant.FP8_DTYPES:
        k_scale, v_scale = torch.tensor([0.031]), torch.tensor([1.7e-4])
        scales = {"k_scale": float(k_scale), "v_scale": float(v_scale)}
    width = kv_quant.row_width(kv_cache_dtype, head_dim)
    ours = [torch.zeros(8, BLOCK, heads, width, dtype=dtype) for _ in range(2)]
    theirs = [c.clone() for c in ours]
    slots = torch.randperm(8 * BLOCK, generator=gen)[:tokens]
    slots[7] = -1
    write_kv_cache(key, value, *ours, slots, **scales)
    keep = slots >= 0
    kv_quant.write(key[keep], value[keep], *theirs, slots[keep], k_scale, v_scale)
    for a, b in zip(ours, theirs, strict=True):
        assert torch.equal(_bits(a), _bits(b)), f"seed {seed}"


def _q8_0(n: int, k: int, gen: torch.Generator) -> torch.Tensor:
    """A random [n, k] weight as GGUF Q8_0 blocks packed for ``quant_linear``."""
    from gguf import GGMLQuantizationType, quants

    w = (torch.randn(n, k, generator=gen) * 0.1).numpy()
    blocks = torch.from_numpy(quants.quantize(w, GGMLQuantizationType.Q8_0).copy())
    return quant_pack(blocks, QUANT_TYPES["Q8_0"], k)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("kv_cache_dtype", ["auto", *KV_DTYPES])
def test_decode_layers_with_quantized_cache(kv_cache_dtype: str, dtype: torch.dtype) -> None:
    """``decode_layers`` over quantized caches (each layer its own fp8 scales) equals the
    same ops called one by one from Python with ``write_kv_cache`` writing K/V, bit for
    bit, logits and caches; and the rows it writes are ``kv_quant.quantize``'s."""
    seed = secrets.randbits(32)
    gen = torch.Generator().manual_seed(seed)
    layers, hidden, heads, kv_heads, head_dim, inter = 2, 128, 6, 2, 64, 256
    q_size, kv_size = heads * head_dim, kv_heads * head_dim
    qkv_n = q_size + 2 * kv_size
    q8 = QUANT_TYPES["Q8_0"]
    weights: list[torch.Tensor] = []
    for _ in range(layers):
        weights += [1 + 0.1 * torch.randn(hidden, generator=gen), _q8_0(qkv_n, hidden, gen),
                    0.1 * torch.randn(qkv_n, generator=gen), _q8_0(hidden, q_size, gen),
                    1 + 0.1 * torch.randn(hidden, generator=gen), _q8_0(2 * inter, hidden, gen),
                    _q8_0(hidden, inter, gen)]  # fmt: skip
    weights = [w.to(dtype) if w.dtype == torch.float32 else w for w in weights]
    ctx_lens = [17, 33, 5]
    store = kv_quant.storage_dtype(kv_cache_dtype, dtype)
    caches: list[tuple[torch.Tensor, torch.Tensor]] = []
    k_scales: list[float] = []
    v_scales: list[float] = []
    k0, _, table = _paged(ctx_lens, (heads, kv_heads), head_dim, gen)
    for layer in range(layers):  # the same pages, other values
        k, v = (torch.where(k0.isnan(), k0, torch.randn(k0.shape, generator=gen)) for _ in range(2))
        if store in kv_quant.FP8_DTYPES:
            k_scales.append(float(_fp8_scale(k, store, 2.0 + layer)))
            v_scales.append(float(_fp8_scale(v, store, 1.5)))
        ks = torch.tensor(k_scales[-1:]) if k_scales else None
        vs = torch.tensor(v_scales[-1:]) if v_scales else None
        caches.append((kv_quant.quantize(k, store, ks), kv_quant.quantize(v, store, vs)))
    tokens = len(ctx_lens)
    ctx = torch.tensor(ctx_lens)
    pos = ctx - 1  # each request's new token: its last cached position
    slots = table[torch.arange(tokens), pos // BLOCK].long() * BLOCK + pos % BLOCK
    angle = pos[:, None, None].float() * torch.linspace(0.01, 1.0, head_dim // 2)
    cos = torch.cat([angle.cos(), angle.cos()], -1).to(dtype)
    sin = torch.cat([-angle.sin(), angle.sin()], -1).to(dtype)
    x = torch.randn(tokens, hidden, generator=gen).to(dtype)
    eps, scale = 1e-5, head_dim**-0.5
    twin = [(k.clone(), v.clone()) for k, v in caches]

    scale_args = [k_scales, v_scales] if k_scales else []
    fused = torch.ops.actorserve_cpu.decode_layers(
        x, weights, [q8] * 4 * layers, [qkv_n, hidden, 2 * inter, hidden],
        [k for k, _ in caches], [v for _, v in caches], table, slots, ctx, cos, sin,
        heads, kv_heads, eps, scale, *scale_args,
    )  # fmt: skip

    # The same layers op by op.
    h, residual = x, None
    rows = torch.arange(tokens)
    written = []
    for layer in range(layers):
        w = weights[layer * 7 : layer * 7 + 7]
        normed, residual = rms_norm(h, w[0], eps, residual)
        qkv = quant_linear(normed, w[1], q8, qkv_n).add_(w[2])
        qk = qkv[:, : q_size + kv_size].view(tokens, heads + kv_heads, head_dim)
        rotary_embedding_(qk, cos, sin)
        key = qkv[:, q_size : q_size + kv_size].view(tokens, kv_heads, head_dim)
        value = qkv[:, q_size + kv_size :].view(tokens, kv_heads, head_dim)
        written.append((key.clone(), value.clone()))
        fp8 = {"k_scale": k_scales[layer], "v_scale": v_scales[layer]} if k_scales else {}
        write_kv_cache(key, value, *twin[layer], slots, **fp8)
        attn = torch.full((tokens, heads, head_dim), float("nan"), dtype=dtype)
        query = qkv[:, :q_size].view(tokens, heads, head_dim)
        paged_attention_rows(attn, query, *twin[layer], table, rows, rows, ctx, scale, **fp8)
        proj = quant_linear(attn.view(tokens, q_size), w[3], q8, hidden)
        normed, residual = rms_norm(proj, w[4], eps, residual)
        h = quant_linear(silu_and_mul(quant_linear(normed, w[5], q8, 2 * inter)), w[6], q8, hidden)
    assert torch.equal(fused[0], h) and torch.equal(fused[1], residual), f"seed {seed}"
    for layer, ((k, v), (k2, v2)) in enumerate(zip(caches, twin, strict=True)):
        assert torch.equal(_bits(k), _bits(k2)) and torch.equal(_bits(v), _bits(v2)), f"seed {seed}"
        ks = torch.tensor(k_scales[layer : layer + 1]) if k_scales else None
        vs = torch.tensor(v_scales[layer : layer + 1]) if v_scales else None
        key, value = written[layer]
        flat_k, flat_v = k.view(-1, kv_heads, k.shape[-1]), v.view(-1, kv_heads, v.shape[-1])
        assert torch.equal(_bits(flat_k[slots]), _bits(kv_quant.quantize(key, store, ks)))
        assert torch.equal(_bits(flat_v[slots]), _bits(kv_quant.quantize(value, store, vs)))


def test_rejects_bad_quantized_caches() -> None:
    """A cache the op cannot read is a clear error, not a read past a row."""
    query = torch.randn(1, 4, 64)
    out = torch.empty_like(query)
    idx = (
        torch.zeros(1, 1, dtype=torch.int32),
        torch.tensor([0]),
        torch.tensor([0]),
        torch.tensor([1]),
    )
    fp8 = torch.zeros(1, BLOCK, 2, 64, dtype=torch.float8_e4m3fn)
    with pytest.raises(RuntimeError, match="last dim must be 68"):
        int8 = torch.zeros(1, BLOCK, 2, 64, dtype=torch.int8)
        paged_attention_rows(out, query, int8, int8, *idx, 0.1)
    with pytest.raises(RuntimeError, match="differ in dtype"):
        paged_attention_rows(out, query, fp8, fp8.view(torch.float8_e5m2), *idx, 0.1)
    with pytest.raises(RuntimeError, match="k_scale and v_scale must be positive"):
        paged_attention_rows(out, query, fp8, fp8, *idx, 0.1, k_scale=0.0)
    with pytest.raises(RuntimeError, match="fp32, bf16 or fp16 queries"):
        paged_attention_rows(out.double(), query.double(), fp8, fp8, *idx, 0.1)
    with pytest.raises(RuntimeError, match="query's dtype, or be fp8"):
        plain = torch.zeros(1, BLOCK, 2, 64, dtype=torch.bfloat16)
        paged_attention_rows(out, query, plain, plain, *idx, 0.1)
    with pytest.raises(RuntimeError, match="must be contiguous Char"):
        bad = torch.zeros(1, BLOCK, 2, 64, dtype=torch.int8)
        write_kv_cache(torch.randn(1, 2, 64), torch.randn(1, 2, 64), bad, bad, torch.tensor([0]))
