"""Soak (issue 16): mixed traffic at ~80 % of measured capacity for a long time, then checks.

    .venv/bin/python -m bench.soak [--duration 1200] [--load 0.8]      # make soak
    .venv/bin/python -m bench.soak --duration 120                       # make test-slow's

A fresh server on the default model. First its capacity for this mix: closed-loop clients
(``--concurrency``) for ``--capacity-s`` seconds, completed requests per second. Then Poisson
arrivals at ``--load`` x that rate for ``--duration`` seconds, of these kinds (weights in
``MIX``): streamed and plain completions, streamed chat, stop strings, ``n`` = 2, prompt
logprobs, clients that hang up after two chunks, clients that give up on a plain request
after a moment (an abort), and injected bad requests (a 400 each: the only errors allowed).
A third of the prompts share one of four long prefixes (prefix caching in play).

Every ``--sample-s`` seconds it records each process's resident memory (by role) and the
engine's KV usage and queue. At the end, once idle, it checks:

- memory: each process's RSS slope over the second half of the run (least squares, MiB per
  minute), and its growth over that half;
- KV usage back to 0 %, nothing running or waiting;
- the client's counts: sent = succeeded + errored + aborted, errored = injected;
- the server's: every engine request the api_server sent ended in the engine
  (``actorserve:api_requests_total`` = the sum of ``vllm:request_success_total`` over its
  finish reasons, aborts included);
- the server log: no ERROR line, no traceback.

Writes ``bench/out/soak.json`` and ``soak.png`` (RSS per process and KV usage over time).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import re
import sys
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import psutil

from bench.plots import write_result
from bench.procs import ServerProcess

OUT = Path(__file__).resolve().parent / "out"
SERVER_ARGS = ("--max-model-len", "2048", "--kv-cache-memory-bytes", "512MiB")
MODEL = "SmolLM2-135M-Instruct"
MIX = {
    "stream": 25, "plain": 15, "chat_stream": 15, "stop": 10, "n2": 8, "prompt_logprobs": 7,
    "disconnect": 8, "abort": 6, "bad": 6,
}  # fmt: skip
_WORDS = [
    "river", "stone", "light", "market", "window", "garden", "number", "paper", "music", "engine",
    "cloud", "table", "letter", "bridge", "forest", "silver", "harbor", "winter", "station",
    "lantern",
]  # fmt: skip
PREFIXES = [
    " ".join(f"Rule {p}.{i}: keep the {_WORDS[(p + i) % len(_WORDS)]} in order." for i in range(40))
    for p in range(4)
]


@dataclass
class Tally:
    """The client's side: what it sent and how each request ended, by kind."""

    sent: Counter[str] = field(default_factory=Counter)
    succeeded: Counter[str] = field(default_factory=Counter)
    errored: Counter[str] = field(default_factory=Counter)
    aborted: Counter[str] = field(default_factory=Counter)
    errors: list[str] = field(default_factory=list)  # the unexpected ones (first 20)

    def total(self, which: Counter[str]) -> int:
        return sum(which.values())


def _prompt(rng: random.Random) -> str:
    words = " ".join(rng.choice(_WORDS) for _ in range(rng.randint(8, 120)))
    return f"{rng.choice(PREFIXES)}\n{words}" if rng.random() < 0.33 else words


def _body(kind: str, rng: random.Random) -> tuple[str, dict[str, Any]]:
    """The endpoint and JSON body of one request of ``kind``."""
    body: dict[str, Any] = {"model": MODEL, "max_tokens": rng.randint(8, 48), "temperature": 0.7,
                            "seed": rng.randint(0, 1 << 30)}  # fmt: skip
    if kind == "chat_stream":
        body["messages"] = [{"role": "user", "content": _prompt(rng)}]
        body["stream"] = True
        return "/v1/chat/completions", body
    body["prompt"] = _prompt(rng)
    if kind in ("stream", "disconnect"):
        body["stream"] = True
        if kind == "disconnect":  # long enough to hang up in the middle
            body["max_tokens"], body["ignore_eos"] = 200, True
    elif kind == "stop":
        body["stop"] = ["\n", " the", "."]
    elif kind == "n2":
        body["n"] = 2
    elif kind == "prompt_logprobs":
        body["prompt_logprobs"] = 1
        body["logprobs"] = 2
    elif kind == "abort":
        body["max_tokens"] = 200
        body["ignore_eos"] = True
    elif kind == "bad":
        body["temperature"] = -1.0  # a 400, never sent to the engine
    return "/v1/completions", body


async def _one(
    client: httpx.AsyncClient, url: str, kind: str, rng: random.Random, t: Tally
) -> None:
    path, body = _body(kind, rng)
    t.sent[kind] += 1
    try:
        if body.get("stream"):
            chunks = 0
            async with client.stream("POST", url + path, json=body) as r:
                if r.status_code != 200:
                    await r.aread()
                    raise RuntimeError(f"{r.status_code} {r.text[:200]}")
                done = False
                async for line in r.aiter_lines():
                    if not line.startswith("data: "):
                        continue
                    if line == "data: [DONE]":
                        done = True
                        break
                    if "error" in json.loads(line[6:]):
                        raise RuntimeError(f"error event: {line[:200]}")
                    chunks += 1
                    if kind == "disconnect" and chunks == 2:
                        t.aborted[kind] += 1
                        return  # leaving the block closes the connection mid-stream
                if not done:
                    raise RuntimeError("the stream ended without [DONE]")
        else:
            timeout = 0.5 if kind == "abort" else None
            try:
                r = await client.post(url + path, json=body, timeout=timeout)
            except httpx.TimeoutException:
                if kind == "abort":
                    t.aborted[kind] += 1
                    return
                raise
            if kind == "bad":
                if r.status_code == 400 and "error" in r.json():
                    t.errored[kind] += 1  # injected: the error it must get
                    return
                raise RuntimeError(f"a bad request got {r.status_code}")
            if r.status_code != 200:
                raise RuntimeError(f"{r.status_code} {r.text[:200]}")
            want = body.get("n", 1)
            if len(r.json()["choices"]) != want:
                raise RuntimeError(f"{len(r.json()['choices'])} choices, not {want}")
        t.succeeded[kind] += 1
    except Exception as e:  # noqa: BLE001 - every failure is counted and reported
        t.errored[kind] += 1
        if len(t.errors) < 20:
            t.errors.append(f"{kind}: {type(e).__name__}: {e}")


def _kinds(rng: random.Random) -> str:
    return rng.choices(list(MIX), weights=list(MIX.values()))[0]


async def measure_capacity(url: str, seconds: float, concurrency: int, seed: int) -> float:
    """Completed requests per second of the mix with ``concurrency`` closed-loop clients."""
    rng = random.Random(seed)
    tally = Tally()
    stop_at = time.monotonic() + seconds

    async def client_loop(client: httpx.AsyncClient) -> None:
        while time.monotonic() < stop_at:
            await _one(client, url, _kinds(rng), rng, tally)

    began = time.monotonic()
    async with httpx.AsyncClient(timeout=300) as client:
        await asyncio.gather(*(client_loop(client) for _ in range(concurrency)))
    if tally.errors:
        raise RuntimeError(f"errors while measuring capacity: {tally.errors[:3]}")
    done = tally.total(tally.succeeded) + tally.total(tally.aborted) + tally.total(tally.errored)
    return done / (time.monotonic() - began)


def _roles(server: ServerProcess) -> dict[str, psutil.Process]:
    """Role -> process of the server's process group (the launcher as ``launcher``)."""
    roles: dict[str, psutil.Process] = {}
    try:
        launcher = psutil.Process(server.popen.pid)
        children = launcher.children()
    except psutil.Error:
        return roles
    roles["launcher"] = launcher
    for p in children:
        try:
            args = p.cmdline()[p.cmdline().index("launch.child") + 1 :]
        except (psutil.Error, ValueError):
            continue
        role = f"worker {args[1]}" if args[0] == "worker" else args[0]
        roles[role if role not in roles else f"{role} {p.pid}"] = p
    return roles


def _sample(server: ServerProcess, began: float, tally: Tally) -> dict[str, Any]:
    rss = {}
    for role, p in _roles(server).items():
        try:
            rss[role] = p.memory_info().rss / (1 << 20)
        except psutil.Error:
            continue
    m = server.metrics()
    return {
        "t": time.monotonic() - began,
        "rss_mib": rss,
        "kv_usage": m.get("vllm:kv_cache_usage_perc", 0.0),
        "running": m.get("vllm:num_requests_running", 0.0),
        "waiting": m.get("vllm:num_requests_waiting", 0.0),
        "sent": tally.total(tally.sent),
    }


async def run_load(
    server: ServerProcess, began: float, rate: float, duration: float, sample_s: float, seed: int
) -> tuple[Tally, list[dict[str, Any]]]:
    """Poisson arrivals of the mix at ``rate`` per second for ``duration`` seconds."""
    rng = random.Random(seed)
    tally = Tally()
    samples: list[dict[str, Any]] = []
    tasks: set[asyncio.Task[None]] = set()
    next_sample = 0.0
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=64)
    async with httpx.AsyncClient(timeout=600, limits=limits) as client:
        arrival = 0.0
        while arrival < duration:
            now = time.monotonic() - began
            if now >= next_sample:
                samples.append(await asyncio.to_thread(_sample, server, began, tally))
                s = samples[-1]
                print(f"  t={s['t']:6.0f} s  sent={s['sent']:5d}  ok={tally.total(tally.succeeded):5d}"
                      f"  err={tally.total(tally.errored):4d}  aborted={tally.total(tally.aborted):4d}"
                      f"  running={s['running']:3.0f}  waiting={s['waiting']:3.0f}"
                      f"  kv={100 * s['kv_usage']:5.1f} %", file=sys.stderr, flush=True)  # fmt: skip
                next_sample += sample_s
            if arrival > now:
                await asyncio.sleep(min(arrival - now, max(0.0, next_sample - now)))
                continue
            task = asyncio.create_task(_one(client, server.url, _kinds(rng), rng, tally))
            tasks.add(task)
            task.add_done_callback(tasks.discard)
            arrival += rng.expovariate(rate)
        if tasks:
            await asyncio.wait(tasks, timeout=300)
    return tally, samples


def memory_slopes(samples: list[dict[str, Any]]) -> dict[str, dict[str, float]]:
    """Per process: the least-squares RSS slope (MiB/min) and growth (MiB) over the second
    half of the samples (the first half warms allocators and caches up)."""
    half = samples[len(samples) // 2 :]
    out: dict[str, dict[str, float]] = {}
    for role in sorted({r for s in half for r in s["rss_mib"]}):
        pts = [(s["t"] / 60, s["rss_mib"][role]) for s in half if role in s["rss_mib"]]
        if len(pts) < 3:
            continue
        t, rss = np.array(pts).T
        slope = float(np.polyfit(t, rss, 1)[0])
        out[role] = {"slope_mib_per_min": round(slope, 3), "growth_mib": round(float(rss[-1] - rss[0]), 1),
                     "rss_mib_end": round(float(rss[-1]), 1)}  # fmt: skip
    return out


def wait_idle(server: ServerProcess, timeout_s: float = 120) -> dict[str, float]:
    deadline = time.monotonic() + timeout_s
    while True:
        m = server.metrics()
        idle = (
            m.get("vllm:num_requests_running", 0) == 0
            and m.get("vllm:num_requests_waiting", 0) == 0
        )
        if idle and m.get("vllm:kv_cache_usage_perc", 0) == 0 or time.monotonic() > deadline:
            return m
        time.sleep(0.5)


def finish_reasons(server: ServerProcess) -> dict[str, float]:
    """``vllm:request_success_total`` by ``finished_reason``."""
    from prometheus_client.parser import text_string_to_metric_families

    text = httpx.get(f"{server.url}/metrics", timeout=30).text
    out: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name == "vllm:request_success_total":
                reason = sample.labels["finished_reason"]
                out[reason] = out.get(reason, 0.0) + sample.value
    return out


def _success_total(m: dict[str, float]) -> float:
    return m.get("vllm:request_success_total", 0.0)


def log_problems(text: str) -> list[str]:
    """Lines of the server log that report an error: ERROR records and tracebacks."""
    return [ln for ln in text.splitlines() if re.search(r"\bERROR\b|Traceback", ln)][:20]


def soak(
    duration: float, load: float, capacity_s: float, concurrency: int, sample_s: float, seed: int
) -> dict[str, Any]:
    server = ServerProcess(*SERVER_ARGS)
    try:
        server.wait_ready()
        print(f"measuring capacity: {concurrency} clients for {capacity_s:.0f} s", file=sys.stderr)
        capacity = asyncio.run(measure_capacity(server.url, capacity_s, concurrency, seed))
        wait_idle(server)
        rate = load * capacity
        print(f"capacity {capacity:.2f} req/s; soaking at {rate:.2f} req/s for {duration:.0f} s",
              file=sys.stderr)  # fmt: skip
        before, reasons_before = server.metrics(), finish_reasons(server)
        began = time.monotonic()
        tally, samples = asyncio.run(run_load(server, began, rate, duration, sample_s, seed + 1))
        after, reasons_after = wait_idle(server), finish_reasons(server)
        samples.append(_sample(server, began, tally))  # idle, at the end
        log = Path(server.log.name).read_text(errors="replace")
        procs = {role: p.pid for role, p in _roles(server).items()}
    finally:
        server.close()
    sent_engine = after.get("actorserve:api_requests_total", 0) - before.get(
        "actorserve:api_requests_total", 0
    )
    ended_engine = _success_total(after) - _success_total(before)
    sent, ok = tally.total(tally.sent), tally.total(tally.succeeded)
    errored, aborted = tally.total(tally.errored), tally.total(tally.aborted)
    checks = {
        "client_counts_add_up": sent == ok + errored + aborted,
        "only_injected_errors": errored == tally.errored["bad"] == tally.sent["bad"],
        "engine_requests_all_ended": sent_engine == ended_engine,
        "kv_usage_zero_at_end": after.get("vllm:kv_cache_usage_perc", -1) == 0,
        "nothing_running_at_end": after.get("vllm:num_requests_running", -1) == 0
        and after.get("vllm:num_requests_waiting", -1) == 0,
        "no_errors_in_log": not log_problems(log),
    }
    return {
        "duration_s": duration,
        "load": load,
        "capacity_req_s": round(capacity, 3),
        "rate_req_s": round(rate, 3),
        "server_args": list(SERVER_ARGS),
        "mix": MIX,
        "client": {
            "sent": dict(tally.sent),
            "succeeded": dict(tally.succeeded),
            "errored": dict(tally.errored),
            "aborted": dict(tally.aborted),
            "unexpected_errors": tally.errors,
        },  # fmt: skip
        "engine_requests": {
            "sent": sent_engine,
            "ended": ended_engine,
            "by_finish_reason": {k: v - reasons_before.get(k, 0) for k, v in reasons_after.items()},
        },  # fmt: skip
        "memory": memory_slopes(samples),
        "log_problems": log_problems(log),
        "processes": procs,
        "checks": checks,
        "samples": samples,
    }


def plot(result: dict[str, Any], path: Path) -> None:
    from bench.plots import _pyplot, save_figure

    plt = _pyplot()
    samples = result["samples"]
    fig, (ax1, ax2) = plt.subplots(2, 1, figsize=(9, 7), sharex=True)
    for role in sorted({r for s in samples for r in s["rss_mib"]}):
        pts = [(s["t"] / 60, s["rss_mib"][role]) for s in samples if role in s["rss_mib"]]
        t, rss = zip(*pts, strict=True)
        slope = result["memory"].get(role, {}).get("slope_mib_per_min", float("nan"))
        ax1.plot(t, rss, label=f"{role} ({slope:+.2f} MiB/min)")
    ax1.set_ylabel("resident memory (MiB)")
    ax1.set_yscale("log")
    ax1.legend(fontsize=8)
    ax1.set_title(f"soak: {result['rate_req_s']:.2f} req/s ({100 * result['load']:.0f} % of "
                  f"{result['capacity_req_s']:.2f}) for {result['duration_s'] / 60:.0f} min")  # fmt: skip
    t = [s["t"] / 60 for s in samples]
    ax2.plot(t, [100 * s["kv_usage"] for s in samples], label="KV usage %")
    ax2.plot(t, [s["running"] for s in samples], label="running")
    ax2.plot(t, [s["waiting"] for s in samples], label="waiting")
    ax2.set_xlabel("minutes")
    ax2.legend(fontsize=8)
    save_figure(fig, path)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--duration", type=float, default=1200, help="seconds of load (default 20 min)")
    p.add_argument("--load", type=float, default=0.8, help="fraction of the measured capacity")
    p.add_argument("--capacity-s", type=float, default=60, help="seconds to measure capacity")
    p.add_argument("--concurrency", type=int, default=8, help="clients while measuring capacity")
    p.add_argument("--sample-s", type=float, default=10, help="seconds between samples")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", type=Path, default=OUT / "soak.json")
    a = p.parse_args(argv)
    result = soak(a.duration, a.load, a.capacity_s, a.concurrency, a.sample_s, a.seed)
    write_result(result, a.out, plot)
    print(json.dumps({k: result[k] for k in ("capacity_req_s", "rate_req_s", "client",
                                             "engine_requests", "memory", "checks")}, indent=1))  # fmt: skip
    return 0 if all(result["checks"].values()) else 1


if __name__ == "__main__":
    sys.exit(main())
