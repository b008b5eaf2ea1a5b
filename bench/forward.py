"""Forward-pass speed of the default model: decode steps at batch 1/16/64 and prefill
tokens/s, each with achieved GFLOP/s beside a plain fp32 matmul's in the same run; then
whole ``ModelRunner.execute`` decode steps (metadata, forward, LM head, greedy sampler)
of a W1-like batch (``--runner-batch`` requests, ``--runner-prompt`` prompt tokens).

    .venv/bin/python -m bench.forward [--device cpu|cuda] [--threads N] [--context 512]
    .venv/bin/python -m bench.forward --profile 16   # torch.profiler table of one decode step

Times are medians of per-call times (``--stat min`` for the least disturbed call:
steadier when other processes load a shared machine).
FLOPs = 2 * linear params * tokens (+ the LM head on sampled rows) + attention
(QK^T and PV: 4 * heads * head_dim per query per context position).
"""

from __future__ import annotations

import argparse
import os
import time
from collections.abc import Callable

import numpy as np
import torch

from services.config import EngineConfig, ModelArchConfig
from services.gpu_worker.model_runner import ModelRunner, build_attention_metadata
from services.model_loader import load_hf_config, prepare_model
from services.protocol import NewRequest, RunningRequestDelta, SamplingParams, StepPlan


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


_STATS = {"median": np.median, "min": np.min}
_stat = _STATS["median"]


def _timed(fn, device: torch.device, min_time: float = 1.0, min_iters: int = 5) -> float:
    """Seconds per call (median, or ``--stat``) after one warm-up call."""
    fn()
    _sync(device)
    times: list[float] = []
    start = time.perf_counter()
    while len(times) < min_iters or time.perf_counter() - start < min_time:
        t0 = time.perf_counter()
        fn()
        _sync(device)
        times.append(time.perf_counter() - t0)
    return float(_stat(times))


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


def make_step(runner: ModelRunner, q_lens: np.ndarray, ctx: np.ndarray) -> Callable[[], None]:
    """One forward + LM head of requests with ``ctx`` cached tokens each computing
    ``q_lens`` new ones; every request samples one row."""
    bs, device = runner.block_size, runner.device
    blocks = -(-(ctx + q_lens) // bs)
    table = np.zeros((len(q_lens), int(blocks.max())), dtype=np.int32)
    start = 0
    for i, n in enumerate(blocks):
        table[i, :n] = np.arange(start, start + n)
        start += n
    if start > runner.num_blocks:
        runner.initialize_kv_cache(start)
    # Write the context's K/V: on CPU a fresh cache is untouched pages, which read as the
    # shared zero page and would make attention look almost free.
    for k_cache, v_cache in runner.kv_caches:
        k_cache[:start].uniform_(-1, 1)
        v_cache[:start].uniform_(-1, 1)
    meta, _, positions = build_attention_metadata(ctx, q_lens, table, bs, device)
    ids = torch.randint(0, runner.arch.vocab_size, (int(q_lens.sum()),), device=device)
    pos = torch.from_numpy(positions).to(device)
    last = torch.from_numpy(np.cumsum(q_lens) - 1).to(device)

    def step() -> None:
        meta.backend_state.clear()
        with torch.inference_mode():
            hidden = runner.model(ids, pos, meta, runner.kv_caches)
            runner.model.compute_logits(hidden[last])

    return step


def bench_step(runner: ModelRunner, q_lens: np.ndarray, ctx: np.ndarray) -> tuple[float, float]:
    """(seconds per ``make_step`` step, FLOPs per step)."""
    step = make_step(runner, q_lens, ctx)
    return _timed(step, runner.device), step_flops(runner.arch, q_lens, ctx, len(q_lens))


def profile_decode(runner: ModelRunner, batch: int, context: int) -> None:
    """Print torch.profiler's op table for one decode step of ``batch`` requests."""
    step = make_step(runner, np.ones(batch, dtype=np.int64), np.full(batch, context))
    step()
    with torch.profiler.profile() as prof:
        step()
    print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=30))


def bench_runner_decode(
    runner: ModelRunner, batch: int, prompt_len: int, steps: int
) -> tuple[float, float]:
    """(seconds per ``execute`` decode step (median, or ``--stat``), seconds per prefill token) for
    ``batch`` greedy requests of ``prompt_len`` random tokens, each prefilled alone."""
    bs, vocab = runner.block_size, runner.arch.vocab_size
    max_len = prompt_len + steps + 1
    per_req = -(-max_len // bs)
    if batch * per_req > runner.num_blocks:
        runner.initialize_kv_cache(batch * per_req)
    greedy = SamplingParams(temperature=0.0, max_tokens=steps + 1, ignore_eos=True)
    rng = np.random.default_rng(0)
    ids = [f"r{i}" for i in range(batch)]
    step_id = 0

    def execute(plan: StepPlan) -> None:
        nonlocal step_id
        step_id += 1
        runner.execute(plan)

    start = time.perf_counter()
    for i, req_id in enumerate(ids):
        prompt = rng.integers(0, vocab, prompt_len).tolist()
        blocks = list(range(i * per_req, (i + 1) * per_req))
        new = NewRequest(req_id, prompt, prompt_len, greedy, blocks, 0)
        execute(StepPlan(step_id, new_requests=[new], num_scheduled_tokens=[prompt_len]))
    prefill = (time.perf_counter() - start) / (batch * prompt_len)
    times = []
    for k in range(steps):
        running = [RunningRequestDelta(r, [], prompt_len + k) for r in ids]
        t0 = time.perf_counter()
        execute(StepPlan(step_id, running=running, num_scheduled_tokens=[1] * batch))
        _sync(runner.device)
        times.append(time.perf_counter() - t0)
    execute(StepPlan(step_id, finished_req_ids=ids))
    return float(_stat(times)), prefill


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="auto")
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--context", type=int, default=512, help="cached tokens per decode request")
    parser.add_argument("--prefill", type=int, default=512, help="prompt tokens per prefill step")
    parser.add_argument("--attention-backend", default=None)
    parser.add_argument("--runner-batch", type=int, nargs="*", default=[1, 16])
    parser.add_argument("--runner-prompt", type=int, default=256)
    parser.add_argument("--runner-steps", type=int, default=64)
    parser.add_argument("--stat", choices=sorted(_STATS), default="median")
    parser.add_argument("--profile", type=int, metavar="BATCH", help="profile one decode step")
    args = parser.parse_args()
    global _stat
    _stat = _STATS[args.stat]
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
    if args.profile is not None:
        profile_decode(runner, args.profile, args.context)
        return
    base = matmul_gflops(device, torch.float32)
    print(f"device={device} dtype={runner.dtype} threads={torch.get_num_threads()} "
          f"attention={runner.attn_backend.name} "
          f"OMP_WAIT_POLICY={os.environ.get('OMP_WAIT_POLICY', '(unset)')}")  # fmt: skip
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
    for batch in args.runner_batch:
        sec, prefill = bench_runner_decode(runner, batch, args.runner_prompt, args.runner_steps)
        print(f"runner: {batch:3d} x {args.runner_prompt}-token prompts: prefill "
              f"{1 / prefill:7.1f} tok/s; decode {sec * 1e3:7.2f} ms/step ({args.stat} of "
              f"{args.runner_steps}) {batch / sec:7.1f} tok/s")  # fmt: skip


if __name__ == "__main__":
    main()
