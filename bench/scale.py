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
  the client's CPU (share of one core), how busy the machine's cores were, throughput.

    .venv/bin/python -m bench.scale overhead [--running 64 256 1024] [--window 20]

Writes ``bench/out/scale_overhead.json`` and a PNG beside it, prints a table. The client
runs on the same machine and takes CPU from the server: on the 2-core development machine
that is part of what the numbers show (see bench/RESULTS.md).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx
import psutil

from bench.metrics import parse_prometheus

REPO = Path(__file__).resolve().parent.parent
OUT = REPO / "bench" / "out"
MODEL = "llama-3-8b"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class SimServer:
    """A simulated server on a free port; ``close()`` ends its process group."""

    def __init__(self, *args: str) -> None:
        self.port = _free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log = tempfile.NamedTemporaryFile(prefix="scale-", suffix=".log", delete=False)  # noqa: SIM115
        cmd = [sys.executable, "-m", "launch.cli", "serve", "--port", str(self.port),
               "--worker-backend", "sim", "--sim-model", MODEL, "--sim-hardware", "h200",
               *args]  # fmt: skip
        self.popen = subprocess.Popen(cmd, cwd=REPO, stdout=self.log, stderr=subprocess.STDOUT,
                                      stdin=subprocess.DEVNULL, start_new_session=True)  # fmt: skip

    def wait_ready(self, timeout_s: float = 240) -> None:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.popen.poll() is not None:
                raise RuntimeError(f"server exited: {Path(self.log.name).read_text()[-2000:]}")
            with contextlib.suppress(httpx.HTTPError):
                if httpx.get(f"{self.url}/health", timeout=2).status_code == 200:
                    return
            time.sleep(0.5)
        raise RuntimeError("server did not start")

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

    def close(self) -> None:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.popen.pid, signal.SIGTERM)
        try:
            self.popen.wait(30)
        except subprocess.TimeoutExpired:
            os.killpg(self.popen.pid, signal.SIGKILL)
            self.popen.wait(10)
        os.unlink(self.log.name)


async def closed_loop(url: str, clients: int, stop: asyncio.Event, max_tokens: int) -> None:
    limits = httpx.Limits(max_connections=clients, max_keepalive_connections=clients)
    async with httpx.AsyncClient(limits=limits, timeout=None) as client:

        async def one(i: int) -> None:
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


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="experiment", required=True)
    p = sub.add_parser("overhead", help="engine overhead at H200 step times")
    p.add_argument("--running", type=int, nargs="+", default=[64, 256, 1024])
    p.add_argument("--window", type=float, default=20.0, help="seconds measured per point")
    p.add_argument("--max-tokens", type=int, default=512)
    p.add_argument("--async-scheduling", choices=["off", "on", "both"], default="both")
    args = parser.parse_args()
    modes = {"off": [False], "on": [True], "both": [False, True]}[args.async_scheduling]
    rows = []
    header = (f"{'running':>7} {'async':>5} {'idle':>6} {'steps/s':>8} {'step ms':>8} "
              f"{'sched ms':>8} {'IPC KiB':>8} {'detok ms':>8} {'api CPU':>7} {'client':>6} "
              f"{'CPU busy':>8} {'tok/s':>8}")  # fmt: skip
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
                  f"{r['generation_tok_s']:>8.0f}", flush=True)  # fmt: skip
    OUT.mkdir(parents=True, exist_ok=True)
    (OUT / "scale_overhead.json").write_text(json.dumps(rows, indent=2) + "\n")
    plot(rows, OUT / "scale_overhead.png")
    print(f"wrote {OUT / 'scale_overhead.json'} and .png")
    return 0


if __name__ == "__main__":
    sys.exit(main())
