"""Decode attention on CPU: the C++ paged-attention op against the SDPA path
(gather each request's blocks, then ``scaled_dot_product_attention``), one layer of
the default model's heads (9 query / 3 KV heads of 64) over a paged cache whose
blocks sit in random order, with the bytes of K/V each call must read and the
bandwidth that implies; the bandwidth of a plain ``sum`` over a buffer as large as all
layers' caches is printed beside it (same run).

    .venv/bin/python -m bench.attention_cpu [--threads 1] [--shapes 1x512 16x320 64x512]
"""

from __future__ import annotations

import argparse
import time

import torch

from actorserve_kernels.cpu import load_cpu_ops, paged_attention_rows
from bench.forward import _timed
from services.gpu_worker.attention.base import AttentionMetadata
from services.gpu_worker.attention.torch_backend import TorchAttentionBackend

HEADS, KV_HEADS, HEAD_DIM = 9, 3, 64
BLOCK = 16


def bench_shape(batch: int, ctx: int, block: int = BLOCK, layers: int = 1) -> dict:
    blocks = batch * (-(-ctx // block))
    # One cache per layer, visited in turn as a forward pass does: with all layers' K/V
    # larger than the L3 cache, every call streams its K/V from DRAM.
    caches = [
        (torch.randn(blocks + 1, block, KV_HEADS, HEAD_DIM), torch.randn(blocks + 1, block, KV_HEADS, HEAD_DIM))
        for _ in range(layers)
    ]  # fmt: skip
    k_cache, v_cache = caches[0]
    table = (torch.randperm(blocks) + 1).view(batch, -1).int()
    query = torch.randn(batch, HEADS, HEAD_DIM)
    seq = torch.full((batch,), ctx, dtype=torch.int32)
    qsl = torch.arange(batch + 1, dtype=torch.int32)
    meta = AttentionMetadata(qsl, seq, table, torch.full((batch,), -1), 1, ctx, qsl, seq)
    sdpa = TorchAttentionBackend(HEADS, HEAD_DIM, KV_HEADS, HEAD_DIM**-0.5, use_cpu_kernel=False)
    kv = torch.zeros(batch, KV_HEADS, HEAD_DIM)  # written to slot -1: dropped
    cpu = torch.device("cpu")
    out = torch.empty_like(query)
    rows, ctx_lens = torch.arange(batch), torch.full((batch,), ctx)

    def run_sdpa() -> None:
        for c in caches:
            sdpa.forward(query, kv, kv, c, meta)

    def run_op() -> None:
        for kc, vc in caches:
            paged_attention_rows(out, query, kc, vc, table, rows, rows, ctx_lens, HEAD_DIM**-0.5)

    t_sdpa = _timed(run_sdpa, cpu) / layers
    t_op = _timed(run_op, cpu) / layers
    paged_attention_rows(out, query, k_cache, v_cache, table, rows, rows, ctx_lens, HEAD_DIM**-0.5)
    ref = sdpa.forward(query, kv, kv, (k_cache, v_cache), meta)
    err = float((out - ref).norm() / ref.norm())
    kv_bytes = 2 * batch * ctx * KV_HEADS * HEAD_DIM * 4
    flat = torch.randn(2 * k_cache.numel() * layers)
    t_sum = _timed(flat.sum, cpu)
    return {
        "batch": batch,
        "context": ctx,
        "sdpa_ms": t_sdpa * 1e3,
        "op_ms": t_op * 1e3,
        "speedup": t_sdpa / t_op,
        "op_GBps": kv_bytes / t_op / 1e9,
        "sum_GBps": flat.numel() * 4 / t_sum / 1e9,
        "rel_err": err,
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--threads", type=int, default=None)
    p.add_argument("--block-size", type=int, default=BLOCK)
    p.add_argument("--layers", type=int, default=30, help="caches visited in turn (1: cache-hot)")
    p.add_argument("--shapes", nargs="*", default=["1x512", "16x320", "64x512"])
    args = p.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    if not load_cpu_ops():
        raise SystemExit("the C++ op did not build; see the warning above")
    print(
        f"threads={torch.get_num_threads()} block_size={args.block_size}  layers={args.layers}  (times per layer)"
    )
    print("batch x ctx    SDPA path     C++ op   speedup   op K/V GB/s   sum() GB/s   rel err")
    for shape in args.shapes:
        b, c = (int(x) for x in shape.split("x"))
        r = bench_shape(b, c, args.block_size, args.layers)
        print(
            f"{b:5d} x {c:<5d} {r['sdpa_ms']:8.3f} ms {r['op_ms']:8.3f} ms {r['speedup']:7.2f}x"
            f" {r['op_GBps']:12.1f} {r['sum_GBps']:12.1f}   {r['rel_err']:.1e}"
        )
        time.sleep(0.1)


if __name__ == "__main__":
    main()
