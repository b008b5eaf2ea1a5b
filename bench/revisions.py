"""W1 and W3 against two commits of this repository, interleaved: is a change within noise?

    .venv/bin/python -m bench.revisions BASE [HEAD] --rounds 3 --name revisions_issue30

Each revision is checked out with ``git worktree`` into a temporary folder and served from
there (fresh server per run, default model and flags as in ``bench.cpu_peers``); the client is
this tree's ``actorserve bench`` for every run. Rounds alternate the order (A B, B A, ...), so
a machine that drifts during the experiment penalises neither side. The table gives each
revision's median over rounds with its min-max, and HEAD's ratio to BASE;
``bench/results/NAME.json`` holds every run and ``NAME.png`` plots them.
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
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from bench.cpu_peers import RESULTS, WORKLOADS, Server, _cpu_name, run_one
from bench.procs import REPO

METRICS = (  # (workload, result key, label, higher is better)
    ("W1", "output_throughput", "W1 output tok/s", True),
    ("W1", "median_ttft_ms", "W1 TTFT p50 (ms)", False),
    ("W1", "median_tpot_ms", "W1 TPOT p50 (ms)", False),
    ("W3", "median_ttft_ms", "W3 TTFT p50 (ms)", False),
    ("W3", "median_tpot_ms", "W3 TPOT p50 (ms)", False),
)


def _git(*args: str) -> str:
    return subprocess.run(
        ["git", *args], cwd=REPO, check=True, capture_output=True, text=True
    ).stdout.strip()


@contextlib.contextmanager
def worktrees(revs: list[str]) -> Iterator[dict[str, Path]]:
    """Each revision checked out (``git worktree add --detach``) in a temporary folder,
    removed again at the end: {rev: its tree}."""
    with tempfile.TemporaryDirectory() as tmp:
        trees = {rev: Path(tmp) / rev for rev in revs}
        for rev, tree in trees.items():
            _git("worktree", "add", "--detach", str(tree), rev)
        try:
            yield trees
        finally:
            for tree in trees.values():
                with contextlib.suppress(subprocess.CalledProcessError):
                    _git("worktree", "remove", "--force", str(tree))


def dots(ax: Any, revs: list[str], values: dict[str, list[float]], title: str) -> None:
    """One panel: each revision's values as dots, their median as a bar."""
    for x, rev in enumerate(revs):
        ax.scatter([x] * len(values[rev]), values[rev], color=("tab:gray", "tab:blue")[x])
        ax.hlines(statistics.median(values[rev]), x - 0.25, x + 0.25, color="black")
    ax.set_xticks(range(len(revs)), revs)
    ax.set_xlim(-0.6, len(revs) - 0.4)
    ax.set_title(title, fontsize=9)


def server(rev: str, tree: Path) -> Server:
    """Our server, default model and flags, from the worktree ``tree`` of ``rev``: run there,
    with that tree's packages ahead of the editable install."""
    cmd = [sys.executable, "-m", "launch.cli", "serve", "--port", "PORT",
           "--max-model-len", "2048", "--served-model-name", "smol"]  # fmt: skip
    return Server(rev, cmd, {"PYTHONPATH": str(tree)}, 300, cwd=tree)


def summarize(revs: list[str], runs: list[dict[str, Any]]) -> list[dict[str, Any]]:
    rows = []
    for workload, key, label, higher in METRICS:
        row: dict[str, Any] = {"metric": label, "higher_is_better": higher}
        for rev in revs:
            values = [r[key] for r in runs if r["rev"] == rev and r["workload"] == workload]
            row[rev] = {"median": statistics.median(values), "min": min(values), "max": max(values)}
        row["ratio"] = row[revs[1]]["median"] / row[revs[0]]["median"]
        rows.append(row)
    return rows


def table(revs: list[str], rows: list[dict[str, Any]]) -> str:
    lines = [f"| metric | {revs[0]} median (min-max) | {revs[1]} median (min-max) | ratio |",
             "|---|---|---|---|"]  # fmt: skip
    for row in rows:
        cells = [f"{row[r]['median']:.1f} ({row[r]['min']:.1f}-{row[r]['max']:.1f})" for r in revs]
        lines.append(f"| {row['metric']} | {cells[0]} | {cells[1]} | {row['ratio']:.3f} |")
    return "\n".join(lines)


def plot(revs: list[str], runs: list[dict[str, Any]], path: Path) -> None:
    from bench.plots import _pyplot

    plt = _pyplot()
    fig, axes = plt.subplots(1, len(METRICS), figsize=(3.2 * len(METRICS), 3.6))
    for ax, (workload, key, label, _) in zip(axes, METRICS, strict=True):
        values = {rev: [r[key] for r in runs if r["rev"] == rev and r["workload"] == workload]
                  for rev in revs}  # fmt: skip
        dots(ax, revs, values, label)
    fig.suptitle("each dot one run (fresh server); bar: median", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("base", help="the commit before (any git revision)")
    parser.add_argument("head", nargs="?", default="HEAD", help="the commit after (default HEAD)")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--workloads", nargs="*", default=["W1", "W3"], choices=list(WORKLOADS))
    parser.add_argument("--name", default="revisions", help="result file name (without suffix)")
    args = parser.parse_args()
    revs = [_git("rev-parse", "--short", rev) for rev in (args.base, args.head)]
    runs: list[dict[str, Any]] = []
    with worktrees(revs) as trees:
        out = next(iter(trees.values())).parent / "out"
        for round_ in range(args.rounds):
            order = revs if round_ % 2 == 0 else revs[::-1]
            for rev in order:
                for workload in args.workloads:
                    start = time.monotonic()
                    row = run_one(server(rev, trees[rev]), workload, out)
                    runs.append({**row, "rev": rev, "round": round_})
                    print(f"[{time.strftime('%H:%M:%S')}] round {round_ + 1}/{args.rounds} "
                          f"{rev} {workload}: {row['output_throughput']:.1f} tok/s, TTFT p50 "
                          f"{row['median_ttft_ms']:.0f} ms, TPOT p50 {row['median_tpot_ms']:.1f} ms "
                          f"({time.monotonic() - start:.0f} s)", flush=True)  # fmt: skip
    rows = summarize(revs, runs) if set(args.workloads) == {"W1", "W3"} else []
    RESULTS.mkdir(parents=True, exist_ok=True)
    meta = {"cpu": _cpu_name(), "nproc": os.cpu_count(), "revisions": revs,
            "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())}  # fmt: skip
    (RESULTS / f"{args.name}.json").write_text(
        json.dumps({**meta, "summary": rows, "runs": runs}, indent=1) + "\n"
    )
    if rows:
        plot(revs, runs, RESULTS / f"{args.name}.png")
        print(table(revs, rows))
    print(f"wrote {RESULTS / args.name}.json" + (" and .png" if rows else ""))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
