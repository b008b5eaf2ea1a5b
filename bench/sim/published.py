"""The simulated backend's predictions beside published figures (bench/sim/README.md).

1. nano-vllm's benchmark (its README): Qwen3-0.6B on an RTX 4070 Laptop, 256 requests with
   prompts of U(100, 1024) random tokens and U(100, 1024) output tokens (``random.seed(0)``,
   the order its bench.py draws them in; 133,966 output tokens), ``max_model_len=4096``,
   ``ignore_eos``: nano-vllm 1,434 tok/s, vLLM 1,362 tok/s. The same workload runs through
   our offline ``LLM`` with ``worker_backend="sim"``, and the throughput is output tokens
   over the modelled device time (the sum of the modelled step times: an engine whose own
   overhead is hidden, as CUDA graphs and a lean loop nearly do).
2. The bandwidth floor of a Llama-3-8B bf16 decode step on an H200 (15.01 GB of weights
   read per step, at 4.8 TB/s), against the modelled step at batch 1, 64 and 256.

    .venv/bin/python -m bench.sim.published   # writes bench/sim/published.json
"""

from __future__ import annotations

import json
import random
import time
from pathlib import Path

from launch.llm import LLM, SamplingParams
from services.gpu_worker.sim.cost_model import RequestWork, SimHardware, StepCostModel
from services.model_arch import ModelArchConfig
from services.model_loader.sim_model import sim_config_path

HERE = Path(__file__).parent


def nano_vllm_workload() -> tuple[list[list[int]], list[int]]:
    """nano-vllm bench.py's requests: its draws, in its order."""
    random.seed(0)
    prompts = [
        [random.randint(0, 10000) for _ in range(random.randint(100, 1024))] for _ in range(256)
    ]
    max_tokens = [random.randint(100, 1024) for _ in range(256)]
    return prompts, max_tokens


def nano_vllm() -> dict:
    prompts, max_tokens = nano_vllm_workload()
    llm = LLM(
        worker_backend="sim", sim_model="qwen3-0.6b",
        sim_hardware=str(HERE / "rtx4070-laptop.json"), sim_speed=1e-4,
        max_model_len=4096, gpu_memory_utilization=0.9,
    )  # fmt: skip
    params = [SamplingParams(temperature=0.6, ignore_eos=True, max_tokens=m) for m in max_tokens]
    start = time.monotonic()
    outputs = llm.generate(prompts, params)
    wall = time.monotonic() - start
    tokens = sum(len(o.outputs[0].token_ids) for o in outputs)
    worker = llm.core.executor.worker  # type: ignore[attr-defined]
    device_s = worker.modelled_s
    return {
        "output_tokens": tokens,
        "published_output_tokens": 133966,
        "modelled_device_s": device_s,
        "sim_tok_s": tokens / device_s,
        "published": {"nano-vllm": 1434.13, "vllm": 1361.84},
        "ratio_to_nano_vllm": tokens / device_s / 1434.13,
        "kv_blocks": llm.scheduler.kv_cache_manager.block_pool.num_blocks,
        "real_seconds": wall,
    }


def h200_decode() -> dict:
    arch = ModelArchConfig.from_hf_config(json.loads(sim_config_path("llama-3-8b").read_text()))
    model = StepCostModel(arch, SimHardware.load("h200"))
    floor = (model.weight_bytes(0) - arch.vocab_size * arch.hidden_size * 2) / 4.8e12
    rows = {}
    for batch in (1, 64, 256):
        step = model.step_time([RequestWork(1, 1024, True)] * batch)
        rows[batch] = {"step_ms": step * 1e3, "tok_s": batch / step}
    return {"floor_ms": floor * 1e3, "floor_tok_s_batch1": 1 / floor, "modelled": rows}


def main() -> None:
    results = {"nano_vllm_rtx4070_laptop": nano_vllm(), "llama3_8b_h200_decode": h200_decode()}
    (HERE / "published.json").write_text(json.dumps(results, indent=2) + "\n")
    n = results["nano_vllm_rtx4070_laptop"]
    print(f"nano-vllm workload: {n['output_tokens']} output tokens (published "
          f"{n['published_output_tokens']}); modelled {n['modelled_device_s']:.1f} s of device "
          f"time -> {n['sim_tok_s']:.0f} tok/s vs nano-vllm 1434, vLLM 1362 "
          f"({n['ratio_to_nano_vllm']:.2f}x)")  # fmt: skip
    h = results["llama3_8b_h200_decode"]
    print(f"Llama-3-8B decode on H200: floor {h['floor_ms']:.2f} ms/step "
          f"({h['floor_tok_s_batch1']:.0f} tok/s at batch 1)")  # fmt: skip
    for batch, r in h["modelled"].items():
        print(
            f"  batch {batch:>3}, context 1024: {r['step_ms']:.2f} ms/step, {r['tok_s']:.0f} tok/s"
        )


if __name__ == "__main__":
    main()
