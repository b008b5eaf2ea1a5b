"""Benchmark metrics as vLLM's ``vllm bench serve`` defines them, and the server-side deltas.

Per request: TTFT, TPOT = (E2E − TTFT) / (output tokens − 1) for requests with more than one
output token, ITL (every gap between content chunks, pooled over requests) and E2E latency.
Each gets mean, median, std and the requested percentiles (numpy's linear interpolation, as
vLLM), under vLLM's JSON keys: ``mean_ttft_ms``, ``median_tpot_ms``, ``p99_itl_ms``, ...
Goodput counts the requests meeting every given SLO (``ttft``, ``tpot``, ``e2el`` in ms); a
request with one output token has TPOT 0 there, as in vLLM.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from typing import Any

import numpy as np

from bench.client import RequestOutput
from services.config import ConfigError

METRICS = ("ttft", "tpot", "itl", "e2el")
SLO_KEYS = ("ttft", "tpot", "e2el")
METRIC_TITLES = {
    "ttft": "Time to First Token",
    "tpot": "Time per Output Token (excl. 1st token)",
    "itl": "Inter-token Latency",
    "e2el": "End-to-end Latency",
}


def parse_goodput(specs: Sequence[str] | None) -> dict[str, float]:
    """``["ttft:500", "tpot:50"]`` -> ``{"ttft": 500.0, "tpot": 50.0}`` (milliseconds)."""
    slos: dict[str, float] = {}
    for spec in specs or ():
        key, sep, value = spec.partition(":")
        if not sep or key not in SLO_KEYS:
            raise ConfigError(
                f"--goodput takes KEY:MS with KEY in {', '.join(SLO_KEYS)}, got {spec!r}"
            )
        try:
            ms = float(value)
        except ValueError:
            raise ConfigError(f"--goodput {spec!r}: {value!r} is not a number of ms") from None
        if ms < 0:
            raise ConfigError(f"--goodput {spec!r}: the SLO must be >= 0 ms")
        slos[key] = ms
    return slos


def parse_percentiles(spec: str) -> list[float]:
    try:
        ps = [float(p) for p in spec.split(",") if p.strip()]
    except ValueError:
        raise ConfigError(
            f"--metric-percentiles takes numbers like '90,99', got {spec!r}"
        ) from None
    if not all(0 < p < 100 for p in ps):
        raise ConfigError(f"--metric-percentiles must be in (0, 100), got {spec!r}")
    return ps


def percentile_key(p: float) -> str:
    return str(int(p)) if p == int(p) else str(p)


def tpot(out: RequestOutput) -> float | None:
    """(E2E − TTFT) / (output tokens − 1); None for a single-token (or failed) request."""
    if not out.success or out.output_tokens <= 1:
        return None
    return (out.latency - out.ttft) / (out.output_tokens - 1)


def _stats(name: str, values_s: list[float], percentiles: Iterable[float]) -> dict[str, float]:
    ms = np.asarray(values_s or [0.0], dtype=np.float64) * 1000.0
    stats = {
        f"mean_{name}_ms": float(ms.mean()),
        f"median_{name}_ms": float(np.median(ms)),
        f"std_{name}_ms": float(ms.std()),
    }
    for p in percentiles:
        stats[f"p{percentile_key(p)}_{name}_ms"] = float(np.percentile(ms, p))
    return stats


def token_times(outputs: Sequence[RequestOutput]) -> tuple[np.ndarray, np.ndarray]:
    """When output tokens arrived (s from start) and how many: each content chunk carries an
    equal share of its request's ``usage`` count (chunks and tokens need not be one to one)."""
    times: list[float] = []
    counts: list[float] = []
    for o in outputs:
        if not o.success or o.output_tokens == 0:
            continue
        stamps = o.start_time + o.ttft + np.concatenate([[0.0], np.cumsum(o.itl)])
        times.extend(stamps.tolist())
        counts.extend([o.output_tokens / len(stamps)] * len(stamps))
    return np.asarray(times), np.asarray(counts)


def calculate_metrics(
    outputs: Sequence[RequestOutput],
    duration_s: float,
    percentiles: Sequence[float] = (90.0, 99.0),
    goodput: dict[str, float] | None = None,
) -> dict[str, Any]:
    """vLLM's ``calculate_metrics`` as a flat dict of its JSON keys (times in ms)."""
    ok = [o for o in outputs if o.success]
    ttfts = [o.ttft for o in ok]
    tpots = [t for o in ok if (t := tpot(o)) is not None]
    itls = [g for o in ok for g in o.itl]
    e2els = [o.latency for o in ok]
    total_in = sum(o.prompt_len for o in ok)
    total_out = sum(o.output_tokens for o in ok)
    dur = max(duration_s, 1e-9)
    result: dict[str, Any] = {
        "duration": duration_s,
        "completed": len(ok),
        "failed": len(outputs) - len(ok),
        "total_input_tokens": total_in,
        "total_output_tokens": total_out,
        "request_throughput": len(ok) / dur,
        "output_throughput": total_out / dur,
        "total_token_throughput": (total_in + total_out) / dur,
    }
    if goodput:
        good = sum(
            1
            for o in ok
            if o.ttft * 1000 <= goodput.get("ttft", math.inf)
            and (tpot(o) or 0.0) * 1000 <= goodput.get("tpot", math.inf)
            and o.latency * 1000 <= goodput.get("e2el", math.inf)
        )
        result["request_goodput"] = good / dur
    # Peak requests in flight: a sweep over [start, end), ends before starts at equal times.
    events = sorted([(o.start_time, 1) for o in ok] + [(o.start_time + o.latency, -1) for o in ok])
    result["max_concurrent_requests"] = int(max(np.cumsum([d for _, d in events]), default=0))
    times, counts = token_times(ok)
    if len(times):
        per_second = np.bincount(times.astype(np.int64), weights=counts)
        result["max_output_tokens_per_s"] = float(per_second.max())
    for name, values in (("ttft", ttfts), ("tpot", tpots), ("itl", itls), ("e2el", e2els)):
        result.update(_stats(name, values, percentiles))
    return result


# --- server /metrics (Prometheus text format) ---------------------------------------------


def parse_prometheus(text: str) -> dict[str, float]:
    """Sample name -> value summed over label sets (``_bucket``/``_created`` samples dropped)."""
    from prometheus_client.parser import text_string_to_metric_families

    totals: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            if s.name.endswith(("_bucket", "_created")):
                continue
            totals[s.name] = totals.get(s.name, 0.0) + s.value
    return totals


def server_deltas(before: dict[str, float], after: dict[str, float]) -> dict[str, float | None]:
    """The seeds' prefix-caching numbers over the run: hit rate, prefill tokens, preemptions."""

    def delta(name: str) -> float | None:
        if name not in after:
            return None
        return after[name] - before.get(name, 0.0)

    hits = delta("vllm:prefix_cache_hits_total")
    queries = delta("vllm:prefix_cache_queries_total")
    return {
        "prefix_cache_hits": hits,
        "prefix_cache_queries": queries,
        "prefix_cache_hit_rate": hits / queries if hits is not None and queries else None,
        "prefill_kv_computed_tokens": delta("vllm:request_prefill_kv_computed_tokens_sum"),
        "num_preemptions": delta("vllm:num_preemptions_total"),
    }


# --- console ------------------------------------------------------------------------------


def format_table(
    result: dict[str, Any], percentiles: Sequence[float], metrics: Sequence[str] = METRICS
) -> str:
    """vLLM's "Serving Benchmark Result" block."""
    lines = ["{s:{c}^{n}}".format(s=" Serving Benchmark Result ", n=50, c="=")]

    def row(label: str, value: Any) -> None:
        text = f"{value:.2f}" if isinstance(value, float) else str(value)
        lines.append(f"{label:<40} {text:<10}")

    row("Successful requests:", result["completed"])
    row("Failed requests:", result["failed"])
    if result.get("max_concurrency") is not None:
        row("Maximum request concurrency:", result["max_concurrency"])
    row("Benchmark duration (s):", result["duration"])
    row("Total input tokens:", result["total_input_tokens"])
    row("Total generated tokens:", result["total_output_tokens"])
    row("Request throughput (req/s):", result["request_throughput"])
    if "request_goodput" in result:
        row("Request goodput (req/s):", result["request_goodput"])
    row("Output token throughput (tok/s):", result["output_throughput"])
    if "max_output_tokens_per_s" in result:
        row("Peak output token throughput (tok/s):", result["max_output_tokens_per_s"])
    row("Peak concurrent requests:", result["max_concurrent_requests"])
    row("Total Token throughput (tok/s):", result["total_token_throughput"])
    for m in metrics:
        lines.append("{s:{c}^{n}}".format(s=METRIC_TITLES[m], n=50, c="-"))
        name = m.upper()
        row(f"Mean {name} (ms):", result[f"mean_{m}_ms"])
        row(f"Median {name} (ms):", result[f"median_{m}_ms"])
        for p in percentiles:
            k = percentile_key(p)
            row(f"P{k} {name} (ms):", result[f"p{k}_{m}_ms"])
    server = result.get("server_metrics")
    if server:
        lines.append("{s:{c}^{n}}".format(s="Server metrics (delta)", n=50, c="-"))
        rate = server.get("prefix_cache_hit_rate")
        row("Prefix cache hit rate (%):", "n/a" if rate is None else f"{100 * rate:.2f}")
        for key, label in (
            ("prefill_kv_computed_tokens", "Prefill KV computed tokens:"),
            ("num_preemptions", "Preemptions:"),
        ):
            v = server.get(key)
            row(label, "n/a" if v is None else int(v))
    lines.append("=" * 50)
    return "\n".join(lines)
