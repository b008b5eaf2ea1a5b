"""Issue 15's CPU comparison: W1 and W3 against us and, when installed, llama.cpp's
``llama-server`` and vLLM's CPU build, on the default model, fresh servers, one client.

    .venv/bin/python -m bench.cpu_peers [--peers-dir $TMPDIR/peers] [--only ours llama ...]

W1 = random 256-token prompts, 128 output tokens, 32 prompts at concurrency 16; W3 = 8 prompts
at concurrency 1 with another seed (so no prompt cache helps anyone); both ignore EOS, greedy.
Every (server, workload) pair starts its own server, waits for /health, records the server's
resident memory at idle, runs ``actorserve bench`` (the same requests for every server), and
stops it. Servers (each skipped when its binary is missing; ``../shared/peers/setup.sh``
installs the peers):

- ``ours``: ``actorserve serve`` (a GGUF model on CPU runs from its quantized blocks);
- ``ours-fp32``: the same with ``--quantization none`` (every weight expanded to fp32);
- ``ours-int8``: the same with ``--cpu-activation-quant int8`` (llama.cpp's trade, not exact);
- ``ours-bf16``: the same with ``--dtype bfloat16`` (vLLM's CPU default; not exact);
- ``llama``: ``llama-server`` on the same GGUF file, 16 slots, 2 threads;
- ``vllm-bf16`` / ``vllm-fp32``: ``vllm serve`` on the converted HF folder.

Writes ``bench/results/cpu_peers.json`` and ``cpu_peers.png`` and prints the table.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from bench.procs import REPO, _Process, free_port

RESULTS = REPO / "bench" / "results"
WORKLOADS = {
    "W1": ["--num-prompts", "32", "--max-concurrency", "16", "--seed", "0"],
    "W3": ["--num-prompts", "8", "--max-concurrency", "1", "--seed", "7"],
}
COMMON = ["--dataset-name", "random", "--random-input-len", "256", "--random-output-len", "128",
          "--ignore-eos", "--temperature", "0", "--model", "smol", "--no-plots"]  # fmt: skip


@dataclass
class Server:
    name: str
    cmd: list[str]  # with PORT for the port
    env: dict[str, str]
    ready_s: float  # how long start-up may take
    cwd: Path = REPO  # where it runs (bench.revisions: a worktree of another commit)

    def start(self) -> _Process:
        port = str(free_port())
        cmd = [port if part == "PORT" else part for part in self.cmd]
        env_before = dict(os.environ)
        os.environ.update(self.env)
        try:
            proc = _Process(cmd, name=self.name, cwd=self.cwd)
        finally:
            os.environ.clear()
            os.environ.update(env_before)
        proc.wait_ready(self.ready_s)
        return proc


def servers(peers: Path) -> list[Server]:
    from services.model_loader import default_model_path, prepare_model

    gguf, folder = str(default_model_path()), str(prepare_model(None))
    ours = [sys.executable, "-m", "launch.cli", "serve", "--port", "PORT",
            "--max-model-len", "2048", "--served-model-name", "smol"]  # fmt: skip
    found = [
        Server("ours", ours, {}, 300),
        Server("ours-fp32", [*ours, "--quantization", "none"], {}, 300),
        Server("ours-int8", [*ours, "--cpu-activation-quant", "int8"], {}, 300),
        Server("ours-bf16", [*ours, "--dtype", "bfloat16"], {}, 300),
    ]
    if (peers / "llama-server").exists():
        found.append(Server("llama", [str(peers / "llama-server"), "-m", gguf, "--host", "127.0.0.1",
                                      "--port", "PORT", "-np", "16", "-c", "16384", "-t", "2",
                                      "--threads-http", "24", "--alias", "smol"], {}, 120))  # fmt: skip
    vllm = peers / "venv-vllm" / "bin" / "vllm"
    if vllm.exists():
        for label, dtype in (("vllm-bf16", "bfloat16"), ("vllm-fp32", "float32")):
            cmd = [str(vllm), "serve", folder, "--host", "127.0.0.1", "--port", "PORT",
                   "--max-model-len", "2048", "--dtype", dtype, "--served-model-name", "smol"]  # fmt: skip
            found.append(Server(label, cmd, {"VLLM_CPU_KVCACHE_SPACE": "2"}, 600))
    return found


def tree_rss_mb(pid: int) -> dict[str, float]:
    """Resident MB of a process and its descendants, by command (our worker separately)."""
    out = subprocess.run(
        ["ps", "-e", "-o", "pid=,ppid=,rss=,args="], capture_output=True, text=True
    )
    rows = [line.split(None, 3) for line in out.stdout.splitlines()]
    children: dict[int, list[tuple[int, int, str]]] = {}
    for p, pp, rss, args in (r for r in rows if len(r) == 4):
        children.setdefault(int(pp), []).append((int(p), int(rss), args))
    total = worker = 0.0
    todo = [pid]
    own = next((int(r[2]) for r in rows if len(r) == 4 and int(r[0]) == pid), 0)
    total += own / 1024
    while todo:
        for p, rss, args in children.get(todo.pop(), []):
            total += rss / 1024
            if "launch.child worker" in args:
                worker += rss / 1024
            todo.append(p)
    return {"total_mb": round(total), "worker_mb": round(worker)}


def run_one(server: Server, workload: str, out_dir: Path) -> dict[str, Any]:
    proc = server.start()
    try:
        time.sleep(2)  # let start-up settle before reading memory
        memory = tree_rss_mb(proc.popen.pid)
        name = f"{server.name}-{workload}.json"
        cmd = [sys.executable, "-m", "launch.cli", "bench", "--base-url", proc.url, *COMMON,
               *WORKLOADS[workload], "--result-dir", str(out_dir), "--result-filename", name]  # fmt: skip
        run = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True)
        if run.returncode:
            raise RuntimeError(f"bench against {server.name} failed: {run.stderr[-2000:]}")
        result = json.loads((out_dir / name).read_text())
    finally:
        proc.close()
    return {
        "server": server.name, "workload": workload, **memory,
        "completed": result["completed"], "output_throughput": result["output_throughput"],
        "median_ttft_ms": result["median_ttft_ms"], "median_tpot_ms": result["median_tpot_ms"],
        "p99_itl_ms": result.get("p99_itl_ms"),
    }  # fmt: skip


def table(rows: list[dict[str, Any]]) -> str:
    by = {(r["server"], r["workload"]): r for r in rows}
    lines = ["| server | W1 out tok/s | W1 TTFT p50 | W1 TPOT p50 | W3 TTFT p50 | W3 TPOT p50 | idle RSS |",
             "|---|---|---|---|---|---|---|"]  # fmt: skip
    for name in dict.fromkeys(r["server"] for r in rows):
        w1, w3 = by.get((name, "W1")), by.get((name, "W3"))
        cells = [name]
        cells += [f"{w1['output_throughput']:.0f}", f"{w1['median_ttft_ms'] / 1e3:.2f} s",
                  f"{w1['median_tpot_ms']:.1f} ms"] if w1 else ["—"] * 3  # fmt: skip
        cells += (
            [f"{w3['median_ttft_ms']:.0f} ms", f"{w3['median_tpot_ms']:.1f} ms"]
            if w3
            else ["—"] * 2
        )
        mem = w3 or w1
        assert mem is not None
        worker = f" (worker {mem['worker_mb']} MB)" if mem["worker_mb"] else ""
        cells.append(f"{mem['total_mb']} MB{worker}")
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def plot(rows: list[dict[str, Any]], path: Path) -> None:
    from bench.plots import _pyplot

    plt = _pyplot()
    names = list(dict.fromkeys(r["server"] for r in rows))
    by = {(r["server"], r["workload"]): r for r in rows}
    fig, axes = plt.subplots(1, 3, figsize=(13, 4))
    panels = (("W1", "output_throughput", "W1 output tok/s (higher is better)"),
              ("W3", "median_tpot_ms", "W3 TPOT p50, ms (lower is better)"),
              ("W3", "median_ttft_ms", "W3 TTFT p50, ms (lower is better)"))  # fmt: skip
    for ax, (workload, key, title) in zip(axes, panels, strict=True):
        values = [by[(n, workload)][key] if (n, workload) in by else 0.0 for n in names]
        ax.bar(
            names, values, color=["tab:blue" if n.startswith("ours") else "tab:gray" for n in names]
        )
        ax.set_title(title, fontsize=10)
        ax.tick_params(axis="x", rotation=30)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--peers-dir", type=Path,
                        default=Path(os.environ.get("TMPDIR", "/tmp")) / "peers")  # fmt: skip
    parser.add_argument("--only", nargs="*", help="server names to run (default: all found)")
    parser.add_argument("--workloads", nargs="*", default=list(WORKLOADS), choices=list(WORKLOADS))
    parser.add_argument("--name", default="cpu_peers", help="result file name (without suffix)")
    args = parser.parse_args()
    chosen = [s for s in servers(args.peers_dir) if not args.only or s.name in args.only]
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for server in chosen:
            for workload in args.workloads:
                start = time.monotonic()
                print(f"[{time.strftime('%H:%M:%S')}] {server.name} {workload} ...", flush=True)
                rows.append(run_one(server, workload, Path(tmp)))
                r = rows[-1]
                print(f"    {r['output_throughput']:.1f} tok/s, TTFT p50 {r['median_ttft_ms']:.0f} ms, "
                      f"TPOT p50 {r['median_tpot_ms']:.1f} ms, idle RSS {r['total_mb']} MB "
                      f"({time.monotonic() - start:.0f} s)", flush=True)  # fmt: skip
    RESULTS.mkdir(parents=True, exist_ok=True)
    meta = {
        "cpu": _cpu_name(),
        "nproc": os.cpu_count(),
        "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
    }
    (RESULTS / f"{args.name}.json").write_text(json.dumps({**meta, "rows": rows}, indent=1) + "\n")
    plot(rows, RESULTS / f"{args.name}.png")
    print(table(rows))
    print(f"wrote {RESULTS / args.name}.json and .png")
    return 0


def _cpu_name() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            return next(
                line.split(":", 1)[1].strip() for line in f if line.startswith("model name")
            )
    except (OSError, StopIteration):
        return "unknown"


if __name__ == "__main__":
    raise SystemExit(main())
