"""Compile every kernel variant the wrappers launch for a CUDA target, without a GPU.

    TRITON_INTERPRET=0 python -m actorserve_kernels.compile_check [--arch 80 90]

The interpreter (how the CPU tests run the kernels) accepts code that the compiler
rejects (a variable changing dtype across an ``if``, a ``tl.dot`` under 16 wide), so this
runs the public wrappers on small CPU tensors with the kernel launches intercepted and
hands each launch to ``triton.compile`` for each ``sm_<arch>``, Triton's bundled ptxas
included.
Positional launch arguments are runtime values and keyword ones constexprs, as the
wrappers pass them (``num_warps`` and ``num_stages`` are compiler options). Exit status 0 when all compile, 2 when the kernels were interpreted
(``kernels`` turns the interpreter on for CPU-only hosts unless TRITON_INTERPRET=0).

fp8 e4m3 KV caches (``--kv-cache-dtype fp8``) need sm_89+: Triton refuses fp8e4nv before
Ada ("type fp8e4nv not supported in this architecture"), so those variants are skipped,
with a note, for older targets. e5m2 compiles everywhere (before sm_89 Triton converts
fp32 to e5m2 in software, through fp16).
"""

from __future__ import annotations

import argparse
import sys
import time
from typing import Any

import torch
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from triton.runtime.jit import JITFunction

import actorserve_kernels.attention as attention
import actorserve_kernels.fused as fused
import actorserve_kernels.fused_moe_triton as fused_moe_triton
import actorserve_kernels.kv_cache as kv_cache
from actorserve_kernels import kv_quant

_TYPES = {torch.float32: "fp32", torch.float16: "fp16", torch.bfloat16: "bf16",
          torch.int32: "i32", torch.int64: "i64", torch.int8: "i8",
          torch.float8_e4m3fn: "fp8e4nv", torch.float8_e5m2: "fp8e5"}  # fmt: skip


# Triton has no fp8 e4m3 (fp8e4nv) before Ada.
_FP8E4NV_MIN_ARCH = 89

# Launch keywords that are compiler options, not the kernel's constexprs.
_LAUNCH_OPTIONS = ("num_warps", "num_stages")


class _Capture:
    """Stands in for a JIT function: records each ``kernel[grid](...)`` launch."""

    def __init__(self, fn: Any) -> None:
        self.fn = fn
        self.launches: list[tuple[tuple, dict]] = []

    def __getitem__(self, grid: Any):
        return lambda *args, **kwargs: self.launches.append((args, kwargs))


def _source(fn: Any, args: tuple, constexprs: dict) -> ASTSource:
    signature: dict[str, str] = {}
    for name, value in zip(fn.arg_names, args, strict=False):
        if isinstance(value, torch.Tensor):
            signature[name] = "*" + _TYPES[value.dtype]
        elif isinstance(value, float):
            signature[name] = "fp32"
        else:
            signature[name] = "i32" if -(2**31) <= value < 2**31 else "i64"
    signature |= dict.fromkeys(constexprs, "constexpr")
    return ASTSource(fn=fn, signature=signature, constexprs=constexprs)


def _launch_variants() -> list[tuple[str, Any, tuple, dict]]:
    """Run the wrappers on CPU tensors with the launches captured."""
    kernels = [
        (attention, "_paged_attention_kernel"),
        (attention, "_reduce_splits_kernel"),
        (kv_cache, "_reshape_and_cache_kernel"),
        (fused, "_rms_norm_kernel"),
        (fused, "_silu_and_mul_kernel"),
        (fused, "_rotary_and_cache_kernel"),
        (fused_moe_triton, "_moe_align_kernel"),
        (fused_moe_triton, "_fused_moe_kernel"),
    ]
    captures = [(mod, name, _Capture(getattr(mod, name))) for mod, name in kernels]
    for mod, name, cap in captures:
        setattr(mod, name, cap)
    try:
        # (dtype, q heads, kv heads, head_dim, block_size, query lens, num_splits)
        for dtype, hq, hkv, d, bs, q_lens, splits in [
            (torch.bfloat16, 32, 8, 128, 16, [7, 1], None),  # prefill + decode
            (torch.bfloat16, 32, 8, 128, 16, [1, 1], 4),  # split-KV decode
            (torch.float16, 9, 3, 64, 8, [5, 1], None),  # GQA 3
            (torch.float32, 8, 1, 64, 32, [1, 1], None),  # fp32: ieee dot
        ]:
            q = torch.empty(sum(q_lens), hq, d, dtype=dtype)
            cache = torch.empty(4, bs, hkv, d, dtype=dtype)
            qsl = torch.tensor([0, q_lens[0], sum(q_lens)], dtype=torch.int32)
            seq_lens = torch.tensor([9, 40], dtype=torch.int32)
            table = torch.zeros(2, 4, dtype=torch.int32)
            attention.paged_attention(
                q, cache, cache, table, qsl, seq_lens, max(q_lens), 40, num_splits=splits
            )
            kv = torch.empty(sum(q_lens), hkv, d, dtype=dtype)
            slots = torch.zeros(sum(q_lens), dtype=torch.int64)
            kv_cache.reshape_and_cache(kv, kv, cache, cache, slots)
            # The fused ops, at a Llama-3-8B width (4096, MLP 14336) and at SmolLM2's (576).
            hidden = 4096 if d == 128 else 576
            x = torch.empty(sum(q_lens), hidden, dtype=dtype)
            weight = torch.empty(hidden, dtype=dtype)
            fused.rms_norm(x, weight, 1e-5)
            fused.rms_norm(x, weight, 1e-5, residual=x)
            fused.silu_and_mul(torch.empty(sum(q_lens), 2 * 3 * hidden, dtype=dtype))
            qkv = torch.empty(sum(q_lens), hq + 2 * hkv, d, dtype=dtype)
            cos = torch.empty(sum(q_lens), 1, d, dtype=dtype)
            fused.rotary_and_cache(qkv[:, : hq + hkv], qkv[:, hq + hkv :], cos, cos, hq,
                                   cache, cache, slots)  # fmt: skip
        # Quantized KV caches (--kv-cache-dtype): the attention, write and rotary kernels.
        # (model dtype, cache, q heads, kv heads, head_dim, query lens, num_splits)
        for dtype, name, hq, hkv, d, q_lens, splits in [
            (torch.bfloat16, "fp8_e4m3", 32, 8, 128, [7, 1], None),
            (torch.bfloat16, "fp8_e4m3", 32, 8, 128, [1, 1], 4),
            (torch.bfloat16, "fp8_e5m2", 32, 8, 128, [7, 1], None),
            (torch.bfloat16, "int8", 32, 8, 128, [7, 1], None),
            (torch.bfloat16, "int8", 32, 8, 128, [1, 1], 4),
            (torch.float16, "fp8_e4m3", 9, 3, 64, [5, 1], None),
            (torch.float32, "fp8_e4m3", 8, 1, 64, [1, 1], None),
            (torch.float32, "int8", 8, 1, 64, [1, 1], None),
        ]:
            q = torch.empty(sum(q_lens), hq, d, dtype=dtype)
            width = kv_quant.row_width(name, d)
            cache = torch.empty(4, 16, hkv, width, dtype=kv_quant.storage_dtype(name, dtype))
            scale = torch.ones(1)
            qsl = torch.tensor([0, q_lens[0], sum(q_lens)], dtype=torch.int32)
            seq_lens = torch.tensor([9, 40], dtype=torch.int32)
            table = torch.zeros(2, 4, dtype=torch.int32)
            attention.paged_attention(q, cache, cache, table, qsl, seq_lens, max(q_lens), 40,
                                      num_splits=splits, k_scale=scale, v_scale=scale)  # fmt: skip
            kv = torch.empty(sum(q_lens), hkv, d, dtype=dtype)
            slots = torch.zeros(sum(q_lens), dtype=torch.int64)
            kv_cache.reshape_and_cache(kv, kv, cache, cache, slots, scale, scale)
            qkv = torch.empty(sum(q_lens), hq + 2 * hkv, d, dtype=dtype)
            cos = torch.empty(sum(q_lens), 1, d, dtype=dtype)
            fused.rotary_and_cache(qkv[:, : hq + hkv], qkv[:, hq + hkv :], cos, cos, hq,
                                   cache, cache, slots, scale, scale)  # fmt: skip
        # Fused MoE: the alignment kernel (small batches) and both GEMMs (TOP_K gather;
        # MUL_ROUTED_WEIGHT) of each block config. (dtype, tokens, top_k, experts): decode
        # and prefill, Qwen3-MoE's k 8 of 128 experts and Mixtral's 2 of 8 (sizes small:
        # only dtypes and constexprs matter; int32 ids for Mixtral's).
        for dtype, tokens, top_k, experts in [
            (torch.bfloat16, 4, 8, 128),
            (torch.bfloat16, 4, 8, 256),  # DeepSeek-V3's 8 of 256
            (torch.bfloat16, 1024, 8, 128),
            (torch.bfloat16, 2, 2, 8),
            (torch.float16, 256, 2, 8),
            (torch.float32, 2, 2, 8),
            (torch.float32, 256, 2, 8),
        ]:
            hidden, inter = 256, 96
            x = torch.empty(tokens, hidden, dtype=dtype)
            w13 = torch.empty(experts, 2 * inter, hidden, dtype=dtype)
            w2 = torch.empty(experts, hidden, inter, dtype=dtype)
            ids = torch.arange(tokens * top_k).reshape(tokens, top_k) % experts
            ids = ids.int() if experts == 8 else ids
            fused_moe_triton.fused_moe(x, w13, w2, torch.ones(tokens, top_k), ids)
    finally:
        for mod, name, cap in captures:
            setattr(mod, name, cap.fn)
    return [(name, cap.fn, a, kw) for _, name, cap in captures for a, kw in cap.launches]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="compile the kernels for a CUDA target")
    parser.add_argument("--arch", type=int, nargs="+", default=[80, 90], help="e.g. 80 90")
    args = parser.parse_args(argv)
    if not isinstance(attention._paged_attention_kernel, JITFunction):
        print("the kernels were set up for the interpreter: run with TRITON_INTERPRET=0")
        return 2
    seen, skipped, failed = set(), set(), 0
    launches = _launch_variants()
    for arch, (name, fn, launch_args, kwargs) in ((a, v) for a in args.arch for v in launches):
        options = {k: kwargs[k] for k in _LAUNCH_OPTIONS if k in kwargs}
        constexprs = {k: v for k, v in kwargs.items() if k not in _LAUNCH_OPTIONS}
        source = _source(fn, launch_args, constexprs)
        key = repr((arch, name, source.signature, constexprs, options))
        if arch < _FP8E4NV_MIN_ARCH and "*fp8e4nv" in source.signature.values():
            if key not in skipped:
                skipped.add(key)
                print(f"sm_{arch} {name} {constexprs | options}: skipped (fp8 e4m3 needs sm_89+)")
            continue
        if key in seen:
            continue
        seen.add(key)
        start = time.monotonic()
        try:
            compiled = triton.compile(source, target=GPUTarget("cuda", arch, 32), options=options)
            detail = f"{compiled.metadata.shared} B shared"
        except Exception as e:  # report every variant, not just the first failure
            failed += 1
            detail = f"FAILED\n{e}"
        print(
            f"sm_{arch} {name} {constexprs | options}: {detail} ({time.monotonic() - start:.1f} s)"
        )
    note = f" ({len(skipped)} fp8 e4m3 variants skipped: sm_89+ only)" if skipped else ""
    print(f"{len(seen) - failed}/{len(seen)} variants compiled{note}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
