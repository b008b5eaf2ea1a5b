"""Forward-pass speed of the default model: decode steps at batch 1/16/64 and prefill
tokens/s, each with achieved GFLOP/s beside a plain fp32 matmul's in the same run.

    .venv/bin/python -m bench.forward [--device cpu|cuda] [--threads N] [--context 512]

FLOPs = 2 * linear params * tokens (+ the LM head on sampled rows) + attention
(QK^T and PV: 4 * heads * head_dim per query per context position).
"""

from __future__ import annotations

import argparse
import time

import numpy as np
import torch

from services.config import EngineConfig, ModelArchConfig
from services.gpu_worker.model_runner import ModelRunner, build_attention_metadata
from services.model_loader import load_hf_config, prepare_model


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _timed(fn, device: torch.device, min_time: float = 1.0, min_iters: int = 3) -> float:
    """Median-free but warm: seconds per call after one warm-up call."""
    fn()
    _sync(device)
    iters, start = 0, time.perf_counter()
    while iters < min_iters or time.perf_counter() - start < min_time:
        fn()
        iters += 1
    _sync(device)
    return (time.perf_counter() - start) / iters


def matmul_gflops(device: torch.device, dtype: torch.dtype, n: int = 2048) -> float:
    a, b = (
        torch.randn(n, n, device=device, dtype=dtype),
        torch.randn(n, n, device=device, dtype=dtype),
    )
    return 2 * n**3 / _timed(lambda: a @ b, device) / 1e9


def step_flops(arch: ModelArchConfig, q_lens: np.ndarray, ctx: np.ndarray, sampled: int) -> float:
    h, kv, d = arch.hidden_size, arch.num_key_value_heads * arch.head_dim, arch.head_dim
    q = arch.num_attention_heads * d
    per_layer = h * (q + 2 * kv) + q * h + 3 * h * arch.intermediate_size
    linear = 2 * per_layer * arch.num_hidden_layers * int(q_lens.sum())
    lm_head = 2 * arch.vocab_size * h * sampled
    # Query i of a request sees ctx + i + 1 positions.
    attended = float((q_lens * ctx + q_lens * (q_lens + 1) / 2).sum())
    attn = 4 * arch.num_attention_heads * d * attended * arch.num_hidden_layers
    return linear + lm_head + attn


def bench_step(runner: ModelRunner, q_lens: np.ndarray, ctx: np.ndarray) -> tuple[float, float]:
    """(seconds per step, FLOPs per step) for requests with ``ctx`` cached tokens each
    computing ``q_lens`` new ones; every request samples one row."""
    bs, device = runner.block_size, runner.device
    blocks = -(-(ctx + q_lens) // bs)
    table = np.zeros((len(q_lens), int(blocks.max())), dtype=np.int32)
    start = 0
    for i, n in enumerate(blocks):
        table[i, :n] = np.arange(start, start + n)
        start += n
    if start > runner.num_blocks:
        runner.initialize_kv_cache(start)
    meta, _, positions = build_attention_metadata(ctx, q_lens, table, bs, device)
    ids = torch.randint(0, runner.arch.vocab_size, (int(q_lens.sum()),), device=device)
    pos = torch.from_numpy(positions).to(device)
    last = torch.from_numpy(np.cumsum(q_lens) - 1).to(device)

    def step() -> None:
        meta.backend_state.clear()
        with torch.inference_mode():
            hidden = runner.model(ids, pos, meta, runner.kv_caches)
            runner.model.compute_logits(hidden[last])

    return _timed(step, device), step_flops(runner.arch, q_lens, ctx, len(q_lens))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="auto")
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--context", type=int, default=512, help="cached tokens per decode request")
    parser.add_argument("--prefill", type=int, default=512, help="prompt tokens per prefill step")
    parser.add_argument("--attention-backend", default=None)
    args = parser.parse_args()
    folder = prepare_model(None)
    arch = ModelArchConfig.from_hf_config(load_hf_config(folder))
    config = EngineConfig.from_kwargs(
        device=args.device, dtype=args.dtype, num_threads=args.threads,
        attention_backend=args.attention_backend,
    )  # fmt: skip
    config.finalize(arch)
    runner = ModelRunner(config, folder)
    runner.initialize_kv_cache(1)
    device = runner.device
    base = matmul_gflops(device, torch.float32)
    print(f"device={device} dtype={runner.dtype} threads={torch.get_num_threads()} "
          f"attention={runner.attn_backend.name}")  # fmt: skip
    print(f"plain torch.float32 2048^3 matmul: {base:8.1f} GFLOP/s")
    if runner.dtype != torch.float32:
        print(
            f"plain {runner.dtype} 2048^3 matmul: {matmul_gflops(device, runner.dtype):8.1f} GFLOP/s"
        )
    for batch in (1, 16, 64):
        q_lens, ctx = np.ones(batch, dtype=np.int64), np.full(batch, args.context, dtype=np.int64)
        sec, flops = bench_step(runner, q_lens, ctx)
        print(f"decode batch {batch:3d} (ctx {args.context}): {sec * 1e3:8.2f} ms/step "
              f"{batch / sec:9.1f} tok/s {flops / sec / 1e9:8.1f} GFLOP/s "
              f"({100 * flops / sec / 1e9 / base:.0f}% of matmul)")  # fmt: skip
    sec, flops = bench_step(runner, np.array([args.prefill]), np.array([0]))
    print(f"prefill {args.prefill} tokens:        {sec * 1e3:8.2f} ms/step "
          f"{args.prefill / sec:9.1f} tok/s {flops / sec / 1e9:8.1f} GFLOP/s "
          f"({100 * flops / sec / 1e9 / base:.0f}% of matmul)")  # fmt: skip


if __name__ == "__main__":
    main()
