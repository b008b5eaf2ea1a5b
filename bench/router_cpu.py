"""The router's own CPU per request (issue 34), ours beside sglang's router in one run.

Per router: a fresh fleet, a fresh router process in front of it, one open-loop run of
``--requests`` streaming completions (``bench/routing.py scale``'s workload: 150 tenants'
~6,000-token contexts plus a short query, 128 output tokens, Poisson arrivals), and the
router process's CPU time (user + system, its children too; psutil) over the run divided
by the requests: ``router_cpu_ms_per_request``.

``--backend sim`` (the default, the issue's measurement): eight simulated H200 replicas of
Llama-3-8B (``actorserve serve --worker-backend sim``, KV events on), ``--rate`` simulated
requests/s at ``--sim-speed`` (80 and 10: 8 real requests/s). ``--backend fake``: eight stub
replicas in one child process (``python -m bench.router_cpu fake-fleet``: health, metrics
with a cache geometry, ``/load``, and streams of 128 vLLM-shaped SSE events, one every
``--itl-ms``): no KV events and no engine, so nothing on the host competes with the
router but the client; quick, for profiling.

``--passes 2``: a second run over the same tenants (other queries) after the first, on
the same router: the steady state, where a tenant's context is no longer new to it.

    .venv/bin/python -m bench.router_cpu [--backend sim|fake] [--requests 400] [--rate 80]
        [--passes 1] [--sglang /tmp/peers/venv-sgr] [--label after] [--out FILE]

Rows go to ``--out`` (``bench/out/router_cpu.json``; a row per router, pass and
``--label``; a rerun with the same label and backend replaces its rows) and a PNG beside
it. ``commit`` is the checkout's, with ``+`` when ``services/router`` has changes.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from bench.procs import REPO, RouterProcess, ServerProcess, free_port
from bench.routing import (
    SIM_SERVER,
    SglangRouter,
    _cpu_seconds,
    _model,
    fleet,
    measure_rate,
    open_loop,
)

OUT = Path(__file__).resolve().parent / "out"

# ---- stub replicas (``fake-fleet``): one process, one port each, raw asyncio + httptools


class _FakeReplica:
    """What the router reads of a replica, and streamed completions: ``max_tokens`` SSE
    events ``itl_s`` apart after ``ttft_s``, then a usage event (if asked) and ``[DONE]``."""

    def __init__(self, ttft_s: float, itl_s: float) -> None:
        self.ttft_s, self.itl_s = ttft_s, itl_s
        self.serial = 0

    def protocol(self) -> asyncio.Protocol:
        import httptools

        replica = self

        class Conn(asyncio.Protocol):
            def connection_made(self, transport: Any) -> None:
                self.transport = transport
                self.parser = httptools.HttpRequestParser(self)
                self.url = b""
                self.body: list[bytes] = []

            def data_received(self, data: bytes) -> None:
                try:
                    self.parser.feed_data(data)
                except httptools.HttpParserError:
                    self.transport.close()

            def on_url(self, url: bytes) -> None:
                self.url += url

            def on_body(self, body: bytes) -> None:
                self.body.append(body)

            def on_message_complete(self) -> None:
                method = self.parser.get_method()
                url, body = self.url.split(b"?")[0], b"".join(self.body)
                self.url, self.body = b"", []
                replica.answer(self.transport, method, url, body)

        return Conn()

    @staticmethod
    def _whole(
        transport: Any, status: int, body: bytes, ctype: bytes = b"application/json"
    ) -> None:
        reason = {200: b"OK", 404: b"Not Found"}.get(status, b"X")
        transport.write(b"HTTP/1.1 %d %s\r\ncontent-type: %s\r\ncontent-length: %d\r\n\r\n%s"
                        % (status, reason, ctype, len(body), body))  # fmt: skip

    def answer(self, transport: Any, method: bytes, url: bytes, body: bytes) -> None:
        if url == b"/health":
            self._whole(transport, 200, b"")
        elif url == b"/metrics":
            page = (b'vllm:cache_config_info{block_size="16",prefix_caching_hash_algo="sha256",'
                    b'num_gpu_blocks="15000",enable_prefix_caching="True"} 1.0\n'
                    b"vllm:num_requests_running 0.0\nvllm:num_requests_waiting 0.0\n")  # fmt: skip
            self._whole(transport, 200, page, b"text/plain")
        elif url == b"/load":
            self._whole(transport, 200, b'{"server_load":0,"num_requests_waiting":0,'
                        b'"num_requests_running":0}')  # fmt: skip
        elif url == b"/v1/models":
            self._whole(
                transport, 200, b'{"object":"list","data":[{"id":"fake","object":"model"}]}'
            )
        elif url == b"/v1/completions" and method == b"POST":
            self.stream(transport, json.loads(body))
        else:
            self._whole(transport, 404, b'{"error":{"message":"not found"}}')

    def stream(self, transport: Any, body: dict[str, Any]) -> None:
        loop = asyncio.get_running_loop()
        self.serial += 1
        rid = f"cmpl-{self.serial:032x}"
        n = int(body.get("max_tokens") or 16)
        usage = bool((body.get("stream_options") or {}).get("include_usage"))
        common = (
            f'data: {{"id":"{rid}","object":"text_completion","created":1733000000,"model":"fake",'
        )
        head = common + '"choices":[{"index":0,"text":"'
        transport.write(b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream; charset=utf-8\r\n"
                        b"transfer-encoding: chunked\r\n\r\n")  # fmt: skip

        def chunk(data: str) -> None:
            raw = data.encode()
            transport.write(b"%x\r\n%s\r\n" % (len(raw), raw))

        def step(i: int) -> None:
            if transport.is_closing():
                return
            if i < n:
                finish = '"length"' if i == n - 1 else "null"
                chunk(f'{head} word{i}","logprobs":null,"finish_reason":{finish},'
                      '"stop_reason":null}],"usage":null}\n\n')  # fmt: skip
                loop.call_later(self.itl_s, step, i + 1)
                return
            if usage:
                chunk(f'{common}"choices":[],"usage":{{"prompt_tokens":6000,'
                      f'"total_tokens":{6000 + n},"completion_tokens":{n}}}}}\n\n')  # fmt: skip
            chunk("data: [DONE]\n\n")
            transport.write(b"0\r\n\r\n")

        loop.call_later(self.ttft_s, step, 0)


def fake_fleet(ports: list[int], ttft_s: float, itl_s: float) -> None:
    import uvloop

    async def main() -> None:
        loop = asyncio.get_running_loop()
        for port in ports:
            replica = _FakeReplica(ttft_s, itl_s)
            await loop.create_server(replica.protocol, "127.0.0.1", port)
        print("ready", flush=True)
        await asyncio.Event().wait()

    uvloop.run(main())


@contextlib.contextmanager
def fake_urls(n: int, ttft_ms: float, itl_ms: float) -> Iterator[list[str]]:
    ports = [free_port() for _ in range(n)]
    cmd = [sys.executable, "-m", "bench.router_cpu", "fake-fleet", "--ttft-ms", str(ttft_ms),
           "--itl-ms", str(itl_ms), "--ports", *map(str, ports)]  # fmt: skip
    proc = subprocess.Popen(cmd, cwd=REPO, stdout=subprocess.PIPE, start_new_session=True)
    try:
        assert proc.stdout is not None
        if proc.stdout.readline().strip() != b"ready":
            raise RuntimeError("the fake fleet did not start")
        yield [f"http://127.0.0.1:{p}" for p in ports]
    finally:
        os.killpg(proc.pid, signal.SIGTERM)
        proc.wait(10)


# ---- the measurement


@contextlib.contextmanager
def backends(args: argparse.Namespace) -> Iterator[tuple[list[str], list[ServerProcess]]]:
    """The replicas' URLs (and the sim fleet's servers)."""
    if args.backend == "fake":
        with fake_urls(8, args.ttft_ms, args.itl_ms) as urls:
            yield urls, []
        return
    server = (*SIM_SERVER, "--kv-cache-memory-bytes", "30GiB", "--sim-speed", str(args.sim_speed))
    with fleet(server, 8, [None]) as servers:
        yield [s.url for s in servers], servers


def measure(router_name: str, args: argparse.Namespace) -> list[dict[str, Any]]:
    """A row per pass: the router's CPU over it, per request."""
    speed = args.sim_speed if args.backend == "sim" else 1.0
    rows = []
    with backends(args) as (urls, servers):
        if router_name == "sglang":
            router: Any = SglangRouter(args.sglang, urls)
            popen, log = router.proc.popen, router.proc.log
        else:
            router = RouterProcess(urls, "--policy", args.policy, "--seed", "0",
                                   "--tokenizer", "default", *args.router_args)  # fmt: skip
            popen, log = router.popen, router.log
        try:
            router.wait_ready(120)
            model = _model(urls[0])
            # a warm-up request outside the measurement (the tokenizer's first call, pools)
            asyncio.run(open_loop(router.url, model, 1000.0, 2, 1.0, 1, "[warm-up] ", 1, 4))
            time.sleep(1.0)
            salt = f"[{router_name} {args.label}] "  # the tenants' contexts, new to the fleet
            for k in range(args.passes):  # pass k > 0: the same tenants (seen), other queries
                cpu0, wall0 = _cpu_seconds(popen.pid), time.perf_counter()
                if servers:
                    ttfts, _, _ = asyncio.run(measure_rate(
                        servers, router.url, model, args.rate, args.requests, speed,
                        args.tenants, salt, k, args.max_tokens,
                    ))  # fmt: skip
                else:
                    ttfts = asyncio.run(open_loop(router.url, model, args.rate, args.requests,
                                                  speed, args.tenants, salt, k, args.max_tokens))  # fmt: skip
                cpu, wall = _cpu_seconds(popen.pid) - cpu0, time.perf_counter() - wall0
                ttfts.sort()
                rows.append({
                    "router": router_name, "label": args.label, "backend": args.backend,
                    "pass": k + 1, "requests": args.requests, "completed": len(ttfts),
                    "request_rate": args.rate, "router_cpu_s": cpu, "wall_s": wall,
                    "router_cpu_ms_per_request": 1e3 * cpu / args.requests,
                    "router_cores": cpu / wall,
                    "ttft_p50_s": ttfts[len(ttfts) // 2] if ttfts else None,
                    "ttft_p90_s": ttfts[int(0.9 * len(ttfts))] if ttfts else None,
                })  # fmt: skip
        finally:
            with contextlib.suppress(OSError):
                (OUT / f"router_cpu_{router_name}.log").write_bytes(
                    Path(log.name).read_bytes()[-200_000:]
                )
            router.close()
    return rows


def plot(rows: list[dict[str, Any]], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 4.2))
    names = [f"{r['router']}\n{r['label']}\n{r['backend']}, pass {r.get('pass', 1)}" for r in rows]
    values = [r["router_cpu_ms_per_request"] for r in rows]
    colors = ["#dd8452" if r["router"] == "sglang" else "#4c72b0" for r in rows]
    bars = ax.bar(names, values, color=colors)
    for bar, v in zip(bars, values, strict=True):
        ax.annotate(f"{v:.1f}", (bar.get_x() + bar.get_width() / 2, v), ha="center",
                    va="bottom", fontsize=9)  # fmt: skip
    ax.set_ylabel("router CPU ms / request")
    ax.set_title("Router CPU per streamed request (150 tenants x 6k tokens, 128 out)")
    ax.tick_params(axis="x", labelsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command")
    f = sub.add_parser("fake-fleet", help="(internal) stub replicas on the given ports")
    f.add_argument("--ports", type=int, nargs="+", required=True)
    f.add_argument("--ttft-ms", type=float, default=20.0)
    f.add_argument("--itl-ms", type=float, default=10.0)
    parser.add_argument("--backend", choices=["sim", "fake"], default="sim")
    parser.add_argument("--routers", nargs="+", default=["ours", "sglang"],
                        choices=["ours", "sglang"])  # fmt: skip
    parser.add_argument("--policy", default="prefix_precise", help="ours")
    parser.add_argument("--router-args", nargs="*", default=[], help="more for ours")
    parser.add_argument("--sglang", type=Path, default=Path("/tmp/peers/venv-sgr"),
                        help="setup.sh's venv with sglang-router")  # fmt: skip
    parser.add_argument("--requests", type=int, default=400)
    parser.add_argument("--rate", type=float, default=80.0, help="requests/s (simulated with sim)")
    parser.add_argument("--sim-speed", type=float, default=10.0)
    parser.add_argument("--tenants", type=int, default=150)
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--ttft-ms", type=float, default=20.0, help="fake")
    parser.add_argument("--itl-ms", type=float, default=10.0, help="fake")
    parser.add_argument("--rate-fake", type=float, default=8.0, help="fake: requests/s")
    parser.add_argument("--passes", type=int, default=1,
                        help="passes over the tenants (2: the second sees them again)")  # fmt: skip
    parser.add_argument("--label", default="now")
    parser.add_argument("--out", type=Path, default=OUT / "router_cpu.json")
    args = parser.parse_args()
    if args.command == "fake-fleet":
        fake_fleet(args.ports, args.ttft_ms / 1e3, args.itl_ms / 1e3)
        return 0
    if args.backend == "fake":
        args.rate = args.rate_fake
    if "sglang" in args.routers and not (args.sglang / "bin" / "python").exists():
        print(f"no sglang-router in {args.sglang} (../shared/peers/setup.sh): ours only")
        args.routers = [r for r in args.routers if r != "sglang"]
    OUT.mkdir(parents=True, exist_ok=True)
    rows: list[dict[str, Any]] = []
    if args.out.exists():
        rows = [r for r in json.loads(args.out.read_text())
                if not (r["label"] == args.label and r["backend"] == args.backend)]  # fmt: skip
    model = Path("/proc/cpuinfo").read_text().split("model name")[1].split("\n")[0].strip(" :\t")
    for name in args.routers:
        for row in measure(name, args):
            row["cpu_model"], row["commit"] = model, _commit()
            rows.append(row)
            print(f"{name:>7} {args.label} pass {row['pass']}: {row['router_cpu_ms_per_request']:.2f} "
                  f"ms CPU/request ({row['router_cores']:.2f} cores), "
                  f"{row['completed']}/{row['requests']} done, TTFT P50 {row['ttft_p50_s']:.3f} s",
                  flush=True)  # fmt: skip
    args.out.write_text(json.dumps(rows, indent=2) + "\n")
    plot(rows, args.out.with_suffix(".png"))
    print(f"wrote {args.out} and .png")
    return 0


def _commit() -> str:
    with contextlib.suppress(OSError, subprocess.CalledProcessError):
        head = subprocess.check_output(["git", "rev-parse", "--short", "HEAD"], cwd=REPO,
                                       text=True).strip()  # fmt: skip
        changed = subprocess.check_output(["git", "status", "--porcelain", "--", "services/router"],
                                          cwd=REPO, text=True).strip()  # fmt: skip
        return head + ("+" if changed else "")
    return "?"


if __name__ == "__main__":
    sys.exit(main())
