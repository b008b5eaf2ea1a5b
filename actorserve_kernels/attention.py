"""Unified paged attention: one Triton kernel for a varlen batch of prefill chunks and decodes.

Inputs follow vLLM's v1 attention metadata. The batch's new tokens are packed along one
axis: sequence ``s`` owns query rows ``query_start_loc[s]:query_start_loc[s + 1]``, and its
context (cached tokens plus the new ones, whose K/V ``reshape_and_cache`` has already
written) is ``seq_lens[s]`` tokens long, stored in the pages ``block_table[s]``. New token
``j`` of sequence ``s`` sits at position ``seq_lens[s] - query_len + j`` and attends to every
position up to and including its own (causal within the new tokens).

Tiling. A program owns one *q-block* of one sequence and one KV head. A q-block is
``BLOCK_Q`` consecutive new tokens times the ``G = num_q_heads // num_kv_heads`` query
heads that share that KV head, packed into the rows of one ``BLOCK_M``-row tile
(``BLOCK_M`` a power of two, 16 for decode batches and 64 otherwise, at least ``G``;
``BLOCK_Q = BLOCK_M // G``; row ``m`` is token ``m // G``, head ``m % G``; the rows past
``BLOCK_Q * G`` are masked when ``G`` does not divide ``BLOCK_M``). Each K/V tile is therefore loaded once per KV head and
used by all of its query heads, which is what makes GQA decode cheap: a decode step is
bound by reading K/V, not by the matmuls. The program walks the context in tiles of
``TILE_SIZE`` positions, independent of the page size: each position looks up its own
page, so any block size works (the engine uses powers of two). Scores are computed in the log2 domain
(``scale * log2(e)`` folded in) and accumulated with an online softmax in fp32; the loop
stops at the last position the q-block's final token can see, so causal prefill skips
the upper triangle. Sequences are found without a host sync: sequence ``s``'s q-blocks
are numbered from ``query_start_loc[s] // BLOCK_Q + s``, so ``T // BLOCK_Q + B`` programs
are always enough and each finds its sequence by binary search (as vLLM does).

Split-KV (flash-decoding). When a decode batch is too small to occupy the GPU (few
sequences times KV heads) but contexts are long, a third grid axis splits each context
into ``num_splits`` contiguous ranges of tiles. Each split writes its unnormalised fp32
accumulator with its running max and sum, and a small reduce kernel rescales and combines
them. Heuristic (``num_kv_splits``): split only pure decode batches (``max_query_len ==
1``) with fewer ``B * num_kv_heads`` programs than ``2 * num_SMs``; use enough splits to
reach about two programs per SM, but give every split at least ``MIN_TOKENS_PER_SPLIT``
context tokens so the extra writes and the reduce stay small next to the K/V reads, and at
most ``MAX_SPLITS``; round down to a power of two (the reduce loads all splits as one
vector). Prefill batches already have enough programs and are compute-bound.

Quantized KV caches (``--kv-cache-dtype``, stored as ``kv_quant`` describes). The cache
tensor's dtype picks the kernel variant (the ``KV_KIND`` constexpr), so a plain cache runs
the same code as before. An fp8 cache's tiles are loaded as fp8 and an int8 cache's as
int8 with each position's fp32 row scale (the 4 bytes after its ``head_dim`` values),
dequantized in registers in fp32 (``float(stored) * scale``) and rounded to the query's
dtype, which is what the plain kernel would have read from a cache holding
``kv_quant.dequantize(stored, scale, query.dtype)``: the two give the same result (the
tests check it bit for bit in the interpreter). The dots and the softmax are the plain
kernel's. Reading fp8 needs sm_89+ for e4m3 (Triton has no e4m3 conversions before
Ada); e5m2 converts in software on older GPUs.

The file stays whole: one kernel, its split-KV reduce, the heuristic that picks between
them and the wrapper that checks and launches them, read together.
"""

from __future__ import annotations

import functools
import math
import os

import torch
import triton
import triton.language as tl

from actorserve_kernels import kv_quant

TILE_SIZE = 32  # context positions per K/V tile (tl.dot needs >= 16)
MIN_TOKENS_PER_SPLIT = 256
MAX_SPLITS = 16
_LOG2E = 1.4426950408889634
# Triton's interpreter (3.9) multiplies bf16 tiles as raw 16-bit integers in tl.dot, so when
# interpreting, bf16 operands are upcast to fp32 first. Read at import, as @triton.jit is.
_INTERPRETING = os.environ.get("TRITON_INTERPRET", "0").lower() in ("1", "true", "on", "yes")


@triton.jit
def _round_bf16(x, ROUND: tl.constexpr):
    """fp32 ``x`` rounded to the nearest bf16 value (ties to even), still fp32, when ROUND.

    Triton's interpreter (3.9) converts fp32 to bf16 by truncating, where GPUs and torch
    round to nearest even: when interpreting, bf16 results are rounded by hand first."""
    if ROUND:
        bits = x.to(tl.uint32, bitcast=True)
        bits = (bits + (0x7FFF + ((bits >> 16) & 1))) >> 16 << 16
        x = bits.to(tl.float32, bitcast=True)
    return x


# Triton's library functions (tl.max, tl.sum, tl.zeros, tl.cdiv) are themselves @jit
# functions, compiled or interpreted as decided when triton is first imported, so the kernels
# here use builtins only: then they also run interpreted when something imported triton
# before TRITON_INTERPRET was set. tl.reduce with the combine functions tl.max and tl.sum use
# compiles to the same code, and the interpreter recognises them and reduces with numpy (it
# would call any other combine function element by element, in Python).
@triton.jit
def _max_fallback(a, b):
    return tl.maximum(a, b)


@triton.jit
def _add_fallback(a, b):
    return a + b


_max_combine = getattr(tl.standard, "_elementwise_max", _max_fallback)
_add_combine = getattr(tl.standard, "_sum_combine", _add_fallback)


@triton.jit
def _find_seq_idx(query_start_loc_ptr, q_block_idx, num_seqs, BLOCK_Q: tl.constexpr):
    """Last sequence whose first q-block index is <= ``q_block_idx``."""
    lo: tl.int32 = 0
    hi: tl.int32 = num_seqs
    while lo < hi:
        mid = (lo + hi) // 2
        first_q_block = tl.load(query_start_loc_ptr + mid) // BLOCK_Q + mid
        if first_q_block <= q_block_idx:
            lo = mid + 1
        else:
            hi = mid
    return lo - 1


@triton.jit
def _paged_attention_kernel(
    out_ptr,  # [T, num_q_heads, HEAD_DIM]
    q_ptr,  # [T, num_q_heads, HEAD_DIM]
    k_cache_ptr,  # [num_blocks, BLOCK_SIZE, num_kv_heads, HEAD_DIM (+ 4 for int8)]
    v_cache_ptr,  # [num_blocks, BLOCK_SIZE, num_kv_heads, HEAD_DIM (+ 4 for int8)]
    k_scale_ptr,  # [1] fp32, the layer's K scale when KV_KIND == "fp8" (else not read)
    v_scale_ptr,  # [1] fp32
    block_table_ptr,  # [B, max_blocks] int32
    seq_lens_ptr,  # [B] int32
    query_start_loc_ptr,  # [B + 1] int32
    split_acc_ptr,  # [T, num_q_heads, NUM_SPLITS, HEAD_DIM] fp32, used when NUM_SPLITS > 1
    split_max_ptr,  # [T, num_q_heads, NUM_SPLITS] fp32
    split_sum_ptr,  # [T, num_q_heads, NUM_SPLITS] fp32
    qk_scale,  # softmax scale * log2(e)
    num_seqs,
    stride_q_tok,
    stride_q_head,
    stride_o_tok,
    stride_o_head,
    stride_k_block,
    stride_k_pos,
    stride_k_head,
    stride_v_block,
    stride_v_pos,
    stride_v_head,
    stride_bt_seq,
    NUM_Q_HEADS: tl.constexpr,
    QUERIES_PER_KV: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    TILE_SIZE: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_Q: tl.constexpr,
    NUM_SPLITS: tl.constexpr,
    DOT_PRECISION: tl.constexpr,  # None: Triton's default
    DOT_IN_FP32: tl.constexpr,
    KV_KIND: tl.constexpr,  # "auto" (the cache holds q's dtype), "fp8" or "int8"
):
    q_block_idx = tl.program_id(0)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)

    seq = _find_seq_idx(query_start_loc_ptr, q_block_idx, num_seqs, BLOCK_Q)
    q_start = tl.load(query_start_loc_ptr + seq)
    q_len = tl.load(query_start_loc_ptr + seq + 1) - q_start
    q_block = q_block_idx - (q_start // BLOCK_Q + seq)
    if q_block * BLOCK_Q >= q_len:
        return  # the grid is an upper bound on the number of q-blocks
    seq_len = tl.load(seq_lens_ptr + seq)
    context_len = seq_len - q_len  # tokens cached before this step's new ones

    offs_m = tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, HEAD_DIM)
    offs_t = tl.arange(0, TILE_SIZE)
    q_pos = q_block * BLOCK_Q + offs_m // QUERIES_PER_KV  # index among the new tokens
    q_head = kv_head * QUERIES_PER_KV + offs_m % QUERIES_PER_KV
    row_valid = (offs_m < BLOCK_Q * QUERIES_PER_KV) & (q_pos < q_len)
    q_tok = (q_start + q_pos).to(tl.int64)

    q = tl.load(
        q_ptr + q_tok[:, None] * stride_q_tok + q_head[:, None] * stride_q_head + offs_d[None, :],
        mask=row_valid[:, None],
        other=0.0,
    )
    if DOT_IN_FP32:
        q = q.to(tl.float32)

    # The q-block's last token sees the most context; nothing past it is read.
    kv_end = context_len + tl.minimum(q_len, (q_block + 1) * BLOCK_Q)
    num_tiles = (kv_end + TILE_SIZE - 1) // TILE_SIZE
    tiles_per_split = (num_tiles + NUM_SPLITS - 1) // NUM_SPLITS
    tile_lo = split * tiles_per_split
    tile_hi = tl.minimum(tile_lo + tiles_per_split, num_tiles)

    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.full([BLOCK_M], 0.0, dtype=tl.float32)
    acc = tl.full([BLOCK_M, HEAD_DIM], 0.0, dtype=tl.float32)
    block_table_row = block_table_ptr + seq.to(tl.int64) * stride_bt_seq
    if KV_KIND == "fp8":
        k_scale = tl.load(k_scale_ptr)
        v_scale = tl.load(v_scale_ptr)

    for tile in range(tile_lo, tile_hi):
        kv_pos = tile * TILE_SIZE + offs_t
        kv_valid = kv_pos < kv_end
        block = tl.load(block_table_row + kv_pos // BLOCK_SIZE, mask=kv_valid, other=0)
        block = block.to(tl.int64)
        in_block = kv_pos % BLOCK_SIZE
        k_off = block * stride_k_block + in_block * stride_k_pos + kv_head * stride_k_head
        v_off = block * stride_v_block + in_block * stride_v_pos + kv_head * stride_v_head
        k = tl.load(
            k_cache_ptr + k_off[None, :] + offs_d[:, None], mask=kv_valid[None, :], other=0.0
        )
        v = tl.load(
            v_cache_ptr + v_off[:, None] + offs_d[None, :], mask=kv_valid[:, None], other=0.0
        )
        if KV_KIND == "auto":
            if DOT_IN_FP32:
                k = k.to(tl.float32)
                v = v.to(tl.float32)
        else:
            # Dequantized in fp32, then rounded to q's dtype as a plain cache would hold it.
            k = k.to(tl.float32)
            v = v.to(tl.float32)
            if KV_KIND == "fp8":
                k = k * k_scale
                v = v * v_scale
            else:  # int8: each position's fp32 scale follows its HEAD_DIM values
                k_row_scale = tl.load(
                    (k_cache_ptr + k_off + HEAD_DIM).to(tl.pointer_type(tl.float32)),
                    mask=kv_valid,
                    other=0.0,
                )
                v_row_scale = tl.load(
                    (v_cache_ptr + v_off + HEAD_DIM).to(tl.pointer_type(tl.float32)),
                    mask=kv_valid,
                    other=0.0,
                )
                k = k * k_row_scale[None, :]
                v = v * v_row_scale[:, None]
            if DOT_IN_FP32:  # bf16 q, interpreted: what .to(bf16) gives on a GPU, kept fp32
                k = _round_bf16(k, True)
                v = _round_bf16(v, True)
            else:
                k = k.to(q_ptr.dtype.element_ty)
                v = v.to(q_ptr.dtype.element_ty)

        s = tl.dot(q, k, input_precision=DOT_PRECISION) * qk_scale
        visible = row_valid[:, None] & (kv_pos[None, :] <= context_len + q_pos[:, None])
        s = tl.where(visible, s, float("-inf"))

        m_new = tl.maximum(m_i, tl.reduce(s, 1, _max_combine))
        # A row that has seen nothing yet (masked row, or an all-masked tile) keeps
        # m = -inf; subtracting 0 instead keeps exp2 at 0 rather than NaN.
        m_ref = tl.where(m_new == float("-inf"), 0.0, m_new)
        p = tl.exp2(s - m_ref[:, None])
        alpha = tl.exp2(m_i - m_ref)
        l_i = l_i * alpha + tl.reduce(p, 1, _add_combine)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=DOT_PRECISION)
        m_i = m_new

    if NUM_SPLITS == 1:
        out = acc / tl.where(l_i == 0.0, 1.0, l_i)[:, None]
        o_ptrs = out_ptr + q_tok[:, None] * stride_o_tok + q_head[:, None] * stride_o_head
        tl.store(
            o_ptrs + offs_d[None, :], out.to(out_ptr.dtype.element_ty), mask=row_valid[:, None]
        )
    else:
        # An empty split (short context) stores m = -inf, l = 0: weight 0 in the reduce.
        split_row = (q_tok * NUM_Q_HEADS + q_head) * NUM_SPLITS + split
        tl.store(split_max_ptr + split_row, m_i, mask=row_valid)
        tl.store(split_sum_ptr + split_row, l_i, mask=row_valid)
        acc_ptrs = split_acc_ptr + split_row[:, None] * HEAD_DIM + offs_d[None, :]
        tl.store(acc_ptrs, acc, mask=row_valid[:, None])


@triton.jit
def _reduce_splits_kernel(
    out_ptr,  # [T, num_q_heads, HEAD_DIM]
    split_acc_ptr,  # [T, num_q_heads, NUM_SPLITS, HEAD_DIM] fp32
    split_max_ptr,  # [T, num_q_heads, NUM_SPLITS] fp32
    split_sum_ptr,  # [T, num_q_heads, NUM_SPLITS] fp32
    query_start_loc_ptr,  # [B + 1] int32
    num_seqs,
    stride_o_tok,
    stride_o_head,
    NUM_Q_HEADS: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    NUM_SPLITS: tl.constexpr,
):
    tok = tl.program_id(0).to(tl.int64)
    if tok >= tl.load(query_start_loc_ptr + num_seqs):
        return  # padding rows past the batch: left as they were
    head = tl.program_id(1)
    rows = (tok * NUM_Q_HEADS + head) * NUM_SPLITS + tl.arange(0, NUM_SPLITS)
    m = tl.load(split_max_ptr + rows)
    l = tl.load(split_sum_ptr + rows)  # noqa: E741
    # Split 0 always holds position 0, so the max is finite and empty splits weigh 0.
    weight = tl.exp2(m - tl.reduce(m, 0, _max_combine))
    acc = tl.load(split_acc_ptr + rows[:, None] * HEAD_DIM + tl.arange(0, HEAD_DIM)[None, :])
    out = tl.reduce(acc * weight[:, None], 0, _add_combine) / tl.reduce(l * weight, 0, _add_combine)
    o_ptrs = out_ptr + tok * stride_o_tok + head * stride_o_head + tl.arange(0, HEAD_DIM)
    tl.store(o_ptrs, out.to(out_ptr.dtype.element_ty))


@functools.cache
def _num_sms(device: torch.device) -> int:
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).multi_processor_count
    return 132  # interpreter: pretend to be an H100 so the heuristic behaves as on a GPU


def num_kv_splits(
    num_seqs: int, num_kv_heads: int, max_query_len: int, max_seq_len: int, num_sms: int
) -> int:
    """How many ranges to split each context into (1 = no split-KV); see the module doc."""
    programs = num_seqs * num_kv_heads
    if max_query_len > 1 or programs >= 2 * num_sms:
        return 1
    wanted = min(math.ceil(2 * num_sms / programs), max_seq_len // MIN_TOKENS_PER_SPLIT, MAX_SPLITS)
    return 1 if wanted < 2 else 1 << (wanted.bit_length() - 1)


def split_buffer_numel(num_tokens: int, num_q_heads: int, num_splits: int, head_dim: int) -> int:
    """fp32 elements of split-KV scratch: each (token, head, split)'s accumulator, max, sum."""
    return num_tokens * num_q_heads * num_splits * (head_dim + 2)


def max_split_rows(num_kv_heads: int, num_sms: int) -> int:
    """The most (sequences x splits) a decode step can split into, whatever its batch and
    context (``num_kv_splits`` stops splitting at ``2 * num_sms`` programs)."""
    return max(
        b * num_kv_splits(b, num_kv_heads, 1, MAX_SPLITS * MIN_TOKENS_PER_SPLIT, num_sms)
        for b in range(1, 2 * num_sms + 1)
    )


def _check(cond: bool, msg: str) -> None:
    if not cond:
        raise ValueError(f"paged_attention: {msg}")


def kv_cache_kind(
    fn: str,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    k_scale: torch.Tensor | None,
    v_scale: torch.Tensor | None,
) -> str:
    """``kv_quant.kind`` of the caches ("auto", "fp8" or "int8"), checked: both caches share
    a dtype, and an fp8 cache comes with its fp32 scales (one element each, on the cache's
    device). Scales passed with another kind are ignored."""
    if key_cache.dtype != value_cache.dtype:
        raise ValueError(f"{fn}: key_cache {key_cache.dtype} != value_cache {value_cache.dtype}")
    kind = kv_quant.kind(key_cache)
    if kind == "fp8":
        for name, s in (("k_scale", k_scale), ("v_scale", v_scale)):
            if s is None:
                raise ValueError(f"{fn}: an fp8 KV cache needs {name} (the layer's fp32 scale)")
            if s.numel() != 1 or s.dtype != torch.float32 or s.device != key_cache.device:
                raise ValueError(
                    f"{fn}: {name} must be one fp32 element on {key_cache.device}, got "
                    f"{list(s.shape)} {s.dtype} on {s.device}"
                )
    return kind


def paged_attention(
    query: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    block_table: torch.Tensor,
    query_start_loc: torch.Tensor,
    seq_lens: torch.Tensor,
    max_query_len: int,
    max_seq_len: int,
    scale: float | None = None,
    out: torch.Tensor | None = None,
    num_splits: int | None = None,
    split_buffer: torch.Tensor | None = None,
    k_scale: torch.Tensor | None = None,
    v_scale: torch.Tensor | None = None,
) -> torch.Tensor:
    """Causal attention of the batch's new tokens over their paged context.

    Args:
        query: ``[T, num_q_heads, head_dim]``; rows past ``query_start_loc[-1]`` are not read
            and their output rows are left as they were.
        key_cache, value_cache: ``[num_blocks, block_size, num_kv_heads, head_dim]``, already
            holding the new tokens' K/V: in ``query``'s dtype, or quantized as ``kv_quant``
            describes (fp8 e4m3/e5m2; int8 ``[..., head_dim + 4]`` with the row scales).
        block_table: ``[B, max_blocks]`` int32 physical block ids per sequence.
        query_start_loc: ``[B + 1]`` int32 cumulative query lengths.
        seq_lens: ``[B]`` int32 context lengths including the new tokens.
        max_query_len, max_seq_len: host-side maxima of the above (pick the kernel shape).
        scale: softmax scale, ``head_dim ** -0.5`` by default.
        out: optional output buffer shaped like ``query``.
        num_splits: force the number of split-KV ranges (a power of two); ``None`` uses
            the heuristic ``num_kv_splits``.
        split_buffer: fp32 scratch of at least ``split_buffer_numel`` elements for the
            split partials, so that nothing is allocated (a CUDA graph replays with it);
            ``None`` allocates them when splitting.
        k_scale, v_scale: the layer's fp32 scales (``[1]``, on the device, read by the
            kernel: a CUDA graph sees their current value); required for an fp8 cache,
            ignored otherwise.

    Returns:
        ``out``: ``[T, num_q_heads, head_dim]`` in ``query``'s dtype.
    """
    num_tokens, num_q_heads, head_dim = query.shape
    _, block_size, num_kv_heads, row_width = key_cache.shape
    num_seqs = seq_lens.shape[0]
    kind = kv_cache_kind("paged_attention", key_cache, value_cache, k_scale, v_scale)
    _check(key_cache.shape == value_cache.shape, "key_cache and value_cache shapes differ")
    expected_width = head_dim + (kv_quant.INT8_SCALE_BYTES if kind == "int8" else 0)
    _check(
        row_width == expected_width,
        f"cache rows of {row_width} {key_cache.dtype} != {expected_width} for head_dim {head_dim}",
    )
    _check(head_dim >= 16 and head_dim & (head_dim - 1) == 0, f"head_dim {head_dim} unsupported")
    _check(num_q_heads % num_kv_heads == 0, f"{num_q_heads} q heads, {num_kv_heads} kv heads")
    _check(query_start_loc.shape[0] == num_seqs + 1, "query_start_loc must have B + 1 entries")
    _check(block_table.shape[0] == num_seqs, "block_table must have B rows")
    for name, t in (("query", query), ("key_cache", key_cache), ("value_cache", value_cache)):
        _check(t.stride(-1) == 1, f"{name} must be contiguous in head_dim")
    _check(block_table.stride(1) == 1, "block_table rows must be contiguous")
    if out is None:
        out = query.new_empty(query.shape)  # contiguous even when query is a view
    _check(out.shape == query.shape and out.stride(-1) == 1, "out must be shaped like query")
    if num_tokens == 0 or num_seqs == 0:
        return out

    queries_per_kv = num_q_heads // num_kv_heads
    decode_only = max_query_len <= 1
    # A decode q-block has G useful rows: the smallest tile tl.dot takes (16) wastes least.
    # Prefill reuses each K/V tile over more query rows. Untuned: bench/gpu_check.py is
    # where to tune these and TILE_SIZE.
    block_m = max(16 if decode_only else 64, triton.next_power_of_2(queries_per_kv))
    block_q = block_m // queries_per_kv
    if num_splits is None:
        num_splits = num_kv_splits(
            num_seqs, num_kv_heads, max_query_len, max_seq_len, _num_sms(query.device)
        )
    _check(num_splits >= 1 and num_splits & (num_splits - 1) == 0, "num_splits: power of two")

    if num_splits > 1:
        rows = num_tokens * num_q_heads * num_splits
        needed = split_buffer_numel(num_tokens, num_q_heads, num_splits, head_dim)
        if split_buffer is None:
            split_buffer = torch.empty(needed, dtype=torch.float32, device=query.device)
        _check(
            split_buffer.dtype == torch.float32 and split_buffer.numel() >= needed,
            f"split_buffer needs {needed} fp32 elements",
        )
        split_acc = split_buffer[: rows * head_dim].view(
            num_tokens, num_q_heads, num_splits, head_dim
        )
        split_max = split_buffer[rows * head_dim : rows * (head_dim + 1)]
        split_sum = split_buffer[rows * (head_dim + 1) : needed]
    else:
        split_acc = split_max = split_sum = out  # not touched

    grid = (num_tokens // block_q + num_seqs, num_kv_heads, num_splits)
    _paged_attention_kernel[grid](
        out,
        query,
        key_cache,
        value_cache,
        k_scale if kind == "fp8" else key_cache,  # not read unless fp8
        v_scale if kind == "fp8" else value_cache,
        block_table,
        seq_lens,
        query_start_loc,
        split_acc,
        split_max,
        split_sum,
        (head_dim**-0.5 if scale is None else scale) * _LOG2E,
        num_seqs,
        query.stride(0),
        query.stride(1),
        out.stride(0),
        out.stride(1),
        key_cache.stride(0),
        key_cache.stride(1),
        key_cache.stride(2),
        value_cache.stride(0),
        value_cache.stride(1),
        value_cache.stride(2),
        block_table.stride(0),
        NUM_Q_HEADS=num_q_heads,
        QUERIES_PER_KV=queries_per_kv,
        HEAD_DIM=head_dim,
        BLOCK_SIZE=block_size,
        TILE_SIZE=TILE_SIZE,
        BLOCK_M=block_m,
        BLOCK_Q=block_q,
        NUM_SPLITS=num_splits,
        # fp32 tl.dot defaults to tf32 on GPUs (10-bit mantissa); fp32 callers want fp32.
        DOT_PRECISION="ieee" if query.dtype == torch.float32 else None,
        DOT_IN_FP32=_INTERPRETING and query.dtype == torch.bfloat16,
        KV_KIND=kind,
    )
    if num_splits > 1:
        _reduce_splits_kernel[(num_tokens, num_q_heads)](
            out,
            split_acc,
            split_max,
            split_sum,
            query_start_loc,
            num_seqs,
            out.stride(0),
            out.stride(1),
            NUM_Q_HEADS=num_q_heads,
            HEAD_DIM=head_dim,
            NUM_SPLITS=num_splits,
        )
    return out
