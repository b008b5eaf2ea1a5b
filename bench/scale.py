"""Experiments at GPU scale on the simulated backend (``--worker-backend sim``).

``overhead``: the engine's own cost per step when the device is an H200 running
Llama-3-8B (steps of a few milliseconds). For each number of running requests (64, 256,
1,024 by default) and with ``--async-scheduling`` off and on, a fresh server at
``--sim-speed 1`` and a closed loop of that many clients (each sends its next request
when the last one ends; 128-token prompts, outputs of up to 512 tokens with
``ignore_eos``: decode-heavy chat), measured over a window once every slot runs:

- device idle: the share of the simulated device's timeline spent waiting for the next
  plan (``actorserve:device_seconds_total``); the goal is <= 5 % at 256;
- scheduler time per step (its own CPU: schedule, update, sends), IPC bytes per step
  (every socket the engine sends on), detokenizer time per step, the api_server's and
  the client's CPU (share of one core), how busy the machine's cores were, the batch the
  device really ran (output tokens per step: below the running count when the client is
  late to send the next request), throughput.

    .venv/bin/python -m bench.scale overhead [--running 64 256 1024] [--window 20]

``rates``: chat requests with ShareGPT-like lengths (prompts 23 to 437 tokens, outputs 20
to 380, uniform around ShareGPT's means of ~230 and ~200; fixed seed) at rising Poisson
rates: throughput, TTFT/ITL percentiles, goodput (TTFT <= 500 ms, TPOT <= 50 ms), and the
limits the seeds' troubleshooting tables read: peak running (against ``--max-num-seqs``),
peak waiting, preemptions.

``budget``: ``--max-num-batched-tokens`` 512 / 2,048 / 8,192 / 16,384 on a mix of long
prompts and chat (random prompts of 200 to 3,900 tokens, 128 output tokens, Poisson
arrivals at ``--rate``, 15/s by default: ~70 % of the H200's prefill compute): the TTFT-ITL
trade-off of the seeds, with numbers.

``prefix``: prefix caching on and off for chat with a shared 1,024-token system prompt
(the ``chat`` dataset: multi-turn conversations): hit rate, prompt tokens computed, TTFT.

Both run ``actorserve bench`` (streaming, ``--scrape-metrics``) against a fresh simulated
server per point; all times are simulated seconds at ``--sim-speed 1``.

Writes ``bench/out/scale_<experiment>.json`` and a PNG beside it, prints a table. The client
runs on the same machine and takes CPU from the server: on the 2-core development machine
that is part of what the numbers show (see bench/RESULTS.md).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import httpx
import psutil

from bench.metrics import parse_prometheus
from bench.procs import ServerProcess

REPO = Path(__file__).resolve().parent.parent
OUT = REPO / "bench" / "out"
MODEL = "llama-3-8b"


class SimServer(ServerProcess):
    """A simulated H200 serving Llama-3-8B on a free port; ``close()`` ends its group."""

    def __init__(self, *args: str) -> None:
        super().__init__("--worker-backend", "sim", "--sim-model", MODEL, "--sim-hardware", "h200",
                         *args)  # fmt: skip

    def metrics(self) -> dict[str, float]:
        """Samples summed over label sets, and the device's by state (``name|busy``)."""
        from prometheus_client.parser import text_string_to_metric_families

        text = httpx.get(f"{self.url}/metrics", timeout=30).text
        out = parse_prometheus(text)
        for family in text_string_to_metric_families(text):
            for sample in family.samples:
                if "state" in sample.labels and sample.name.endswith("_total"):
                    key = f"{sample.name}|{sample.labels['state']}"
                    out[key] = out.get(key, 0.0) + sample.value
        return out

    def process(self, role: str) -> psutil.Process:
        for p in psutil.process_iter():
            with contextlib.suppress(psutil.Error):
                if os.getpgid(p.pid) == self.popen.pid and role in " ".join(p.cmdline()):
                    return p
        raise LookupError(role)


async def closed_loop(url: str, clients: int, stop: asyncio.Event, max_tokens: int) -> None:
    """``clients`` users, each sending its next request when the last one returned.

    Each user has its own one-connection httpx client. With one shared pool of N
    connections this client took half a core of the 2-core host at N = 256 (0.05 this
    way), and it was so late with the next requests that the "256 running" device ran
    batches of ~110: session 7's table measured the client, not the engine.
    """

    ssl = httpx.create_ssl_context()  # shared: httpx builds one per client otherwise (~45 ms)

    async def one(i: int) -> None:
        async with httpx.AsyncClient(timeout=None, verify=ssl) as client:
            k = 0
            while not stop.is_set():
                prompt = [100 + (i * 7919 + k * 104729 + j) % 20000 for j in range(128)]
                body = {"model": MODEL, "prompt": prompt, "max_tokens": max_tokens,
                        "ignore_eos": True, "temperature": 0}  # fmt: skip
                with contextlib.suppress(httpx.HTTPError):
                    await client.post(f"{url}/v1/completions", json=body)
                k += 1

    await asyncio.gather(*(one(i) for i in range(clients)))


def _delta(after: dict[str, float], before: dict[str, float], name: str) -> float:
    return after.get(name, 0.0) - before.get(name, 0.0)


def measure(running: int, async_scheduling: bool, window_s: float, max_tokens: int) -> dict:
    args = ["--max-num-seqs", str(running), "--max-model-len", "1024"]
    if async_scheduling:
        args.append("--async-scheduling")
    server = SimServer(*args)
    try:
        server.wait_ready()
        api = server.process("api_server")

        async def run() -> dict[str, Any]:
            stop = asyncio.Event()
            load = asyncio.create_task(closed_loop(server.url, running, stop, max_tokens))
            loop = asyncio.get_running_loop()
            deadline = time.monotonic() + 120
            while time.monotonic() < deadline:  # until every slot runs
                m = await loop.run_in_executor(None, server.metrics)
                if m.get("vllm:num_requests_running", 0) >= running:
                    break
                await asyncio.sleep(0.5)
            before = await loop.run_in_executor(None, server.metrics)
            me = psutil.Process()
            psutil.cpu_percent()  # starts the machine-wide count
            cpu0, mine0, t0 = api.cpu_times(), me.cpu_times(), time.monotonic()
            await asyncio.sleep(window_s)
            after = await loop.run_in_executor(None, server.metrics)
            cpu1, mine1, t1 = api.cpu_times(), me.cpu_times(), time.monotonic()
            machine = psutil.cpu_percent() / 100
            stop.set()
            load.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await load
            wall = t1 - t0
            steps = _delta(after, before, "actorserve:worker_forward_time_seconds_count")
            busy = _delta(after, before, "actorserve:device_seconds_total|busy")
            idle = _delta(after, before, "actorserve:device_seconds_total|idle")
            detok = _delta(after, before, "actorserve:detokenizer_batch_time_seconds_sum")
            sched = _delta(after, before, "actorserve:scheduler_step_time_seconds_sum")
            sched_steps = _delta(after, before, "actorserve:scheduler_step_time_seconds_count")
            sent = _delta(after, before, "actorserve:socket_sent_bytes_total")
            return {
                "running": running,
                "async_scheduling": async_scheduling,
                "window_s": wall,
                "steps_per_s": steps / wall,
                "device_idle": idle / max(busy + idle, 1e-9),
                "modelled_step_ms": 1e3 * busy / max(steps, 1),
                "scheduler_ms_per_step": 1e3 * sched / max(sched_steps, 1),
                "ipc_kib_per_step": sent / max(steps, 1) / 1024,
                "detokenizer_ms_per_step": 1e3 * detok / max(steps, 1),
                "api_server_cpu": (sum(cpu1[:2]) - sum(cpu0[:2])) / wall,
                "client_cpu": (sum(mine1[:2]) - sum(mine0[:2])) / wall,
                "machine_cpu_busy": machine,
                "cores": psutil.cpu_count(),
                "generation_tok_s": _delta(after, before, "vllm:generation_tokens_total") / wall,
                # The batch the device really ran: below `running` when the client is late.
                "tokens_per_step": _delta(after, before, "vllm:generation_tokens_total")
                / max(steps, 1),
                "mean_running": after.get("vllm:num_requests_running", 0.0),
            }

        return asyncio.run(run())
    finally:
        server.close()


def plot(rows: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 4))
    for flag, style in ((False, "o-"), (True, "s--")):
        pts = [r for r in rows if r["async_scheduling"] == flag]
        ax.plot([r["running"] for r in pts], [100 * r["device_idle"] for r in pts], style,
                label="async scheduling" if flag else "sync")  # fmt: skip
    ax.axhline(5, color="grey", lw=0.8)
    ax.set_xscale("log", base=2)
    ax.set_xlabel("running requests")
    ax.set_ylabel("simulated H200 idle (% of its timeline)")
    ax.set_title("Llama-3-8B on a simulated H200: engine overhead")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def bench_point(server_args: list[str], bench_args: list[str], name: str) -> dict[str, Any]:
    """One fresh simulated server, one ``actorserve bench`` run against it: its result."""
    server = SimServer(*server_args)
    try:
        server.wait_ready()
        out_dir = OUT / "scale_runs"
        cmd = [sys.executable, "-m", "launch.cli", "bench", "--base-url", server.url,
               "--scrape-metrics", "--disable-tqdm", "--no-plots", "--result-dir", str(out_dir),
               "--result-filename", f"{name}.json", *bench_args]  # fmt: skip
        subprocess.run(cmd, cwd=REPO, check=True, stdout=subprocess.DEVNULL)
        return json.loads((out_dir / f"{name}.json").read_text())  # type: ignore[no-any-return]
    finally:
        server.close()


def _ms(result: dict[str, Any], key: str) -> float:
    return float(result.get(key) or float("nan"))


BUDGET_BENCH = ["--dataset-name", "random", "--random-input-len", "2048",
                "--random-range-ratio", "0.9", "--random-output-len", "128", "--ignore-eos",
                "--num-prompts", "300", "--seed", "1"]  # fmt: skip
PREFIX_BENCH = ["--dataset-name", "chat", "--chat-system-len", "1024", "--chat-num-turns", "4",
                "--chat-user-len", "64", "--chat-assistant-len", "64", "--chat-output-len", "64",
                "--ignore-eos", "--num-prompts", "400", "--request-rate", "20",
                "--seed", "1"]  # fmt: skip


RATES_BENCH = ["--dataset-name", "random", "--random-input-len", "230",
               "--random-range-ratio", "0.9", "--random-output-len", "200", "--ignore-eos",
               "--seed", "1", "--goodput", "ttft:500", "tpot:50"]  # fmt: skip


def rates_experiment(rates: list[float], num_prompts: int, sim_speed: float) -> list[dict]:
    rows = []
    print(f"{'rate':>6} {'tok/s':>7} {'goodput':>8} {'TTFT p50':>9} {'TTFT p99':>9} "
          f"{'ITL p50':>8} {'ITL p99':>8} {'running':>8} {'waiting':>8} {'preempt':>8}",
          flush=True)  # fmt: skip
    for rate in rates:
        speed = ["--sim-speed", str(sim_speed)]
        bench = [*RATES_BENCH, "--num-prompts", str(num_prompts), "--request-rate", str(rate)]
        r = bench_point(["--async-scheduling", *speed], [*bench, *speed], f"rate-{rate:g}")
        timeline = r.get("server_timeline") or [(0, 0, 0, 0)]
        deltas = r.get("server_metrics") or {}
        row = {"request_rate": rate, "sim_speed": sim_speed, "output_tok_s": _ms(r, "output_throughput"),
               "goodput_req_s": _ms(r, "request_goodput"),
               "ttft_p50_ms": _ms(r, "median_ttft_ms"), "ttft_p99_ms": _ms(r, "p99_ttft_ms"),
               "itl_p50_ms": _ms(r, "median_itl_ms"), "itl_p99_ms": _ms(r, "p99_itl_ms"),
               "peak_running": max(t[1] for t in timeline),
               "peak_waiting": max(t[2] for t in timeline),
               "peak_kv_usage": max(t[3] if len(t) > 3 else 0.0 for t in timeline),
               "preemptions": deltas.get("num_preemptions"), "completed": r.get("completed")}  # fmt: skip
        rows.append(row)
        print(f"{rate:>6g} {row['output_tok_s']:>7.0f} {row['goodput_req_s']:>8.1f} "
              f"{row['ttft_p50_ms']:>9.1f} {row['ttft_p99_ms']:>9.1f} {row['itl_p50_ms']:>8.2f} "
              f"{row['itl_p99_ms']:>8.2f} {row['peak_running']:>8.0f} {row['peak_waiting']:>8.0f} "
              f"{row['preemptions'] or 0:>8.0f}", flush=True)  # fmt: skip
    return rows


def budget_experiment(budgets: list[int], rate: float) -> list[dict]:
    rows = []
    print(f"{'budget':>7} {'TTFT p50':>9} {'TTFT p99':>9} {'ITL p50':>8} {'ITL p99':>8} "
          f"{'tok/s':>7}", flush=True)  # fmt: skip
    for budget in budgets:
        server = ["--max-num-batched-tokens", str(budget), "--max-model-len", "4096",
                  "--async-scheduling"]  # fmt: skip
        bench = [*BUDGET_BENCH, "--request-rate", str(rate)]
        r = bench_point(server, bench, f"budget-{budget}")
        row = {"max_num_batched_tokens": budget, "request_rate": rate, "ttft_p50_ms": _ms(r, "median_ttft_ms"),
               "ttft_p99_ms": _ms(r, "p99_ttft_ms"), "itl_p50_ms": _ms(r, "median_itl_ms"),
               "itl_p99_ms": _ms(r, "p99_itl_ms"), "output_tok_s": _ms(r, "output_throughput"),
               "completed": r.get("completed")}  # fmt: skip
        rows.append(row)
        print(f"{budget:>7} {row['ttft_p50_ms']:>9.1f} {row['ttft_p99_ms']:>9.1f} "
              f"{row['itl_p50_ms']:>8.2f} {row['itl_p99_ms']:>8.2f} {row['output_tok_s']:>7.0f}",
              flush=True)  # fmt: skip
    return rows


def prefix_experiment() -> list[dict]:
    rows = []
    print(f"{'prefix caching':>14} {'hit rate':>8} {'prefill tokens':>14} {'TTFT p50':>9} "
          f"{'TTFT p99':>9}", flush=True)  # fmt: skip
    for on in (True, False):
        flag = "--enable-prefix-caching" if on else "--no-enable-prefix-caching"
        r = bench_point(
            [flag, "--async-scheduling"], PREFIX_BENCH, f"prefix-{'on' if on else 'off'}"
        )
        deltas = r.get("server_metrics") or {}
        row = {"prefix_caching": on, "hit_rate": deltas.get("prefix_cache_hit_rate"),
               "prefill_tokens_computed": deltas.get("prefill_kv_computed_tokens"),
               "ttft_p50_ms": _ms(r, "median_ttft_ms"), "ttft_p99_ms": _ms(r, "p99_ttft_ms"),
               "completed": r.get("completed")}  # fmt: skip
        rows.append(row)
        print(f"{'on' if on else 'off':>14} {row['hit_rate'] or 0:>8.1%} "
              f"{row['prefill_tokens_computed'] or 0:>14.0f} {row['ttft_p50_ms']:>9.1f} "
              f"{row['ttft_p99_ms']:>9.1f}", flush=True)  # fmt: skip
    return rows


def plot_sweep(rows: list[dict], x: str, xlabel: str, path: Path, log_x: bool = False) -> None:
    """TTFT and ITL percentiles (and the prefix experiment's TTFT) against ``x``."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (a, b) = plt.subplots(1, 2, figsize=(10, 4))
    xs = [float(r[x]) for r in rows]
    for key, style in (("ttft_p50_ms", "o-"), ("ttft_p99_ms", "s--")):
        a.plot(xs, [r[key] for r in rows], style, label=key.replace("_ms", "").replace("_", " "))
    for key, style in (("itl_p50_ms", "o-"), ("itl_p99_ms", "s--")):
        if key in rows[0]:
            b.plot(
                xs, [r[key] for r in rows], style, label=key.replace("_ms", "").replace("_", " ")
            )
    for ax, what in ((a, "TTFT (ms)"), (b, "ITL (ms)")):
        ax.set_xlabel(xlabel)
        ax.set_ylabel(what)
        ax.legend()
        if log_x:
            ax.set_xscale("log", base=2)
    fig.suptitle("Llama-3-8B on a simulated H200 (simulated ms)")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="experiment", required=True)
    p = sub.add_parser("overhead", help="engine overhead at H200 step times")
    p.add_argument("--running", type=int, nargs="+", default=[64, 256, 1024])
    p.add_argument("--window", type=float, default=20.0, help="seconds measured per point")
    p.add_argument("--max-tokens", type=int, default=512)
    p.add_argument("--async-scheduling", choices=["off", "on", "both"], default="both")
    b = sub.add_parser("budget", help="--max-num-batched-tokens: TTFT against ITL")
    b.add_argument("--budgets", type=int, nargs="+", default=[512, 2048, 8192, 16384])
    b.add_argument("--rate", type=float, default=15.0, help="requests/s (Poisson)")
    sub.add_parser("prefix", help="prefix caching on and off, shared system prompt")
    r = sub.add_parser("rates", help="ShareGPT-like chat at rising request rates")
    r.add_argument("--rates", type=float, nargs="+", default=[10, 20, 40, 60])
    r.add_argument("--num-prompts", type=int, default=10000, help="per rate")
    r.add_argument(
        "--sim-speed",
        type=float,
        default=1.0,
        help="> 1 slows the simulated world so that this host's CPUs keep up at high rates",
    )
    args = parser.parse_args()
    if args.experiment in ("budget", "prefix", "rates"):
        if args.experiment == "rates":
            rows = rates_experiment(args.rates, args.num_prompts, args.sim_speed)
        elif args.experiment == "budget":
            rows = budget_experiment(args.budgets, args.rate)
        else:
            rows = prefix_experiment()
        OUT.mkdir(parents=True, exist_ok=True)
        path = OUT / f"scale_{args.experiment}.json"
        path.write_text(json.dumps(rows, indent=2) + "\n")
        if args.experiment == "rates":
            plot_sweep(rows, "request_rate", "requests/s", path.with_suffix(".png"))
        elif args.experiment == "budget":
            plot_sweep(rows, "max_num_batched_tokens", "--max-num-batched-tokens",
                       path.with_suffix(".png"), log_x=True)  # fmt: skip
        print(f"wrote {path}")
        return 0
    modes = {"off": [False], "on": [True], "both": [False, True]}[args.async_scheduling]
    rows = []
    header = (f"{'running':>7} {'async':>5} {'idle':>6} {'steps/s':>8} {'step ms':>8} "
              f"{'sched ms':>8} {'IPC KiB':>8} {'detok ms':>8} {'api CPU':>7} {'client':>6} "
              f"{'CPU busy':>8} {'tok/step':>8} {'tok/s':>8}")  # fmt: skip
    print(header, flush=True)
    for running in args.running:
        for mode in modes:
            r = measure(running, mode, args.window, args.max_tokens)
            rows.append(r)
            print(f"{r['running']:>7} {'on' if mode else 'off':>5} {100 * r['device_idle']:>5.1f}% "
                  f"{r['steps_per_s']:>8.1f} {r['modelled_step_ms']:>8.2f} "
                  f"{r['scheduler_ms_per_step']:>8.2f} {r['ipc_kib_per_step']:>8.1f} "
                  f"{r['detokenizer_ms_per_step']:>8.2f} {r['api_server_cpu']:>7.2f} "
                  f"{r['client_cpu']:>6.2f} {100 * r['machine_cpu_busy']:>7.0f}% "
                  f"{r['tokens_per_step']:>8.0f} {r['generation_tok_s']:>8.0f}", flush=True)  # fmt: skip
    OUT.mkdir(parents=True, exist_ok=True)
    (OUT / "scale_overhead.json").write_text(json.dumps(rows, indent=2) + "\n")
    plot(rows, OUT / "scale_overhead.png")
    print(f"wrote {OUT / 'scale_overhead.json'} and .png")
    return 0


if __name__ == "__main__":
    sys.exit(main())
