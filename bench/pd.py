"""Prefill/decode disaggregation experiments (issue 14).

``transfer``: the second seed's estimate against a measurement. Moving one request's KV
from the prefill instance to the decode instance costs about

    KV bytes per token x prompt tokens / link bandwidth,

KV bytes per token = 2 (K and V) x layers x KV heads x head dim x bytes per element. The
seed's data point: 15 prompt tokens, ~0.188 MB, 1.51 ms (one GPU, UCX over TCP and CUDA
IPC). Here: the default model's KV layout (SmolLM2-135M: 30 layers, 3 KV heads of 64, fp32
on CPU: 46,080 bytes a token), the ``p2p`` connector's two worker halves in one process
over loopback TCP (the same code a decode rank runs: hold, pull layer by layer, copy into
the cache, release), prompts of 15 to 2,048 tokens. The link bandwidth in the estimate is
measured first on the same loopback with ZeroMQ alone (large frames, DEALER/ROUTER), so the
gap between estimate and measurement is the connector's own cost (gathering the blocks,
the per-layer messages, copying into the cache).

    .venv/bin/python -m bench.pd transfer [--tokens 15 64 256 1024 2048] [--repeats 7]

``colocated``: the seeds' question, honestly, on this 2-core machine. A chat workload
with occasional long prompts (``--long-share`` of the requests have ~1,500-token prompts,
the rest ~100; 64 output tokens each; Poisson arrivals at ``--rate``, fixed seed), sent by
the same streaming client to two setups of the default model, each with one core per
instance (``taskset``):

- colocated: two replicas behind ``actorserve router --policy cost``;
- 1P1D: a prefill instance (``kv_producer``) and a decode instance (``kv_consumer``) behind
  ``actorserve pd-proxy``.

Per setup: TTFT and ITL P50/P99, TPOT, and goodput (requests per second meeting TTFT <=
``--slo-ttft-ms`` and TPOT <= ``--slo-tpot-ms``). PD keeps the long prefills off the
decode instance (its ITL should stay flat) but puts every prompt on one core and adds the
transfer to the TTFT.

    .venv/bin/python -m bench.pd colocated [--rate 1.0] [--requests 80] [--long-share 0.15]

``sim``: four simulated H200s serving Llama-3-8B (``--worker-backend sim``, NVLink between
them), as four colocated replicas behind ``actorserve router --policy cost``, as 2P2D and
as 1P3D behind ``actorserve pd-proxy``, on three of DistServe's SLO shapes (its Table 1,
for OPT on A100s; here the shapes, not the model): chatbot (ShareGPT-like: ~230-token
prompts, ~200 output; TTFT <= 250 ms, TPOT <= 100 ms), code completion (HumanEval-like:
~150 / ~100; TTFT <= 125 ms, TPOT <= 200 ms) and summarization (LongBench-like: ~1,800 /
~100; TTFT <= 15 s, TPOT <= 150 ms). ``actorserve bench`` at each ``--rates`` point;
goodput is requests per second meeting both SLOs (the JSON has it per GPU too, as DistServe
reports it). Run at
``--sim-speed 4`` so that this host's two cores keep up; every time is simulated.

    .venv/bin/python -m bench.pd sim [--workloads chat code summarization] [--requests 400]

Each experiment writes ``bench/out/pd_<experiment>.json`` and a PNG beside it, and prints
a table.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import threading
import time
from pathlib import Path
from typing import Any

import msgspec
import torch
import zmq

from services.config import EngineConfig
from services.config.kv_transfer import KVTransferConfig
from services.kv_transfer.p2p import P2PConnectorWorker
from services.protocol import KVLayout, KVTransferDone, P2PHold, P2PLoad, P2PMetadata

OUT = Path(__file__).resolve().parent / "out"
SEED_POINT = {"tokens": 15, "mb": 0.188, "ms": 1.51}  # the second seed's NIXL run
_encode = msgspec.msgpack.Encoder().encode


def default_layout(block_size: int = 16) -> KVLayout:
    from services.model_arch import ModelArchConfig
    from services.model_loader import load_hf_config, prepare_model

    arch = ModelArchConfig.from_hf_config(load_hf_config(prepare_model(None)))
    return KVLayout(arch.num_hidden_layers, block_size, arch.num_key_value_heads,
                    arch.head_dim, "float32")  # fmt: skip


def bytes_per_token(layout: KVLayout) -> int:
    elem = torch.tensor([], dtype=getattr(torch, layout.dtype)).element_size()
    return 2 * layout.num_layers * layout.num_kv_heads * layout.head_dim * elem


def loopback_bandwidth(total_mb: int = 256, frame_mb: int = 4) -> float:
    """Bytes per second ZeroMQ moves over loopback TCP between two threads (DEALER/ROUTER,
    ``frame_mb`` frames, as the connector sends them), best of three."""
    ctx = zmq.Context.instance()
    router = ctx.socket(zmq.ROUTER)
    port = router.bind_to_random_port("tcp://127.0.0.1")
    dealer = ctx.socket(zmq.DEALER)
    dealer.connect(f"tcp://127.0.0.1:{port}")
    frame = bytearray(frame_mb << 20)
    n = total_mb // frame_mb
    best = 0.0
    try:
        for _ in range(3):
            dealer.send(b"go")
            identity, _ = router.recv_multipart()

            def serve(identity: bytes = identity) -> None:
                for _ in range(n):
                    router.send_multipart([identity, frame], copy=False)

            start = time.perf_counter()
            t = threading.Thread(target=serve)
            t.start()
            for _ in range(n):
                dealer.recv(copy=False)
            t.join()
            best = max(best, n * len(frame) / (time.perf_counter() - start))
    finally:
        dealer.close(linger=0)
        router.close(linger=0)
    return best


class _Reports:
    def __init__(self) -> None:
        self.items: list[KVTransferDone] = []
        self.cond = threading.Condition()

    def __call__(self, done: KVTransferDone) -> None:
        with self.cond:
            self.items.append(done)
            self.cond.notify_all()

    def take(self, req_id: str, timeout_s: float = 60.0) -> KVTransferDone:
        with self.cond:
            ok = self.cond.wait_for(
                lambda: any(req_id in d.finished_recving + d.failed_recving for d in self.items),
                timeout_s,
            )
            assert ok, f"no report for {req_id}"
            done = next(d for d in self.items if req_id in d.finished_recving + d.failed_recving)
            self.items.remove(done)
        assert req_id in done.finished_recving, f"{req_id}: the pull failed"
        return done


def transfer(tokens: list[int], repeats: int, transport: str = "zmq") -> dict[str, Any]:
    from bench.procs import free_port
    from services.flags import ConfigError

    layout = default_layout()
    per_token = bytes_per_token(layout)
    bandwidth = loopback_bandwidth()
    bs = layout.block_size
    num_blocks = -(-max(tokens) // bs) + 1
    shape = (num_blocks, bs, layout.num_kv_heads, layout.head_dim)
    src = [(torch.randn(shape), torch.randn(shape)) for _ in range(layout.num_layers)]
    dst = [(torch.zeros(shape), torch.zeros(shape)) for _ in range(layout.num_layers)]
    port = free_port()
    prod_reports, cons_reports = _Reports(), _Reports()
    engine = EngineConfig()
    extra = {"transport": transport}
    prod = P2PConnectorWorker(KVTransferConfig("p2p", "kv_producer", kv_port=port,
                                               kv_connector_extra_config=extra),
                              engine, 0, prod_reports)  # fmt: skip
    cons = P2PConnectorWorker(KVTransferConfig("p2p", "kv_consumer", kv_port=free_port(),
                                               kv_connector_extra_config=extra),
                              engine, 0, cons_reports)  # fmt: skip
    try:
        prod.register_kv_caches(src, layout)
        cons.register_kv_caches(dst, layout)
    except ConfigError as e:
        raise SystemExit(str(e)) from None
    rows = []
    try:
        for n in tokens:
            blocks = list(range(-(-n // bs)))
            times = []
            for r in range(repeats + 1):  # the first is a warm-up (connection set-up)
                req = f"{n}-{r}"
                prod.bind_connector_metadata(_encode(P2PMetadata(
                    holds=[P2PHold(req, blocks, [1] * len(blocks), 60.0)])))  # fmt: skip
                cons.bind_connector_metadata(_encode(P2PMetadata(loads=[P2PLoad(
                    "d" + req, blocks, req, blocks, [1] * len(blocks), "127.0.0.1", port)])))  # fmt: skip
                cons.start_load_kv()
                done = cons_reports.take("d" + req)
                if r:
                    times.append(done.seconds)
            moved = len(blocks) * bs * per_token  # whole blocks move
            rows.append({
                "prompt_tokens": n,
                "bytes": moved,
                "estimate_ms": 1e3 * n * per_token / bandwidth,
                "estimate_blocks_ms": 1e3 * moved / bandwidth,
                "measured_ms_median": 1e3 * statistics.median(times),
                "measured_ms_min": 1e3 * min(times),
                "measured_mb_s": moved / 1e6 / statistics.median(times),
            })  # fmt: skip
            print(f"{n:>6} tokens {moved / 1e6:8.2f} MB  estimate {rows[-1]['estimate_ms']:8.2f} ms"
                  f"  measured {rows[-1]['measured_ms_median']:8.2f} ms (min "
                  f"{rows[-1]['measured_ms_min']:.2f})", flush=True)  # fmt: skip
    finally:
        prod.shutdown()
        cons.shutdown()
    return {"transport": transport, "layout": msgspec.to_builtins(layout),
            "bytes_per_token": per_token,
            "loopback_bytes_per_s": bandwidth, "repeats": repeats, "rows": rows,
            "seed_point": SEED_POINT}  # fmt: skip


def plot_transfer(result: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = result["rows"]
    x = [r["prompt_tokens"] for r in rows]
    fig, ax = plt.subplots(figsize=(6, 4))
    transport = result.get("transport", "zmq")
    ax.plot(x, [r["measured_ms_median"] for r in rows], "o-",
            label=f"measured (p2p over {transport}, median)")  # fmt: skip
    ax.plot(x, [r["estimate_ms"] for r in rows], "s--",
            label=f"estimate: bytes / {result['loopback_bytes_per_s'] / 1e9:.1f} GB/s")  # fmt: skip
    s = result["seed_point"]
    ax.plot([s["tokens"]], [s["ms"]], "k*", markersize=10, label="seed: NIXL, 0.188 MB")
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlabel("prompt tokens")
    ax.set_ylabel("KV transfer time (ms)")
    ax.set_title(f"KV transfer, {result['bytes_per_token']:,} bytes/token, loopback TCP")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)


SERVER = ("--kv-cache-memory-bytes", "512MiB", "--max-model-len", "2048")


def _p2p(role: str) -> tuple[str, str]:
    from bench.procs import free_port

    cfg = {"kv_connector": "p2p", "kv_role": role, "kv_port": free_port()}
    return "--kv-transfer-config", json.dumps(cfg)


def workload(n: int, long_share: float, rate: float, seed: int = 0) -> tuple[list, list[float]]:
    """``n`` completions (text prompts of ~100 or ~1,500 tokens, 64 output tokens) and
    their Poisson arrival times."""
    import random

    from bench.datasets import SampleRequest

    rng = random.Random(seed)
    words = ["alpha", "beta", "gamma", "delta", "epsilon", "zeta", "eta", "theta", "iota", "kappa", "lambda", "mu", "nu", "xi", "omicron", "pi", "rho", "sigma", "tau", "upsilon", "phi", "chi", "psi", "omega"]  # fmt: skip
    requests, arrivals, t = [], [], 0.0
    for i in range(n):
        size = 1100 if rng.random() < long_share else 75  # words: ~1,500 / ~100 tokens
        text = f"Request {i}. " + " ".join(rng.choice(words) for _ in range(size))
        requests.append(SampleRequest(text, None, 64))
        t += rng.expovariate(rate)
        arrivals.append(t)
    return requests, arrivals


def _percentile(values: list[float], q: float) -> float:
    import numpy as np

    return float(np.percentile(values, q)) if values else float("nan")


def measure_setup(url: str, requests: list, arrivals: list[float], slo_ttft_s: float,
                  slo_tpot_s: float) -> dict[str, Any]:  # fmt: skip
    import asyncio

    from bench.client import RequestSettings, make_client, run_requests

    async def run() -> tuple[list, float]:
        async with make_client(None, 600) as client:
            model = (await client.get(url + "/v1/models")).json()["data"][0]["id"]
            settings = RequestSettings(url, "/v1/completions", model, ignore_eos=True)
            return await run_requests(client, requests, settings, arrivals, None)

    outputs, duration = asyncio.run(run())
    ok = [o for o in outputs if o.success]
    ttft = [o.ttft for o in ok]
    itl = [x for o in ok for x in o.itl]
    tpot = [(o.latency - o.ttft) / (o.output_tokens - 1) for o in ok if o.output_tokens > 1]
    good = sum(1 for o in ok if o.ttft <= slo_ttft_s and o.output_tokens > 1
               and (o.latency - o.ttft) / (o.output_tokens - 1) <= slo_tpot_s)  # fmt: skip
    return {
        "completed": len(ok), "failed": len(outputs) - len(ok), "duration_s": duration,
        "ttft_p50_ms": 1e3 * _percentile(ttft, 50), "ttft_p99_ms": 1e3 * _percentile(ttft, 99),
        "itl_p50_ms": 1e3 * _percentile(itl, 50), "itl_p99_ms": 1e3 * _percentile(itl, 99),
        "tpot_p50_ms": 1e3 * _percentile(tpot, 50), "tpot_p99_ms": 1e3 * _percentile(tpot, 99),
        "goodput_rps": good / duration, "good": good,
    }  # fmt: skip


def colocated(rate: float, n: int, long_share: float, slo_ttft_ms: float,
              slo_tpot_ms: float) -> dict[str, Any]:  # fmt: skip
    from bench.procs import RouterProcess, ServerProcess, _Process, free_port

    requests, arrivals = workload(n, long_share, rate)
    slo = (slo_ttft_ms / 1e3, slo_tpot_ms / 1e3)
    rows: dict[str, Any] = {}
    # colocated: two replicas, one core each, behind the router
    servers = [ServerProcess(*SERVER, pin=str(i)) for i in range(2)]
    try:
        for server in servers:
            server.wait_ready()
        router = RouterProcess([s.url for s in servers], "--policy", "cost", "--seed", "0")
        try:
            router.wait_ready(60)
            print("colocated: 2 replicas (1 core each) behind the router", flush=True)
            rows["colocated"] = measure_setup(router.url, requests, arrivals, *slo)
        finally:
            router.close()
    finally:
        for server in servers:
            server.close()
    # 1P1D: prefill on core 0, decode on core 1, behind pd-proxy
    prefill = ServerProcess(*SERVER, *_p2p("kv_producer"), pin="0")
    decode = ServerProcess(*SERVER, *_p2p("kv_consumer"), pin="1")
    try:
        prefill.wait_ready()
        decode.wait_ready()
        cmd = [sys.executable, "-m", "launch.cli", "pd-proxy", "--port", str(free_port()),
               "--prefill", prefill.url, "--decode", decode.url, "--seed", "0"]  # fmt: skip
        proxy = _Process(cmd, None, "pd-proxy")
        try:
            proxy.wait_ready(60)
            print("1P1D: prefill (core 0) and decode (core 1) behind pd-proxy", flush=True)
            rows["1P1D"] = measure_setup(proxy.url, requests, arrivals, *slo)
            rows["1P1D"]["decode_transfers"] = decode.metrics().get(
                "vllm:nixl_xfer_time_seconds_count", 0.0
            )
        finally:
            proxy.close()
    finally:
        prefill.close()
        decode.close()
    for name, r in rows.items():
        print(f"{name:>10}: TTFT p50/p99 {r['ttft_p50_ms']:7.0f}/{r['ttft_p99_ms']:7.0f} ms  "
              f"ITL p50/p99 {r['itl_p50_ms']:6.0f}/{r['itl_p99_ms']:6.0f} ms  TPOT p50 "
              f"{r['tpot_p50_ms']:5.0f} ms  goodput {r['goodput_rps']:.2f} req/s "
              f"({r['good']}/{r['completed']})", flush=True)  # fmt: skip
    return {"rate": rate, "requests": n, "long_share": long_share, "slo_ttft_ms": slo_ttft_ms,
            "slo_tpot_ms": slo_tpot_ms, "setups": rows}  # fmt: skip


def plot_colocated(result: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = list(result["setups"])
    fig, axes = plt.subplots(1, 3, figsize=(11, 3.6))
    for ax, (key, label) in zip(axes, (("ttft", "TTFT (ms)"), ("itl", "ITL (ms)")), strict=False):
        for j, q in enumerate(("p50", "p99")):
            ax.bar([i + 0.4 * j for i in range(len(names))],
                   [result["setups"][n][f"{key}_{q}_ms"] for n in names], 0.4, label=q)  # fmt: skip
        ax.set_xticks([i + 0.2 for i in range(len(names))], names)
        ax.set_ylabel(label)
        ax.legend()
    axes[2].bar(names, [result["setups"][n]["goodput_rps"] for n in names])
    axes[2].set_ylabel("goodput (req/s)")
    fig.suptitle(f"colocated vs 1P1D, {result['rate']} req/s, {result['long_share']:.0%} long "
                 f"prompts, SLO TTFT {result['slo_ttft_ms']:.0f} ms / TPOT "
                 f"{result['slo_tpot_ms']:.0f} ms")  # fmt: skip
    fig.tight_layout()
    fig.savefig(path, dpi=120)


SIM = ("--worker-backend", "sim", "--sim-model", "llama-3-8b", "--sim-hardware", "h200",
       "--async-scheduling", "--max-model-len", "4096")  # fmt: skip
# name: (input len, output len, range ratio, SLO TTFT ms, SLO TPOT ms, default rates)
WORKLOADS: dict[str, tuple[int, int, float, float, float, tuple[float, ...]]] = {
    "chat": (230, 200, 0.9, 250, 100, (20, 40)),
    "code": (150, 100, 0.9, 125, 200, (20, 40)),
    "summarization": (1800, 100, 0.5, 15_000, 150, (8, 16)),
}
SETUPS = {"colocated": (0, 0), "2P2D": (2, 2), "1P3D": (1, 3)}


def sim_point(setup: str, workload: str, rate: float, n: int, speed: float,
              slo: tuple[float | None, float | None] = (None, None)) -> dict[str, Any]:  # fmt: skip
    import subprocess

    from bench.procs import RouterProcess, ServerProcess, _Process, free_port

    prefill, decode = SETUPS[setup]
    args = (*SIM, "--sim-speed", str(speed))
    if prefill:
        servers = [ServerProcess(*args, *_p2p("kv_producer")) for _ in range(prefill)]
        servers += [ServerProcess(*args, *_p2p("kv_consumer")) for _ in range(decode)]
    else:
        servers = [ServerProcess(*args) for _ in range(4)]
    front: Any = None
    try:
        for server in servers:
            server.wait_ready()
        if prefill:
            cmd = [sys.executable, "-m", "launch.cli", "pd-proxy", "--port", str(free_port()),
                   "--seed", "0"]  # fmt: skip
            for server in servers[:prefill]:
                cmd += ["--prefill", server.url]
            for server in servers[prefill:]:
                cmd += ["--decode", server.url]
            front = _Process(cmd, None, "pd-proxy")
        else:
            front = RouterProcess([s.url for s in servers], "--policy", "cost", "--seed", "0")
        front.wait_ready(60)
        inp, out, ratio, ttft, tpot, _ = WORKLOADS[workload]
        ttft, tpot = slo[0] or ttft, slo[1] or tpot
        name = f"{workload}-{setup}-{rate:g}"
        out_dir = OUT / "pd_runs"
        cmd = [sys.executable, "-m", "launch.cli", "bench", "--base-url", front.url,
               "--dataset-name", "random", "--random-input-len", str(inp),
               "--random-output-len", str(out), "--random-range-ratio", str(ratio),
               "--ignore-eos", "--num-prompts", str(n), "--request-rate", str(rate),
               "--seed", "1", "--sim-speed", str(speed), "--goodput", f"ttft:{ttft:g}",
               f"tpot:{tpot:g}", "--disable-tqdm", "--no-plots", "--result-dir", str(out_dir),
               "--result-filename", f"{name}.json"]  # fmt: skip
        subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL)
        r = json.loads((out_dir / f"{name}.json").read_text())
        transfers = sum(s.metrics().get("vllm:nixl_xfer_time_seconds_count", 0.0)
                        for s in servers[prefill:]) if prefill else 0.0  # fmt: skip
    finally:
        if front is not None:
            front.close()
        for server in servers:
            server.close()
    row = {
        "setup": setup, "workload": workload, "rate": rate, "completed": r["completed"],
        "slo_ttft_ms": ttft, "slo_tpot_ms": tpot,
        "goodput_rps": r.get("request_goodput", 0.0),
        "goodput_per_gpu": r.get("request_goodput", 0.0) / 4,
        "slo_attainment": r.get("request_goodput", 0.0) / max(r["request_throughput"], 1e-9),
        "ttft_p50_ms": r["median_ttft_ms"], "ttft_p99_ms": r["p99_ttft_ms"],
        "tpot_p50_ms": r["median_tpot_ms"], "tpot_p99_ms": r["p99_tpot_ms"],
        "itl_p99_ms": r["p99_itl_ms"], "output_throughput": r["output_throughput"],
        "transfers": transfers,
    }  # fmt: skip
    print(f"{workload:>13} {setup:>9} {rate:>5g} req/s: goodput {row['goodput_rps']:6.2f} req/s "
          f"({100 * row['slo_attainment']:5.1f} % in SLO)  TTFT p50/p99 {row['ttft_p50_ms']:7.0f}/"
          f"{row['ttft_p99_ms']:7.0f} ms  TPOT p50/p99 {row['tpot_p50_ms']:5.1f}/"
          f"{row['tpot_p99_ms']:5.1f} ms", flush=True)  # fmt: skip
    return row


def plot_sim(rows: list[dict[str, Any]], path: Path) -> None:
    """Per workload: SLO attainment, TTFT P50 and ITL P99 against the rate, per setup."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    workloads = list(dict.fromkeys(r["workload"] for r in rows))
    panels = (("slo_attainment", "requests within both SLOs (%)", 100.0),
              ("ttft_p50_ms", "TTFT P50 (ms)", 1.0), ("itl_p99_ms", "ITL P99 (ms)", 1.0))  # fmt: skip
    fig, axes = plt.subplots(len(workloads), 3, figsize=(12, 3.2 * len(workloads)), squeeze=False)
    for row_axes, w in zip(axes, workloads, strict=True):
        ttft, tpot = WORKLOADS[w][3:5]
        for ax, (key, label, scale) in zip(row_axes, panels, strict=True):
            for setup in SETUPS:
                pts = [r for r in rows if r["workload"] == w and r["setup"] == setup]
                ax.plot([r["rate"] for r in pts], [scale * r[key] for r in pts], "o-",
                        label=setup)  # fmt: skip
            ax.set_xlabel("request rate (req/s, 4 GPUs)")
            ax.set_ylabel(label)
            ax.set_title(f"{w} (SLO TTFT {ttft:g} ms, TPOT {tpot:g} ms)", fontsize=9)
            ax.legend(fontsize=8)
    fig.suptitle("4 simulated H200s, Llama-3-8B: colocated vs disaggregated (simulated time)")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.pd", description=__doc__.splitlines()[0])
    p.add_argument(
        "--name", default=None, help="output bench/out/pd_NAME.json (default: the experiment)"
    )
    sub = p.add_subparsers(dest="experiment", required=True)
    t = sub.add_parser("transfer", help="the seed's KV transfer estimate against a measurement")
    t.add_argument("--tokens", type=int, nargs="+", default=[15, 64, 256, 1024, 2048])
    t.add_argument("--repeats", type=int, default=7)
    t.add_argument("--transport", choices=("zmq", "nixl"), default="zmq",
                   help="nixl: pip install --no-deps nixl-cu12 first")  # fmt: skip
    c = sub.add_parser("colocated", help="colocated replicas against 1P1D on this machine")
    c.add_argument("--rate", type=float, default=1.0)
    c.add_argument("--requests", type=int, default=80)
    c.add_argument("--long-share", type=float, default=0.15)
    c.add_argument("--slo-ttft-ms", type=float, default=3000)
    c.add_argument("--slo-tpot-ms", type=float, default=150)
    m = sub.add_parser("sim", help="4 simulated H200s: colocated, 2P2D, 1P3D")
    m.add_argument("--workloads", nargs="+", default=list(WORKLOADS), choices=list(WORKLOADS))
    m.add_argument("--rates", type=float, nargs="+", default=None,
                   help="default: two per workload (see WORKLOADS)")  # fmt: skip
    m.add_argument("--requests", type=int, default=400)
    m.add_argument("--sim-speed", type=float, default=4.0)
    m.add_argument("--slo-ttft-ms", type=float, default=None,
                   help="instead of the workload's DistServe SLO")  # fmt: skip
    m.add_argument("--slo-tpot-ms", type=float, default=None)
    args = p.parse_args(argv)
    OUT.mkdir(parents=True, exist_ok=True)
    path = OUT / f"pd_{args.name or args.experiment}.json"
    if args.experiment == "transfer":
        result = transfer(args.tokens, args.repeats, args.transport)
        plot_transfer(result, path.with_suffix(".png"))
    elif args.experiment == "sim":
        slo = (args.slo_ttft_ms, args.slo_tpot_ms)
        rows = [sim_point(setup, w, rate, args.requests, args.sim_speed, slo)
                for w in args.workloads for rate in (args.rates or WORKLOADS[w][5])
                for setup in SETUPS]  # fmt: skip
        result = {"sim_speed": args.sim_speed, "requests": args.requests, "rows": rows}
        plot_sim(rows, path.with_suffix(".png"))
    else:
        result = colocated(args.rate, args.requests, args.long_share, args.slo_ttft_ms,
                           args.slo_tpot_ms)  # fmt: skip
        plot_colocated(result, path.with_suffix(".png"))
    path.write_text(json.dumps(result, indent=2) + "\n")
    print(f"wrote {path} and .png")
    return 0


if __name__ == "__main__":
    sys.exit(main())
