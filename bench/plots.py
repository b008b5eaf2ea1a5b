"""PNG plots of a benchmark result: TTFT and TPOT CDFs, throughput and running/waiting over time.

Reads only the result dict (the JSON file's content), so a saved result can be re-plotted.
"""

from __future__ import annotations

import json
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np


def _pyplot() -> Any:
    import matplotlib

    matplotlib.use("Agg")  # files only: no display on a server
    import matplotlib.pyplot as plt

    return plt


def _step_cdf(ax: Any, values: list[float], **kw: Any) -> None:
    x = np.sort(np.asarray(values, dtype=np.float64))
    # From 0 at the smallest value up to 1 at the largest.
    ax.step(np.r_[x[0], x], np.r_[0.0, np.arange(1, len(x) + 1) / len(x)], where="post", **kw)


def _cdf(ax: Any, values_ms: list[float], title: str) -> None:
    if values_ms:
        x = np.asarray(values_ms)
        _step_cdf(ax, values_ms)
        for p, style in ((50, ":"), (99, "--")):
            ax.axvline(np.percentile(x, p), color="grey", linestyle=style, label=f"p{p}")
        ax.legend(loc="lower right")
    ax.set(title=title, xlabel="ms", ylabel="fraction of requests", ylim=(0, 1.02))
    ax.grid(alpha=0.3)


def save_figure(fig: Any, path: Path) -> None:
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    _pyplot().close(fig)


def write_result(
    result: dict[str, Any], out: Path, plot: Callable[[dict[str, Any], Path], None]
) -> None:
    """``out`` (JSON) and its plot beside it (the same name, ``.png``)."""
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=1))
    plot(result, out.with_suffix(".png"))
    print(f"wrote {out} and {out.with_suffix('.png')}", file=sys.stderr)


def plot_result(result: dict[str, Any], stem: Path) -> list[Path]:
    """Write ``{stem}_ttft_cdf.png``, ``_tpot_cdf.png``, ``_throughput.png`` and, when the
    server was scraped, ``_running_waiting.png``. Returns the paths written."""
    plt = _pyplot()
    written: list[Path] = []

    def save(fig: Any, suffix: str) -> None:
        path = stem.with_name(f"{stem.name}_{suffix}.png")
        fig.tight_layout()
        fig.savefig(path, dpi=110)
        plt.close(fig)
        written.append(path)

    label = result.get("label") or result.get("model_id", "")
    for key, title in (("ttfts", "TTFT"), ("tpots", "TPOT")):
        fig, ax = plt.subplots(figsize=(6, 4))
        values = [1000 * v for v in result.get(key, []) if v is not None]
        _cdf(ax, values, f"{title} CDF: {label}")
        save(fig, f"{title.lower()}_cdf")

    fig, ax = plt.subplots(figsize=(7, 4))
    times = np.asarray(result.get("token_times", []), dtype=np.float64)
    counts = np.asarray(result.get("token_counts", []), dtype=np.float64)
    if len(times):
        width = max(0.5, float(result.get("duration", 1.0)) / 60)  # ~60 bins across the run
        bins = np.arange(0.0, times.max() + width, width)
        per_bin, _ = np.histogram(times, bins=bins, weights=counts)
        ax.plot(bins[:-1] + width / 2, per_bin / width, label="output tok/s")
        started, _ = np.histogram(result.get("start_times", []), bins=bins)
        ax2 = ax.twinx()
        ax2.plot(
            bins[:-1] + width / 2,
            started / width,
            color="tab:orange",
            alpha=0.6,
            label="requests sent/s",
        )
        ax2.set_ylabel("requests sent/s")
        ax2.legend(loc="upper right")
    ax.set(title="Throughput over time", xlabel="s since start", ylabel="output tokens/s")
    ax.legend(loc="upper left")
    ax.grid(alpha=0.3)
    save(fig, "throughput")

    timeline = result.get("server_timeline") or []
    if timeline:
        columns = list(zip(*timeline, strict=True))[:3]  # time, running, waiting (then KV usage)
        t, running, waiting = (np.asarray(c, dtype=np.float64) for c in columns)
        fig, ax = plt.subplots(figsize=(7, 4))
        ax.step(t, running, where="post", label="vllm:num_requests_running")
        ax.step(t, waiting, where="post", label="vllm:num_requests_waiting")
        ax.set(title="Server queue over time", xlabel="s since start", ylabel="requests")
        ax.legend()
        ax.grid(alpha=0.3)
        save(fig, "running_waiting")
    return written


def plot_compare(results: dict[str, dict[str, Any]], path: Path) -> Path:
    """TTFT and TPOT CDFs of several labelled runs of one workload, overlaid in one PNG."""
    plt = _pyplot()
    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    for ax, (key, title) in zip(axes, (("ttfts", "TTFT"), ("tpots", "TPOT")), strict=True):
        for label, result in results.items():
            values = [1000 * v for v in result.get(key, []) if v is not None]
            if values:
                _step_cdf(ax, values, label=label)
        ax.set(title=f"{title} CDF", xlabel="ms", ylabel="fraction of requests", ylim=(0, 1.02))
        ax.grid(alpha=0.3)
        ax.legend(loc="lower right")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
