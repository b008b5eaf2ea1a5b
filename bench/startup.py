"""Start-up time of ``actorserve serve`` at two commits: the command to ``/health`` 200.

    .venv/bin/python -m bench.startup BASE [HEAD] --rounds 3 --name startup_gguf_reader

Each revision is checked out with ``git worktree`` (as ``bench.revisions`` does) and served
from there, default model, once unmeasured (each tree builds the C++ ops into a cache of its
own at its first start),
then ``--rounds`` times per configuration, the revisions alternating (A B, B A, ...).
Measured: seconds from the command to the first ``/health`` 200 (polled every 50 ms), and
the CPU seconds the server's processes had spent by then (all of them, the launcher and
its children). The table gives medians with min-max and HEAD's ratio to BASE;
``bench/results/NAME.json`` holds every start, ``NAME.png`` plots them.
"""

from __future__ import annotations

import argparse
import contextlib
import http.client
import json
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import psutil

from bench.cpu_peers import RESULTS, _cpu_name
from bench.procs import _Process, free_port
from bench.revisions import _git, dots, worktrees

CONFIGS = {  # name: serve flags after the model's defaults
    "default": [],
    "tp3": ["-tp", "3"],
}


def tree_cpu_s(pid: int) -> float:
    """CPU seconds (user + system) of a process and its live descendants."""
    root = psutil.Process(pid)
    total = 0.0
    for p in [root, *root.children(recursive=True)]:
        with contextlib.suppress(psutil.Error):
            t = p.cpu_times()
            total += t.user + t.system
    return total


def start_once(tree: Path, flags: list[str]) -> dict[str, float]:
    """One fresh server from worktree ``tree``: seconds to ready, CPU seconds by then."""
    cmd = [sys.executable, "-m", "launch.cli", "serve", "--port", str(free_port()),
           "--max-model-len", "2048", *flags]  # fmt: skip
    env_before = dict(os.environ)
    os.environ["PYTHONPATH"] = str(tree)  # that tree's packages ahead of the editable install
    # each tree its own C++ ops build: torch's builder rebuilds when the sources' paths
    # change, so trees sharing one would rebuild (~45 s) at every switch
    os.environ["TORCH_EXTENSIONS_DIR"] = str(tree.parent / f"{tree.name}-torch-extensions")
    try:
        began = time.perf_counter()
        proc = _Process(cmd, name="startup", cwd=tree)
    finally:
        os.environ.clear()
        os.environ.update(env_before)
    try:
        seconds = _wait_ready(proc, began)
        return {"ready_s": seconds, "cpu_s": tree_cpu_s(proc.popen.pid)}
    finally:
        proc.close()


def _wait_ready(proc: _Process, began: float, timeout_s: float = 300) -> float:
    """Seconds from ``began`` to the first ``/health`` 200, polled every 50 ms with a bare
    ``http.client`` request (an httpx call every 50 ms costs this machine's CPU enough
    to slow the start it measures)."""
    while time.perf_counter() - began < timeout_s:
        if proc.popen.poll() is not None:
            raise RuntimeError(f"exited: {Path(proc.log.name).read_text()[-2000:]}")
        conn = http.client.HTTPConnection("127.0.0.1", proc.port, timeout=2)
        try:
            conn.request("GET", "/health")
            if conn.getresponse().status == 200:
                return time.perf_counter() - began
        except OSError:
            pass
        finally:
            conn.close()
        time.sleep(0.05)
    raise RuntimeError(f"not ready after {timeout_s:.0f} s")


def summarize(revs: list[str], runs: list[dict[str, Any]]) -> list[dict[str, Any]]:
    rows = []
    for config in dict.fromkeys(r["config"] for r in runs):
        for key in ("ready_s", "cpu_s"):
            row: dict[str, Any] = {"config": config, "metric": key}
            for rev in revs:
                values = [r[key] for r in runs if r["rev"] == rev and r["config"] == config]
                row[rev] = {"median": statistics.median(values), "min": min(values),
                            "max": max(values)}  # fmt: skip
            row["ratio"] = row[revs[1]]["median"] / row[revs[0]]["median"]
            rows.append(row)
    return rows


def table(revs: list[str], rows: list[dict[str, Any]]) -> str:
    lines = [f"| configuration | measure | {revs[0]} median (min-max) | {revs[1]} median "
             "(min-max) | ratio |", "|---|---|---|---|---|"]  # fmt: skip
    label = {"ready_s": "to /health 200 (s)", "cpu_s": "CPU by then (s)"}
    for row in rows:
        cells = [f"{row[r]['median']:.2f} ({row[r]['min']:.2f}-{row[r]['max']:.2f})" for r in revs]
        lines.append(f"| {row['config']} | {label[row['metric']]} | {cells[0]} | {cells[1]} "
                     f"| {row['ratio']:.2f} |")  # fmt: skip
    return "\n".join(lines)


def plot(revs: list[str], runs: list[dict[str, Any]], path: Path) -> None:
    from bench.plots import _pyplot

    plt = _pyplot()
    configs = list(dict.fromkeys(r["config"] for r in runs))
    fig, axes = plt.subplots(1, 2 * len(configs), figsize=(3.0 * 2 * len(configs), 3.4))
    panels = [(c, k) for c in configs for k in ("ready_s", "cpu_s")]
    for ax, (config, key) in zip(axes, panels, strict=True):
        values = {rev: [r[key] for r in runs if r["rev"] == rev and r["config"] == config]
                  for rev in revs}  # fmt: skip
        what = "to /health 200 (s)" if key == "ready_s" else "CPU by then (s)"
        dots(ax, revs, values, f"{config}: {what}")
        ax.set_ylim(bottom=0)
    fig.suptitle("actorserve serve start-up; each dot one fresh server, bar: median", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("base", help="the commit before (any git revision)")
    parser.add_argument("head", nargs="?", default="HEAD", help="the commit after (default HEAD)")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--configs", nargs="+", default=list(CONFIGS), choices=list(CONFIGS))
    parser.add_argument("--name", default="startup", help="result file name (without suffix)")
    args = parser.parse_args()
    revs = [_git("rev-parse", "--short", rev) for rev in (args.base, args.head)]
    runs: list[dict[str, Any]] = []
    with worktrees(revs) as trees:
        for rev in revs:  # unmeasured: a tree's first start builds the C++ ops
            print(f"[{time.strftime('%H:%M:%S')}] {rev}: a first start (not measured)",
                  flush=True)  # fmt: skip
            start_once(trees[rev], [])
        for round_ in range(args.rounds):
            for rev in revs if round_ % 2 == 0 else revs[::-1]:
                for config in args.configs:
                    row = start_once(trees[rev], CONFIGS[config])
                    runs.append({**row, "rev": rev, "config": config, "round": round_})
                    print(f"[{time.strftime('%H:%M:%S')}] round {round_ + 1}/{args.rounds} "
                          f"{rev} {config}: ready in {row['ready_s']:.2f} s, "
                          f"{row['cpu_s']:.1f} CPU s", flush=True)  # fmt: skip
    rows = summarize(revs, runs)
    RESULTS.mkdir(parents=True, exist_ok=True)
    meta = {"cpu": _cpu_name(), "nproc": os.cpu_count(), "revisions": revs,
            "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())}  # fmt: skip
    (RESULTS / f"{args.name}.json").write_text(
        json.dumps({**meta, "summary": rows, "runs": runs}, indent=1) + "\n"
    )
    plot(revs, runs, RESULTS / f"{args.name}.png")
    print(table(revs, rows))
    print(f"wrote {RESULTS / args.name}.json and .png")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
