"""The C++ fused-MoE op (``actorserve_kernels.cpu.fused_moe``) against the torch reference
``actorserve_kernels.moe.fused_experts_ref``: fp32 equal up to accumulation order, bf16
within bf16 tolerance, on fresh random inputs each run (the seed is in every failure)."""

from __future__ import annotations

import secrets
from collections.abc import Iterator

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


def _ep_map(experts: int, local: list[int]) -> torch.Tensor:
    """An ``expert_map``: global id -> its index among ``local`` (in order), else -1."""
    expert_map = torch.full((experts,), -1, dtype=torch.int32)
    expert_map[local] = torch.arange(len(local), dtype=torch.int32)
    return expert_map


# scenario -> this rank's experts (of 8)
EP_SCENARIOS = {
    "half": [0, 1, 2, 3],  # rank 0 of EP=2
    "round_robin": [1, 3, 5, 7],  # odd experts, local index e // 2
    "token_all_remote": [4, 5, 6, 7],  # token 0 routed to remote experts only
    "none_local": [0, 1, 2, 3],  # every token routed to experts 4-7
}


def _ep_share_ref(
    x: torch.Tensor,
    w13: torch.Tensor,
    w2: torch.Tensor,
    weights: torch.Tensor,
    ids: torch.Tensor,
    local: list[int],
) -> torch.Tensor:
    """This rank's share computed independently of any expert map: the reference on the
    full weights with the routing weights of remote pairs zeroed."""
    is_local = torch.isin(ids.long(), torch.tensor(local))
    return moe.fused_experts_ref(x, w13, w2, weights * is_local, ids)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("tokens", [1, 3, 64])  # decode (streamed), prefill (at::linear)
@pytest.mark.parametrize("scenario", list(EP_SCENARIOS))
@pytest.mark.usefixtures("poison_empty")
def test_fused_moe_expert_map(tokens: int, dtype: torch.dtype, scenario: str) -> None:
    """``moe.fused_experts`` with an ``expert_map`` and this rank's experts' weights: the
    sum over the local experts' pairs only, zeros for tokens with no local pair."""
    seed = secrets.randbits(32)
    local = EP_SCENARIOS[scenario]
    x, w13, w2, weights, ids = _inputs(tokens, 128, 48, 8, 2, dtype, seed=seed)
    if scenario == "none_local":
        gen = torch.Generator().manual_seed(seed)
        ids = torch.stack([torch.randperm(4, generator=gen)[:2] + 4 for _ in range(tokens)])
    if scenario == "token_all_remote":
        ids[0] = torch.tensor([2, 0])
    expert_map = _ep_map(8, local)
    ref = _ep_share_ref(x, w13, w2, weights, ids, local)
    with torch.no_grad():
        out = moe.fused_experts(x, w13[local], w2[local], weights, ids, expert_map=expert_map)
        ref_mapped = moe.fused_experts_ref(
            x, w13[local], w2[local], weights, ids, expert_map=expert_map
        )
    assert out.dtype == dtype and out.shape == ref.shape
    if scenario == "none_local":
        assert torch.equal(out, torch.zeros_like(out))
    if scenario == "token_all_remote":
        assert torch.equal(out[0], torch.zeros_like(out[0]))
    tol = {"rtol": 1e-5, "atol": 1e-6} if dtype == torch.float32 else {"rtol": 2e-2, "atol": 2e-2}
    torch.testing.assert_close(out.float(), ref.float(), **tol, msg=lambda m: f"seed {seed}: {m}")
    torch.testing.assert_close(
        ref_mapped.float(), ref.float(), **tol, msg=lambda m: f"seed {seed}: reference: {m}"
    )


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("tokens", [2, 64])
def test_fused_moe_expert_map_shares_sum_to_the_whole(tokens: int, dtype: torch.dtype) -> None:
    """EP=2: ranks 0 and 1, each with its half of w13/w2; their shares add up to the
    result on every expert."""
    seed = secrets.randbits(32)
    x, w13, w2, weights, ids = _inputs(tokens, 128, 48, 8, 2, dtype, seed=seed)
    with torch.no_grad():
        whole = moe.fused_experts(x, w13, w2, weights, ids)
        shares = [
            moe.fused_experts(
                x, w13[lo:hi], w2[lo:hi], weights, ids, expert_map=_ep_map(8, list(range(lo, hi)))
            )
            for lo, hi in ((0, 4), (4, 8))
        ]
    tol = {"rtol": 1e-5, "atol": 1e-6} if dtype == torch.float32 else {"rtol": 2e-2, "atol": 2e-2}
    torch.testing.assert_close(
        (shares[0].float() + shares[1].float()),
        whole.float(),
        **tol,
        msg=lambda m: f"seed {seed}: {m}",
    )


@pytest.mark.usefixtures("poison_empty")
def test_fused_moe_op_skips_ids_of_minus_one() -> None:
    """The op itself: ids of -1 left out (int32 ids, an odd size: no streaming), all -1
    gives zeros, and it stays deterministic; ids below -1 are rejected."""
    seed = secrets.randbits(32)
    x, w13, w2, weights, ids = _inputs(
        5, 40, 24, 6, 4, torch.float32, ids_dtype=torch.int32, seed=seed
    )
    ids[1, 2] = -1
    ids[3] = -1
    with torch.no_grad():
        out = fused_moe(x, w13, w2, weights, ids)
        ref = moe.fused_experts_ref(x, w13, w2, weights * (ids >= 0), ids.clamp(min=0))
        assert torch.equal(out, fused_moe(x, w13, w2, weights, ids))
        none = fused_moe(x, w13, w2, weights, torch.full_like(ids, -1))
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-6, msg=lambda m: f"seed {seed}: {m}")
    assert torch.equal(out[3], torch.zeros_like(out[3]))
    assert torch.equal(none, torch.zeros_like(none))
    ids[0, 0] = -2
    with pytest.raises(RuntimeError, match="out of"):
        fused_moe(x, w13, w2, weights, ids)


def test_fused_experts_maps_ids_for_the_op(monkeypatch: pytest.MonkeyPatch) -> None:
    """With an ``expert_map`` the op gets ``expert_map[topk_ids]``; a float map is refused."""
    from actorserve_kernels import cpu

    calls = []

    def spy(*args: torch.Tensor) -> torch.Tensor:
        calls.append(args)
        return fused_moe(*args)

    monkeypatch.setattr(cpu, "fused_moe", spy)
    x, w13, w2, weights, ids = _inputs(4, 64, 32, 8, 2, torch.float32, seed=secrets.randbits(32))
    expert_map = _ep_map(8, [4, 5, 6, 7])
    with torch.no_grad():
        moe.fused_experts(x, w13[4:], w2[4:], weights, ids, expert_map=expert_map)
    assert len(calls) == 1
    assert calls[0][4].tolist() == expert_map[ids].tolist()
    with pytest.raises(ValueError, match="expert_map"):
        moe.fused_experts(x, w13[4:], w2[4:], weights, ids, expert_map=expert_map.float())
