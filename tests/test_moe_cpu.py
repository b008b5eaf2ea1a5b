"""The C++ fused-MoE op (``actorserve_kernels.cpu.fused_moe``) against the torch reference
``actorserve_kernels.moe.fused_experts_ref``: fp32 equal up to accumulation order, bf16
within bf16 tolerance, on fresh random inputs each run (the seed is in every failure)."""

from __future__ import annotations

import secrets

import pytest
import torch

from actorserve_kernels import moe
from actorserve_kernels.cpu import fused_moe, load_cpu_ops

pytestmark = pytest.mark.skipif(not load_cpu_ops(), reason="no C++ compiler to build the op")


def _inputs(
    tokens: int,
    hidden: int,
    inter: int,
    experts: int,
    top_k: int,
    dtype: torch.dtype,
    *,
    skip_expert: int | None = None,
    ids_dtype: torch.dtype = torch.int64,
    seed: int,
) -> tuple[torch.Tensor, ...]:
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(tokens, hidden, generator=gen).to(dtype)
    w13 = (torch.randn(experts, 2 * inter, hidden, generator=gen) / hidden**0.5).to(dtype)
    w2 = (torch.randn(experts, hidden, inter, generator=gen) / inter**0.5).to(dtype)
    logits = torch.randn(tokens, experts, generator=gen)
    if skip_expert is not None:
        logits[:, skip_expert] = -float("inf")
    weights, ids = torch.topk(torch.softmax(logits, dim=-1), top_k, dim=-1)
    weights = weights / weights.sum(dim=-1, keepdim=True)
    return x, w13, w2, weights.float(), ids.to(ids_dtype)


SHAPES = [
    # (tokens, hidden, inter)
    (1, 64, 32),  # decode: every expert streamed
    (3, 128, 48),  # 3 tokens of an expert at most: padded to 4 rows
    (8, 128, 32),  # mixed: some experts streamed, some by at::linear
    (64, 64, 48),  # every expert by at::linear
    (64, 128, 32),
]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(("tokens", "hidden", "inter"), SHAPES)
def test_fused_moe_matches_reference(
    tokens: int, hidden: int, inter: int, dtype: torch.dtype
) -> None:
    seed = secrets.randbits(32)
    args = _inputs(tokens, hidden, inter, 8, 2, dtype, skip_expert=5, seed=seed)
    assert 5 not in args[4].tolist()  # an expert without tokens
    with torch.no_grad():
        ref = moe.fused_experts_ref(*args)
        out = fused_moe(*args)
    assert out.dtype == dtype and out.shape == ref.shape
    if dtype == torch.float32:
        torch.testing.assert_close(
            out, ref, rtol=1e-5, atol=1e-6, msg=lambda m: f"seed {seed}: {m}"
        )
    else:  # the streamed experts keep fp32 intermediates, the reference rounds them to bf16
        torch.testing.assert_close(
            out.float(), ref.float(), rtol=2e-2, atol=2e-2, msg=lambda m: f"seed {seed}: {m}"
        )


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fused_moe_odd_sizes_and_top_k(dtype: torch.dtype) -> None:
    """H and I not multiples of 16 (no streaming: at::linear for every expert), top-4,
    int32 ids, an expert chosen twice for one token."""
    seed = secrets.randbits(32)
    x, w13, w2, weights, ids = _inputs(5, 40, 24, 6, 4, dtype, ids_dtype=torch.int32, seed=seed)
    ids[0, 1] = ids[0, 0]
    with torch.no_grad():
        ref = moe.fused_experts_ref(x, w13, w2, weights, ids)
        out = fused_moe(x, w13, w2, weights, ids)
    tol = {"rtol": 1e-5, "atol": 1e-6} if dtype == torch.float32 else {"rtol": 2e-2, "atol": 2e-2}
    torch.testing.assert_close(out.float(), ref.float(), **tol, msg=lambda m: f"seed {seed}: {m}")


@pytest.mark.parametrize("tokens", [1, 8, 64])
def test_fused_moe_deterministic(tokens: int) -> None:
    args = _inputs(tokens, 128, 48, 8, 2, torch.float32, seed=secrets.randbits(32))
    with torch.no_grad():
        first = fused_moe(*args)
        second = fused_moe(*args)
    assert torch.equal(first, second)


def test_fused_moe_no_tokens() -> None:
    x, w13, w2, weights, ids = _inputs(1, 64, 32, 8, 2, torch.float32, seed=0)
    out = fused_moe(x[:0], w13, w2, weights[:0], ids[:0])
    assert out.shape == (0, 64)


def test_fused_moe_rejects_bad_expert_ids() -> None:
    x, w13, w2, weights, ids = _inputs(2, 64, 32, 8, 2, torch.float32, seed=0)
    ids[1, 0] = 8
    with pytest.raises(RuntimeError, match="out of"):
        fused_moe(x, w13, w2, weights, ids)


def test_fused_experts_routes_to_the_op(monkeypatch: pytest.MonkeyPatch) -> None:
    """``moe.fused_experts`` on a CPU tensor (no grad) calls ``cpu.fused_moe``."""
    from actorserve_kernels import cpu

    calls = []

    def spy(*args: torch.Tensor) -> torch.Tensor:
        calls.append(args)
        return fused_moe(*args)

    monkeypatch.setattr(cpu, "fused_moe", spy)
    args = _inputs(4, 64, 32, 8, 2, torch.float32, seed=secrets.randbits(32))
    with torch.no_grad():
        out = moe.fused_experts(*args)
        ref = moe.fused_experts_ref(*args)
    assert len(calls) == 1
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-6)
