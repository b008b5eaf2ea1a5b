"""Where an eager decode step's time goes on a GPU (after ``bench/gpu_check.py`` found an
8B step ~30 ms at every batch size, for 3.6 ms of weights).

One decode step of the Llama-3-8B-shaped model with random weights (the model runner,
triton attention), batch 1 and 64, context 2048, under ``torch.profiler``: the step's wall
time, the GPU's busy time (the sum of its kernels), how many kernels it launches, and the
host-side ops that take the most CPU time. A step whose kernels add up to far less than its
wall time is launch-bound: the host cannot issue kernels as fast as the GPU runs them.

    python3 -m bench.gpu_profile [--out bench/out/gpu_profile.json] [--tiny]

``--tiny`` (a 2-layer model; on a machine without a GPU, the CPU) checks the logic. On the
lent GPU machine: ``bash bench/gpu_check_device.sh``'s environment, then this module.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch

from bench import gpu_check as gc

TINY = {**gc.LLAMA3_8B, "hidden_size": 256, "intermediate_size": 512, "num_hidden_layers": 2,
        "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 1024}  # fmt: skip


def build(arch_json: dict[str, Any], device: str, max_batch: int) -> tuple[Any, Any]:
    from services.config import EngineConfig, ModelArchConfig
    from services.gpu_worker.model_runner import ModelRunner

    arch = ModelArchConfig.from_hf_config(arch_json)
    config = EngineConfig()
    config.model.load_format = "dummy"
    config.model.dtype = "bfloat16" if device == "cuda" else "float32"
    config.scheduler.max_model_len = 4096
    config.worker.device = device
    config.worker.attention_backend = "triton" if device == "cuda" else None
    config.cache.block_size = gc.BLOCK_SIZE
    config.scheduler.max_num_seqs = max_batch
    config.finalize(arch)
    runner = ModelRunner(config, None, arch=arch)  # dummy weights, drawn on the device
    runner.initialize_kv_cache(max_batch * math.ceil(gc.CONTEXT / gc.BLOCK_SIZE))
    return runner, arch


def profile(runner: Any, arch: Any, device: str, batch: int) -> dict[str, Any]:
    from services.gpu_worker.model_runner import build_attention_metadata

    blocks = math.ceil(gc.CONTEXT / gc.BLOCK_SIZE)
    table = np.arange(batch * blocks, dtype=np.int32).reshape(batch, blocks)
    meta, _, positions = build_attention_metadata(
        np.full(batch, gc.CONTEXT - 1), np.ones(batch, dtype=np.int64), table, gc.BLOCK_SIZE,
        torch.device(device),
    )  # fmt: skip
    ids = torch.randint(0, arch.vocab_size, (batch,), device=device)
    pos = torch.from_numpy(positions).to(device)
    model = runner.model

    def step() -> None:
        with torch.inference_mode():
            model.compute_logits(model(ids, pos, meta, runner.kv_caches))
        if device == "cuda":
            torch.cuda.synchronize()

    for _ in range(3):
        step()
    steps = 5
    start = time.perf_counter()
    for _ in range(steps):
        step()
    wall_ms = (time.perf_counter() - start) / steps * 1e3
    activities = [torch.profiler.ProfilerActivity.CPU]
    if device == "cuda":
        activities.append(torch.profiler.ProfilerActivity.CUDA)
    with torch.profiler.profile(activities=activities) as prof:
        for _ in range(steps):
            step()
    events = prof.key_averages()
    device_events = [e for e in events if e.device_type == torch.autograd.DeviceType.CUDA]
    kernels = sum(e.count for e in device_events) / steps
    gpu_ms = sum(e.self_device_time_total for e in device_events) / steps / 1e3
    top = sorted(events, key=lambda e: e.self_cpu_time_total, reverse=True)[:12]
    return {
        "batch": batch,
        "wall_ms": wall_ms,
        "gpu_kernel_ms": gpu_ms,
        "kernels_per_step": kernels,
        "gpu_busy": gpu_ms / wall_ms if wall_ms else None,
        "top_cpu_ops": [
            {
                "op": e.key,
                "calls_per_step": e.count / steps,
                "self_cpu_ms_per_step": e.self_cpu_time_total / steps / 1e3,
            }
            for e in top
        ],  # fmt: skip
    }


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", type=Path, default=Path("bench/out/gpu_profile.json"))
    p.add_argument("--tiny", action="store_true", help="a 2-layer model (a dry run)")
    p.add_argument("--batches", type=int, nargs="+", default=[1, 64])
    a = p.parse_args()
    device = "cuda" if torch.cuda.is_available() else "cpu"
    runner, arch = build(TINY if a.tiny else gc.LLAMA3_8B, device, max(a.batches))
    result = {"device": torch.cuda.get_device_name() if device == "cuda" else "cpu",
              "model": "tiny" if a.tiny else "llama-3-8b shape", "rows": []}  # fmt: skip
    for batch in a.batches:
        row = profile(runner, arch, device, batch)
        result["rows"].append(row)
        print(f"B={batch}: step {row['wall_ms']:.2f} ms, kernels {row['gpu_kernel_ms']:.2f} ms "
              f"({row['kernels_per_step']:.0f} launches), GPU busy "
              f"{(row['gpu_busy'] or 0):.0%}")  # fmt: skip
        for op in row["top_cpu_ops"][:8]:
            print(f"    {op['op'][:60]:<60} x{op['calls_per_step']:>6.0f} "
                  f"{op['self_cpu_ms_per_step']:8.3f} ms")  # fmt: skip
    a.out.parent.mkdir(parents=True, exist_ok=True)
    a.out.write_text(json.dumps(result, indent=1))
    print(f"wrote {a.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
