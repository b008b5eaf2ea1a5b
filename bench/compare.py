"""One workload against several OpenAI-compatible servers in turn, and a ratio table.

    .venv/bin/python -m bench.compare --server ours=http://127.0.0.1:8000 \\
        --server vllm=http://127.0.0.1:8001 --random-input-len 256 --random-output-len 128 \\
        --num-prompts 32 --max-concurrency 16 --ignore-eos --result-dir results/

Every server gets the same requests (built once, same seed) and the same arrival times; each
run is saved as ``actorserve bench`` saves it (JSON + PNGs, the label in the file name), then
the table prints each metric per server and its ratio to the first server, and
``compare-*.json`` / ``compare-*_cdf.png`` hold the summary and overlaid CDFs. The model name
is each server's first ``/v1/models`` entry unless ``--model`` is given.
"""

from __future__ import annotations

import argparse
import asyncio
import json
from datetime import datetime
from typing import Any

from services.config import ConfigError

# (key, label, higher is better)
SUMMARY_KEYS: tuple[tuple[str, str, bool], ...] = (
    ("request_throughput", "Request throughput (req/s)", True),
    ("output_throughput", "Output token throughput (tok/s)", True),
    ("total_token_throughput", "Total token throughput (tok/s)", True),
    ("request_goodput", "Request goodput (req/s)", True),
    ("median_ttft_ms", "Median TTFT (ms)", False),
    ("p99_ttft_ms", "P99 TTFT (ms)", False),
    ("median_tpot_ms", "Median TPOT (ms)", False),
    ("p99_tpot_ms", "P99 TPOT (ms)", False),
    ("median_itl_ms", "Median ITL (ms)", False),
    ("median_e2el_ms", "Median E2EL (ms)", False),
    ("prefix_cache_hit_rate", "Prefix cache hit rate", True),
)


def parse_servers(specs: list[str]) -> dict[str, str]:
    """``["ours=http://h:1", ...]`` -> ``{"ours": "http://h:1"}``, in the order given."""
    servers: dict[str, str] = {}
    for spec in specs:
        label, sep, url = spec.partition("=")
        if not sep or not label or not url.startswith(("http://", "https://")):
            raise ConfigError(f"--server takes LABEL=http://HOST:PORT, got {spec!r}")
        if label in servers:
            raise ConfigError(f"--server label {label!r} given twice")
        servers[label] = url.rstrip("/").removesuffix("/v1")
    if not servers:
        raise ConfigError("give at least one --server LABEL=URL")
    return servers


def _value(result: dict[str, Any], key: str) -> float | None:
    if key == "prefix_cache_hit_rate":
        return (result.get("server_metrics") or {}).get(key)
    return result.get(key)


def ratio_table(results: dict[str, dict[str, Any]]) -> str:
    """Each metric per server, then each later server's ratio to the first ("x1.50")."""
    labels = list(results)
    base = labels[0]
    head = f"{'metric':<34}" + "".join(f"{label:>14}" for label in labels)
    head += "".join(f"{label + '/' + base:>16}" for label in labels[1:])
    lines = [head, "-" * len(head)]
    for key, title, higher in SUMMARY_KEYS:
        values = [_value(results[label], key) for label in labels]
        if all(v is None for v in values):
            continue
        row = f"{title + (' ↑' if higher else ' ↓'):<34}"
        row += "".join(f"{'n/a' if v is None else f'{v:.2f}':>14}" for v in values)
        for v in values[1:]:
            ok = v is not None and values[0]
            row += f"{f'x{v / values[0]:.2f}' if ok else 'n/a':>16}"  # type: ignore[operator]
        lines.append(row)
    return "\n".join(lines)


def main(args: argparse.Namespace) -> int:
    from bench.metrics import format_table, parse_percentiles
    from bench.serve import benchmark, build_requests, save_result

    servers = parse_servers(args.server)
    requests = build_requests(args)
    results: dict[str, dict[str, Any]] = {}
    stamp = f"{datetime.now():%Y%m%d-%H%M%S}"
    for label, url in servers.items():
        print(f"--- {label}: {url}")
        result = asyncio.run(benchmark(args, requests, url, label=label))
        print(format_table(result, parse_percentiles(args.metric_percentiles)))
        results[label] = result
        if not args.no_save:
            save_result(result, args, f"bench-{args.dataset_name}-{stamp}-{label}.json")
    print(ratio_table(results))
    if not args.no_save:
        summary = {
            label: {key: _value(r, key) for key, _, _ in SUMMARY_KEYS}
            for label, r in results.items()
        }
        path = args.result_dir / f"compare-{args.dataset_name}-{stamp}.json"
        path.write_text(json.dumps({"servers": servers, "summary": summary}, indent=1))
        print(f"wrote {path}")
        if not args.no_plots:
            from bench.plots import plot_compare

            print(f"wrote {plot_compare(results, path.with_name(path.stem + '_cdf.png'))}")
    return 0 if all(r["completed"] for r in results.values()) else 1


def build_parser() -> argparse.ArgumentParser:
    from bench.serve import add_cli_args

    p = argparse.ArgumentParser(prog="bench.compare", description=__doc__.splitlines()[0])
    p.add_argument(
        "--server",
        action="append",
        default=[],
        metavar="LABEL=URL",
        help="a server to benchmark (repeat; the first is the ratios' baseline)",
    )
    p.add_argument("--model", default=None, help="the 'model' field for every server")
    add_cli_args(p, with_server=False)
    return p


if __name__ == "__main__":
    import sys

    from services.model_loader import ModelLoadError

    try:
        raise SystemExit(main(build_parser().parse_args()))
    except (ConfigError, ModelLoadError) as e:
        print(f"error: {e}", file=sys.stderr)
        raise SystemExit(2) from None
