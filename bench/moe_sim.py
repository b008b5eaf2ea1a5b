"""Mixture of experts on simulated H200s: TP=8 against EP=8 with DP attention (issue 33).

Two layouts of eight simulated H200s (``services/gpu_worker/sim``) for each of the shipped
MoE models (``qwen3-30b-a3b``, ``deepseek-v3``):

- ``tp8``: one engine core, ``-tp 8``: every layer split eight ways, each expert too, two
  all-reduces a layer;
- ``ep8``: eight engine cores, ``-dp 8 --enable-expert-parallel``: attention data-parallel
  (each engine its own requests, whole attention weights and KV), the experts spread
  whole over the eight ranks (16 of Qwen3's 128, 32 of DeepSeek's 256 each), the engines in
  lock-step through the MoE layers with an all-gather and a reduce-scatter a layer.

Both fleets get the same budget a step: vLLM's defaults on an H200 for the TP engine
(``--max-num-seqs 1024 --max-num-batched-tokens 8192``), an eighth of them for each EP
engine (128 and 1,024), so the comparison is of the layouts, not of step budgets (the step
budget is the knob between TTFT and ITL: "Simulated GPUs" in bench/RESULTS.md).
``--ep-budget per-engine`` gives each EP engine the whole of vLLM's defaults instead, as a
plain ``-dp 8`` deployment has (eight times the TP engine's a step). Chunked prefill and
prefix caching on. Two workloads with random prompts and ``ignore_eos`` (fixed seed), Poisson arrivals at each of
``--rates``: ``decode`` (prompts U(100, 300), outputs U(400, 1200): chat with long
answers) and ``prefill`` (prompts U(2000, 6000), outputs U(32, 96): summarisation, RAG).
Per point: output tokens/s, requests/s served, TTFT and TPOT percentiles (simulated
seconds), goodput (requests meeting the workload's SLO per second), the steps' batch and,
for EP, how much of the step the engines spent waiting for the slowest one.

In-process, not through servers: ``ep8`` is eight schedulers and eight lock-stepping worker
ranks (sixteen processes, with the api_server, tokenizer and detokenizer nineteen), whose
steps are a few milliseconds of simulated time; on this 2-core machine the host could not
keep up even at ``--sim-speed`` 10, and its lag would be charged to whichever layout has
more processes. Here the same pieces run in one process on a simulated clock: the real
``Scheduler`` per engine (budget, chunked prefill, preemption, block pool sized by the
simulated device), the real ``SimWorker`` per engine (its ``execute``, and in lock-step
``begin_dp_step`` and ``execute_dummy``, as the worker loop calls them), the tokenizer's
``DataParallelBalancer`` choosing the engine. A step lasts the modelled time (for EP, the
longest of the engines' modelled times: the agreement and the MoE layers' collectives make
every engine wait for the last). The engine's own host time is not in these numbers (a
scheduler that keeps the device busy, as ``--async-scheduling`` nearly does: see "Simulated
GPUs and engine overhead" in bench/RESULTS.md).

    .venv/bin/python -m bench.moe_sim run [--models ...] [--workloads decode prefill] \\
        [--latency-us 5] [--out bench/results/moe_sim.json]
    .venv/bin/python -m bench.moe_sim plot bench/results/moe_sim.json
    .venv/bin/python -m bench.moe_sim merge PART.json ... --out bench/results/moe_sim.json
    .venv/bin/python -m bench.moe_sim steps            # the step-time table (no scheduler)

``--latency-us`` replaces the H200 file's ``interconnect_latency_s`` (per ring hop; 5 us
shipped) to show how much of the answer hangs on it.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import random
import sys
import tempfile
import time
from collections import deque
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from services.config import EngineConfig
from services.gpu_worker.distributed import rank_state
from services.gpu_worker.sim.cost_model import RequestWork, SimHardware, StepCost, StepCostModel
from services.gpu_worker.sim.model_shape import load_sim_model
from services.gpu_worker.sim.worker import SimWorker
from services.model_loader import load_hf_config, prepare_model
from services.model_loader.sim_model import sim_config_path, sim_model_folder
from services.protocol import EngineState, SamplingParams, StepPlan
from services.request import Request
from services.scheduler.scheduler import Scheduler
from services.tokenizer.balancer import DataParallelBalancer

RESULTS = Path(__file__).resolve().parent / "results"
MODELS = ("qwen3-30b-a3b", "deepseek-v3")
LAYOUTS = {
    "tp8": {"tensor_parallel_size": 8},
    "ep8": {"data_parallel_size": 8, "enable_expert_parallel": True},
}
ENGINE = {"max_num_seqs": 1024, "max_num_batched_tokens": 8192}  # vLLM's, on an H200


@dataclass(frozen=True)
class Workload:
    name: str
    prompt: tuple[int, int]  # uniform, inclusive
    output: tuple[int, int]
    slo_ttft_s: float
    slo_tpot_s: dict[str, float]  # per model
    rates: dict[str, list[float]]  # per model, requests per second
    window_s: float = 40.0  # arrivals over this much simulated time per point
    warmup_s: float = 10.0  # requests arriving before this are left out of the latencies


WORKLOADS = {
    "decode": Workload(
        "decode", (100, 300), (400, 1200), 2.0,
        {"qwen3-30b-a3b": 0.030, "deepseek-v3": 0.080},
        {"qwen3-30b-a3b": [2, 8, 16, 32, 64, 96],
         "deepseek-v3": [1, 4, 8, 16, 24, 32, 48]},
    ),
    "prefill": Workload(
        "prefill", (2000, 6000), (32, 96), 5.0,
        {"qwen3-30b-a3b": 0.050, "deepseek-v3": 0.200},
        {"qwen3-30b-a3b": [8, 16, 32, 48, 64, 96, 128],
         "deepseek-v3": [2, 4, 8, 12, 16, 20, 24]},
    ),
}  # fmt: skip


@dataclass
class _Tracked:
    arrival: float
    prompt: int
    first: float | None = None
    last: float | None = None
    tokens: int = 0


@dataclass
class _Engine:
    scheduler: Scheduler
    worker: SimWorker
    plan: StepPlan | None = None


def hardware_file(latency_us: float | None, folder: Path) -> str:
    """The H200 as shipped, or with ``interconnect_latency_s`` replaced."""
    if latency_us is None:
        return "h200"
    hw = SimHardware.load("h200")
    raw = {f.name: getattr(hw, f.name) for f in dataclasses.fields(hw) if f.name != "extra"}
    raw["interconnect_latency_s"] = latency_us * 1e-6
    path = folder / f"h200-latency-{latency_us:g}us.json"
    path.write_text(json.dumps(raw))
    return str(path)


def engine_budget(layout: str, ep_budget: str) -> dict[str, int]:
    """One engine's step budget: the fleet's (``ENGINE``) split over its engines, or
    (``per-engine``) the whole of it for each."""
    engines = LAYOUTS[layout].get("data_parallel_size", 1)
    if ep_budget == "per-engine":
        return dict(ENGINE)
    return {k: v // engines for k, v in ENGINE.items()}


def build(model: str, layout: str, hardware: str, ep_budget: str = "fleet") -> list[_Engine]:
    """The engine cores of ``layout``: a scheduler and the output rank's SimWorker each."""
    config = EngineConfig.from_kwargs(
        worker_backend="sim", sim_model=model, sim_hardware=hardware, sim_speed=1e-9,
        **engine_budget(layout, ep_budget), **LAYOUTS[layout],
    )  # fmt: skip
    folder = sim_model_folder(model, prepare_model(None))
    arch, _ = load_sim_model(load_hf_config(folder))
    config.finalize(arch)
    p = config.parallel
    workers = [
        SimWorker(config, folder, rank_state(p, 0, arch.num_hidden_layers, dp_rank=d))
        for d in range(p.data_parallel_size)
    ]
    num_blocks = min(w.determine_num_blocks() for w in workers)
    engines = []
    for w in workers:
        w.initialize_kv_cache(num_blocks)
        engines.append(_Engine(Scheduler(config.scheduler, config.cache, num_blocks), w))
    return engines


def requests(workload: Workload, rate: float, seed: int) -> list[tuple[float, list[int], int]]:
    """(arrival s, prompt, output length) of each request: Poisson arrivals over the window."""
    rng = random.Random(seed)
    tokens = np.random.default_rng(seed)
    out: list[tuple[float, list[int], int]] = []
    t = 0.0
    while True:
        t += rng.expovariate(rate)
        if t > workload.window_s:
            return out
        prompt = tokens.integers(100, 30_000, rng.randint(*workload.prompt)).tolist()
        out.append((t, prompt, rng.randint(*workload.output)))


def simulate(
    model: str, layout: str, workload: Workload, rate: float, hardware: str, seed: int = 0,
    ep_budget: str = "fleet",
) -> dict[str, Any]:  # fmt: skip
    """One point: every request of the window served to its end, on the simulated clock."""
    engines = build(model, layout, hardware, ep_budget)
    block_size = engines[0].scheduler.cache_config.block_size
    balancer = DataParallelBalancer(len(engines), block_size, "sha256")
    pending = deque(requests(workload, rate, seed))
    tracked: dict[str, _Tracked] = {}
    now = 0.0
    steps = 0
    busy = 0.0
    wait = 0.0  # EP: engine-seconds spent waiting for the slowest engine
    batch: list[int] = []
    peak_running = peak_waiting = 0
    real_start = time.monotonic()
    while pending or any(e.scheduler.has_unfinished_requests() for e in engines):
        while pending and pending[0][0] <= now:
            arrival, prompt, max_tokens = pending.popleft()
            req_id = f"r{len(tracked)}"
            d = balancer.choose(prompt, None, None)
            params = SamplingParams(max_tokens=max_tokens, ignore_eos=True, temperature=0.0)
            engines[d].scheduler.add_request(Request(req_id, prompt, params, eos_token_id=None))
            tracked[req_id] = _Tracked(arrival, len(prompt))
        if not any(e.scheduler.has_unfinished_requests() for e in engines):
            now = pending[0][0]
            continue
        for e in engines:
            e.plan = e.scheduler.schedule() if e.scheduler.has_unfinished_requests() else None
        counts = tuple(e.plan.total_num_scheduled_tokens if e.plan else 0 for e in engines)
        results = []
        times = []  # each engine's modelled step
        own = []  # ... less its wait for the others
        for d, e in enumerate(engines):
            if len(engines) > 1:  # the worker loop's agreed step (lockstep.run_agreed_step)
                e.worker.begin_dp_step(counts)
            result = e.worker.execute(e.plan) if e.plan is not None else None
            cost = e.worker.last_cost if e.plan is not None else StepCost()
            if len(engines) > 1 and counts[d] == 0 and any(counts):
                e.worker.execute_dummy()
                cost = e.worker.last_cost
            results.append(result)
            times.append(cost.total)
            own.append(cost.total - cost.wait)
        # The agreement before the next step waits for the slowest engine.
        step = max(times)
        if not any(counts):  # nothing schedulable (every request waits for blocks): idle
            step = max(step, 1e-3)
        now += step
        steps += 1
        busy += step
        wait += sum(step - t for t in own)
        batch.append(sum(counts))
        running = waiting = 0  # over every engine
        for d, (e, result) in enumerate(zip(engines, results, strict=True)):
            if e.plan is None:
                continue
            for out in e.scheduler.update_from_output(e.plan, result):
                r = tracked[out.req_id]
                if out.new_token_ids:
                    r.first = now if r.first is None else r.first
                    r.last = now
                    r.tokens += len(out.new_token_ids)
            stats = e.scheduler.get_stats()
            running += stats.num_running_reqs
            waiting += stats.num_waiting_reqs
            balancer.on_state(
                EngineState(d, stats.num_waiting_reqs, stats.num_running_reqs, stats.kv_cache_usage)
            )
        peak_running = max(peak_running, running)
        peak_waiting = max(peak_waiting, waiting)
    point = summarize(
        model, layout, workload, rate, tracked, now, steps, busy, wait, batch,
        peak_running, peak_waiting, sum(e.scheduler.num_preemptions for e in engines),
        time.monotonic() - real_start, engines,
    )  # fmt: skip
    return {**point, "engine_budget": engine_budget(layout, ep_budget)}


def _pct(values: list[float], p: float) -> float | None:
    return float(np.percentile(values, p)) if values else None


def summarize(
    model: str, layout: str, workload: Workload, rate: float, tracked: dict[str, _Tracked],
    end: float, steps: int, busy: float, wait: float, batch: list[int], peak_running: int,
    peak_waiting: int, preemptions: int, real_s: float, engines: list[_Engine],
) -> dict[str, Any]:  # fmt: skip
    measured = [r for r in tracked.values() if r.arrival >= workload.warmup_s]
    ttft = [r.first - r.arrival for r in measured if r.first is not None]
    tpot = [
        (r.last - r.first) / (r.tokens - 1)
        for r in measured
        if r.first is not None and r.last is not None and r.tokens > 1
    ]
    slo_tpot = workload.slo_tpot_s[model]
    good = sum(
        1
        for r in measured
        if r.first is not None
        and r.last is not None
        and r.first - r.arrival <= workload.slo_ttft_s
        and (r.tokens <= 1 or (r.last - r.first) / (r.tokens - 1) <= slo_tpot)
    )
    span = workload.window_s - workload.warmup_s
    # Output tokens per second over the arrival window's measured part: the tokens of every
    # request that ended by then, and a share of the others' as they went (uniform).
    tokens_in_window = 0.0
    for r in tracked.values():
        if r.first is None or r.last is None:
            continue
        lo, hi = max(r.first, workload.warmup_s), min(r.last, workload.window_s)
        if hi > lo:
            tokens_in_window += r.tokens * (hi - lo) / max(r.last - r.first, 1e-9)
    w = engines[0].worker
    return {
        "model": model, "layout": layout, "workload": workload.name, "rate": rate,
        "requests": len(tracked), "measured_requests": len(measured),
        "output_tok_s": tokens_in_window / span,
        "goodput_req_s": good / span,
        "slo": {"ttft_s": workload.slo_ttft_s, "tpot_s": slo_tpot},
        "ttft_p50_s": _pct(ttft, 50), "ttft_p99_s": _pct(ttft, 99),
        "tpot_p50_s": _pct(tpot, 50), "tpot_p99_s": _pct(tpot, 99),
        "end_s": end, "steps": steps, "mean_step_s": busy / max(steps, 1),
        "mean_batch_tokens": float(np.mean(batch)) if batch else 0.0,
        "lockstep_wait_share": wait / (busy * len(engines)) if busy else 0.0,
        "peak_running": peak_running, "peak_waiting": peak_waiting,
        "preemptions": preemptions,
        "kv_blocks_per_engine": engines[0].scheduler.kv_cache_manager.block_pool.num_blocks,
        "weights_gb_per_rank": w.cost.weight_bytes(0) / 1e9,
        "real_s": real_s,
    }  # fmt: skip


def step_table(hardware: str) -> list[dict[str, Any]]:
    """Modelled step times of balanced decode and prefill steps, by part, for both layouts
    (the cost model alone: no scheduler, every engine the same work)."""
    hw = SimHardware.load(hardware)
    rows = []
    for model in MODELS:
        arch, extras = load_sim_model(json.loads(sim_config_path(model).read_text()))
        tp = StepCostModel(arch, hw, "bf16", 8, extras=extras)
        ep = StepCostModel(
            arch, hw, "bf16", 1, expert_parallel_size=8, data_parallel_size=8, extras=extras
        )
        shapes = [("decode", b, RequestWork(1, 1024, True)) for b in (8, 64, 256, 1024, 4096)]
        shapes += [("prefill", t, RequestWork(t // 8, 0, True)) for t in (8192, 65536)]
        for kind, total, one in shapes:
            per_engine = total // 8
            if kind == "decode":
                tp_work, ep_work = [one] * total, [one] * per_engine
            else:  # the same prompts: eight of total/8 tokens
                tp_work, ep_work = [one] * 8, [one]
            for name, cost in (
                ("tp8", tp.step_cost(tp_work)),
                ("ep8", ep.step_cost(ep_work, (sum(w.num_new_tokens for w in ep_work),) * 8)),
            ):
                parts = dataclasses.asdict(cost)
                rows.append({
                    "model": model, "kind": kind, "tokens": total, "layout": name,
                    "step_ms": cost.total * 1e3,
                    "tok_s": total / cost.total,
                    **{k: v * 1e3 for k, v in parts.items()},
                })  # fmt: skip
    return rows


def _decode_steps(
    tp: StepCostModel, ep: StepCostModel, batch: int, context: int
) -> tuple[float, float]:
    """(TP=8, EP=8) step of ``batch`` decodes at ``context``, B/8 an EP engine."""
    one = RequestWork(1, context, True)
    per = batch // 8
    return tp.step_time([one] * batch), ep.step_cost([one] * per, (per,) * 8).total


def crossover(latencies_us: list[float], context: int = 1024) -> list[dict[str, Any]]:
    """For each model and interconnect latency per ring hop: the decode step at batches 8
    and 1,024 in both layouts (balanced: B/8 requests an engine), and the smallest batch at
    which EP=8's step is shorter than TP=8's (every request decoding at ``context``)."""
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for latency in latencies_us:
            hw = SimHardware.load(hardware_file(latency, Path(tmp)))
            for model in MODELS:
                arch, extras = load_sim_model(json.loads(sim_config_path(model).read_text()))
                tp = StepCostModel(arch, hw, "bf16", 8, extras=extras)
                ep = StepCostModel(
                    arch, hw, "bf16", 1, expert_parallel_size=8, data_parallel_size=8,
                    extras=extras,
                )  # fmt: skip
                first = None
                for batch in range(8, 8193, 8):
                    tp_s, ep_s = _decode_steps(tp, ep, batch, context)
                    if ep_s < tp_s:
                        first = batch
                        break
                b8, b1024 = _decode_steps(tp, ep, 8, context), _decode_steps(tp, ep, 1024, context)
                rows.append({
                    "model": model, "latency_us": latency, "context": context,
                    "tp8_ms_b8": b8[0] * 1e3, "ep8_ms_b8": b8[1] * 1e3,
                    "tp8_ms_b1024": b1024[0] * 1e3, "ep8_ms_b1024": b1024[1] * 1e3,
                    "ep_faster_from_batch": first,
                })  # fmt: skip
    return rows


def plot(result: dict[str, Any], path: Path) -> list[Path]:
    from bench.plots import _pyplot, save_figure

    plt = _pyplot()
    written = []
    points = result["points"]
    for model in sorted({p["model"] for p in points}):
        fig, axes = plt.subplots(2, 3, figsize=(15, 8))
        for row, workload in enumerate(("decode", "prefill")):
            for ax, (key, label, scale) in zip(
                axes[row],
                (("output_tok_s", "output tokens/s", 1.0), ("tpot_p50_s", "TPOT p50 (ms)", 1e3),
                 ("ttft_p50_s", "TTFT p50 (s)", 1.0)),
                strict=True,
            ):  # fmt: skip
                latencies = sorted({p.get("latency_us", 5.0) for p in points}, reverse=True)
                for layout, color, marker in (("tp8", "tab:blue", "o"), ("ep8", "tab:orange", "s")):
                    for latency, line in zip(latencies, ("-", "--", ":"), strict=False):
                        sel = sorted(
                            (p for p in points
                             if (p["model"], p["workload"], p["layout"]) == (model, workload, layout)
                             and p.get("latency_us", 5.0) == latency),
                            key=lambda p: p["rate"],
                        )  # fmt: skip
                        xs = [p["rate"] for p in sel if p[key] is not None]
                        ys = [p[key] * scale for p in sel if p[key] is not None]
                        name = layout if len(latencies) == 1 else f"{layout}, {latency:g} us/hop"
                        ax.plot(xs, ys, line, color=color, marker=marker, label=name)
                if key == "ttft_p50_s":
                    ax.set_yscale("log")
                ax.set(title=f"{workload}: {label}", xlabel="requests/s", ylabel=label)
                ax.grid(alpha=0.3)
                ax.legend()
        fig.suptitle(f"{model} on 8 simulated H200s: TP=8 vs EP=8 (DP attention)")
        out = path.with_name(f"{path.stem}_{model}.png")
        save_figure(fig, out)
        written.append(out)
    return written


def print_points(points: list[dict[str, Any]]) -> None:
    print("| model | workload | req/s | layout | tok/s | goodput | TTFT p50 / p99 | "
          "TPOT p50 / p99 | step | batch | wait | peak run / wait |")  # fmt: skip
    for p in points:

        def ms(v: float | None) -> str:
            return "-" if v is None else f"{v * 1e3:,.0f}"

        print(
            f"| {p['model']} | {p['workload']} | {p['rate']:g} | {p['layout']} | "
            f"{p['output_tok_s']:,.0f} | {p['goodput_req_s']:.1f} | "
            f"{ms(p['ttft_p50_s'])} / {ms(p['ttft_p99_s'])} ms | "
            f"{ms(p['tpot_p50_s'])} / {ms(p['tpot_p99_s'])} ms | "
            f"{p['mean_step_s'] * 1e3:.1f} ms | {p['mean_batch_tokens']:,.0f} | "
            f"{100 * p['lockstep_wait_share']:.0f} % | {p['peak_running']} / {p['peak_waiting']} |"
        )


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)
    run = sub.add_parser("run")
    run.add_argument("--models", nargs="+", default=list(MODELS))
    run.add_argument("--workloads", nargs="+", default=list(WORKLOADS))
    run.add_argument("--layouts", nargs="+", default=list(LAYOUTS))
    run.add_argument("--rates", nargs="+", type=float, help="instead of each workload's")
    run.add_argument("--latency-us", type=float, help="interconnect latency per ring hop")
    run.add_argument("--ep-budget", choices=("fleet", "per-engine"), default="fleet")
    run.add_argument("--seed", type=int, default=0)
    run.add_argument("--out", type=Path, default=RESULTS / "moe_sim.json")
    plot_cmd = sub.add_parser("plot")
    plot_cmd.add_argument("json", type=Path)
    steps = sub.add_parser("steps")
    steps.add_argument("--latency-us", type=float)
    cross = sub.add_parser("crossover", help="decode batch from which EP=8 steps faster")
    cross.add_argument("--latencies-us", nargs="+", type=float, default=[0, 0.5, 1, 2, 5])
    merge = sub.add_parser("merge", help="join the points of runs (e.g. one per model)")
    merge.add_argument("parts", nargs="+", type=Path)
    merge.add_argument("--out", type=Path, required=True)
    args = parser.parse_args(argv)
    if args.command == "merge":
        parts = [json.loads(p.read_text()) for p in args.parts]
        for part in parts:
            for q in part["points"] + part["steps"]:
                q.setdefault("latency_us", part["interconnect_latency_us"])
        rows = {json.dumps(q, sort_keys=True): q for part in parts for q in part["steps"]}
        result = {
            **parts[0],
            "points": [q for part in parts for q in part["points"]],
            "steps": list(rows.values()),
        }
        result.pop("interconnect_latency_us", None)
        args.out.write_text(json.dumps(result, indent=1) + "\n")
        args.command, args.json = "plot", args.out
    if args.command == "crossover":
        for row in crossover(args.latencies_us):
            print(json.dumps(row))
        return
    if args.command == "plot":
        for path in plot(json.loads(args.json.read_text()), args.json):
            print(f"wrote {path}", file=sys.stderr)
        return
    with tempfile.TemporaryDirectory() as tmp:
        hardware = hardware_file(args.latency_us, Path(tmp))
        if args.command == "steps":
            for row in step_table(hardware):
                print(json.dumps(row))
            return
        points = []
        for model in args.models:
            for name in args.workloads:
                workload = WORKLOADS[name]
                for rate in args.rates or workload.rates[model]:
                    for layout in args.layouts:
                        point = simulate(
                            model, layout, workload, rate, hardware, args.seed, args.ep_budget
                        )
                        point["latency_us"] = 5.0 if args.latency_us is None else args.latency_us
                        points.append(point)
                        print_points([point])
                        sys.stdout.flush()
        result = {
            "hardware": "h200",
            "interconnect_latency_us": args.latency_us if args.latency_us is not None else 5.0,
            "engine": ENGINE,
            "ep_budget": args.ep_budget,
            "workloads": {k: dataclasses.asdict(w) for k, w in WORKLOADS.items()},
            "steps": step_table(hardware),
            "points": points,
        }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=1) + "\n")
    for path in plot(result, args.out):
        print(f"wrote {args.out} and {path}", file=sys.stderr)


if __name__ == "__main__":
    main()
