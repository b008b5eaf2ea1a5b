"""Ray against mp for an engine core's ranks and for data-parallel engine cores (issue 36),
in one run on one local Ray cluster.

A two-node Ray cluster on this machine (Ray's ``cluster_utils.Cluster``: two raylets, 2
CPUs each, loopback only), then per configuration a fresh server on the default model:

- ``tp3 mp`` / ``tp3 ray``: ``-tp 3``, the ranks processes or Ray actors (2 on one node,
  1 on the other: ``--distributed-executor-backend ray``);
- ``dp2 mp`` / ``dp2 ray``: ``-dp 2``, the engine cores on this machine or each a Ray actor
  running an engine node (``--data-parallel-backend ray``).

Measured: start-up (the command to ``/health`` 200), the time per output token of
``--requests`` greedy streamed completions one after another (``--max-tokens`` each,
EOS ignored; the mean gap between the stream's events after the first), and the workers'
own forward time per step (``actorserve:worker_forward_time_seconds``, all ranks). Their
difference is what a step costs beyond the model: plans and results over ZeroMQ and the
scheduler; Ray is not on that path, so it should not grow under Ray.

    .venv/bin/python -m bench.ray_backend [--requests 4] [--max-tokens 64] [--out FILE]

Rows go to ``--out`` (``bench/results/ray_backend.json``) and a PNG beside it.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path
from typing import Any

os.environ["RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"] = "0"  # before ray: nodes on 127.0.0.1

import httpx  # noqa: E402

from bench.procs import REPO, ServerProcess  # noqa: E402

CONFIGS = {
    "tp3 mp": ["-tp", "3"],
    "tp3 ray": ["-tp", "3", "--distributed-executor-backend", "ray"],
    "dp2 mp": ["-dp", "2"],
    "dp2 ray": ["-dp", "2", "--data-parallel-backend", "ray"],
}


def stream_gaps(url: str, max_tokens: int) -> list[float]:
    body = {"prompt": "The history of Paris", "max_tokens": max_tokens, "temperature": 0,
            "ignore_eos": True, "stream": True}  # fmt: skip
    times = []
    with httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=600) as r:
        for line in r.iter_lines():
            if line.startswith("data:") and "[DONE]" not in line:
                times.append(time.monotonic())
    return [b - a for a, b in zip(times[1:], times[2:], strict=False)]


def forward_seconds(server: ServerProcess) -> tuple[float, float]:
    m = server.metrics()
    return (
        m.get("actorserve:worker_forward_time_seconds_sum", 0.0),
        m.get("actorserve:worker_forward_time_seconds_count", 0.0),
    )


def measure(name: str, args: argparse.Namespace) -> dict[str, Any]:
    began = time.monotonic()
    server = ServerProcess("--max-model-len", "512", *CONFIGS[name])
    try:
        server.wait_ready(600)
        startup = time.monotonic() - began
        stream_gaps(server.url, 8)  # warm
        time.sleep(1.5)  # remote engines' metrics come with their next status
        s0, c0 = forward_seconds(server)
        gaps: list[float] = []
        for i in range(args.requests):
            gaps += stream_gaps(server.url, args.max_tokens)
            print(f"  {name}: request {i + 1}/{args.requests}", file=sys.stderr, flush=True)
        time.sleep(1.5)
        s1, c1 = forward_seconds(server)
    finally:
        server.close()
    tpot = sum(gaps) / len(gaps)
    ranks = 3 if name.startswith("tp3") else 1
    forward = (s1 - s0) / max(c1 - c0, 1) if c1 > c0 else float("nan")
    row = {"config": name, "startup_s": round(startup, 2), "tpot_ms": round(tpot * 1e3, 2),
           "worker_forward_ms": round(forward * 1e3, 2), "ranks_per_engine": ranks,
           "beyond_forward_ms": round((tpot - forward) * 1e3, 2)}  # fmt: skip
    print(f"  {row}", file=sys.stderr, flush=True)
    return row


def plot(rows: list[dict[str, Any]], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(10, 4))
    names = [r["config"] for r in rows]
    colours = ["tab:blue" if "mp" in n else "tab:orange" for n in names]
    axes[0].bar(names, [r["startup_s"] for r in rows], color=colours)
    axes[0].set_ylabel("start-up to /health (s)")
    axes[1].bar(names, [r["worker_forward_ms"] for r in rows], color=colours, label="forward")
    axes[1].bar(names, [r["beyond_forward_ms"] for r in rows], color="grey",
                bottom=[r["worker_forward_ms"] for r in rows], label="beyond forward")  # fmt: skip
    axes[1].set_ylabel("time per output token (ms)")
    axes[1].legend()
    fig.suptitle("Ray against mp on a 2-node local Ray cluster (default model, CPU)")
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--requests", type=int, default=4)
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--out", type=Path, default=REPO / "bench/results/ray_backend.json")
    args = p.parse_args()
    from ray.cluster_utils import Cluster

    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 2,
                                                            "include_dashboard": False})  # fmt: skip
    cluster.add_node(num_cpus=2)
    cluster.wait_for_nodes()
    os.environ["RAY_ADDRESS"] = cluster.address  # the servers join it
    rows = []
    try:
        for name in CONFIGS:
            print(f"{name}: starting", file=sys.stderr, flush=True)
            rows.append(measure(name, args))
    finally:
        cluster.shutdown()
    result = {"machine": os.uname().nodename, "cpus": os.cpu_count(), "rows": rows,
              "requests": args.requests, "max_tokens": args.max_tokens}  # fmt: skip
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2) + "\n")
    plot(rows, args.out.with_suffix(".png"))
    for r in rows:
        print(json.dumps(r))
    return 0


if __name__ == "__main__":
    sys.exit(main())
