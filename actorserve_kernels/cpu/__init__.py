"""C++ ops for CPU workers, built on first use with torch's extension builder.

- ``paged_attention_rows``: attention of single query rows over the paged KV cache in
  place (the torch attention backend's decode rows; SDPA keeps the prefill rows, as in
  vLLM's CPU backend), plain or quantized (``--kv-cache-dtype``: fp8 e4m3fn / e5m2, int8;
  ``actorserve_kernels/kv_quant.py``), dequantized in registers;
- ``write_kv_cache``: K/V rows into their cache slots, quantized as ``kv_quant.write``
  quantizes them (bit for bit);
- ``small_linear``: a weight-streaming linear for 1-2 tokens (batch-1/2 decode);
- ``quant_linear``: a linear over GGUF-quantized weights (Q4_0, Q4_1, Q8_0 blocks,
  interleaved 16 rows at a time by ``quant_pack``), dequantized in registers, fp32
  accumulation; ``quant_dequant_rows`` expands single rows (embedding lookups);
- ``rms_norm`` (with the residual add), ``silu_and_mul``, ``rotary_embedding_``: the
  per-layer elementwise ops in one pass each;
- ``fused_moe``: a mixture-of-experts layer's experts (``actorserve_kernels/moe.py``),
  the tokens grouped by expert, each expert's GEMMs over its tokens only;
- ``decode_layers``: a decode step's decoder layers in one call, from the ops above
  (the model's fast path for decode-only steps over quantized weights).

They are compiled once per machine and source version (~20 s on 2 cores; ``make install``
does it ahead) into torch's extension cache (``TORCH_EXTENSIONS_DIR``, default
``~/.cache/torch_extensions``); a build killed half-way (its lock file left behind) is
noticed at the next start and redone (``_build_guard``). Without a C++ compiler, or with
``ACTORSERVE_CPU_KERNELS=0``, ``load_cpu_ops()`` returns False and callers use torch ops.
"""

from __future__ import annotations

import contextlib
import fcntl
import functools
import hashlib
import os
import platform
import sys
from collections.abc import Iterator
from pathlib import Path

import torch

from services.logging_utils import init_logger

logger = init_logger(__name__)

_DIR = Path(__file__).parent
_SOURCES = [
    _DIR / name
    for name in (
        "paged_attention.cpp",
        "gemv.cpp",
        "quant_gemv.cpp",
        "elementwise.cpp",
        "decode_layers.cpp",
        "moe.cpp",
    )
]
_FLAGS = ["-O3", "-march=native", "-fopenmp", "-ffp-contract=fast", "-fno-math-errno"]


def _flags() -> list[str]:
    """``_FLAGS`` plus ``$ACTORSERVE_CPU_FLAGS`` (e.g. ``-mno-avx512f``: the AVX2 code path
    on an AVX-512 machine, as on AMD Zen 3)."""
    return _FLAGS + os.environ.get("ACTORSERVE_CPU_FLAGS", "").split()


@functools.cache
def cpu_flags() -> frozenset[str]:
    """This CPU's feature flags (/proc/cpuinfo; empty where there is none)."""
    try:
        with open("/proc/cpuinfo") as f:
            line = next((line for line in f if line.startswith("flags")), "")
    except OSError:
        return frozenset()
    return frozenset(line.partition(":")[2].split())


def bf16_dot_products() -> bool:
    """Whether this CPU multiplies bf16 natively (AVX512_BF16 or AMX-BF16), so oneDNN's bf16
    GEMM runs at about twice the fp32 rate instead of emulated (slower than fp32)."""
    return bool(cpu_flags() & {"avx512_bf16", "amx_bf16"})


def _build_name() -> str:
    """One build folder per CPU and per source text: the build is ``-march=native``, so a
    cache shared by machines with other CPUs must not be reused, and two checkouts with
    different sources sharing the cache must not rebuild each other's library. The
    digest covers the headers too, which torch's builder does not hash."""
    cpu = " ".join(sorted(cpu_flags())) or platform.processor()
    sources = b"".join(p.read_bytes() for p in sorted(_DIR.glob("*.[ch]*")))
    flags = " ".join(_flags()).encode()
    digest = hashlib.sha256(cpu.encode() + b"\0" + flags + b"\0" + sources).hexdigest()[:16]
    return f"actorserve_cpu_ops_{digest}"


@contextlib.contextmanager
def _build_guard(name: str) -> Iterator[None]:
    """Held around torch's build-and-load: an ``flock`` on a file in the build folder, which
    the kernel lets go when its holder dies. torch's builder marks a build with a ``lock``
    file and waits, forever, while one exists; one found while this guard is held was left
    by a build whose process was killed (a first start interrupted by Ctrl-C), since every
    live builder holds the guard: it is removed at once. Processes that start together (a
    TP group's ranks) take turns: the first builds, the others load what it built."""
    from torch.utils.cpp_extension import _get_build_directory

    build = Path(_get_build_directory(name, verbose=False))
    with open(build / "actorserve.guard", "a") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        lock = build / "lock"
        if lock.exists():
            logger.warning("removing the build lock of an interrupted build: %s", lock)
            lock.unlink(missing_ok=True)
        yield


@functools.cache
def load_cpu_ops() -> bool:
    """Build (once) and load the ops into ``torch.ops.actorserve_cpu``; True on success."""
    if os.environ.get("ACTORSERVE_CPU_KERNELS", "1") == "0":
        return False
    # The `ninja` wheel puts its binary beside the interpreter, which is not on PATH
    # unless the venv is activated; torch's builder looks for it on PATH.
    bin_dir = os.path.dirname(sys.executable)
    if bin_dir not in os.environ.get("PATH", "").split(os.pathsep):
        os.environ["PATH"] = bin_dir + os.pathsep + os.environ.get("PATH", "")
    try:
        from torch.utils.cpp_extension import load

        name = _build_name()
        with _build_guard(name):
            load(
                name=name,
                sources=[str(p) for p in _SOURCES],
                extra_cflags=_flags(),
                extra_ldflags=["-fopenmp"],
                is_python_module=False,
                verbose=False,
            )
    except Exception as e:  # no compiler, no ninja, a build error: plain torch still works
        errors = [line for line in str(e).splitlines() if "error" in line.lower()]
        logger.warning(
            "C++ CPU kernels unavailable (%s); using torch ops instead",
            errors[0] if errors else type(e).__name__,
        )
        logger.debug("C++ build output:\n%s", e)
        return False
    return True


def paged_attention_rows(
    out: torch.Tensor,
    query: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    block_table: torch.Tensor,
    rows: torch.Tensor,
    reqs: torch.Tensor,
    ctx_lens: torch.Tensor,
    scale: float,
    k_scale: float = 1.0,
    v_scale: float = 1.0,
) -> None:
    """out[rows[i]] = attention of query[rows[i]] over the first ctx_lens[i] cached
    positions of request reqs[i] (its row of ``block_table``), for every i.

    ``query``/``out`` [T, heads, D] (last dim contiguous), caches [blocks, block_size,
    kv_heads, D] contiguous, ``block_table`` int32, the index tensors int64. D is 64 or 128.
    The caches are the query's dtype, or quantized as ``kv_quant`` describes: float8_e4m3fn
    / float8_e5m2 of that shape read ``float(stored) * k_scale`` (``v_scale`` for V: the
    layer's scales), or int8 [blocks, block_size, kv_heads, D + 4] whose rows carry their
    own scales (``k_scale``/``v_scale`` unused); fp32, bf16 or fp16 queries. Each element
    is dequantized to the fp32 value ``kv_quant.dequantize`` gives, so the result is the
    op's on an fp32 cache holding those values. Requires ``load_cpu_ops()`` to have
    returned True.
    """
    torch.ops.actorserve_cpu.paged_attention_rows(
        out,
        query,
        key_cache,
        value_cache,
        block_table,
        rows,
        reqs,
        ctx_lens,
        scale,
        k_scale,
        v_scale,
    )


def write_kv_cache(
    key: torch.Tensor,
    value: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    slots: torch.Tensor,
    k_scale: float = 1.0,
    v_scale: float = 1.0,
) -> None:
    """Token t's ``key``/``value`` rows ([T, kv_heads, D], fp32/bf16/fp16, last dim
    contiguous) into cache slot ``slots[t]`` (int64; negative: skipped), quantized for an
    fp8 (with the layer's ``k_scale``/``v_scale``) or int8 cache exactly as
    ``kv_quant.write`` does, copied for a cache of their own dtype. Requires
    ``load_cpu_ops()`` to have returned True."""
    torch.ops.actorserve_cpu.write_kv_cache(
        key, value, key_cache, value_cache, slots, k_scale, v_scale
    )


def small_linear(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """``x @ weight.T`` for fp32 ``x`` [M, K] with M in (1, 2, 4) and K a multiple of 16
    (``weight`` [N, K], contiguous), streaming the weight at memory bandwidth.
    Requires ``load_cpu_ops()`` to have returned True."""
    out = x.new_empty(x.shape[0], weight.shape[0])
    torch.ops.actorserve_cpu.small_linear(out, x, weight)
    return out


# ggml type ids the quant ops read; K-quants need K a multiple of 256 (their super-block)
QUANT_TYPES = {"Q4_0": 2, "Q4_1": 3, "Q8_0": 8, "Q4_K": 12, "Q6_K": 14}


# ORed into a Q4_0/Q4_1/Q8_0 type id: the layout and op for int8 activations (AVX-512 VNNI,
# x rounded to int8 per block of 32; not exact). ``quant_pack`` and ``quant_linear`` take it.
INT8_ACTIVATIONS = 256
INT8_ACTIVATION_TYPES = frozenset(QUANT_TYPES[t] for t in ("Q4_0", "Q4_1", "Q8_0"))


@functools.cache
def int8_activations_supported() -> bool:
    """Whether this CPU and build run ``quant_linear`` with ``INT8_ACTIVATIONS``."""
    if not load_cpu_ops():
        return False
    try:
        packed = quant_pack(torch.zeros(16, 18, dtype=torch.uint8), 2 | INT8_ACTIVATIONS, 32)
        quant_linear(torch.zeros(1, 32), packed, 2 | INT8_ACTIVATIONS, 16)
    except RuntimeError:
        return False
    return True


def quant_pack(blocks: torch.Tensor, ggml_type: int, k: int) -> torch.Tensor:
    """A weight ``W`` [N, K] given as its GGUF blocks (uint8 [N, K / 32 * block bytes] of
    ggml type ``ggml_type``, ``QUANT_TYPES``) in the layout ``quant_linear`` reads: the
    blocks of 16 rows interleaved, same bits, same size (Q4_K: 148 bytes per 256 weights
    instead of 144, its 6-bit scales unpacked to bytes; + zero rows up to a multiple of
    16). Requires ``load_cpu_ops()`` to have returned True."""
    return torch.ops.actorserve_cpu.quant_pack(blocks, ggml_type, k)  # type: ignore[no-any-return]


def quant_linear(x: torch.Tensor, packed: torch.Tensor, ggml_type: int, n: int) -> torch.Tensor:
    """``x @ W.T`` for fp32 ``x`` [M, K] and ``W`` [n, K] packed by ``quant_pack``: equal
    to the dequantized weight's fp32 product up to rounding order (bf16 ``x``: see
    ``QuantWeight.linear``). Requires
    ``load_cpu_ops()`` to have returned True."""
    out = x.new_empty(x.shape[0], n)
    torch.ops.actorserve_cpu.quant_linear(out, x, packed, ggml_type, n)
    return out


def quant_dequant_rows(
    packed: torch.Tensor, ggml_type: int, n: int, k: int, ids: torch.Tensor
) -> torch.Tensor:
    """Rows ``ids`` (int64) of ``W`` [n, k] packed by ``quant_pack``, dequantized to fp32
    [len(ids), k] (embedding lookups). Requires ``load_cpu_ops()`` to have returned True."""
    return torch.ops.actorserve_cpu.quant_dequant_rows(packed, ggml_type, n, k, ids)  # type: ignore[no-any-return]


def decode_layers(*args: object) -> tuple[torch.Tensor, torch.Tensor]:
    """``torch.ops.actorserve_cpu.decode_layers`` (see ``services/gpu_worker/model/llama.py``
    and ``decode_layers.cpp``). The KV caches may be quantized (fp8 e4m3fn / e5m2, int8
    rows, as ``kv_quant`` stores them; K/V written as ``kv_quant.write`` writes them); fp8
    caches need two trailing lists, every layer's K and V scales (``k_scales``,
    ``v_scales``: floats). Requires ``load_cpu_ops()`` to have returned True."""
    return torch.ops.actorserve_cpu.decode_layers(*args)  # type: ignore[no-any-return]


def rms_norm(
    x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """(rms_norm(x + residual) * weight, x + residual) for fp32 or bf16 [T, H] (residual optional:
    then the second result is ``x`` itself), in one pass. Requires ``load_cpu_ops()``."""
    out = torch.empty_like(x)
    if residual is None:
        torch.ops.actorserve_cpu.add_rms_norm(out, x.new_empty(0, x.shape[1]), x, None, weight, eps)
        return out, x
    total = torch.empty_like(x)
    torch.ops.actorserve_cpu.add_rms_norm(out, total, x, residual, weight, eps)
    return out, total


def silu_and_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """silu(gate) * up for fp32 or bf16 ``gate_up`` = [gate | up] [T, 2D], in one pass."""
    out = gate_up.new_empty(gate_up.shape[0], gate_up.shape[1] // 2)
    torch.ops.actorserve_cpu.silu_and_mul(out, gate_up)
    return out


def rotary_embedding_(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate fp32 or bf16 ``x`` [T, heads, D] in place (neox style) with the model's (cos | cos) and
    (-sin | sin) rows ``cos``/``sin`` [T, 1, D]; D a multiple of 32. Returns ``x``."""
    torch.ops.actorserve_cpu.rotary_embedding(x, cos, sin)
    return x


def fused_moe(
    hidden: torch.Tensor,
    w13: torch.Tensor,
    w2: torch.Tensor,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
) -> torch.Tensor:
    """``actorserve_kernels.moe.fused_experts_ref``'s result: for fp32 or bf16 ``hidden``
    [T, H], ``w13`` [E, 2I, H] (gate rows, then up rows), ``w2`` [E, H, I] (one dtype),
    ``topk_weights`` [T, k] (read as fp32) and ``topk_ids`` [T, k] (int32/int64),
    ``out[t] = sum_j topk_weights[t, j] * down_e(silu(gate_e(x)) * up_e(x))``,
    ``e = topk_ids[t, j]``. The pairs are grouped by expert; an expert with 1-4 tokens
    streams its weights (fp32 accumulation, fp32 activation), one with more runs
    ``at::linear`` on its gathered tokens in the hidden dtype, as the reference does; each
    token's k rows are summed in fp32 in a fixed order (by expert id, as the reference
    adds them) and rounded once, so the result does not depend on thread scheduling.
    Requires ``load_cpu_ops()`` to have returned True."""
    out = torch.empty_like(hidden, memory_format=torch.contiguous_format)
    torch.ops.actorserve_cpu.fused_moe(out, hidden, w13, w2, topk_weights, topk_ids)
    return out
