"""The Triton fused-MoE kernels (``actorserve_kernels.fused_moe_triton``) against
``moe.fused_experts_ref``.

Without a GPU they run in Triton's interpreter (see tests/test_kernels.py), on fresh random
inputs each run (the seed is printed); the whole file takes 5-20 s. The shapes are
small and awkward on purpose: I (32-48) not a multiple of the tiles, experts that no token
picks, one token, k = 1 and 2, fewer pairs than experts.

Tolerances. Outputs where the experts' contributions cancel are small, and every error
bound below is taken relative to the largest output ``M = max |exact|`` rather than
element by element (an element near zero can be many of its own ulp off, in torch's bf16
reference too):

* fp32 (ieee dots): within ``1e-5 * |ref| + 2e-6 * M`` of ``fused_experts_ref`` (they
  differ only in fp32 summation order; seen: under ``2e-7 * M`` beyond ``1e-5 * |ref|``).
* bf16/fp16: within ``2 eps * M`` of the exact result (the reference on fp64 copies of
  the same inputs; ``eps`` = 2^-7 for bf16, 2^-10 for fp16: about 2 ulp of the largest
  output), seen up to 1.1 eps * M; torch's bf16/fp16 reference is as far (up to 1.25 eps
  * M). The kernel's mean error is also at most 1.5x that of torch's reference in the same
  dtype (seen 0.84-1.03x: both round ``gate_up``, ``act`` and the experts' outputs, the
  kernel ``silu(gate) * up`` once where torch rounds twice).
"""

from __future__ import annotations

import secrets
from collections.abc import Iterator

import pytest
import torch

import actorserve_kernels  # noqa: F401  (turns the interpreter on for CPU-only hosts)
from actorserve_kernels import fused_moe_triton as fmt
from actorserve_kernels.fused_moe_triton import default_config, fused_moe, moe_align_block_size
from actorserve_kernels.moe import fused_experts_ref

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
EPS = {dt: torch.finfo(dt).eps for dt in (torch.bfloat16, torch.float16)}
# A multi-tile config: 64-row blocks, GROUP_M swizzle, several (partial) K slices.
BIG = {"BLOCK_M": 64, "BLOCK_N": 128, "BLOCK_K": 16, "GROUP_M": 8}
SMALL_K = {"BLOCK_K": 16}


@pytest.fixture
def gen() -> torch.Generator:
    seed = secrets.randbits(32)
    print(f"seed {seed}")  # shown when the test fails
    return torch.Generator().manual_seed(seed)


def make_inputs(
    gen: torch.Generator,
    dtype: torch.dtype,
    tokens: int,
    hidden: int,
    inter: int,
    experts: int,
    top_k: int,
    unused: tuple[int, ...] = (),
):
    """Random activations, weights scaled to keep outputs O(1), and a softmax-top-k router
    that never picks the experts in ``unused``."""
    x = torch.randn(tokens, hidden, generator=gen)
    w13 = torch.randn(experts, 2 * inter, hidden, generator=gen) / hidden**0.5
    w2 = torch.randn(experts, hidden, inter, generator=gen) / inter**0.5
    logits = torch.randn(tokens, experts, generator=gen)
    logits[:, list(unused)] = float("-inf")
    weights, ids = torch.softmax(logits, dim=-1).topk(top_k, dim=-1)
    return (
        x.to(dtype).to(DEVICE),
        w13.to(dtype).to(DEVICE),
        w2.to(dtype).to(DEVICE),
        weights.to(DEVICE),
        ids.to(DEVICE),
    )


# ---------------------------------------------------------------- moe_align_block_size


@pytest.mark.parametrize("drop", [False, True], ids=["all_local", "drop"])
@pytest.mark.parametrize("block_m", [16, 64])
@pytest.mark.parametrize(
    ("tokens", "top_k", "experts"),
    [
        (20, 2, 8),
        (1, 2, 8),  # fewer pairs than experts
        (3, 1, 4),
        (17, 2, 4),
        (0, 2, 4),
        (150, 2, 8),  # 300 pairs: two steps of the Triton kernel's 256
        (20, 8, 128),  # Qwen3-MoE's routing: 160 pairs, three steps of 64
        (5, 8, 256),  # DeepSeek-V3's: tails written 32 rows at a time
    ],
)
def test_align(
    gen: torch.Generator, block_m: int, tokens: int, top_k: int, experts: int, drop: bool
) -> None:
    """Both methods, the same result, and it is the one the docstring describes. ``drop``:
    about half the pairs have id -1 (another rank's expert, expert parallelism) and, when
    there are several tokens, all of the first token's: they are left out."""
    # Distinct experts per token; expert experts - 1 is never picked.
    per_token = [torch.randperm(experts - 1, generator=gen)[:top_k] for _ in range(tokens)]
    ids = torch.stack(per_token) if per_token else torch.empty(0, top_k, dtype=torch.int64)
    if drop:
        ids[torch.rand(ids.shape, generator=gen) < 0.5] = -1
        if tokens > 1:
            ids[0] = -1
    by_torch = moe_align_block_size(ids.to(DEVICE), block_m, experts, method="torch")
    # int32 ids, as some routers give them.
    by_triton = moe_align_block_size(ids.int().to(DEVICE), block_m, experts, method="triton")
    for a, b in zip(by_torch, by_triton, strict=True):
        assert a.dtype == b.dtype == torch.int32
        assert a.tolist() == b.tolist()
    sorted_ids, expert_ids, num_post = (t.cpu() for t in by_triton)
    num_pairs = tokens * top_k
    flat = ids.flatten()
    counts = torch.bincount(flat[flat >= 0], minlength=experts)
    padded = (counts + block_m - 1) // block_m * block_m
    total = int(padded.sum())
    assert num_post.tolist() == [total]
    assert sorted_ids.numel() == expert_ids.numel() * block_m
    assert sorted_ids.numel() == fmt._max_padded_rows(num_pairs, experts, block_m)
    # Every kept pair exactly once, in its expert's blocks, in token order; padding =
    # num_pairs.
    valid = sorted_ids[:total][sorted_ids[:total] < num_pairs]
    assert sorted(valid.tolist()) == torch.nonzero(flat >= 0).flatten().tolist()
    assert (sorted_ids[total:] == num_pairs).all()
    block_of = torch.arange(total) // block_m
    expected_experts = torch.repeat_interleave(torch.arange(experts), padded // block_m)
    assert expert_ids[: total // block_m].tolist() == expected_experts.tolist()
    assert (expert_ids[total // block_m :] == -1).all()
    for e in range(experts):
        rows = sorted_ids[:total][expert_ids[block_of] == e]
        pairs = rows[rows < num_pairs]
        assert pairs.tolist() == torch.nonzero(flat == e).flatten().tolist()
        assert rows.numel() == int(padded[e])


def test_align_auto_method() -> None:
    assert fmt.TRITON_ALIGN_MAX_PAIRS >= 512  # decode batches take the one-launch kernel
    ids = torch.arange(2 * (fmt.TRITON_ALIGN_MAX_PAIRS + 1)).reshape(-1, 2) % 8
    auto = moe_align_block_size(ids.to(DEVICE), 16, 8)  # past the limit: torch
    forced = moe_align_block_size(ids.to(DEVICE), 16, 8, method="triton")
    assert all(a.tolist() == b.tolist() for a, b in zip(auto, forced, strict=True))
    with pytest.raises(ValueError, match="method"):
        moe_align_block_size(ids, 16, 8, method="cuda")


# ---------------------------------------------------------------- the grouped GEMM alone


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("mul_routed_weight", [False, True])
def test_grouped_gemm_writes_every_row(
    gen: torch.Generator, dtype: torch.dtype, mul_routed_weight: bool
) -> None:
    """Each pair's row of ``A`` (row ``p // k``, or ``p``) times its expert's ``B``, into a
    NaN-poisoned output: every pair's row written, a block of expert -1 (another rank's,
    with expert parallelism) written as zeros."""
    tokens, top_k, experts, n, k = 9, 2, 4, 40, 48
    x, _, _, weights, ids = make_inputs(gen, dtype, tokens, k, 8, experts, top_k)
    a = x if not mul_routed_weight else torch.randn(tokens * top_k, k, generator=gen).to(x)
    b = torch.randn(experts, n, k, generator=gen).to(x)
    cfg = default_config(tokens, top_k, experts, dtype) | SMALL_K
    sorted_ids, expert_ids, num_post = moe_align_block_size(ids, cfg["BLOCK_M"], experts)
    dropped = int(expert_ids[0])
    expert_ids[0] = -1
    c = torch.full((tokens * top_k, n), float("nan"), dtype=dtype, device=DEVICE)
    flat_w = weights.reshape(-1).contiguous()
    gather_k = 1 if mul_routed_weight else top_k
    fmt._grouped_gemm(a, b, c, flat_w, sorted_ids, expert_ids, num_post, gather_k,
                      mul_routed_weight, cfg)  # fmt: skip
    flat_ids = ids.reshape(-1)
    for p in range(tokens * top_k):
        e = int(flat_ids[p])
        if e == dropped and p in sorted_ids[: cfg["BLOCK_M"]].tolist():
            assert (c[p] == 0).all()
            continue
        expected = a[p // gather_k].double() @ b[e].double().T
        if mul_routed_weight:
            expected = expected * float(flat_w[p])
        tol = 1e-5 if dtype == torch.float32 else EPS[dtype]
        torch.testing.assert_close(c[p].double(), expected, rtol=tol, atol=tol)


# ---------------------------------------------------------------- fused_moe


SHAPES = [
    # tokens, hidden, inter, experts, top_k, unused experts
    (20, 64, 48, 8, 2, (3, 6)),
    (1, 64, 32, 8, 2, ()),  # decode: 2 pairs, 8 experts
    (7, 64, 40, 4, 1, (0,)),  # k = 1: the buffer is the output
    (13, 64, 36, 6, 2, (5,)),
]


@pytest.mark.parametrize("config", [None, SMALL_K, BIG], ids=["default", "small_k", "big"])
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "T{}_H{}_I{}_E{}_k{}".format(*s[:5]))
def test_fused_moe_fp32(gen: torch.Generator, shape: tuple, config: dict | None) -> None:
    tokens, hidden, inter, experts, top_k, unused = shape
    x, w13, w2, weights, ids = make_inputs(gen, torch.float32, *shape[:5], unused=unused)
    out = fused_moe(x, w13, w2, weights, ids, config=config)
    ref = fused_experts_ref(x, w13, w2, weights, ids)
    assert out.shape == ref.shape and out.dtype == torch.float32
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=2e-6 * float(ref.abs().max()))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("config", [None, BIG], ids=["default", "big"])
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "T{}_H{}_I{}_E{}_k{}".format(*s[:5]))
def test_fused_moe_16bit(
    gen: torch.Generator, dtype: torch.dtype, shape: tuple, config: dict | None
) -> None:
    tokens, hidden, inter, experts, top_k, unused = shape
    x, w13, w2, weights, ids = make_inputs(gen, dtype, *shape[:5], unused=unused)
    out = fused_moe(x, w13, w2, weights, ids, config=config)
    assert out.shape == (tokens, hidden) and out.dtype == dtype
    exact = fused_experts_ref(x.double(), w13.double(), w2.double(), weights.double(), ids)
    scale = float(exact.abs().max())
    err = (out.double() - exact).abs()
    assert float(err.max()) <= 2 * EPS[dtype] * scale, f"{float(err.max()) / scale} of max"
    if tokens >= 13:  # enough values for a stable mean
        torch_err = (fused_experts_ref(x, w13, w2, weights, ids).double() - exact).abs()
        assert float(err.mean()) <= 1.5 * float(torch_err.mean())


def test_fused_moe_strided_rows_int32_ids(gen: torch.Generator) -> None:
    """``hidden`` as a view of wider rows, int32 ids, fp16 routing weights."""
    x, w13, w2, weights, ids = make_inputs(gen, torch.float32, 11, 64, 48, 8, 2, unused=(1,))
    wide = torch.randn(11, 100, generator=gen).to(DEVICE)
    wide[:, 20:84] = x
    view = wide[:, 20:84]
    out = fused_moe(view, w13, w2, weights.half(), ids.int())
    ref = fused_experts_ref(x, w13, w2, weights.half().float(), ids)
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=2e-6 * float(ref.abs().max()))


def test_fused_moe_no_tokens() -> None:
    x = torch.empty(0, 64, device=DEVICE)
    w13 = torch.zeros(4, 64, 64, device=DEVICE)
    w2 = torch.zeros(4, 64, 32, device=DEVICE)
    ids = torch.empty(0, 2, dtype=torch.int64, device=DEVICE)
    out = fused_moe(x, w13, w2, torch.empty(0, 2, device=DEVICE), ids)
    assert out.shape == (0, 64)


def test_fused_moe_rejects_bad_inputs(gen: torch.Generator) -> None:
    x, w13, w2, weights, ids = make_inputs(gen, torch.float32, 3, 64, 32, 4, 2)
    with pytest.raises(ValueError, match="do not match"):
        fused_moe(x, w13[:, :-1], w2, weights, ids)
    with pytest.raises(ValueError, match="differ"):
        fused_moe(x, w13.half(), w2.half(), weights, ids)
    with pytest.raises(ValueError, match="integers"):
        fused_moe(x, w13, w2, weights, ids.float())
    with pytest.raises(ValueError, match="contiguous"):
        fused_moe(x.T.contiguous().T, w13, w2, weights, ids)


def test_default_config() -> None:
    decode = default_config(8, 8, 128, torch.bfloat16)
    prefill = default_config(4096, 8, 128, torch.bfloat16)
    assert decode["BLOCK_M"] == 16 and prefill["BLOCK_M"] == 64
    for cfg in (decode, prefill, default_config(4096, 8, 128, torch.float32)):
        assert min(cfg["BLOCK_M"], cfg["BLOCK_N"], cfg["BLOCK_K"]) >= 16  # tl.dot, compiled


@pytest.mark.skipif(DEVICE.type != "cuda", reason="moe.fused_experts uses Triton on CUDA only")
def test_fused_experts_dispatches_to_triton(gen: torch.Generator) -> None:
    from actorserve_kernels.moe import fused_experts

    x, w13, w2, weights, ids = make_inputs(gen, torch.bfloat16, 20, 64, 48, 8, 2)
    torch.testing.assert_close(
        fused_experts(x, w13, w2, weights, ids), fused_moe(x, w13, w2, weights, ids)
    )


# ---------------------------------------------------------------- expert parallelism


@pytest.fixture
def poison_empty() -> Iterator[None]:
    """``torch.empty`` filled with NaN (torch's deterministic mode fills uninitialized
    memory): a row of a buffer that is read but was never written shows in the result."""
    enabled = torch.are_deterministic_algorithms_enabled()
    warn_only = torch.is_deterministic_algorithms_warn_only_enabled()
    torch.use_deterministic_algorithms(True, warn_only=True)
    yield
    torch.use_deterministic_algorithms(enabled, warn_only=warn_only)


def ep_map(experts: int, local: list[int]) -> torch.Tensor:
    """An ``expert_map``: global id -> its index among ``local`` (in order), else -1."""
    expert_map = torch.full((experts,), -1, dtype=torch.int32)
    expert_map[local] = torch.arange(len(local), dtype=torch.int32)
    return expert_map.to(DEVICE)


# scenario -> this rank's experts (of 8)
EP_SCENARIOS = {
    "half": [0, 1, 2, 3],  # rank 0 of EP=2
    "round_robin": [1, 3, 5, 7],  # odd experts, local index e // 2
    "token_all_remote": [4, 5, 6, 7],  # token 0 routed to remote experts only
    "none_local": [4, 5, 6, 7],  # no token picks a local expert (router skips 4-7)
}


def ep_inputs(gen: torch.Generator, dtype: torch.dtype, tokens: int, scenario: str):
    """Full-model inputs (8 experts, top-2, H 64, I 48) for an expert-map scenario, and
    this rank's experts."""
    local = EP_SCENARIOS[scenario]
    unused = tuple(local) if scenario == "none_local" else ()
    x, w13, w2, weights, ids = make_inputs(gen, dtype, tokens, 64, 48, 8, 2, unused=unused)
    if scenario == "token_all_remote":
        ids[0] = torch.tensor([2, 0])
    return (x, w13, w2, weights, ids), local


def ep_exact(x, w13, w2, weights, ids, local: list[int], dtype: torch.dtype) -> torch.Tensor:
    """This rank's share computed independently of any expert map: the reference on the
    full weights with the routing weights of remote pairs zeroed (fp64 copies for 16-bit
    dtypes: the exact result)."""
    masked = weights * torch.isin(ids, torch.tensor(local, device=ids.device))
    if dtype == torch.float32:
        return fused_experts_ref(x, w13, w2, masked, ids)
    return fused_experts_ref(x.double(), w13.double(), w2.double(), masked.double(), ids)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("tokens", [1, 4, 64])  # decode, prefill
@pytest.mark.parametrize("scenario", list(EP_SCENARIOS))
@pytest.mark.usefixtures("poison_empty")
def test_fused_moe_expert_map(
    gen: torch.Generator, dtype: torch.dtype, tokens: int, scenario: str
) -> None:
    """``expert_map`` with this rank's experts' weights: the sum over the local experts'
    pairs only (the same bounds as above), zeros for a token with no local pair, on
    outputs poisoned in advance (the buffers' rows of dropped pairs are never written)."""
    (x, w13, w2, weights, ids), local = ep_inputs(gen, dtype, tokens, scenario)
    expert_map = ep_map(8, local)
    out = fused_moe(x, w13[local], w2[local], weights, ids, expert_map=expert_map)
    exact = ep_exact(x, w13, w2, weights, ids, local, dtype)
    assert out.shape == (tokens, 64) and out.dtype == dtype
    if scenario == "none_local":
        assert torch.equal(out, torch.zeros_like(out))
        return
    if scenario == "token_all_remote":
        assert torch.equal(out[0], torch.zeros_like(out[0]))
    scale = float(exact.abs().max())
    if dtype == torch.float32:
        torch.testing.assert_close(out, exact, rtol=1e-5, atol=2e-6 * scale)
    else:
        err = float((out.double() - exact).abs().max())
        assert err <= 2 * EPS[dtype] * scale, f"{err / scale} of max"
    # The reference with the same map and weights agrees.
    ref = fused_experts_ref(x, w13[local], w2[local], weights, ids, expert_map=expert_map)
    tol = 1e-5 if dtype == torch.float32 else 2 * EPS[dtype]
    torch.testing.assert_close(out.double(), ref.double(), rtol=tol, atol=tol * scale)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.usefixtures("poison_empty")
def test_fused_moe_expert_map_all_remote(gen: torch.Generator, dtype: torch.dtype) -> None:
    """No pair local at all (the map all -1): zeros, whatever the buffers held; k = 2, and
    k = 1 (where the buffer would otherwise be the output) with the multi-tile config."""
    for top_k, config in ((2, None), (1, BIG)):
        x, w13, w2, weights, ids = make_inputs(gen, dtype, 6, 64, 32, 8, top_k)
        none = torch.full((8,), -1, dtype=torch.int32, device=DEVICE)
        out = fused_moe(x, w13[:2], w2[:2], weights, ids, expert_map=none, config=config)
        assert torch.equal(out, torch.zeros_like(out))


@pytest.mark.parametrize("align", ["triton", "torch"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("tokens", [3, 64])
@pytest.mark.usefixtures("poison_empty")
def test_fused_moe_expert_map_shares_sum_to_the_whole(
    gen: torch.Generator,
    monkeypatch: pytest.MonkeyPatch,
    dtype: torch.dtype,
    tokens: int,
    align: str,
) -> None:
    """EP=2: ranks 0 and 1, each with its half of w13/w2 (top-2 with the default config,
    top-1 with the multi-tile one; either alignment method); their shares add up to the
    result on every expert."""
    if align == "torch":
        monkeypatch.setattr(fmt, "TRITON_ALIGN_MAX_PAIRS", 0)
    for top_k, config in ((2, None), (1, BIG)):
        x, w13, w2, weights, ids = make_inputs(gen, dtype, tokens, 64, 48, 8, top_k)
        whole = fused_moe(x, w13, w2, weights, ids)
        shares = [
            fused_moe(
                x,
                w13[lo:hi],
                w2[lo:hi],
                weights,
                ids,
                config=config,
                expert_map=ep_map(8, list(range(lo, hi))),
            )
            for lo, hi in ((0, 4), (4, 8))
        ]
        total = shares[0].double() + shares[1].double()
        scale = float(whole.abs().max())
        tol = 1e-5 if dtype == torch.float32 else 2 * EPS[dtype]
        torch.testing.assert_close(total, whole.double(), rtol=tol, atol=tol * scale)


def test_fused_moe_rejects_bad_expert_map(gen: torch.Generator) -> None:
    x, w13, w2, weights, ids = make_inputs(gen, torch.float32, 3, 64, 32, 4, 2)
    with pytest.raises(ValueError, match="expert_map"):
        fused_moe(x, w13, w2, weights, ids, expert_map=torch.zeros(4, device=DEVICE))
    with pytest.raises(ValueError, match="expert_map"):
        fused_moe(x, w13, w2, weights, ids, expert_map=torch.zeros(2, 2, dtype=torch.int32))


@pytest.mark.skipif(DEVICE.type != "cuda", reason="moe.fused_experts uses Triton on CUDA only")
def test_fused_experts_dispatches_expert_map_to_triton(gen: torch.Generator) -> None:
    from actorserve_kernels.moe import fused_experts

    x, w13, w2, weights, ids = make_inputs(gen, torch.bfloat16, 20, 64, 48, 8, 2)
    expert_map = ep_map(8, [4, 5, 6, 7])
    torch.testing.assert_close(
        fused_experts(x, w13[4:], w2[4:], weights, ids, expert_map=expert_map),
        fused_moe(x, w13[4:], w2[4:], weights, ids, expert_map=expert_map),
    )
