"""Idle memory of each process of ``actorserve serve`` and the server's total (issue 34).

    .venv/bin/python -m bench.process_memory [--base REV] [--peers-dir $TMPDIR/peers]

Starts a fresh server on the default model (``bench.cpu_peers``' flags), waits for /health
and ``--settle-s``, then reads every process's resident memory (RSS) and unique memory
(USS: the pages no other process shares, what stopping it would free) with psutil, the median
of ``--samples`` readings a second apart. The sum of RSS counts shared library pages once per
process; the sum of USS counts them in none, so the truth lies between the two.

``--base REV`` measures that commit too, served from a ``git worktree`` (as
``bench.revisions`` does), in the same run: the numbers before a change beside those after.
When llama.cpp's ``llama-server`` is in ``--peers-dir`` (``../shared/peers/setup.sh``), it is
measured the same way on the same GGUF file (``bench.cpu_peers``' flags); else it is skipped
with a message. Writes ``bench/results/process_memory.json`` and ``.png`` and prints a table.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import psutil

from bench.cpu_peers import RESULTS, Server, _cpu_name, servers
from bench.procs import _Process
from bench.revisions import _git
from bench.revisions import server as revision_server

GOAL_MB = 120  # the goal for each process that does not compute
COMPUTE_ROLES = ("worker",)
ROLE_ORDER = ("launcher", "api_server", "tokenizer", "detokenizer", "scheduler", "worker")


def _role(proc: psutil.Process, root: int) -> str:
    cmd = proc.cmdline()
    if proc.pid == root and "launch.cli" in cmd:
        return "launcher"
    if "launch.child" in cmd:
        return cmd[cmd.index("launch.child") + 1]
    return Path(cmd[0]).name if cmd else "?"


def read_processes(root: int) -> list[dict[str, Any]]:
    """Each live process of the tree under ``root``: its role, pid, RSS and USS in MB."""
    rows = []
    launcher = psutil.Process(root)
    for proc in [launcher, *launcher.children(recursive=True)]:
        with contextlib.suppress(psutil.Error):
            info = proc.memory_full_info()
            rows.append({"role": _role(proc, root), "pid": proc.pid,
                         "rss_mb": info.rss / 2**20, "uss_mb": info.uss / 2**20})  # fmt: skip
    return rows


def measure(server: Server, label: str, settle_s: float, samples: int) -> dict[str, Any]:
    """Start ``server``, wait for /health and ``settle_s``, and read its processes' memory
    ``samples`` times a second apart (the median of each)."""
    start = time.monotonic()
    proc: _Process = server.start()
    try:
        ready_s = time.monotonic() - start
        time.sleep(settle_s)
        readings = []
        for i in range(samples):
            if i:
                time.sleep(1.0)
            readings.append(read_processes(proc.popen.pid))
    finally:
        proc.close()
    processes = []
    for first in readings[0]:  # processes present in every reading, by pid
        same = [r for reading in readings for r in reading if r["pid"] == first["pid"]]
        processes.append({
            "role": first["role"], "pid": first["pid"],
            "rss_mb": round(statistics.median(r["rss_mb"] for r in same), 1),
            "uss_mb": round(statistics.median(r["uss_mb"] for r in same), 1),
        })  # fmt: skip
    processes.sort(key=lambda p: ROLE_ORDER.index(p["role"]) if p["role"] in ROLE_ORDER else 99)
    helpers = [p for p in processes if p["role"] not in COMPUTE_ROLES]
    return {
        "server": label,
        "ready_s": round(ready_s, 1),
        "processes": processes,
        "total_rss_mb": round(sum(p["rss_mb"] for p in processes)),
        "total_uss_mb": round(sum(p["uss_mb"] for p in processes)),
        "helpers_rss_mb": round(sum(p["rss_mb"] for p in helpers)),
        "max_helper_rss_mb": round(max((p["rss_mb"] for p in helpers), default=0.0), 1),
    }


def table(rows: list[dict[str, Any]]) -> str:
    lines = ["| server | process | RSS MB | USS MB |", "|---|---|---:|---:|"]
    for row in rows:
        for p in row["processes"]:
            lines.append(
                f"| {row['server']} | {p['role']} | {p['rss_mb']:.0f} | {p['uss_mb']:.0f} |"
            )
        lines.append(f"| {row['server']} | **total** | **{row['total_rss_mb']}** | "
                     f"**{row['total_uss_mb']}** |")  # fmt: skip
    return "\n".join(lines)


def plot(rows: list[dict[str, Any]], path: Path) -> None:
    """Left: each process's idle RSS per server, the goal as a line; right: each server's
    total, stacked by process."""
    from bench.plots import _pyplot, save_figure

    plt = _pyplot()
    fig, (left, right) = plt.subplots(1, 2, figsize=(12, 4.4), width_ratios=(3, 2))
    ours = [r for r in rows if any(p["role"] == "worker" for p in r["processes"])]
    roles = [r for r in ROLE_ORDER if any(p["role"] == r for row in ours for p in row["processes"])]
    width = 0.8 / max(len(ours), 1)
    for i, row in enumerate(ours):
        rss = {p["role"]: p["rss_mb"] for p in reversed(row["processes"])}  # first of a role
        xs = [j + (i - (len(ours) - 1) / 2) * width for j in range(len(roles))]
        bars = left.bar(xs, [rss.get(r, 0.0) for r in roles], width, label=row["server"])
        left.bar_label(bars, fmt="%.0f", fontsize=7)
    left.axhline(GOAL_MB, color="grey", linestyle="--", label=f"goal: {GOAL_MB} MB")
    left.set_xticks(range(len(roles)), roles)
    left.set(title="idle RSS of each process", ylabel="MB")
    left.legend(fontsize=8)
    left.grid(axis="y", alpha=0.3)
    for x, row in enumerate(rows):
        bottom = 0.0
        for p in row["processes"]:
            right.bar(x, p["rss_mb"], bottom=bottom, color=_colour(p["role"]), edgecolor="white")
            bottom += p["rss_mb"]
        right.annotate(f"{bottom:.0f}", (x, bottom), ha="center", va="bottom", fontsize=8)
    right.set_xticks(range(len(rows)), [r["server"] for r in rows], fontsize=8)
    handles = [plt.Rectangle((0, 0), 1, 1, color=_colour(r)) for r in ROLE_ORDER]
    right.legend(handles, ROLE_ORDER, fontsize=7)
    right.set(title="server's total idle RSS", ylabel="MB")
    right.grid(axis="y", alpha=0.3)
    save_figure(fig, path)


def _colour(role: str) -> str:
    palette = ("tab:blue", "tab:orange", "tab:green", "tab:red", "tab:purple", "tab:brown")
    return palette[ROLE_ORDER.index(role)] if role in ROLE_ORDER else "tab:grey"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--base", help="also measure this commit (the numbers before a change)")
    parser.add_argument("--peers-dir", type=Path,
                        default=Path(os.environ.get("TMPDIR", "/tmp")) / "peers")  # fmt: skip
    parser.add_argument("--settle-s", type=float, default=5.0)
    parser.add_argument("--samples", type=int, default=3)
    parser.add_argument("--name", default="process_memory", help="result file name (no suffix)")
    args = parser.parse_args()
    found = {s.name: s for s in servers(args.peers_dir)}
    head = _git("rev-parse", "--short", "HEAD")
    dirty = " + working tree" if _git("status", "--porcelain", "--untracked-files=no") else ""
    runs: list[tuple[str, Server]] = [(f"ours ({head}{dirty})", found["ours"])]
    if "llama" in found:
        runs.append(("llama-server", found["llama"]))
    else:
        print(f"llama-server not in {args.peers_dir} (../shared/peers/setup.sh installs it): "
              "skipped", file=sys.stderr)  # fmt: skip
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        tree = Path(tmp) / "base"
        if args.base:
            base = _git("rev-parse", "--short", args.base)
            _git("worktree", "add", "--detach", str(tree), base)
            runs.insert(0, (f"ours ({base})", revision_server(base, tree)))
        try:
            for label, server in runs:
                print(f"[{time.strftime('%H:%M:%S')}] {label} ...", file=sys.stderr, flush=True)
                rows.append(measure(server, label, args.settle_s, args.samples))
        finally:
            if args.base:
                with contextlib.suppress(subprocess.CalledProcessError):
                    _git("worktree", "remove", "--force", str(tree))
    RESULTS.mkdir(parents=True, exist_ok=True)
    meta = {
        "cpu": _cpu_name(),
        "nproc": os.cpu_count(),
        "memory_gb": round(psutil.virtual_memory().total / 2**30, 1),
        "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        "command": " ".join(["python -m bench.process_memory", *sys.argv[1:]]),
        "goal_mb_per_helper": GOAL_MB,
    }
    out = RESULTS / f"{args.name}.json"
    out.write_text(json.dumps({**meta, "rows": rows}, indent=1) + "\n")
    plot(rows, out.with_suffix(".png"))
    print(table(rows))
    print(f"wrote {out} and {out.with_suffix('.png')}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
