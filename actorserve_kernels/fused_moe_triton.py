"""Fused mixture-of-experts on GPUs: a grouped GEMM over the (token, expert) pairs sorted by
expert, as vLLM's ``fused_moe`` does. ``actorserve_kernels.moe`` dispatches to ``fused_moe``
on CUDA and defines the math (``fused_experts_ref``). The file stays whole: its kernels are
one pipeline (align, GEMM, activation, GEMM, sum) whose buffers and block sizes agree.

Steps, for ``hidden`` [T, H], ``w13`` [E, 2I, H] (gate rows then up rows), ``w2`` [E, H, I]
and the router's ``topk_ids`` / ``topk_weights`` [T, k]:

1. ``moe_align_block_size``: the ``T * k`` pairs, numbered ``t * k + j``, are sorted by
   expert (stably, so each expert's pairs keep token order) and each expert's segment is
   padded to a multiple of ``BLOCK_M`` with the sentinel ``T * k``. It returns the sorted
   pair ids, the expert of every ``BLOCK_M`` block and the padded length (on the device).
   Up to ``TRITON_ALIGN_MAX_PAIRS`` pairs (decode) one Triton program does it in one launch
   (a histogram, a scan of the padded counts, then each pair's rank among its expert's by a
   scan of one-hot rows); larger batches use torch ops (scatter-add, cumsum, a stable
   argsort, searchsorted), ~25 small kernels but a parallel sort. Both give the same
   result, neither syncs with the host, and every shape depends only on ``T * k``, ``E``
   and ``BLOCK_M`` (the GEMM grid is sized for the worst padding,
   ``T * k + min(E, T * k) * (BLOCK_M - 1)`` rows; programs past the real padded length
   return at once), so the whole layer should capture in a CUDA graph (not yet tried on a
   GPU).
2. ``_fused_moe_kernel`` with ``A = hidden`` (pair ``p`` reads row ``p // k``) and
   ``B = w13[e]``: ``gate_up`` [T * k, 2I]. One program computes one ``BLOCK_M`` block of
   sorted pairs (all of one expert) times ``BLOCK_N`` output columns, gathering its rows of
   ``A`` by the sorted ids, accumulating in fp32 over ``BLOCK_K`` slices of ``H``, and
   scattering the rounded rows back to their pair ids. Programs are ordered in groups of
   ``GROUP_M`` blocks (vLLM's swizzle) so that neighbouring programs share ``B`` tiles in L2.
3. ``fused.silu_and_mul``: ``act`` [T * k, I] (fp32 math, rounded once).
4. The same kernel with ``A = act`` (pair ``p`` reads row ``p``), ``B = w2[e]`` and
   ``MUL_ROUTED_WEIGHT``: each fp32 row times its routing weight, rounded to the hidden
   dtype into a [T, k, H] buffer.
5. The ``k`` rows of each token summed (torch; CUDA accumulates a bf16/fp16 sum in fp32 and
   rounds once). With ``k == 1`` the buffer is the output.

Expert parallelism. With an ``expert_map`` (``moe`` module doc: int32 [E_global], global id
-> local index or -1; ``w13``/``w2`` hold the local experts) the ids are mapped by one gather
and ``moe_align_block_size`` drops the pairs of id -1, as vLLM's does: they are in no block,
so neither GEMM computes or writes their rows, and the grid and padding count local pairs
only. Their rows of the [T, k, H] buffer are therefore never written, and step 5 is
``_moe_sum_kernel`` instead of torch's sum: each token's rows of local pairs summed in fp32
(in order of j, as torch's sum), unwritten rows skipped (not even read), rounded once; a
token with no local pair gets zeros. No extra pass over the buffer (no zero fill), no host
sync.

Numerics. GEMMs accumulate in fp32; fp32 inputs use ``input_precision="ieee"`` (Triton's
default for fp32 on GPUs is tf32), so fp32 results equal the reference to fp32 summation
order (the tests: within 1e-5 relative plus 2e-6 of the largest output). In bf16/fp16 the intermediates are rounded where vLLM
rounds them (``gate_up``, ``act``, each weighted expert output, the sum); the reference
rounds at the same places except that it rounds ``silu(gate)`` before ``* up`` and rounds
each expert output before weighting it, so both are a few ulp from the exact result and
from each other (tests/test_fused_moe_triton.py gives the bounds it checks).

Interpreter. As ``attention`` explains: builtins only (``tl.full``, no ``tl.zeros`` or
``tl.cdiv``; sums and prefix sums by ``tl.reduce`` / ``tl.associative_scan`` with
``_add_combine``, which the interpreter runs as numpy sum / cumsum); bf16 tiles are upcast to fp32 before ``tl.dot`` when interpreting (the
interpreter multiplies bf16 as raw integers) and bf16 outputs are rounded by hand
(``_round_bf16``; the interpreter truncates).

Block sizes (``default_config``) are untuned guesses for an H200: ``BLOCK_M`` 16 while
experts get few tokens each on average (decode), else 64; ``BLOCK_N`` 64/128, ``BLOCK_K``
64. bench/gpu_check.py is where to tune them (vLLM keeps per-shape JSON tables).

Not here yet: quantized weights, chunking very large batches (the [T, k, H] buffer is the
largest temporary). (The GEMM kernel still writes zeros for a block of expert -1, the way
older vLLM marked other ranks' experts after aligning by global id; the expert map path does
not make such blocks.)
"""

from __future__ import annotations

from typing import Any

import torch
import triton
import triton.language as tl

from actorserve_kernels.attention import _INTERPRETING, _add_combine, _round_bf16
from actorserve_kernels.fused import _FLOAT_TYPES, _round_by_hand, silu_and_mul

__all__ = ["default_config", "fused_moe", "moe_align_block_size"]


# ---------------------------------------------------------------- alignment


def _max_padded_rows(num_pairs: int, num_experts: int, block_m: int) -> int:
    """An upper bound on the padded length, a multiple of ``block_m``: each expert that has
    pairs adds at most ``block_m - 1`` padding rows, and at most ``num_pairs`` experts do."""
    bound = num_pairs + min(num_experts, num_pairs) * (block_m - 1)
    return (bound + block_m - 1) // block_m * block_m


@triton.jit
def _moe_align_kernel(
    topk_ids_ptr,  # [T * k] int32/int64
    sorted_ids_ptr,  # [R] int32
    expert_ids_ptr,  # [R // BLOCK_M] int32
    num_tokens_post_padded_ptr,  # [1] int32
    num_pairs,  # T * k
    num_rows,  # R
    BLOCK_M: tl.constexpr,
    E_PAD: tl.constexpr,  # next power of two >= E
    CHUNK: tl.constexpr,  # pairs (and blocks) per step: [CHUNK, E_PAD] tiles
    FILL: tl.constexpr,  # rows per step of the sentinel writes past the end
    TAIL: tl.constexpr,  # tail rows per step: [E_PAD, TAIL] tiles
):
    """One program: counts per expert, padded offsets, then every pair's destination."""
    experts = tl.arange(0, E_PAD)
    counts = tl.full([E_PAD], 0, dtype=tl.int32)
    for start in range(0, num_pairs, CHUNK):
        offs = start + tl.arange(0, CHUNK)
        ids = tl.load(topk_ids_ptr + offs, mask=offs < num_pairs, other=-1).to(tl.int32)
        local = ids >= 0  # -1: another rank's expert, not counted
        counts += tl.histogram(tl.where(local, ids, 0), E_PAD, mask=local)
    padded = (counts + (BLOCK_M - 1)) // BLOCK_M * BLOCK_M
    padded_end = tl.associative_scan(padded, 0, _add_combine)
    padded_start = padded_end - padded
    total = tl.reduce(padded, 0, _add_combine)
    tl.store(num_tokens_post_padded_ptr, total)

    # Sentinels where no pair goes (each expert's tail, and past the end), so that no row
    # is written twice: each expert's < BLOCK_M tail positions, then the rows past the end.
    for tail_start in range(0, BLOCK_M, TAIL):
        tail = tail_start + tl.arange(0, TAIL)[None, :]
        tail_rows = (padded_start + counts)[:, None] + tail
        tl.store(sorted_ids_ptr + tail_rows, num_pairs, mask=tail < (padded - counts)[:, None])
    for start in range(0, num_rows, FILL):
        rows = start + tl.arange(0, FILL)
        tl.store(sorted_ids_ptr + rows, num_pairs, mask=(rows >= total) & (rows < num_rows))
    # Block b belongs to the number of experts whose padded segment ends at or before it.
    for start in range(0, num_rows // BLOCK_M, CHUNK):
        blocks = start + tl.arange(0, CHUNK)
        first_row = blocks * BLOCK_M
        ended = (padded_end[None, :] <= first_row[:, None]).to(tl.int32)
        expert = tl.where(first_row < total, tl.reduce(ended, 1, _add_combine), -1)
        tl.store(expert_ids_ptr + blocks, expert, mask=first_row < num_rows)

    # Each pair goes to its expert's cursor plus its rank among the chunk's pairs of that
    # expert (an inclusive scan of the one-hot rows), which keeps token order.
    # Pairs of id -1 (and past the end) match no expert and are not stored.
    cursor = padded_start
    for start in range(0, num_pairs, CHUNK):
        offs = start + tl.arange(0, CHUNK)
        ids = tl.load(topk_ids_ptr + offs, mask=offs < num_pairs, other=-1).to(tl.int32)
        onehot = (ids[:, None] == experts[None, :]).to(tl.int32)
        rank = tl.reduce(tl.associative_scan(onehot, 0, _add_combine) * onehot, 1, _add_combine)
        base = tl.reduce(onehot * cursor[None, :], 1, _add_combine)
        tl.store(sorted_ids_ptr + base + rank - 1, offs, mask=ids >= 0)
        cursor += tl.reduce(onehot, 0, _add_combine)


# Up to this many pairs (decode, small batches) one Triton program aligns them: one launch
# instead of ~25 small torch kernels. Past it the torch path's sort scales better than one
# program's loop. Untuned.
TRITON_ALIGN_MAX_PAIRS = 1024


def moe_align_block_size(
    topk_ids: torch.Tensor, block_m: int, num_experts: int, method: str = "auto"
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The (token, k) pairs sorted by expert, each expert's segment padded to ``block_m``.

    Args:
        topk_ids: [T, k] integer expert ids in ``[0, num_experts)``, or -1: a pair of an
            expert another rank holds (expert parallelism), dropped: in no block, not
            counted (not checked: that would need a host sync).
        block_m: the GEMM's rows per block.
        num_experts: E.
        method: ``"triton"`` (one program), ``"torch"`` (scatter-add, cumsum, a stable
            argsort, searchsorted) or ``"auto"``: Triton up to ``TRITON_ALIGN_MAX_PAIRS``
            pairs. Both give the same result and neither syncs with the host.

    Returns:
        ``sorted_ids``: [R] int32, ``R = _max_padded_rows(T * k, E, block_m)``: the ids
        ``t * k + j`` of the pairs not dropped, grouped by expert in expert order (token
        order within an expert), each expert's segment starting at a multiple of
        ``block_m``; padding holds ``T * k``.
        ``expert_ids``: [R // block_m] int32, the expert of each block; -1 past the end.
        ``num_tokens_post_padded``: [1] int32, the padded length (a multiple of ``block_m``).

    vLLM's ``moe_align_block_size`` returns the same three (its buffers are sized alike).
    """
    device = topk_ids.device
    num_pairs = topk_ids.numel()
    rows = _max_padded_rows(num_pairs, num_experts, block_m)
    if method == "auto":
        method = "triton" if 0 < num_pairs <= TRITON_ALIGN_MAX_PAIRS else "torch"
    if method == "triton":
        sorted_ids = torch.empty(rows, dtype=torch.int32, device=device)
        expert_ids = torch.empty(rows // block_m, dtype=torch.int32, device=device)
        num_tokens_post_padded = torch.empty(1, dtype=torch.int32, device=device)
        e_pad = max(triton.next_power_of_2(num_experts), 16)
        _moe_align_kernel[(1,)](
            topk_ids.reshape(-1),
            sorted_ids,
            expert_ids,
            num_tokens_post_padded,
            num_pairs,
            rows,
            BLOCK_M=block_m,
            E_PAD=e_pad,
            # Tiles of at most 8K elements (untuned).
            CHUNK=max(16, min(256, 8192 // e_pad)),
            FILL=1024,
            TAIL=max(1, min(block_m, 8192 // e_pad)),
            num_warps=4,
        )
        return sorted_ids, expert_ids, num_tokens_post_padded
    if method != "torch":
        raise ValueError(f"moe_align_block_size: method {method!r}")
    flat = topk_ids.reshape(-1).to(torch.int64)
    # Dropped pairs (id -1) count as an extra expert E, sorted last, scattered to a slot
    # past the end that is cut off.
    key = torch.where(flat >= 0, flat, num_experts)
    counts = torch.zeros(num_experts + 1, dtype=torch.int64, device=device)
    # bincount would sync on CUDA (it sizes its output from the max id).
    counts.scatter_add_(0, key, torch.ones_like(key))
    padded = (counts + (block_m - 1)) // block_m * block_m
    padded_end = padded.cumsum(0)
    padded_start = padded_end - padded
    start = counts.cumsum(0) - counts
    order = torch.argsort(key, stable=True)
    sorted_experts = key[order]
    rank = torch.arange(num_pairs, device=device) - start[sorted_experts]
    dest = padded_start[sorted_experts] + rank
    dest = torch.where(sorted_experts < num_experts, dest, rows)
    sorted_ids = torch.full((rows + 1,), num_pairs, dtype=torch.int32, device=device)
    sorted_ids.scatter_(0, dest, order.to(torch.int32))
    sorted_ids = sorted_ids[:rows]
    block_starts = torch.arange(0, rows, block_m, device=device)
    expert_ids = torch.searchsorted(padded_end[:num_experts], block_starts, right=True)
    expert_ids = torch.where(expert_ids < num_experts, expert_ids, -1).to(torch.int32)
    num_tokens_post_padded = padded_end[num_experts - 1 : num_experts].to(torch.int32)
    return sorted_ids, expert_ids, num_tokens_post_padded


# ---------------------------------------------------------------- grouped GEMM


@triton.jit
def _fused_moe_kernel(
    a_ptr,  # [T or T * k, K]: pair p reads row p // TOP_K
    b_ptr,  # [E, N, K]
    c_ptr,  # [T * k, N]: pair p writes row p
    topk_weights_ptr,  # [T * k] fp32, read when MUL_ROUTED_WEIGHT
    sorted_ids_ptr,  # [R] int32
    expert_ids_ptr,  # [R // BLOCK_M] int32
    num_tokens_post_padded_ptr,  # [1] int32
    N,
    K,
    num_pairs,  # T * k: ids >= it are padding
    num_blocks_m,  # R // BLOCK_M
    stride_am,
    stride_be,
    stride_bn,
    stride_cm,
    TOP_K: tl.constexpr,
    MUL_ROUTED_WEIGHT: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    GROUP_M: tl.constexpr,
    DOT_PRECISION: tl.constexpr,  # None: Triton's default
    DOT_IN_FP32: tl.constexpr,  # bf16 interpreted: upcast the tiles (module doc)
    ROUND: tl.constexpr,  # bf16 output interpreted: round by hand
):
    # Swizzle: GROUP_M consecutive row blocks (mostly one expert) sweep the columns together.
    pid = tl.program_id(0)
    num_blocks_n = (N + BLOCK_N - 1) // BLOCK_N
    programs_per_group = GROUP_M * num_blocks_n
    first_m = (pid // programs_per_group) * GROUP_M
    group_m = tl.minimum(num_blocks_m - first_m, GROUP_M)
    pid_m = first_m + (pid % programs_per_group) % group_m
    pid_n = (pid % programs_per_group) // group_m

    if pid_m * BLOCK_M >= tl.load(num_tokens_post_padded_ptr):
        return  # the grid is sized for the worst padding
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    pair = tl.load(sorted_ids_ptr + offs_m).to(tl.int64)
    row_valid = pair < num_pairs
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    col_valid = offs_n < N
    c_ptrs = c_ptr + pair[:, None] * stride_cm + offs_n[None, :]
    c_mask = row_valid[:, None] & col_valid[None, :]

    expert = tl.load(expert_ids_ptr + pid_m).to(tl.int64)
    if expert < 0:  # an expert this rank does not hold (expert parallelism): no output
        tl.store(c_ptrs, tl.full([BLOCK_M, BLOCK_N], 0.0, c_ptr.dtype.element_ty), mask=c_mask)
        return

    offs_k = tl.arange(0, BLOCK_K)
    a_ptrs = a_ptr + (pair // TOP_K)[:, None] * stride_am + offs_k[None, :]
    b_ptrs = b_ptr + expert * stride_be + offs_n[None, :] * stride_bn + offs_k[:, None]
    acc = tl.full([BLOCK_M, BLOCK_N], 0.0, dtype=tl.float32)
    for k_start in range(0, K, BLOCK_K):
        k_valid = offs_k < K - k_start
        a = tl.load(a_ptrs, mask=row_valid[:, None] & k_valid[None, :], other=0.0)
        b = tl.load(b_ptrs, mask=k_valid[:, None] & col_valid[None, :], other=0.0)
        if DOT_IN_FP32:
            a = a.to(tl.float32)
            b = b.to(tl.float32)
        acc = tl.dot(a, b, acc, input_precision=DOT_PRECISION)
        a_ptrs += BLOCK_K
        b_ptrs += BLOCK_K

    if MUL_ROUTED_WEIGHT:
        weight = tl.load(topk_weights_ptr + pair, mask=row_valid, other=0.0)
        acc = acc * weight[:, None]
    tl.store(c_ptrs, _round_bf16(acc, ROUND).to(c_ptr.dtype.element_ty), mask=c_mask)


@triton.jit
def _moe_sum_kernel(
    down_ptr,  # [T * k, H]: pair p's weighted row (unwritten for a dropped pair)
    ids_ptr,  # [T * k] local expert ids, -1: a dropped pair
    out_ptr,  # [T, H] contiguous
    H,
    stride_down,
    TOP_K: tl.constexpr,
    BLOCK_H: tl.constexpr,
    ROUND: tl.constexpr,  # bf16 output interpreted: round by hand
):
    """out[t] = the sum of token t's rows of local pairs (fp32, in order of j, rounded once)."""
    t = tl.program_id(0).to(tl.int64)
    offs = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    col_valid = offs < H
    acc = tl.full([BLOCK_H], 0.0, dtype=tl.float32)
    for j in range(TOP_K):
        pair = t * TOP_K + j
        # a dropped pair reads no column (a scalar & a block mask fails in the interpreter)
        width = tl.where(tl.load(ids_ptr + pair) >= 0, H, 0)
        row = tl.load(down_ptr + pair * stride_down + offs, mask=offs < width, other=0.0)
        acc += row.to(tl.float32)
    out = _round_bf16(acc, ROUND).to(out_ptr.dtype.element_ty)
    tl.store(out_ptr + t * H + offs, out, mask=col_valid)


def _moe_sum(down: torch.Tensor, local_ids: torch.Tensor) -> torch.Tensor:
    """[T, H]: each token's rows of ``down`` [T, k, H] whose ``local_ids`` [T, k] are not -1,
    summed (``_moe_sum_kernel``)."""
    num_tokens, top_k, hidden_size = down.shape
    out = down.new_empty((num_tokens, hidden_size))
    block_h = min(1024, triton.next_power_of_2(hidden_size))
    _moe_sum_kernel[(num_tokens, triton.cdiv(hidden_size, block_h))](
        down,
        local_ids.contiguous(),
        out,
        hidden_size,
        down.stride(1),
        TOP_K=top_k,
        BLOCK_H=block_h,
        ROUND=_round_by_hand(out.dtype),
        num_warps=4,
    )
    return out


def default_config(num_tokens: int, top_k: int, num_experts: int, dtype: torch.dtype) -> dict:
    """Block sizes for a batch (untuned guesses for an H200; module doc)."""
    if num_tokens * top_k <= 32 * num_experts:
        # Few tokens per expert (decode): the smallest tile tl.dot takes wastes least padding.
        config = {"BLOCK_M": 16, "BLOCK_N": 64, "BLOCK_K": 64, "GROUP_M": 1}
        config |= {"num_warps": 4, "num_stages": 4}
    else:
        config = {"BLOCK_M": 64, "BLOCK_N": 128, "BLOCK_K": 64, "GROUP_M": 8}
        config |= {"num_warps": 4, "num_stages": 3}
    if dtype == torch.float32:  # twice the bytes per tile, no tensor cores with ieee
        config["num_stages"] = 2
    return config


def _grouped_gemm(
    a: torch.Tensor,
    b: torch.Tensor,
    c: torch.Tensor,
    topk_weights: torch.Tensor,
    sorted_ids: torch.Tensor,
    expert_ids: torch.Tensor,
    num_tokens_post_padded: torch.Tensor,
    top_k: int,
    mul_routed_weight: bool,
    config: dict[str, Any],
) -> None:
    num_experts, n, k = b.shape
    num_blocks_m = expert_ids.shape[0]
    num_blocks_n = triton.cdiv(n, config["BLOCK_N"])
    _fused_moe_kernel[(num_blocks_m * num_blocks_n,)](
        a,
        b,
        c,
        topk_weights,
        sorted_ids,
        expert_ids,
        num_tokens_post_padded,
        n,
        k,
        c.shape[0],
        num_blocks_m,
        a.stride(0),
        b.stride(0),
        b.stride(1),
        c.stride(0),
        TOP_K=top_k,
        MUL_ROUTED_WEIGHT=mul_routed_weight,
        # fp32 tl.dot defaults to tf32 on GPUs (10-bit mantissa); fp32 callers want fp32.
        DOT_PRECISION="ieee" if a.dtype == torch.float32 else None,
        DOT_IN_FP32=_INTERPRETING and a.dtype == torch.bfloat16,
        ROUND=_round_by_hand(c.dtype),
        **config,
    )


def _check(cond: bool, msg: str) -> None:
    if not cond:
        raise ValueError(f"fused_moe: {msg}")


def fused_moe(
    hidden: torch.Tensor,
    w13: torch.Tensor,
    w2: torch.Tensor,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
    *,
    expert_map: torch.Tensor | None = None,
    config: dict[str, Any] | None = None,
) -> torch.Tensor:
    """``moe.fused_experts_ref``'s result: the experts' SwiGLU MLPs, weighted and summed.

    Args:
        hidden: [T, H] fp32/bf16/fp16, rows may be strided (last dim contiguous).
        w13: [E, 2I, H], each expert's gate rows then its up rows; ``hidden``'s dtype.
        w2: [E, H, I], the down projections.
        topk_weights: [T, k] routing weights (used as fp32).
        topk_ids: [T, k] integer experts in ``[0, E)``, distinct per token (not checked);
            global ids in ``[0, E_global)`` with ``expert_map``.
        expert_map: None, or with expert parallelism [E_global] integers: each global
            expert's index in ``w13``/``w2``, -1 for one another rank holds; pairs of
            those contribute nothing (a token with none local gets zeros). vLLM's argument.
        config: block sizes and launch options overriding ``default_config``'s (keys
            ``BLOCK_M``, ``BLOCK_N``, ``BLOCK_K``, ``GROUP_M``, ``num_warps``, ``num_stages``).

    Returns [T, H] in ``hidden``'s dtype. Launches no host sync (module doc).
    """
    _check(
        hidden.dim() == 2 and hidden.dtype in _FLOAT_TYPES,
        f"hidden must be [T, H] fp32/bf16/fp16, got {list(hidden.shape)} {hidden.dtype}",
    )
    num_tokens, hidden_size = hidden.shape
    _check(w13.dim() == 3 and w2.dim() == 3, "w13 and w2 must be [E, 2I, H] and [E, H, I]")
    num_experts, inter = w2.shape[0], w2.shape[2]
    _check(
        tuple(w13.shape) == (num_experts, 2 * inter, hidden_size)
        and tuple(w2.shape) == (num_experts, hidden_size, inter),
        f"w13 {list(w13.shape)} and w2 {list(w2.shape)} do not match hidden size {hidden_size}",
    )
    _check(
        w13.dtype == hidden.dtype and w2.dtype == hidden.dtype,
        f"weights {w13.dtype}/{w2.dtype} differ from hidden {hidden.dtype}",
    )
    for name, t in (("hidden", hidden), ("w13", w13), ("w2", w2)):
        _check(t.stride(-1) == 1, f"{name} must be contiguous in its last dim")
    _check(w13.stride(1) >= hidden_size and w2.stride(1) >= inter, "weights rows overlap")
    _check(
        topk_ids.dim() == 2
        and topk_ids.shape[0] == num_tokens
        and tuple(topk_weights.shape) == tuple(topk_ids.shape)
        and not topk_ids.is_floating_point(),
        f"topk_ids {list(topk_ids.shape)} {topk_ids.dtype} and topk_weights "
        f"{list(topk_weights.shape)} must be [{num_tokens}, k], the ids integers",
    )
    if expert_map is not None:
        _check(
            expert_map.dim() == 1
            and not expert_map.is_floating_point()
            and expert_map.device == topk_ids.device,
            f"expert_map must be [E_global] integers on {topk_ids.device}, got "
            f"{list(expert_map.shape)} {expert_map.dtype} on {expert_map.device}",
        )
    top_k = topk_ids.shape[1]
    out_shape = (num_tokens, hidden_size)
    if num_tokens == 0 or top_k == 0 or inter == 0:
        return hidden.new_zeros(out_shape)

    # Tokens per expert on average: over all E_global experts with an expert map.
    all_experts = num_experts if expert_map is None else expert_map.shape[0]
    cfg = default_config(num_tokens, top_k, all_experts, hidden.dtype) | (config or {})
    weights = topk_weights.to(torch.float32).contiguous().view(-1)
    # Another rank's experts map to -1: their pairs are dropped by the alignment.
    ids = topk_ids if expert_map is None else expert_map[topk_ids]
    sorted_ids, expert_ids, num_post = moe_align_block_size(ids, cfg["BLOCK_M"], num_experts)
    num_pairs = num_tokens * top_k
    gate_up = hidden.new_empty((num_pairs, 2 * inter))
    _grouped_gemm(hidden, w13, gate_up, weights, sorted_ids, expert_ids, num_post, top_k,
                  False, cfg)  # fmt: skip
    act = silu_and_mul(gate_up)
    down = hidden.new_empty((num_tokens, top_k, hidden_size))
    _grouped_gemm(act, w2, down.view(num_pairs, hidden_size), weights, sorted_ids,
                  expert_ids, num_post, 1, True, cfg)  # fmt: skip
    if expert_map is not None:  # the rows of dropped pairs are unwritten
        return _moe_sum(down, ids)
    if top_k == 1:
        return down.view(out_shape)
    return down.sum(dim=1)
