"""Triton kernels against a float64 brute-force reference, on fresh random inputs each run.

Without a GPU the kernels run in Triton's interpreter. Triton fixes compiled-or-interpreted
when ``@triton.jit`` decorates a function, so ``actorserve_kernels/__init__.py`` sets
TRITON_INTERPRET=1 on CUDA-less hosts before importing its kernel modules, and the kernels
avoid Triton's own @jit library functions (``tl.max``, ``tl.sum``...), which are fixed when
triton is first imported, possibly earlier (transformers imports it). So the tests work
whichever module imports triton first; two subprocess tests check it and that every
launched variant still compiles for sm_80/sm_90. With a GPU the same tests run compiled on
CUDA (``make gpu-check``).

Every run poisons the output with NaN and fills every cache slot the batch does not own
with NaN, so a row that is not written, or a masked position that leaks into the softmax
or the P·V product, fails the test.
"""

from __future__ import annotations

import importlib.util
import os
import secrets
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import actorserve_kernels
from actorserve_kernels import num_kv_splits, paged_attention, reshape_and_cache

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
TOLERANCE = {torch.float32: 1e-3, torch.float16: 1e-2, torch.bfloat16: 1e-2}


def test_interpreter_mode() -> None:
    from triton.runtime.jit import JITFunction

    kernel = actorserve_kernels.attention._paged_attention_kernel
    if DEVICE.type == "cpu":
        assert os.environ.get("TRITON_INTERPRET") == "1"
        assert not isinstance(kernel, JITFunction), "kernels were compiled, cannot run on CPU"


@pytest.mark.skipif(DEVICE.type != "cpu", reason="interpreter mode is for CPU-only hosts")
def test_kernels_run_when_triton_was_imported_first() -> None:
    """Another module (transformers does) may import triton before TRITON_INTERPRET is set,
    fixing triton's own @jit library functions as compiled; the kernels must still run."""
    script = (
        "import triton.language as tl\n"
        "from triton.runtime.jit import JITFunction\n"
        "assert isinstance(tl.max, JITFunction)\n"
        "import torch\n"
        "from tests.test_kernels import MIXED, check_attention\n"
        "check_attention(MIXED, block_size=8, heads=(6, 2), head_dim=64, dtype=torch.float32)\n"
        "check_attention(MIXED, block_size=8, heads=(6, 2), head_dim=64, dtype=torch.bfloat16,"
        " num_splits=2)\n"
    )
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    root = Path(__file__).resolve().parent.parent
    res = subprocess.run(
        [sys.executable, "-c", script],
        cwd=root,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert res.returncode == 0, res.stderr[-3000:]


@pytest.mark.skipif(DEVICE.type != "cpu", reason="on a GPU the other tests compile every variant")
@pytest.mark.skipif(
    importlib.util.find_spec("triton.backends.nvidia") is None, reason="no CUDA backend in triton"
)
@pytest.mark.parametrize("arch", ["90", pytest.param("80", marks=pytest.mark.slow)])
def test_kernels_compile_for_cuda(arch: str) -> None:
    """The interpreter accepts code the compiler rejects: compile every launched variant
    for sm_<arch> (no GPU needed; ~10 s with a cold Triton cache)."""
    env = dict(os.environ, TRITON_INTERPRET="0", TRITON_DEFAULT_FP_FUSION="1")
    res = subprocess.run(
        [sys.executable, "-m", "actorserve_kernels.compile_check", "--arch", arch],
        cwd=Path(__file__).resolve().parent.parent,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert res.returncode == 0, res.stdout[-4000:] + res.stderr[-2000:]


# ---------------------------------------------------------------- batch construction


def make_batch(
    seqs: list[tuple[int, int]],
    *,
    block_size: int,
    num_q_heads: int,
    num_kv_heads: int,
    head_dim: int,
    dtype: torch.dtype,
    gen: torch.Generator,
) -> dict:
    """A paged batch: ``seqs`` is [(cached tokens, new tokens)] per sequence.

    Physical blocks are a random permutation (pages of a sequence are not adjacent), one
    spare block is left unowned, and every slot no sequence owns holds NaN.
    """
    blocks_per_seq = [-(-(c + n) // block_size) for c, n in seqs]
    num_blocks = sum(blocks_per_seq) + 1
    perm = torch.randperm(num_blocks, generator=gen).tolist()
    shape = (num_blocks, block_size, num_kv_heads, head_dim)
    k_cache = torch.full(shape, float("nan"), dtype=dtype)
    v_cache = torch.full(shape, float("nan"), dtype=dtype)
    block_table = torch.full((len(seqs), max(blocks_per_seq) + 1), -1, dtype=torch.int32)
    for i, ((c, n), nb) in enumerate(zip(seqs, blocks_per_seq, strict=True)):
        ids = perm[:nb]
        perm = perm[nb:]
        block_table[i, :nb] = torch.tensor(ids, dtype=torch.int32)
        k = torch.randn(c + n, num_kv_heads, head_dim, generator=gen).to(dtype)
        v = torch.randn(c + n, num_kv_heads, head_dim, generator=gen).to(dtype)
        for j, b in enumerate(ids):
            lo, hi = j * block_size, min((j + 1) * block_size, c + n)
            k_cache[b, : hi - lo] = k[lo:hi]
            v_cache[b, : hi - lo] = v[lo:hi]
    query_lens = torch.tensor([n for _, n in seqs], dtype=torch.int32)
    query_start_loc = torch.zeros(len(seqs) + 1, dtype=torch.int32)
    query_start_loc[1:] = torch.cumsum(query_lens, 0)
    num_tokens = int(query_start_loc[-1])
    query = torch.randn(num_tokens, num_q_heads, head_dim, generator=gen).to(dtype)
    on = {"device": DEVICE}
    return {
        "query": query.to(**on),
        "key_cache": k_cache.to(**on),
        "value_cache": v_cache.to(**on),
        "block_table": block_table.to(**on),
        "query_start_loc": query_start_loc.to(**on),
        "seq_lens": torch.tensor([c + n for c, n in seqs], dtype=torch.int32, device=DEVICE),
        "max_query_len": int(query_lens.max()),
        "max_seq_len": max(c + n for c, n in seqs),
    }


def reference_attention(batch: dict) -> torch.Tensor:
    """Brute force in float64: gather each sequence's pages, causal softmax per head."""
    q = batch["query"].double().cpu()
    k_cache = batch["key_cache"].double().cpu()
    v_cache = batch["value_cache"].double().cpu()
    block_size, num_kv_heads, head_dim = k_cache.shape[1:]
    group = q.shape[1] // num_kv_heads
    out = torch.empty_like(q)
    qsl = batch["query_start_loc"].tolist()
    for s, seq_len in enumerate(batch["seq_lens"].tolist()):
        pages = batch["block_table"][s, : -(-seq_len // block_size)].long().cpu()
        k = k_cache[pages].reshape(-1, num_kv_heads, head_dim)[:seq_len]
        v = v_cache[pages].reshape(-1, num_kv_heads, head_dim)[:seq_len]
        k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
        qs = q[qsl[s] : qsl[s + 1]]
        q_pos = torch.arange(seq_len - qs.shape[0], seq_len)
        scores = torch.einsum("qhd,khd->hqk", qs, k) * head_dim**-0.5
        scores.masked_fill_(torch.arange(seq_len)[None, :] > q_pos[:, None], float("-inf"))
        out[qsl[s] : qsl[s + 1]] = torch.einsum("hqk,khd->qhd", scores.softmax(-1), v)
    return out


def check_attention(
    seqs, *, block_size, heads, head_dim, dtype, num_splits=None, num_padding_tokens=0
):
    seed = secrets.randbits(32)  # fresh inputs each run; the seed is in every failure message
    gen = torch.Generator().manual_seed(seed)
    num_q_heads, num_kv_heads = heads
    batch = make_batch(
        seqs,
        block_size=block_size,
        num_q_heads=num_q_heads,
        num_kv_heads=num_kv_heads,
        head_dim=head_dim,
        dtype=dtype,
        gen=gen,
    )
    num_tokens = batch["query"].shape[0]
    # Padding rows past query_start_loc[-1] (as a CUDA-graph batch has) must stay untouched.
    padding = torch.randn(num_padding_tokens, *batch["query"].shape[1:], generator=gen)
    padded = dict(batch, query=torch.cat([batch["query"], padding.to(batch["query"])]))
    out = torch.full_like(padded["query"], float("nan"))
    paged_attention(**padded, out=out, num_splits=num_splits)
    assert out[num_tokens:].isnan().all(), f"padding rows were written (seed {seed})"
    out = out[:num_tokens].double().cpu()
    assert not out.isnan().any(), f"rows unwritten or NaN leaked from masked slots (seed {seed})"
    ref = reference_attention(batch)
    err = float((out - ref).norm() / ref.norm())
    assert err < TOLERANCE[dtype], f"relative error {err:.2e} (seed {seed})"


# ---------------------------------------------------------------- paged attention

# (cached tokens, new tokens) per sequence: a prefill from scratch, a chunk whose prefix
# ends mid-block, decodes with and without a prefix, a context ending mid-block.
MIXED = [(0, 7), (13, 5), (20, 1), (0, 1), (9, 1)]
DECODE = [(37, 1), (0, 1), (16, 1), (70, 1)]


@pytest.mark.parametrize(
    "seqs, block_size, heads, head_dim, dtype",
    [
        (MIXED, 16, (2, 2), 64, torch.float32),
        (MIXED, 8, (6, 2), 128, torch.float32),
        (MIXED, 32, (8, 1), 64, torch.bfloat16),
        (MIXED, 16, (3, 1), 128, torch.float16),
        (DECODE, 8, (8, 1), 128, torch.float32),
        (DECODE, 16, (6, 2), 64, torch.bfloat16),
        (MIXED, 1, (4, 2), 64, torch.float32),  # one token per page
    ],
    ids=["mha-b16-d64-fp32", "gqa3-b8-d128-fp32", "gqa8-b32-d64-bf16", "gqa3-b16-d128-fp16",
         "decode-gqa8-b8-d128-fp32", "decode-gqa3-b16-d64-bf16", "gqa2-b1-d64-fp32"],
)  # fmt: skip
def test_paged_attention(seqs, block_size, heads, head_dim, dtype) -> None:
    check_attention(
        seqs,
        block_size=block_size,
        heads=heads,
        head_dim=head_dim,
        dtype=dtype,
        num_padding_tokens=2,
    )


@pytest.mark.parametrize(
    "num_splits, block_size, heads, dtype",
    [(4, 16, (8, 1), torch.float32), (2, 8, (3, 1), torch.bfloat16)],
    ids=["split4-gqa8-fp32", "split2-gqa3-bf16"],
)
def test_split_kv_decode(num_splits, block_size, heads, dtype) -> None:
    # Contexts shorter than num_splits tiles leave some splits empty.
    seqs = [(90, 1), (5, 1), (0, 1), (40, 1)]
    check_attention(
        seqs,
        block_size=block_size,
        heads=heads,
        head_dim=64,
        dtype=dtype,
        num_splits=num_splits,
        num_padding_tokens=3,
    )


def test_split_kv_mixed_batch() -> None:
    # The heuristic splits only decodes, but the kernel must be right for prefill rows too,
    # whose later splits lie wholly past some rows' causal horizon.
    seqs = [*MIXED, (3, 45)]
    check_attention(
        seqs, block_size=8, heads=(6, 2), head_dim=64, dtype=torch.float32, num_splits=4
    )


def test_num_kv_splits_heuristic() -> None:
    sms = 132
    assert num_kv_splits(1, 8, max_query_len=5, max_seq_len=8192, num_sms=sms) == 1  # prefill
    assert num_kv_splits(256, 8, max_query_len=1, max_seq_len=8192, num_sms=sms) == 1  # full GPU
    assert num_kv_splits(1, 8, max_query_len=1, max_seq_len=300, num_sms=sms) == 1  # short
    for batch, ctx in [(1, 2048), (4, 32768), (8, 4096), (1, 1000)]:
        n = num_kv_splits(batch, 8, max_query_len=1, max_seq_len=ctx, num_sms=sms)
        assert n > 1 and n & (n - 1) == 0
        assert ctx // n >= 256 and n <= 16


def test_rejects_bad_shapes() -> None:
    gen = torch.Generator().manual_seed(0)
    kw = dict(block_size=16, num_q_heads=4, num_kv_heads=2, dtype=torch.float32, gen=gen)
    with pytest.raises(ValueError, match="head_dim"):
        paged_attention(**make_batch([(0, 2)], head_dim=48, **kw))
    batch = make_batch([(0, 2)], head_dim=64, **kw)
    batch["key_cache"] = batch["key_cache"][:, :, :1]
    with pytest.raises(ValueError, match="shapes differ"):
        paged_attention(**batch)


@pytest.mark.slow
@pytest.mark.parametrize("block_size", [8, 64, 128])
@pytest.mark.parametrize("heads", [(4, 4), (12, 4), (16, 2)], ids=["gqa1", "gqa3", "gqa8"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_paged_attention_large(block_size, heads, dtype) -> None:
    seqs = [(0, 70), (130, 33), (300, 1), (0, 1), (255, 1), (64, 64)]
    check_attention(seqs, block_size=block_size, heads=heads, head_dim=128, dtype=dtype)


@pytest.mark.slow
@pytest.mark.parametrize("num_splits", [None, 8, 16])
def test_split_kv_decode_large(num_splits) -> None:
    seqs = [(1000, 1), (517, 1), (3, 1)]
    check_attention(
        seqs, block_size=16, heads=(32, 8), head_dim=128, dtype=torch.float16, num_splits=num_splits
    )


# ---------------------------------------------------------------- reshape_and_cache


@pytest.mark.parametrize(
    "block_size, num_kv_heads, head_dim, dtype",
    [(8, 3, 64, torch.float32), (16, 8, 128, torch.bfloat16), (32, 1, 80, torch.float16)],
)
def test_reshape_and_cache(block_size, num_kv_heads, head_dim, dtype) -> None:
    gen = torch.Generator().manual_seed(secrets.randbits(32))
    num_blocks, num_tokens = 6, 21
    # The caches are views into buffers with a guard block on each side, so a padding slot
    # written as block -1 (or past the end) shows up.
    shape = (num_blocks + 2, block_size, num_kv_heads, head_dim)
    k_buf = torch.randn(shape, generator=gen).to(dtype).to(DEVICE)
    v_buf = torch.randn(shape, generator=gen).to(dtype).to(DEVICE)
    slots = torch.randperm(num_blocks * block_size, generator=gen)[:num_tokens]
    slots[torch.randperm(num_tokens, generator=gen)[:5]] = -1  # padding tokens
    # Strided rows, as slices of a fused QKV projection would be.
    kv = torch.randn(num_tokens, 2, num_kv_heads, head_dim, generator=gen).to(dtype)
    key, value = kv[:, 0], kv[:, 1]

    k_ref, v_ref = k_buf.cpu(), v_buf.cpu()
    real = slots >= 0
    k_ref[1:-1].reshape(-1, num_kv_heads, head_dim)[slots[real]] = key[real]
    v_ref[1:-1].reshape(-1, num_kv_heads, head_dim)[slots[real]] = value[real]

    on = {"device": DEVICE}
    reshape_and_cache(key.to(**on), value.to(**on), k_buf[1:-1], v_buf[1:-1], slots.to(**on))
    assert torch.equal(k_buf.cpu(), k_ref) and torch.equal(v_buf.cpu(), v_ref)


def test_reshape_and_cache_casts_to_cache_dtype() -> None:
    key = torch.randn(4, 2, 64, device=DEVICE)
    cache = torch.zeros(2, 8, 2, 64, dtype=torch.bfloat16, device=DEVICE)
    v_cache = cache.clone()
    slots = torch.tensor([3, 0, -1, 15], device=DEVICE)
    reshape_and_cache(key, key, cache, v_cache, slots)
    flat = cache.view(-1, 2, 64)
    # One bf16 ulp: Triton's interpreter truncates where torch and GPUs round to nearest.
    torch.testing.assert_close(flat[[3, 0, 15]].float(), key[[0, 1, 3]], rtol=2**-7, atol=0)
    assert int((flat.abs().sum((1, 2)) != 0).sum()) == 3


# ---------------------------------------------------------------- the attention backend


def test_triton_backend_matches_torch_backend() -> None:
    """Two steps through both backends' ``forward``: the first writes the context, the
    second mixes a prefill chunk and decodes on top of it (one padding token each)."""
    import numpy as np

    from services.gpu_worker.attention import get_attention_backend
    from services.gpu_worker.attention.torch_backend import TorchAttentionBackend
    from services.gpu_worker.model_runner import build_attention_metadata

    heads, kv_heads, head_dim, block_size = 6, 2, 64, 16
    gen = torch.Generator().manual_seed(secrets.randbits(32))
    backends = [
        cls(heads, head_dim, kv_heads, 0.1)
        for cls in (TorchAttentionBackend, get_attention_backend("triton"))
    ]
    computed, scheduled = [np.array([0, 0, 0]), np.array([20, 9, 1])], [[20, 9, 1], [1, 12, 1]]
    final_blocks = -(-(computed[1] + np.array(scheduled[1])) // block_size)  # [2, 2, 1]
    num_blocks = int(final_blocks.sum()) + 1
    perm = torch.randperm(num_blocks, generator=gen).numpy().astype(np.int32)
    table = np.zeros((3, 2), dtype=np.int32)  # scattered pages, fixed for both steps
    table[0], table[1], table[2, 0] = perm[0:2], perm[2:4], perm[4]

    shape = (num_blocks, block_size, kv_heads, head_dim)
    caches = [
        (torch.zeros(shape, device=DEVICE), torch.zeros(shape, device=DEVICE)) for _ in backends
    ]
    for c, n in zip(computed, scheduled, strict=True):
        meta, _, _ = build_attention_metadata(c, np.array(n), table, block_size, DEVICE)
        meta.slot_mapping = torch.cat([meta.slot_mapping, meta.slot_mapping.new_tensor([-1])])
        t = sum(n) + 1
        q, k, v = (
            torch.randn(t, h, head_dim, generator=gen).to(DEVICE)
            for h in (heads, kv_heads, kv_heads)
        )
        ref, got = (be.forward(q, k, v, kv, meta) for be, kv in zip(backends, caches, strict=True))
        torch.testing.assert_close(got[: t - 1], ref[: t - 1], atol=1e-4, rtol=1e-4)
    for ref_kv, got_kv in zip(*caches, strict=True):
        torch.testing.assert_close(got_kv, ref_kv, atol=0, rtol=0)


def _greedy(model, prompt: list[int], num_new: int, block_size: int = 16) -> list[int]:
    """Greedy decoding through a paged cache: the prompt in two chunks, then one token a step."""
    import numpy as np

    from services.gpu_worker.model_runner import build_attention_metadata

    arch = model.arch
    total = len(prompt) + num_new
    num_blocks = -(-total // block_size)
    shape = (num_blocks, block_size, arch.num_key_value_heads, arch.head_dim)
    kv_caches = [
        (torch.zeros(shape, device=DEVICE), torch.zeros(shape, device=DEVICE))
        for _ in range(arch.num_hidden_layers)
    ]
    table = np.arange(num_blocks, dtype=np.int32)[::-1].copy()[None, :]  # pages in reverse
    tokens, computed = list(prompt), 0
    split = len(prompt) // 2
    chunks = [split, len(prompt) - split] + [1] * (num_new - 1)
    with torch.inference_mode():
        for n in chunks:
            meta, _, positions = build_attention_metadata(
                np.array([computed]), np.array([n]), table, block_size, DEVICE
            )
            ids = torch.tensor(tokens[computed : computed + n], device=DEVICE)
            hidden = model(ids, torch.from_numpy(positions).to(DEVICE), meta, kv_caches)
            computed += n
            if computed == len(tokens):
                tokens.append(int(model.compute_logits(hidden[-1:])[0].argmax()))
    return tokens[len(prompt) :]


def test_default_model_greedy_tokens_match_torch_backend(hf_reference) -> None:
    """SmolLM2-135M (GQA 3, head_dim 64) with the triton backend (interpreted on CPU)
    gives the torch backend's greedy tokens, chunked prefill included."""
    from services.gpu_worker.attention import get_attention_backend
    from services.gpu_worker.model.llama import LlamaForCausalLM

    prompt = hf_reference.tokenizer("The capital of France is").input_ids
    results = []
    for name in ("torch", "triton"):
        model = LlamaForCausalLM(hf_reference.arch, get_attention_backend(name))
        model.load_weights(hf_reference.state_dict.items())
        results.append(_greedy(model.to(DEVICE).eval(), prompt, num_new=8))
    assert results[1] == results[0]
