"""The C++ CPU ops (``actorserve_kernels.cpu``): paged attention against the float64 brute-force
reference of the Triton tests, the small-batch linear against float64 matmul, on fresh
random inputs each run.

Every run poisons the output with NaN and every cache slot no sequence owns holds NaN,
so an unwritten row, or a read past a context's end, fails the test.
"""

from __future__ import annotations

import os
import secrets
from pathlib import Path

import numpy as np
import pytest
import torch

from actorserve_kernels.cpu import (
    INT8_ACTIVATIONS,
    QUANT_TYPES,
    int8_activations_supported,
    load_cpu_ops,
    paged_attention_rows,
    quant_dequant_rows,
    quant_linear,
    quant_pack,
    small_linear,
)
from services.gpu_worker.attention.base import AttentionMetadata
from services.gpu_worker.attention.torch_backend import TorchAttentionBackend
from tests.server_utils import REPO
from tests.test_kernels import MIXED, TOLERANCE, make_batch, reference_attention

pytestmark = pytest.mark.skipif(not load_cpu_ops(), reason="no C++ compiler to build the op")


def _batch(seqs, *, block_size, heads, head_dim, dtype):
    seed = secrets.randbits(32)  # in every failure message
    gen = torch.Generator().manual_seed(seed)
    batch = make_batch(
        seqs,
        block_size=block_size,
        num_q_heads=heads[0],
        num_kv_heads=heads[1],
        head_dim=head_dim,
        dtype=dtype,
        gen=gen,
    )
    return batch, seed


def _rows(batch: dict) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Every token of the batch as a row: (row, request, context length = position + 1)."""
    qsl = batch["query_start_loc"].long()
    q_lens = qsl[1:] - qsl[:-1]
    reqs = torch.repeat_interleave(torch.arange(q_lens.shape[0]), q_lens)
    rows = torch.arange(int(qsl[-1]))
    first_pos = batch["seq_lens"].long() - q_lens
    return rows, reqs, first_pos[reqs] + rows - qsl[reqs] + 1


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("heads", [(4, 4), (6, 2), (8, 2), (8, 1), (12, 2)])  # GQA 1, 3, 4, 8, 6
@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("block_size", [8, 16, 32])
def test_matches_reference(block_size: int, head_dim: int, heads, dtype: torch.dtype) -> None:
    batch, seed = _batch(MIXED, block_size=block_size, heads=heads, head_dim=head_dim, dtype=dtype)
    out = torch.full_like(batch["query"], float("nan"))
    rows, reqs, ctx = _rows(batch)
    paged_attention_rows(
        out, batch["query"], batch["key_cache"], batch["value_cache"], batch["block_table"],
        rows, reqs, ctx, head_dim**-0.5,
    )  # fmt: skip
    assert not out.isnan().any(), f"row unwritten or NaN read past a context (seed {seed})"
    ref = reference_attention(batch)
    err = float((out.double() - ref).norm() / ref.norm())
    assert err < TOLERANCE[dtype], f"relative error {err:.2e} (seed {seed})"


def test_long_contexts_and_strided_query() -> None:
    """Contexts of several hundred tokens (many 16-position tiles, the last one partial),
    a query that is a view into a fused qkv tensor, and only some rows computed."""
    seqs = [(500, 1), (37, 1), (1000, 1), (255, 3)]
    batch, seed = _batch(seqs, block_size=16, heads=(9, 3), head_dim=64, dtype=torch.float32)
    q = batch["query"]
    fused = torch.randn(q.shape[0], q.shape[1] + 6, q.shape[2])  # [q | k | v] heads
    fused[:, : q.shape[1]] = q
    query = fused[:, : q.shape[1]]
    rows, reqs, ctx = _rows(batch)
    pick = torch.tensor([0, 2, 4])  # decode rows of requests 0 and 2, one row of request 3
    out = torch.full_like(q, float("nan"))
    paged_attention_rows(
        out, query, batch["key_cache"], batch["value_cache"], batch["block_table"],
        rows[pick], reqs[pick], ctx[pick], 64**-0.5,
    )  # fmt: skip
    ref = reference_attention(batch)
    others = torch.ones(q.shape[0], dtype=torch.bool)
    others[pick] = False
    assert out[others].isnan().all(), "rows that were not asked for were written"
    err = float((out[pick].double() - ref[pick]).norm() / ref[pick].norm())
    assert err < 1e-5, f"relative error {err:.2e} (seed {seed})"


@pytest.mark.parametrize("threads", [2, 4, 7])
@pytest.mark.parametrize("heads", [(9, 3), (8, 1), (6, 2)])
def test_few_rows_split_by_head_and_position(threads: int, heads) -> None:
    """Fewer rows than threads (decode at batch 1): each row is cut into (KV head,
    position range) parts merged by their softmax maxima; equal to the reference for
    contexts shorter than one range, ending mid-tile, and of many ranges."""
    seqs = [(1000, 1), (70, 1), (5, 1)]
    batch, seed = _batch(seqs, block_size=16, heads=heads, head_dim=64, dtype=torch.float32)
    rows, reqs, ctx = _rows(batch)
    ref = reference_attention(batch)
    args = (batch["key_cache"], batch["value_cache"], batch["block_table"])
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        for pick in ([0], [1], [2], [0, 2]):
            idx = torch.tensor(pick)
            out = torch.full_like(batch["query"], float("nan"))
            paged_attention_rows(out, batch["query"], *args, rows[idx], reqs[idx], ctx[idx], 0.125)
            err = float((out[idx].double() - ref[idx]).norm() / ref[idx].norm())
            assert err < 1e-5, f"rows {pick}, {threads} threads: error {err:.2e} (seed {seed})"
    finally:
        torch.set_num_threads(before)


def test_rejects_bad_arguments() -> None:
    batch, _ = _batch([(3, 1)], block_size=8, heads=(4, 4), head_dim=32, dtype=torch.float32)
    rows, reqs, ctx = _rows(batch)
    out = torch.empty_like(batch["query"])
    args = (batch["key_cache"], batch["value_cache"], batch["block_table"])
    with pytest.raises(RuntimeError, match="head_dim 32 is not supported"):
        paged_attention_rows(out, batch["query"], *args, rows, reqs, ctx, 1.0)
    with pytest.raises(RuntimeError, match="int64"):
        paged_attention_rows(out, batch["query"], *args, rows.int(), reqs, ctx, 1.0)


@pytest.mark.parametrize(
    "seqs",
    [MIXED, [(40, 1), (3, 1), (17, 1)], [(0, 7), (0, 3), (0, 12)], [(0, 9), (30, 1), (0, 4)]],
    ids=["mixed", "decode", "fresh-prompts", "fresh-prompts-and-decode"],
)
@pytest.mark.parametrize("use_kernel", [True, False], ids=["op", "sdpa"])
def test_torch_backend_matches_reference(seqs, use_kernel: bool) -> None:
    """The torch backend, with decode rows on the op or on SDPA, against the brute-force
    reference over the cache as the backend left it (this step's K/V written): chunked
    prefill with a cached prefix (masked SDPA), fresh prompts of different lengths (SDPA's
    own causal mask, K/V from the projections), decodes, and mixes of them."""
    batch, seed = _batch(seqs, block_size=16, heads=(9, 3), head_dim=64, dtype=torch.float32)
    qsl, seq_lens = batch["query_start_loc"], batch["seq_lens"]
    num_tokens = int(qsl[-1])
    # This step's tokens are written by the backend: point their slots at the cache.
    qsl_l = qsl.long()
    reqs = torch.repeat_interleave(torch.arange(len(seqs)), qsl_l[1:] - qsl_l[:-1])
    pos = (
        (seq_lens.long() - (qsl_l[1:] - qsl_l[:-1]))[reqs] + torch.arange(num_tokens) - qsl_l[reqs]
    )
    slots = batch["block_table"][reqs, pos // 16].long() * 16 + pos % 16
    gen = torch.Generator().manual_seed(seed)
    key = torch.randn(num_tokens, 3, 64, generator=gen)
    value = torch.randn(num_tokens, 3, 64, generator=gen)
    meta = AttentionMetadata(
        query_start_loc=qsl,
        seq_lens=seq_lens,
        block_table=batch["block_table"],
        slot_mapping=slots,
        max_query_len=batch["max_query_len"],
        max_seq_len=batch["max_seq_len"],
        query_start_loc_cpu=qsl,
        seq_lens_cpu=seq_lens,
    )
    backend = TorchAttentionBackend(9, 64, 3, 64**-0.5, use_cpu_kernel=use_kernel)
    cache = (batch["key_cache"].clone(), batch["value_cache"].clone())
    out = backend.forward(batch["query"], key, value, cache, meta)
    assert backend._kernel is use_kernel
    ref = reference_attention(dict(batch, key_cache=cache[0], value_cache=cache[1]))
    err = float((out.double() - ref).norm() / ref.norm())
    assert err < 1e-5, f"relative error {err:.2e} (seed {seed})"


def test_disabled_by_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("ACTORSERVE_CPU_KERNELS", "0")
    assert load_cpu_ops.__wrapped__() is False


def test_an_interrupted_build_is_not_waited_for_and_a_live_one_is(tmp_path) -> None:
    """torch's builder waits forever on a ``lock`` file; one left by a killed build (the
    file alone) is removed at the next load, while a build in progress (a process that
    holds the guard) is waited for. In a copy of the built folder, so nothing rebuilds."""
    import fcntl
    import shutil
    import subprocess
    import sys
    import time

    from torch.utils.cpp_extension import _get_build_directory

    from actorserve_kernels.cpu import _build_name

    built = Path(_get_build_directory(_build_name(), verbose=False))
    env = dict(os.environ, TORCH_EXTENSIONS_DIR=str(tmp_path))
    copy = Path(subprocess.run(
        [sys.executable, "-c", "from torch.utils.cpp_extension import _get_build_directory as g;"
         f"print(g({_build_name()!r}, verbose=False))"],
        env=env, capture_output=True, text=True, check=True).stdout.strip())  # fmt: skip
    shutil.copytree(built, copy, dirs_exist_ok=True)  # (copy2: the mtimes ninja compares)
    (copy / "lock").touch()  # a killed build's
    (copy / "actorserve.guard").unlink(missing_ok=True)
    load = [sys.executable, "-c", "from actorserve_kernels.cpu import load_cpu_ops as f; "
            "print(f())"]  # fmt: skip
    began = time.monotonic()
    done = subprocess.run(load, env=env, capture_output=True, text=True, timeout=120, cwd=REPO)
    alone = time.monotonic() - began
    assert done.stdout.strip() == "True", done.stderr[-2000:]
    assert "removing the build lock of an interrupted build" in done.stderr
    assert not (copy / "lock").exists()

    with open(copy / "actorserve.guard", "a") as guard:  # a build under way, here
        fcntl.flock(guard, fcntl.LOCK_EX)
        (copy / "lock").touch()
        waiting = subprocess.Popen(load, env=env, stdout=subprocess.PIPE,
                                   stderr=subprocess.PIPE, text=True, cwd=REPO)  # fmt: skip
        # twice the time a load took alone: it has started, and waits on the guard
        deadline = time.monotonic() + max(3.0, 2 * alone)
        while waiting.poll() is None and time.monotonic() < deadline:
            time.sleep(0.1)
        assert waiting.poll() is None
        (copy / "lock").unlink()  # the build done
    out, err = waiting.communicate(timeout=120)
    assert out.strip() == "True", err[-2000:]
    assert "removing the build lock" not in err


@pytest.mark.parametrize("rows", [1, 2, 4])
@pytest.mark.parametrize("n, k", [(960, 576), (576, 1536), (49, 64), (17, 16)])
def test_small_linear(rows: int, n: int, k: int) -> None:
    """x @ W.T for 1, 2 and 4 rows, including N that leaves a partial block of rows."""
    seed = secrets.randbits(32)
    gen = torch.Generator().manual_seed(seed)
    x, w = torch.randn(rows, k, generator=gen), torch.randn(n, k, generator=gen)
    out = small_linear(x, w)
    ref = x.double() @ w.double().T
    err = float((out.double() - ref).norm() / ref.norm())
    assert out.shape == (rows, n) and err < 1e-6, f"relative error {err:.2e} (seed {seed})"


def test_small_linear_rejects_unsupported_shapes() -> None:
    with pytest.raises(RuntimeError, match="1, 2 or 4 rows"):
        small_linear(torch.randn(3, 32), torch.randn(8, 32))
    with pytest.raises(RuntimeError, match="multiple of 16"):
        small_linear(torch.randn(1, 24), torch.randn(8, 24))


def _random_blocks(qtype: str, n: int, k: int, seed: int) -> tuple[np.ndarray, np.ndarray]:
    """GGUF blocks of a random [n, k] matrix (rows of varied scale) by gguf's own quantizer,
    and the matrix they stand for by gguf's own dequantizer."""
    from gguf import GGMLQuantizationType, quants

    rng = np.random.default_rng(seed)
    kind = GGMLQuantizationType[qtype]
    if qtype in K_QUANTS:  # gguf-py has no K-quant quantizer: random valid blocks
        from tests.test_model_loader import _random_k_blocks

        blocks = np.ascontiguousarray(_random_k_blocks(rng, kind, (n, k)))
    else:
        w = rng.standard_normal((n, k)).astype(np.float32)
        w *= rng.uniform(0.01, 2.0, (n, 1)).astype(np.float32)
        blocks = np.ascontiguousarray(quants.quantize(w, kind))
    return blocks, quants.dequantize(blocks, kind).reshape(n, k)


K_QUANTS = ("Q4_K", "Q6_K")
PACKED_BLOCK_BYTES = {"Q4_K": 148}  # 6-bit scales and mins unpacked; others as in GGUF


def _k(qtype: str, k: int) -> int:
    """K rounded up to whole blocks of the type (K-quants: super-blocks of 256)."""
    return -(-k // 256) * 256 if qtype in K_QUANTS else k


# Rows of x: one register pass (1-8 with AVX-512), several (9+), expanded W and a GEMM (from
# 1024 rows with AVX-512, or 64 for K-quants and for a matrix too narrow to give each thread
# 4 groups of 16 rows; AVX2 builds from 16, K-quants from 2).
@pytest.mark.parametrize("qtype", list(QUANT_TYPES))
@pytest.mark.parametrize("rows", [1, 2, 3, 8, 9, 16, 21, 70, 1030])
@pytest.mark.parametrize("n, k", [(200, 576), (576, 1536), (17, 32)])
def test_quant_linear_matches_dequantize_then_matmul(qtype: str, rows: int, n: int, k: int) -> None:
    """The quantized linear against an independent reference: gguf's own quantizer and
    dequantizer (numpy), then a float64 matmul. Equal up to fp32 rounding order."""
    seed = secrets.randbits(32)
    k = _k(qtype, k)
    blocks, dequantized = _random_blocks(qtype, n, k, seed)
    x = np.random.default_rng(seed + 1).standard_normal((rows, k)).astype(np.float32)
    ref = x.astype(np.float64) @ dequantized.astype(np.float64).T
    packed = quant_pack(torch.from_numpy(blocks), QUANT_TYPES[qtype], k)
    row_bytes = blocks.shape[1]
    if qtype in PACKED_BLOCK_BYTES:
        row_bytes = k // 256 * PACKED_BLOCK_BYTES[qtype]
    assert packed.numel() == -(-n // 16) * row_bytes * 16  # the same bytes per row (Q4_K: +3 %)
    out = quant_linear(torch.from_numpy(x), packed, QUANT_TYPES[qtype], n)
    assert out.shape == (rows, n)
    # fp32 summation in any order: |error| <= k u sum|x w| (u = 2^-24), per element; a
    # relative norm alone fails on rare cancellations (a 32-term product summing near 0).
    bound = 2 * k * 2.0**-24 * (np.abs(x).astype(np.float64) @ np.abs(dequantized).T) + 1e-30
    excess = float(np.max(np.abs(out.double().numpy() - ref) / bound))
    assert excess <= 1.0, f"{qtype}: error {excess:.2f}x the fp32 bound (seed {seed})"


@pytest.mark.parametrize("qtype", list(QUANT_TYPES))
@pytest.mark.parametrize("rows", [1, 9, 70])
def test_quant_linear_bf16(qtype: str, rows: int) -> None:
    """bf16 x (a --dtype bfloat16 model): a few rows are the fp32 product of x widened,
    rounded to bf16; from 48 rows W is expanded to bf16 for a bf16 GEMM, close to torch's
    own bf16 matmul over the dequantized weights; both close to the float64 product."""
    seed = secrets.randbits(32)
    n, k = 200, _k(qtype, 576)
    blocks, dequantized = _random_blocks(qtype, n, k, seed)
    packed = quant_pack(torch.from_numpy(blocks), QUANT_TYPES[qtype], k)
    x = torch.randn(rows, k, generator=torch.Generator().manual_seed(seed)).bfloat16()
    out = quant_linear(x, packed, QUANT_TYPES[qtype], n)
    assert out.dtype == torch.bfloat16 and out.shape == (rows, n)
    w = torch.from_numpy(dequantized)
    ref = x.double() @ w.double().T
    err = float((out.double() - ref).norm() / ref.norm())
    assert err < 1e-2, f"{qtype}: relative error {err:.2e} (seed {seed})"
    if rows < 16:  # the register kernels on every build: each row's fp32 product, rounded
        widened = torch.cat(
            [quant_linear(x[i : i + 1].float(), packed, QUANT_TYPES[qtype], n) for i in range(rows)]
        )
        assert torch.equal(out, widened.bfloat16()), f"seed {seed}"
    else:  # the GEMM path: from 48 rows (AVX2 builds: from 16)
        theirs = (x @ w.bfloat16().T).double()
        err = float((out.double() - theirs).norm() / theirs.norm())
        assert err < 5e-3, f"{qtype}: {err:.2e} from torch's bf16 matmul (seed {seed})"


@pytest.mark.parametrize("qtype", list(QUANT_TYPES))
def test_quant_dequant_rows_equals_gguf_dequantizer(qtype: str) -> None:
    """Embedding lookups from the packed layout are bit-equal to gguf's dequantized rows."""
    seed = secrets.randbits(32)
    n, k = 37, _k(qtype, 96) * 2
    blocks, dequantized = _random_blocks(qtype, n, k, seed)
    packed = quant_pack(torch.from_numpy(blocks), QUANT_TYPES[qtype], k)
    ids = torch.tensor([0, 5, 16, 17, 36, 5])
    rows = quant_dequant_rows(packed, QUANT_TYPES[qtype], n, k, ids)
    assert torch.equal(rows, torch.from_numpy(dequantized)[ids]), f"seed {seed}"
    with pytest.raises(RuntimeError, match="out of"):
        quant_dequant_rows(packed, QUANT_TYPES[qtype], n, k, torch.tensor([n]))


def _int8_rounded(x: np.ndarray) -> np.ndarray:
    """x as the int8-activation kernels see it: each block of 32 rounded to int8 steps of
    max|x| / 127 (nearest, ties to even), in float64."""
    m, k = x.shape
    xb = x.reshape(m, k // 32, 32)
    d = (np.abs(xb).max(axis=2) / np.float32(127)).astype(np.float32)
    inv = np.divide(np.float32(1), d, out=np.zeros_like(d), where=d != 0)
    q = np.rint(xb * inv[:, :, None])
    return (q * d[:, :, None]).reshape(m, k).astype(np.float64)


@pytest.mark.skipif(not int8_activations_supported(), reason="needs AVX-512 VNNI")
@pytest.mark.parametrize("qtype", ["Q4_0", "Q4_1", "Q8_0"])
@pytest.mark.parametrize("rows", [1, 3, 8, 9, 70])
def test_quant_linear_int8_activations(qtype: str, rows: int) -> None:
    """--cpu-activation-quant int8: equal to the dequantized weights times x rounded to int8
    per block (an independent numpy model of the rounding), and within ~1 % of exact."""
    seed = secrets.randbits(32)
    n, k = 200, 576
    blocks, dequantized = _random_blocks(qtype, n, k, seed)
    x = np.random.default_rng(seed + 1).standard_normal((rows, k)).astype(np.float32)
    x[0, :32] = 0.0  # an all-zero block: scale 0
    kind = QUANT_TYPES[qtype] | INT8_ACTIVATIONS
    packed = quant_pack(torch.from_numpy(blocks), kind, k)
    out = quant_linear(torch.from_numpy(x), packed, kind, n).double().numpy()
    w = dequantized.astype(np.float64).T
    ref, exact = _int8_rounded(x) @ w, x.astype(np.float64) @ w
    err = np.linalg.norm(out - ref) / np.linalg.norm(ref)
    lossy = np.linalg.norm(out - exact) / np.linalg.norm(exact)
    assert err < 1e-6 and 1e-4 < lossy < 2e-2, f"{qtype}: {err:.2e} / {lossy:.2e} (seed {seed})"


@pytest.mark.skipif(not int8_activations_supported(), reason="needs AVX-512 VNNI")
def test_int8_activations_reject_other_types() -> None:
    with pytest.raises(RuntimeError, match="int8 activations: ggml type 12 is not supported"):
        quant_pack(torch.zeros(16, 144, dtype=torch.uint8), 12 | INT8_ACTIVATIONS, 256)
    packed = quant_pack(torch.zeros(16, 18, dtype=torch.uint8), 2 | INT8_ACTIVATIONS, 32)
    with pytest.raises(RuntimeError, match="not supported"):  # lookups read the exact layout
        quant_dequant_rows(packed, 2 | INT8_ACTIVATIONS, 16, 32, torch.tensor([0]))


def test_quant_ops_reject_bad_shapes() -> None:
    blocks = torch.zeros(8, 20, dtype=torch.uint8)  # one Q4_1 block per row: K = 32
    with pytest.raises(RuntimeError, match="must be uint8 \\[rows, 34\\]"):
        quant_pack(blocks, QUANT_TYPES["Q8_0"], 32)
    with pytest.raises(RuntimeError, match="not supported"):
        quant_pack(blocks, 10, 32)  # Q2_K
    with pytest.raises(RuntimeError, match="multiple of 256 for ggml type 14"):
        quant_pack(blocks, QUANT_TYPES["Q6_K"], 32)
    with pytest.raises(RuntimeError, match="multiple of 32"):
        quant_pack(blocks, 3, 16)
    packed = quant_pack(blocks, 3, 32)
    with pytest.raises(RuntimeError, match="must be \\[2, 320\\], got \\[1, 320\\]"):
        quant_linear(torch.randn(1, 32), packed, 3, 17)  # 17 rows need two groups
    with pytest.raises(RuntimeError, match="multiple of 32"):
        quant_linear(torch.randn(1, 16), packed, 3, 8)
    assert torch.equal(quant_linear(torch.randn(2, 32), packed, 3, 8), torch.zeros(2, 8))
    with pytest.raises(RuntimeError, match="2-D x and out"):
        torch.ops.actorserve_cpu.quant_linear(
            torch.empty(2, 8, 2), torch.randn(2, 32), packed, 3, 8
        )
    with pytest.raises(RuntimeError, match="fp32 or bf16 x, and out of the same dtype"):
        torch.ops.actorserve_cpu.quant_linear(
            torch.empty(2, 8), torch.randn(2, 32).half(), packed, 3, 8
        )
    with pytest.raises(RuntimeError, match="fp32 or bf16 x, and out of the same dtype"):
        torch.ops.actorserve_cpu.quant_linear(
            torch.empty(2, 8), torch.randn(2, 32).bfloat16(), packed, 3, 8
        )


def test_model_linear_uses_streaming_op_for_one_token(monkeypatch: pytest.MonkeyPatch) -> None:
    """The model's ``linear`` takes the op at 1-2 tokens and oneDNN otherwise, with the
    same result either way (bias included)."""
    import types

    import actorserve_kernels.cpu
    from services.gpu_worker.model import layers

    calls: list[int] = []

    def counting(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        calls.append(x.shape[0])
        return small_linear(x, weight)

    monkeypatch.setattr(layers, "_cpu_ops", types.SimpleNamespace(small_linear=counting))
    w, b = torch.randn(100, 64), torch.randn(100)
    with torch.inference_mode():
        for rows in (1, 2, 3, 8):
            x = torch.randn(rows, 64)
            got = layers.linear(x, w, b)
            ref = x.double() @ w.double().T + b.double()
            assert float((got.double() - ref).norm() / ref.norm()) < 1e-6
    assert calls == [1, 2]
    monkeypatch.undo()
    assert (
        layers._cpu_op("small_linear") is actorserve_kernels.cpu.small_linear
    )  # resolved once, reused


@pytest.mark.parametrize("tokens", [1, 3, 40])
def test_rms_norm_and_silu_and_mul(tokens: int) -> None:
    """The fused ops against float64 math, with and without the residual add, on a
    strided input (a row view of a wider tensor) and enough tokens to split them."""
    from actorserve_kernels.cpu import rms_norm, silu_and_mul

    seed = secrets.randbits(32)
    gen = torch.Generator().manual_seed(seed)
    hidden, eps = 576, 1e-5
    wide = torch.randn(tokens, hidden + 32, generator=gen)
    x, res = wide[:, :hidden], torch.randn(tokens, hidden, generator=gen)
    w = torch.randn(hidden, generator=gen)

    def ref_norm(v: torch.Tensor) -> torch.Tensor:
        v = v.double()
        return w.double() * v * torch.rsqrt(v.pow(2).mean(-1, keepdim=True) + eps)

    out, total = rms_norm(x, w, eps)
    assert total is x
    assert torch.allclose(out.double(), ref_norm(x), rtol=1e-5, atol=1e-5), f"seed {seed}"
    out, total = rms_norm(x, w, eps, res)
    assert torch.equal(total, x + res)
    assert torch.allclose(out.double(), ref_norm(x.double() + res.double()), rtol=1e-5, atol=1e-5)
    gate_up = torch.randn(tokens, 2 * 1536, generator=gen)
    gate, up = gate_up.double().chunk(2, dim=-1)
    ref = gate * torch.sigmoid(gate) * up
    assert torch.allclose(silu_and_mul(gate_up).double(), ref, rtol=1e-5, atol=1e-6), f"seed {seed}"


def test_ops_reject_bad_indices_and_shapes() -> None:
    """Index tensors and shapes that would read or write outside the tensors are errors."""
    from actorserve_kernels.cpu import rms_norm

    batch, _ = _batch([(20, 1)], block_size=16, heads=(4, 4), head_dim=64, dtype=torch.float32)
    rows, reqs, ctx = _rows(batch)
    args = (batch["query"], batch["key_cache"], batch["value_cache"], batch["block_table"])
    out = torch.empty_like(batch["query"])
    with pytest.raises(RuntimeError, match="context length 0"):
        paged_attention_rows(out, *args, rows, reqs, torch.zeros_like(ctx), 0.1)
    too_long = torch.full_like(ctx, batch["block_table"].shape[1] * 16 + 1)
    with pytest.raises(RuntimeError, match="context length"):
        paged_attention_rows(out, *args, rows, reqs, too_long, 0.1)
    with pytest.raises(RuntimeError, match="request 5 out of range"):
        paged_attention_rows(out, *args, rows, torch.full_like(reqs, 5), ctx, 0.1)
    with pytest.raises(RuntimeError, match="row 9 out of range"):
        paged_attention_rows(out, *args, torch.full_like(rows, 9), reqs, ctx, 0.1)
    with pytest.raises(RuntimeError, match="out must have the query's shape"):
        paged_attention_rows(out[:, :2], *args, rows, reqs, ctx, 0.1)
    with pytest.raises(RuntimeError, match="must be \\[3, 64\\]"):
        rms_norm(torch.randn(3, 64), torch.ones(64), 1e-6, torch.randn(1, 64))


def test_layers_fall_back_on_strided_inputs() -> None:
    """RMSNorm and SwiGLU on inputs the ops do not take (last dim strided) use torch."""
    from services.gpu_worker.model.layers import RMSNorm, silu_and_mul

    norm = RMSNorm(64, 1e-6)
    x = torch.randn(64, 3).t()  # [3, 64], stride (1, 3)
    with torch.inference_mode():
        ref = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6)
        assert torch.allclose(norm(x), ref, atol=1e-6)
        gate_up = torch.randn(8, 3).t()
        g, u = gate_up.chunk(2, dim=-1)
        assert torch.allclose(silu_and_mul(gate_up), torch.nn.functional.silu(g) * u)


@pytest.mark.parametrize("tokens, head_dim", [(1, 64), (40, 128)])
def test_rotary_embedding_in_place(tokens: int, head_dim: int) -> None:
    """The op rotates the q/k heads of a fused qkv tensor in place, as the torch formula
    does, and leaves the v heads alone."""
    from actorserve_kernels.cpu import rotary_embedding_
    from services.gpu_worker.model.layers import RotaryEmbedding

    rope = RotaryEmbedding(head_dim, 256, 10000.0, None)
    positions = torch.randint(0, 256, (tokens,))
    cos, sin = rope.cos_sin(positions, torch.float32)
    qkv = torch.randn(tokens, 12 + 2 * 3, head_dim)
    qk, v = qkv[:, :15], qkv[:, 15:].clone()
    x1, x2 = qk.double().chunk(2, dim=-1)
    ref = qk.double() * cos.double() + torch.cat([x2, x1], dim=-1) * sin.double()
    out = rotary_embedding_(qk, cos, sin)
    assert out.data_ptr() == qkv.data_ptr()
    assert torch.allclose(qkv[:, :15].double(), ref, atol=1e-5)
    assert torch.equal(qkv[:, 15:], v)
