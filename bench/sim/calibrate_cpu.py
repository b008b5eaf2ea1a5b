"""Check the simulated backend's roofline against our real CPU backend on this machine.

1. Describe this CPU as a ``--sim-hardware`` file with the rates the model's own linear
   layers achieve (the worker's kernels, its dtype): FLOP/s of all layers' linears over 64
   and over 512 tokens (the peak and ``gemm_half_tokens`` follow from the two), and
   bytes/s of every layer's linears over one token (a decode streams the weights from
   memory), and FLOP/s of causal attention over 512 tokens as the CPU path runs it
   (``attention_efficiency``: its share of the linears' peak). Other efficiencies are 1:
   these are achieved rates. (A 2048^3 matmul and a large copy are printed for scale.)
2. Fit what a roofline cannot know, eager PyTorch's overheads: per layer (dispatch, small
   kernels) and per request and layer (our CPU attention works sequence by sequence),
   together from two decode steps, of 1 and of 32 requests. Nothing else.
3. Time the default model's forward + LM head (``bench.forward.make_step``, the torch
   backend) at six other shapes, decodes of 8 and 64 requests and prefill chunks of 64
   to 512 tokens, and compare with what ``StepCostModel`` predicts for the same shapes.

    .venv/bin/python -m bench.sim.calibrate_cpu [--out bench/sim/cpu.json] [--threads N]

Writes the hardware file (usable as ``--sim-hardware bench/sim/cpu.json``) and
``bench/sim/cpu_calibration.json`` with every shape's times and ratio; prints a table.
Every time is the least disturbed call's (``--stat min`` of bench.forward).
"""

from __future__ import annotations

import argparse
import json
import platform
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np
import torch

from bench import forward
from bench.forward import _timed, make_step
from services.config import EngineConfig, ModelArchConfig
from services.gpu_worker.model.layers import Linear
from services.gpu_worker.model_runner import ModelRunner
from services.gpu_worker.sim.cost_model import RequestWork, SimHardware, StepCostModel, sim_dtype
from services.model_loader import load_hf_config, prepare_model

HERE = Path(__file__).parent
# (name, requests, new tokens each, context before)
SHAPES = [
    ("decode x1 ctx 128 (fit)", 1, 1, 128),
    ("decode x32 ctx 256 (fit)", 32, 1, 256),
    ("decode x8 ctx 256", 8, 1, 256),
    ("decode x64 ctx 512", 64, 1, 512),
    ("prefill 64", 1, 64, 0),
    ("prefill 256", 1, 256, 0),
    ("prefill 512", 1, 512, 0),
    ("chunk 256 after 512", 1, 256, 512),
]


def measure_device(runner: ModelRunner) -> dict[str, float]:
    """Achieved rates of the model's own linear layers on this CPU (see the module
    docstring), and for scale a 2048^3 matmul and a 256 MiB copy."""
    cpu, dtype = torch.device("cpu"), runner.dtype
    linears = [m for m in runner.model.modules() if isinstance(m, Linear)]
    rates = {}

    def run_all(mods: list[Linear], xs: list[torch.Tensor]) -> Callable[[], object]:
        return lambda: [m(x) for m, x in zip(mods, xs, strict=True)]

    with torch.inference_mode():
        for t in (64, 512):  # every layer's: their weights stream from memory, as in a step
            xs = [torch.randn(t, m.in_features, dtype=dtype) for m in linears]
            flops = sum(2 * t * m.in_features * m.out_features for m in linears)
            rates[f"flops_{t}"] = flops / _timed(run_all(linears, xs), cpu)
        xs = [torch.randn(1, m.in_features, dtype=dtype) for m in linears]
        nbytes = sum(m.weight.nbytes for m in linears)
        rates["bandwidth"] = nbytes / _timed(run_all(linears, xs), cpu)
    # Prefill attention as the CPU path runs it (SDPA, causal, KV heads expanded), 512 tokens
    a = runner.arch
    q = torch.randn(1, a.num_attention_heads, 512, a.head_dim, dtype=dtype)
    kv = torch.randn(1, a.num_attention_heads, 512, a.head_dim, dtype=dtype)
    attn_flops = 4 * a.num_attention_heads * a.head_dim * (512 * 513 // 2)
    sdpa = torch.nn.functional.scaled_dot_product_attention
    rates["attention_flops"] = attn_flops / _timed(lambda: sdpa(q, kv, kv, is_causal=True), cpu)
    n = 2048
    a, b = torch.randn(n, n, dtype=dtype), torch.randn(n, n, dtype=dtype)
    rates["big_matmul"] = 2 * n**3 / _timed(lambda: a @ b, cpu)
    src = torch.ones((256 << 20) // a.element_size(), dtype=dtype)
    dst = torch.empty_like(src)
    rates["copy"] = 2 * src.nbytes / _timed(lambda: dst.copy_(src), cpu)
    # peak * T / (T + k) through the two measured points
    r1, r2 = rates["flops_64"], rates["flops_512"]
    k = max(0.0, (r2 - r1) / (r1 / 64 - r2 / 512))
    rates["half_tokens"] = k
    rates["peak"] = r2 * (512 + k) / 512
    return rates


def work(requests: int, new: int, context: int) -> list[RequestWork]:
    return [RequestWork(new, context, True) for _ in range(requests)]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=HERE / "cpu.json")
    parser.add_argument("--threads", type=int, default=None)
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    # The least disturbed call of each: rates and step times alike (a shared machine's
    # other load only ever adds time).
    forward._stat = forward._STATS["min"]
    folder = prepare_model(None)
    arch = ModelArchConfig.from_hf_config(load_hf_config(folder))
    config = EngineConfig.from_kwargs(device="cpu", num_threads=torch.get_num_threads())
    config.finalize(arch)
    runner = ModelRunner(config, folder)
    runner.initialize_kv_cache(64 * 40)
    dtype = sim_dtype(str(runner.dtype).removeprefix("torch."))
    print(f"{platform.processor() or platform.machine()}, {torch.get_num_threads()} threads, "
          f"the default model in {dtype}", flush=True)  # fmt: skip
    rates = measure_device(runner)
    flops, bandwidth = rates["peak"], rates["bandwidth"]
    print(f"measured: the model's linears {rates['flops_64'] / 1e9:.0f} / "
          f"{rates['flops_512'] / 1e9:.0f} GFLOP/s at 64 / 512 tokens (peak {flops / 1e9:.0f}, "
          f"half of it at {rates['half_tokens']:.0f} tokens), {bandwidth / 1e9:.1f} GB/s at one "
          f"token; causal attention over 512 tokens {rates['attention_flops'] / 1e9:.0f} "
          f"GFLOP/s; a 2048^3 matmul "
          f"{rates['big_matmul'] / 1e9:.0f} GFLOP/s, a 256 MiB copy "
          f"{rates['copy'] / 1e9:.1f} GB/s", flush=True)  # fmt: skip
    hw = {
        "name": f"this CPU ({torch.get_num_threads()} threads, measured {time.strftime('%Y-%m-%d')})",
        "source": "bench/sim/calibrate_cpu.py: the default model's GEMMs, timed",
        "peak_flops": {dtype: flops},
        "memory_bandwidth": bandwidth,
        "memory_capacity": 16e9,
        "interconnect_bandwidth": 10e9,
        "compute_efficiency": 1.0,
        "bandwidth_efficiency": 1.0,
        "step_overhead_s": 0.0,
        "layer_overhead_s": 0.0,
        "request_overhead_s": 0.0,
        "gemm_half_tokens": rates["half_tokens"],
        "attention_efficiency": min(1.0, rates["attention_flops"] / rates["peak"]),
    }
    measured = {}
    for name, requests, new, context in SHAPES:
        q = np.full(requests, new, dtype=np.int64)
        ctx = np.full(requests, context, dtype=np.int64)
        measured[name] = _timed(make_step(runner, q, ctx), runner.device)
    # The fit, jointly on two decodes (1 and 32 requests): per layer and per request and layer,
    # measured = roofline + layers * (per_layer + requests * per_request).
    layers = arch.num_hidden_layers
    roofline = StepCostModel(arch, SimHardware(**hw), dtype)  # type: ignore[arg-type]
    (n1, *s1), (n8, *s8) = SHAPES[0], SHAPES[1]
    excess1 = (measured[n1] - roofline.step_time(work(*s1))) / layers
    excess8 = (measured[n8] - roofline.step_time(work(*s8))) / layers
    per_request = max(0.0, (excess8 - excess1) / (s8[0] - s1[0]))
    hw["request_overhead_s"] = per_request
    hw["layer_overhead_s"] = max(0.0, excess1 - s1[0] * per_request)
    args.out.write_text(json.dumps(hw, indent=2) + "\n")
    model = StepCostModel(arch, SimHardware.load(str(args.out)), dtype)
    rows = []
    print(f"\n{'shape':<24} {'torch ms':>9} {'sim ms':>9} {'sim/torch':>9}  bound by")
    for name, *shape in SHAPES:
        cost = model.step_cost(work(*shape))
        compute = cost.linear + cost.attention + cost.lm_head
        bound = "overhead" if cost.overhead > compute else "roofline"
        ratio = cost.total / measured[name]
        rows.append({"shape": name, "torch_ms": measured[name] * 1e3, "sim_ms": cost.total * 1e3,
                     "ratio": ratio, "overhead_ms": cost.overhead * 1e3})  # fmt: skip
        print(f"{name:<24} {measured[name] * 1e3:>9.2f} {cost.total * 1e3:>9.2f} {ratio:>9.2f}  "
              f"{bound}")  # fmt: skip
    checked = [r for r in rows if "(fit)" not in r["shape"]]
    worst = max(abs(r["ratio"] - 1) for r in checked)
    print(f"\nlargest error on the shapes not fitted: {worst:.0%} (target: within 25 %)")
    print(f"overheads fitted: {hw['layer_overhead_s'] * 1e6:.0f} us per layer, "
          f"{hw['request_overhead_s'] * 1e6:.0f} us per request and layer; "
          f"hardware file: {args.out}")  # fmt: skip
    (HERE / "cpu_calibration.json").write_text(json.dumps(
        {"hardware": hw, "rates": rates, "threads": torch.get_num_threads(), "rows": rows,
         "worst_error": worst},
        indent=2,
    ) + "\n")  # fmt: skip


if __name__ == "__main__":
    main()
