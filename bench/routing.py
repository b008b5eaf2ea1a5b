"""Routing experiments (issue 13): the seeds' table, a hot prefix, and scale.

``seeds``: the seeds' experiment on this machine. Two fresh replicas of the default model
(each pinned to one core, 256 MiB of KV: about four 1,500-token prefixes), a router per
policy, concurrency 1: three rounds of ten groups, each group a new ~1,500-token prefix
sent as "prefix + question 1", then, once answered (32 tokens), "prefix + question 2".
Over the 30 second requests, per policy: how many went to the replica that served their
first (n/30), the prefix-token hit rate (the replicas' ``vllm:prefix_cache_hits`` /
``_queries`` increments), TTFT P50 and P95 at the client, and the mean prompt tokens
computed (``vllm:request_prefill_kv_computed_tokens``).

    .venv/bin/python -m bench.routing seeds [--policies random prefix_approx prefix_precise cost]

``hot``: the case the seeds left open. One prefix shared by every request, many clients
at once (``--concurrency``), so that pure affinity queues everything on the replica that
holds it: ``cost`` against ``prefix_precise`` and ``round_robin`` on TTFT P95 and goodput
(TTFT <= ``--slo-ttft-ms``). Each replica is pinned to its own core; ``--sim`` runs the same
on simulated H200s (Llama-3-8B) instead, at ``--sim-speed 4`` so that this host's CPUs
(client, router, two servers) keep up; times are then simulated.

    .venv/bin/python -m bench.routing hot [--sim] [--concurrency 16] [--requests 96]

``scale``: eight simulated H200 replicas of Llama-3-8B (a KV pool of 30 GiB each: ~40 of
the tenants' contexts), the llm-d shape: 150 tenants with ~6,000-token contexts, short
queries, 128 output tokens, Poisson arrivals at rising rates; per policy the output tok/s,
TTFT P90 and peak queue (``vllm:num_requests_waiting`` summed over replicas). At
``--sim-speed 4`` (the simulated world runs 4x slower than real time, so this host's CPUs
keep up); every time reported is simulated. With ``--sglang DIR`` (``setup.sh``'s
``venv-sgr``), sglang's router (``cache_aware``) in front of the same kind of replicas too.

    .venv/bin/python -m bench.routing scale [--rates 10 20 40 60] [--requests 600]

Every run writes ``bench/out/routing_<experiment>.json`` and a PNG beside it.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import statistics
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import numpy as np

from bench.procs import RouterProcess, ServerProcess

OUT = Path(__file__).resolve().parent / "out"
SEEDS_SERVER = ("--kv-cache-memory-bytes", "256MiB", "--max-model-len", "2048",
                "--kv-events-endpoint", "auto")  # fmt: skip
SIM_SERVER = ("--worker-backend", "sim", "--sim-model", "llama-3-8b", "--sim-hardware", "h200",
              "--kv-events-endpoint", "auto", "--async-scheduling")  # fmt: skip


def document(group: int, sentences: int = 60) -> str:
    """A ~25-token sentence per line: 60 of them are ~1,500 tokens of the default tokenizer."""
    return "\n".join(
        f"Section {group}.{i}: the committee reviewed item {i} of file {group} and found it in order."
        for i in range(sentences)
    )


@contextlib.contextmanager
def fleet(
    server_args: tuple[str, ...], n: int, pins: list[str | None]
) -> Iterator[list[ServerProcess]]:
    servers: list[ServerProcess] = []
    try:
        for i in range(n):
            servers.append(ServerProcess(*server_args, pin=pins[i % len(pins)]))
        for s in servers:
            s.wait_ready()
        yield servers
    finally:
        for s in servers:
            s.close()


@contextlib.contextmanager
def routed(servers: list[ServerProcess], policy: str, *args: str) -> Iterator[RouterProcess]:
    router = RouterProcess([s.url for s in servers], "--policy", policy, "--seed", "0", *args)
    try:
        router.wait_ready(60)
        yield router
    finally:
        router.close()


async def stream_ttft(client: httpx.AsyncClient, url: str, model: str, prompt: str,
                      max_tokens: int) -> float:  # fmt: skip
    """Seconds to the first generated text of a streaming completion."""
    body = {"model": model, "prompt": prompt, "max_tokens": max_tokens, "stream": True,
            "temperature": 0, "ignore_eos": True}  # fmt: skip
    start = time.perf_counter()
    ttft = None
    async with client.stream("POST", url + "/v1/completions", json=body) as r:
        if r.status_code != 200:
            raise RuntimeError(f"HTTP {r.status_code}: {(await r.aread())[:300]!r}")
        async for line in r.aiter_lines():
            first = ttft is None and line.startswith("data:") and '"text":"' in line
            if first and json.loads(line[5:])["choices"][0]["text"]:
                ttft = time.perf_counter() - start
    return ttft if ttft is not None else time.perf_counter() - start


def _sum(servers: list[ServerProcess], name: str) -> float:
    return sum(s.metrics().get(name, 0.0) for s in servers)


def _model(url: str) -> str:
    return str(httpx.get(url + "/v1/models", timeout=30).json()["data"][0]["id"])


def seeds_policy(policy: str, groups: int, rounds: int, max_tokens: int) -> dict[str, Any]:
    """As the seeds: per round and group a new prefix; "prefix + question 1", wait, then
    "prefix + question 2", the one measured (its replica, TTFT and the replicas' counter
    increments around it)."""
    names = ("vllm:prefix_cache_hits_total", "vllm:prefix_cache_queries_total",
             "vllm:request_prefill_kv_computed_tokens_sum")  # fmt: skip
    with fleet(SEEDS_SERVER, 2, ["0", "1"]) as servers, routed(servers, policy) as router:
        model = _model(servers[0].url)
        measured = dict.fromkeys(names, 0.0)
        ttfts, returned = [], 0

        def successes() -> list[float]:
            return [s.metrics().get("vllm:request_success_total", 0.0) for s in servers]

        async def ask(client: httpx.AsyncClient, g: int, q: int) -> tuple[int, float]:
            """Which replica served it, and its TTFT."""
            before = successes()
            prompt = f"{document(g)}\nQuestion {q}: what did section {g}.{q} find?"
            ttft = await stream_ttft(client, router.url, model, prompt, max_tokens)
            return int(np.argmax(np.subtract(successes(), before))), ttft

        async def run() -> None:
            nonlocal returned
            async with httpx.AsyncClient(timeout=600) as client:
                for r in range(rounds):
                    for g in range(groups):
                        group = r * groups + g  # a new prefix every time
                        first, _ = await ask(client, group, 1)
                        before = {n: _sum(servers, n) for n in names}
                        second, ttft = await ask(client, group, 2)
                        for n in names:
                            measured[n] += _sum(servers, n) - before[n]
                        ttfts.append(ttft)
                        returned += second == first
                    print(f"  {policy}: round {r + 1}/{rounds} done", flush=True)

        asyncio.run(run())
    n = groups * rounds
    return {
        "policy": policy, "requests": n, "returned": returned,
        "hit_rate": measured[names[0]] / max(measured[names[1]], 1.0),
        "ttft_p50_ms": 1e3 * float(np.percentile(ttfts, 50)),
        "ttft_p95_ms": 1e3 * float(np.percentile(ttfts, 95)),
        "prefill_tokens_per_request": measured[names[2]] / n,
    }  # fmt: skip


def hot_policy(policy: str, sim: bool, concurrency: int, requests: int, slo_ms: float,
               max_tokens: int, speed: float = 1.0) -> dict[str, Any]:  # fmt: skip
    """``requests`` questions on one shared prefix, ``concurrency`` at a time; with ``sim``
    at ``--sim-speed speed``, every time in simulated seconds."""
    server_args = (*SIM_SERVER, "--sim-speed", str(speed)) if sim else SEEDS_SERVER
    pins: list[str | None] = [None] if sim else ["0", "1"]
    with (
        fleet(server_args, 2, pins) as servers,
        routed(servers, policy, "--tokenizer", "default") as router,
    ):
        model = _model(servers[0].url)
        prefix = document(0)
        ttfts: list[float] = []

        async def run() -> float:
            sem = asyncio.Semaphore(concurrency)
            async with httpx.AsyncClient(
                timeout=600, limits=httpx.Limits(max_connections=None)
            ) as client:
                # the prefix is computed once on one replica before the burst of questions
                await stream_ttft(client, router.url, model, f"{prefix}\nQuestion warm-up?", 1)
                start = time.perf_counter()

                async def one(i: int) -> None:
                    async with sem:
                        q = f"{prefix}\nQuestion {i}: what did section 0.{i % 60} find?"
                        ttft = await stream_ttft(client, router.url, model, q, max_tokens)
                        ttfts.append(ttft / speed)

                await asyncio.gather(*(one(i) for i in range(requests)))
                return (time.perf_counter() - start) / speed

        elapsed = asyncio.run(run())
        served = [s.metrics().get("vllm:request_success_total", 0.0) for s in servers]
    good = sum(t * 1e3 <= slo_ms for t in ttfts)
    return {
        "policy": policy, "sim": sim, "concurrency": concurrency, "requests": requests,
        "ttft_p50_ms": 1e3 * statistics.median(ttfts),
        "ttft_p95_ms": 1e3 * float(np.percentile(ttfts, 95)),
        "goodput_req_s": good / elapsed, "slo_ttft_ms": slo_ms,
        "served_per_replica": served,
    }  # fmt: skip


class SglangRouter:
    """sglang's router (``sglang_router.launch_router``) from its own virtualenv."""

    def __init__(self, venv: Path, backends: list[str]) -> None:
        from bench.procs import _Process, free_port

        cmd = [str(venv / "bin" / "python"), "-m", "sglang_router.launch_router",
               "--host", "127.0.0.1", "--port", str(free_port()), "--policy", "cache_aware",
               "--prometheus-port", str(free_port()), "--worker-startup-check-interval", "1",
               "--worker-urls", *backends]  # fmt: skip
        self.proc = _Process(cmd, name="sglang-router")
        self.url = self.proc.url

    def wait_ready(self, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            with contextlib.suppress(httpx.HTTPError):
                if httpx.get(self.url + "/v1/models", timeout=2).status_code == 200:
                    return
            if self.proc.popen.poll() is not None:
                break
            time.sleep(0.5)
        raise RuntimeError(f"sglang router: {Path(self.proc.log.name).read_text()[-2000:]}")

    def close(self) -> None:
        self.proc.close()


def tenant_context(tenant: int) -> str:
    return document(tenant, 240)  # ~6,000 tokens


async def open_loop(url: str, model: str, rate: float, requests: int, speed: float,
                    tenants: int, salt: str, seed: int, max_tokens: int) -> list[float]:  # fmt: skip
    """Poisson arrivals at ``rate`` (simulated) requests/s; TTFTs in simulated seconds."""
    rng = np.random.default_rng(seed)
    gaps = rng.exponential(1.0 / rate, requests) * speed  # real seconds
    who = rng.integers(0, tenants, requests)
    ttfts: list[float] = []
    errors: list[str] = []
    async with httpx.AsyncClient(timeout=3600, limits=httpx.Limits(max_connections=None)) as client:

        async def one(i: int) -> None:
            prompt = f"{salt}{tenant_context(int(who[i]))}\nQuery {i}: summarize section {i % 240}."
            try:
                ttfts.append(await stream_ttft(client, url, model, prompt, max_tokens) / speed)
            except (httpx.HTTPError, RuntimeError) as e:  # counted, never the end of the run
                errors.append(f"{type(e).__name__}: {e}"[:200])

        tasks = []
        for i in range(requests):
            tasks.append(asyncio.create_task(one(i)))
            await asyncio.sleep(gaps[i])
        await asyncio.gather(*tasks)
    if errors:
        print(f"  {len(errors)} of {requests} requests failed, e.g. {errors[0]}", flush=True)
    return ttfts


async def measure_rate(servers: list[ServerProcess], url: str, model: str, rate: float,
                       requests: int, speed: float, tenants: int, salt: str, seed: int,
                       max_tokens: int) -> tuple[list[float], float, float]:  # fmt: skip
    """TTFTs, simulated seconds elapsed, and the peak of waiting requests over the fleet."""
    stop = asyncio.Event()
    peak = 0.0

    async def watch() -> None:
        nonlocal peak
        while not stop.is_set():
            waiting = await asyncio.to_thread(_sum, servers, "vllm:num_requests_waiting")
            peak = max(peak, waiting)
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(stop.wait(), 1.0)

    watcher = asyncio.create_task(watch())
    start = time.perf_counter()
    ttfts = await open_loop(url, model, rate, requests, speed, tenants, salt, seed, max_tokens)
    elapsed = (time.perf_counter() - start) / speed
    stop.set()
    await watcher
    return ttfts, elapsed, peak


def scale_policy(policy: str, rates: list[float], requests: int, speed: float, tenants: int,
                 max_tokens: int, sglang: Path | None) -> list[dict[str, Any]]:  # fmt: skip
    args = (*SIM_SERVER, "--kv-cache-memory-bytes", "30GiB", "--sim-speed", str(speed))
    rows = []
    with fleet(args, 8, [None]) as servers:
        urls = [s.url for s in servers]
        if policy == "sglang_cache_aware":
            assert sglang is not None
            router: Any = SglangRouter(sglang, urls)
        else:
            router = RouterProcess(
                urls, "--policy", policy, "--seed", "0", "--tokenizer", "default"
            )
        try:
            router.wait_ready(120)
            model = _model(servers[0].url)
            names = ("vllm:generation_tokens_total", "vllm:prefix_cache_hits_total",
                     "vllm:prefix_cache_queries_total", "vllm:request_prefill_kv_computed_tokens_sum")  # fmt: skip
            popen = router.proc.popen if isinstance(router, SglangRouter) else router.popen
            for k, rate in enumerate(rates):
                before = [_sum(servers, n) for n in names]
                cpu0 = _cpu_seconds(popen.pid)
                ttfts, elapsed, peak = asyncio.run(measure_rate(
                    servers, router.url, model, rate, requests, speed, tenants,
                    f"[{policy}] ", k, max_tokens,
                ))  # fmt: skip
                tokens, hits, queries, computed = (
                    _sum(servers, n) - b for n, b in zip(names, before, strict=True)
                )
                row = {"policy": policy, "request_rate": rate, "output_tok_s": tokens / elapsed,
                       "ttft_p50_s": float(np.percentile(ttfts, 50)),
                       "ttft_p90_s": float(np.percentile(ttfts, 90)), "peak_waiting": peak,
                       "hit_rate": hits / max(queries, 1.0),
                       "prefill_tokens_per_request": computed / requests,
                       "router_cpu_ms_per_request": 1e3 * (_cpu_seconds(popen.pid) - cpu0) / requests}  # fmt: skip
                if policy == "cost":  # requests it sent to copy a hot prefix (cumulative)
                    row["hot_copies"] = router.metrics().get("router:hot_prefix_copies", 0.0)
                rows.append(row)
                print(f"{policy:>18} {rate:>6g} {row['output_tok_s']:>9.0f} "
                      f"{row['ttft_p50_s']:>9.2f} {row['ttft_p90_s']:>9.2f} {peak:>8.0f} "
                      f"{100 * row['hit_rate']:>7.1f}% {row['prefill_tokens_per_request']:>8.0f} "
                      f"{row['router_cpu_ms_per_request']:>9.1f}",
                      flush=True)  # fmt: skip
        finally:
            log = Path(router.log.name if hasattr(router, "log") else router.proc.log.name)
            with contextlib.suppress(OSError):  # kept for a look when a run goes wrong
                (OUT / f"routing_scale_{policy}.log").write_bytes(log.read_bytes()[-200_000:])
            router.close()
    return rows


def _cpu_seconds(pid: int) -> float:
    """CPU time (user + system) of a process and its children so far."""
    import psutil

    procs = [psutil.Process(pid)]
    procs += procs[0].children(recursive=True)
    total = 0.0
    for p in procs:
        with contextlib.suppress(psutil.Error):
            t = p.cpu_times()
            total += t.user + t.system
    return total


def plot_scale(rows: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (a, b, c) = plt.subplots(1, 3, figsize=(14, 4))
    for policy in dict.fromkeys(r["policy"] for r in rows):
        pts = [r for r in rows if r["policy"] == policy]
        x = [r["request_rate"] for r in pts]
        a.plot(x, [r["output_tok_s"] for r in pts], marker="o", label=policy)
        b.plot(x, [r["ttft_p90_s"] for r in pts], marker="o", label=policy)
        c.plot(x, [100 * r.get("hit_rate", 0.0) for r in pts], marker="o", label=policy)
    a.set(xlabel="requests/s", ylabel="output tok/s", title="throughput")
    b.set(xlabel="requests/s", ylabel="TTFT P90 (s)", title="TTFT P90", yscale="log")
    c.set(xlabel="requests/s", ylabel="prefix-token hit rate (%)", title="cache hits")
    a.legend(fontsize=8)
    fig.suptitle("8 simulated H200 replicas, Llama-3-8B, 150 tenants x 6k-token contexts")
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def plot(rows: list[dict], keys: list[tuple[str, str]], title: str, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(keys), figsize=(4.2 * len(keys), 3.6))
    for ax, (key, label) in zip(np.atleast_1d(axes), keys, strict=True):
        ax.bar([r["policy"] for r in rows], [r[key] for r in rows], color="#4c72b0")
        ax.set_title(label, fontsize=10)
        ax.tick_params(axis="x", rotation=30, labelsize=8)
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="experiment", required=True)
    s = sub.add_parser("seeds", help="the seeds' table: affinity at concurrency 1")
    s.add_argument("--policies", nargs="+",
                   default=["random", "prefix_approx", "prefix_precise", "cost"])  # fmt: skip
    s.add_argument("--groups", type=int, default=10, help="per round")
    s.add_argument("--rounds", type=int, default=3)
    s.add_argument("--max-tokens", type=int, default=32)
    h = sub.add_parser("hot", help="one hot prefix under load: cost against pure affinity")
    h.add_argument("--policies", nargs="+", default=["round_robin", "prefix_precise", "cost"])
    h.add_argument("--sim", action="store_true", help="simulated H200 replicas")
    h.add_argument("--concurrency", type=int, default=16)
    h.add_argument("--requests", type=int, default=96)
    h.add_argument("--slo-ttft-ms", type=float, default=None, help="default 2000 (CPU), 200 (sim)")
    h.add_argument("--max-tokens", type=int, default=16)
    h.add_argument("--sim-speed", type=float, default=4.0, help="with --sim")
    c = sub.add_parser("scale", help="8 simulated H200 replicas, 150 tenants, rising rates")
    c.add_argument("--policies", nargs="+",
                   default=["random", "prefix_approx", "prefix_precise", "cost"])  # fmt: skip
    c.add_argument("--rates", type=float, nargs="+", default=[10, 20, 40, 60])
    c.add_argument("--requests", type=int, default=600, help="per rate")
    c.add_argument("--sim-speed", type=float, default=4.0)
    c.add_argument("--tenants", type=int, default=150)
    c.add_argument("--max-tokens", type=int, default=128)
    c.add_argument("--sglang", type=Path, default=None, help="venv with sglang-router")
    args = parser.parse_args()
    OUT.mkdir(parents=True, exist_ok=True)
    rows = []
    if args.experiment == "scale":
        policies = [*args.policies, *(["sglang_cache_aware"] if args.sglang else [])]
        print(f"{'policy':>18} {'rate':>6} {'tok/s':>9} {'TTFT p50':>9} {'TTFT p90':>9} "
              f"{'waiting':>8} {'hits':>8} {'computed':>8} {'router ms':>9}", flush=True)  # fmt: skip
        for policy in policies:
            rows += scale_policy(policy, args.rates, args.requests, args.sim_speed, args.tenants,
                                 args.max_tokens, args.sglang)  # fmt: skip
        path = OUT / "routing_scale.json"
        path.write_text(json.dumps(rows, indent=2) + "\n")
        plot_scale(rows, path.with_suffix(".png"))
        print(f"wrote {path} and .png")
        return 0
    if args.experiment == "seeds":
        print(f"{'policy':>15} {'returned':>9} {'hit rate':>9} {'TTFT p50':>9} {'TTFT p95':>9} "
              f"{'prefill tok/req':>15}", flush=True)  # fmt: skip
        for policy in args.policies:
            r = seeds_policy(policy, args.groups, args.rounds, args.max_tokens)
            rows.append(r)
            print(f"{policy:>15} {r['returned']:>5}/{r['requests']:<3} {100 * r['hit_rate']:>8.1f}% "
                  f"{r['ttft_p50_ms']:>7.0f}ms {r['ttft_p95_ms']:>7.0f}ms "
                  f"{r['prefill_tokens_per_request']:>15.0f}", flush=True)  # fmt: skip
        keys = [("hit_rate", "prefix hit rate"), ("ttft_p95_ms", "TTFT P95 (ms)"),
                ("prefill_tokens_per_request", "prompt tokens computed / request")]  # fmt: skip
        name = "routing_seeds"
        title = "Two replicas, ~1,500-token prefixes, concurrency 1"
    else:
        slo = args.slo_ttft_ms or (200.0 if args.sim else 2000.0)
        print(f"{'policy':>15} {'TTFT p50':>9} {'TTFT p95':>9} {'goodput':>8} {'per replica':>12}",
              flush=True)  # fmt: skip
        for policy in args.policies:
            r = hot_policy(policy, args.sim, args.concurrency, args.requests, slo, args.max_tokens,
                           args.sim_speed if args.sim else 1.0)  # fmt: skip
            rows.append(r)
            print(f"{policy:>15} {r['ttft_p50_ms']:>7.0f}ms {r['ttft_p95_ms']:>7.0f}ms "
                  f"{r['goodput_req_s']:>8.2f} {r['served_per_replica']}", flush=True)  # fmt: skip
        keys = [
            ("ttft_p95_ms", "TTFT P95 (ms)"),
            ("goodput_req_s", f"goodput (TTFT <= {slo:g} ms)"),
        ]
        name = "routing_hot_sim" if args.sim else "routing_hot"
        title = f"One hot prefix, concurrency {args.concurrency}" + (
            " (sim H200)" if args.sim else ""
        )
    path = OUT / f"{name}.json"
    path.write_text(json.dumps(rows, indent=2) + "\n")
    plot(rows, keys, title, path.with_suffix(".png"))
    print(f"wrote {path} and .png")
    return 0


if __name__ == "__main__":
    sys.exit(main())
