"""``actorserve bench``: a serving benchmark for any OpenAI-compatible server (ours, vLLM, llama.cpp).

A smaller ``vllm bench serve`` with the same flag names, metrics and JSON keys:

    actorserve bench --port 8000 --dataset-name random --random-input-len 256 \\
        --random-output-len 128 --num-prompts 32 --max-concurrency 16 --ignore-eos \\
        --scrape-metrics --result-dir results/

prints the "Serving Benchmark Result" table and writes ``<result-dir>/<name>.json`` with PNG
plots beside it. Workloads are in ``bench/datasets.py``, timing in ``bench/client.py``, metric
definitions in ``bench/metrics.py``.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import math
from datetime import datetime
from pathlib import Path
from typing import Any

from services import clock
from services.config import ConfigError

# bench.client's endpoints, repeated so that building the CLI parser imports neither httpx
# nor numpy (``actorserve serve`` builds it too).
COMPLETIONS, CHAT = "/v1/completions", "/v1/chat/completions"


def add_cli_args(p: argparse.ArgumentParser, with_server: bool = True) -> None:
    """The benchmark's flags (vLLM's names). ``with_server=False`` leaves out where to connect."""
    if with_server:
        g = p.add_argument_group("server")
        g.add_argument(
            "--base-url", default=None, help="e.g. http://127.0.0.1:8000 (overrides --host/--port)"
        )
        g.add_argument("--host", default="127.0.0.1")
        g.add_argument("--port", type=int, default=8000)
        g.add_argument(
            "--model", default=None, help="the 'model' field (default: the server's first model)"
        )
    p.add_argument(
        "--endpoint",
        default=None,
        choices=[COMPLETIONS, CHAT],
        help="default: chat for --dataset-name chat, completions otherwise",
    )
    p.add_argument("--api-key", default=None)
    p.add_argument(
        "--tokenizer",
        default=None,
        help="GGUF file or HF folder whose tokenizer builds prompts (default: the default model)",
    )
    d = p.add_argument_group("dataset")
    d.add_argument(
        "--dataset-name", default="random", choices=["random", "prefix-repetition", "chat", "jsonl"]
    )
    d.add_argument(
        "--dataset-path", type=Path, default=None, help="JSONL prompts (--dataset-name jsonl)"
    )
    d.add_argument("--num-prompts", type=int, default=100)
    d.add_argument("--random-input-len", type=int, default=1024)
    d.add_argument("--random-output-len", type=int, default=128)
    d.add_argument("--random-range-ratio", type=float, default=0.0)
    d.add_argument("--random-prefix-len", type=int, default=0)
    d.add_argument("--prefix-repetition-num-prefixes", type=int, default=10)
    d.add_argument("--prefix-repetition-prefix-len", type=int, default=256)
    d.add_argument("--prefix-repetition-suffix-len", type=int, default=256)
    d.add_argument("--prefix-repetition-output-len", type=int, default=128)
    d.add_argument("--chat-num-turns", type=int, default=4)
    d.add_argument("--chat-system-len", type=int, default=256, help="shared system prompt tokens")
    d.add_argument("--chat-user-len", type=int, default=64, help="tokens per user message")
    d.add_argument(
        "--chat-assistant-len", type=int, default=64, help="tokens per earlier reply in the history"
    )
    d.add_argument("--chat-output-len", type=int, default=64)
    d.add_argument(
        "--jsonl-output-len",
        type=int,
        default=None,
        help="max_tokens when a line has no output_len",
    )
    t = p.add_argument_group("traffic")
    t.add_argument(
        "--request-rate", type=float, default=math.inf, help="requests/s (default inf: all at once)"
    )
    t.add_argument(
        "--burstiness", type=float, default=1.0, help="gamma shape of the gaps; 1 = Poisson"
    )
    t.add_argument("--max-concurrency", type=int, default=None)
    t.add_argument("--num-warmups", type=int, default=0)
    t.add_argument("--seed", type=int, default=0)
    t.add_argument(
        "--sim-speed",
        type=float,
        default=1.0,
        help="the server's --sim-speed (simulated backend): the request rate, arrivals and "
        "every reported time are then in simulated seconds, as the server's own metrics are",
    )
    t.add_argument("--ignore-eos", action="store_true")
    t.add_argument("--temperature", type=float, default=0.0)
    t.add_argument("--request-timeout", type=float, default=6 * 3600.0, help="seconds per request")
    o = p.add_argument_group("results")
    o.add_argument("--percentile-metrics", default="ttft,tpot,itl,e2el")
    o.add_argument("--metric-percentiles", default="90,99")
    o.add_argument(
        "--goodput",
        nargs="+",
        default=None,
        metavar="KEY:MS",
        help="SLOs for goodput, e.g. ttft:3000 tpot:120 e2el:20000",
    )
    o.add_argument(
        "--scrape-metrics",
        action="store_true",
        help="read the server's /metrics before/after (deltas) and every 0.5 s (queue)",
    )
    o.add_argument("--result-dir", type=Path, default=Path("."))
    o.add_argument(
        "--result-filename", default=None, help="default: a name from the workload and time"
    )
    o.add_argument("--no-save", action="store_true", help="print the table only")
    o.add_argument("--no-plots", action="store_true")
    o.add_argument("--disable-tqdm", action="store_true")


def base_url(args: argparse.Namespace) -> str:
    url = args.base_url or f"http://{args.host}:{args.port}"
    return url.rstrip("/").removesuffix("/v1")


def build_requests(args: argparse.Namespace) -> list[Any]:
    """The workload ``args`` describe (the tokenizer is loaded only when a dataset needs it)."""
    from bench import datasets as ds

    if args.num_prompts < 1:
        raise ConfigError(f"--num-prompts must be >= 1, got {args.num_prompts}")
    if args.dataset_name == "jsonl":
        if args.dataset_path is None:
            raise ConfigError("--dataset-name jsonl needs --dataset-path")
        return ds.jsonl_dataset(args.dataset_path, args.num_prompts, args.jsonl_output_len)
    from services.model_loader import load_tokenizer, prepare_model

    words = ds.WordTokens(load_tokenizer(prepare_model(args.tokenizer)))
    if args.dataset_name == "random":
        requests = ds.random_dataset(
            words,
            args.num_prompts,
            args.random_input_len,
            args.random_output_len,
            args.random_range_ratio,
            args.random_prefix_len,
            args.seed,
        )
    elif args.dataset_name == "prefix-repetition":
        requests = ds.prefix_repetition_dataset(
            words,
            args.num_prompts,
            args.prefix_repetition_num_prefixes,
            args.prefix_repetition_prefix_len,
            args.prefix_repetition_suffix_len,
            args.prefix_repetition_output_len,
            args.seed,
        )
    else:
        return ds.chat_dataset(
            words,
            args.num_prompts,
            args.chat_num_turns,
            args.chat_system_len,
            args.chat_user_len,
            args.chat_assistant_len,
            args.chat_output_len,
            args.seed,
        )
    if resolve_endpoint(args) == CHAT:  # word-token ids decode to text of the same length
        for r in requests:
            r.prompt = words.text(r.prompt)  # type: ignore[arg-type]  # ids in these datasets
    return requests


def resolve_endpoint(args: argparse.Namespace) -> str:
    return args.endpoint or (CHAT if args.dataset_name == "chat" else COMPLETIONS)


def check_prompts(requests: list[Any], endpoint: str) -> None:
    """Fail before sending anything if a prompt cannot go to ``endpoint``."""
    for i, r in enumerate(requests):
        is_messages = isinstance(r.prompt, list) and isinstance(r.prompt[0], dict)
        is_ids = isinstance(r.prompt, list) and not is_messages
        if endpoint == COMPLETIONS and is_messages:
            raise ConfigError(f"request {i} is chat messages: use --endpoint {CHAT}")
        if endpoint == CHAT and is_ids:
            raise ConfigError(f"request {i} is token ids: use --endpoint {COMPLETIONS}")


class MetricsScraper:
    """Reads ``/metrics``: totals before and after, and running/waiting every ``interval`` s."""

    def __init__(self, client: Any, url: str, interval: float = 0.5) -> None:
        self.client, self.url, self.interval = client, url + "/metrics", interval
        self.timeline: list[tuple[float, float, float, float]] = []

    async def read(self) -> dict[str, float]:
        """Sample name -> value (summed over labels); raises on an HTTP or parse error."""
        from bench.metrics import parse_prometheus

        r = await self.client.get(self.url)
        r.raise_for_status()
        return parse_prometheus(r.text)

    async def read_or_fail(self) -> dict[str, float]:
        import httpx

        try:
            return await self.read()
        except (httpx.HTTPError, ValueError) as e:
            await self.client.aclose()
            raise ConfigError(f"--scrape-metrics: cannot read {self.url}: {e}") from None

    async def sample(self, t0: float, stop: asyncio.Event) -> None:
        while not stop.is_set():
            t = clock.perf_counter() - t0
            try:
                m = await self.read()
                self.timeline.append(
                    (
                        t,
                        m.get("vllm:num_requests_running", 0.0),
                        m.get("vllm:num_requests_waiting", 0.0),
                        m.get("vllm:kv_cache_usage_perc", 0.0),
                    )
                )
            except Exception:  # a missed sample must not end the benchmark
                pass
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(stop.wait(), self.interval)


async def benchmark(
    args: argparse.Namespace, requests: list[Any], url: str, label: str | None = None
) -> dict[str, Any]:
    """Run ``requests`` against ``url``; the result dict (vLLM's JSON keys plus ours)."""
    import httpx
    from tqdm import tqdm

    from bench.client import (
        RequestSettings,
        fetch_models,
        make_client,
        run_requests,
    )
    from bench.datasets import SampleRequest, arrival_times
    from bench.metrics import parse_goodput, parse_percentiles, server_deltas

    parse_percentiles(args.metric_percentiles)  # bad flags fail before the run, not after
    if args.sim_speed <= 0:
        raise ConfigError(f"--sim-speed must be > 0, got {args.sim_speed}")
    clock.set_sim_speed(args.sim_speed)
    parse_goodput(args.goodput)
    endpoint = resolve_endpoint(args)
    check_prompts(requests, endpoint)
    if args.max_concurrency is not None and args.max_concurrency < 1:
        raise ConfigError(f"--max-concurrency must be >= 1, got {args.max_concurrency}")
    arrivals = arrival_times(len(requests), args.request_rate, args.burstiness, args.seed).tolist()
    async with make_client(args.max_concurrency, args.request_timeout) as client:
        try:
            model = args.model or (await fetch_models(client, url, args.api_key))[0]
        except (httpx.HTTPError, IndexError, ValueError) as e:
            raise ConfigError(
                f"cannot list models at {url}/v1/models ({e}); is the server up? "
                "give --model to skip this"
            ) from None
        settings = RequestSettings(
            url, endpoint, model, args.api_key, args.temperature, args.ignore_eos
        )
        if args.num_warmups > 0:
            # vLLM's warm-up: the first request, repeated, without its conversation parent.
            first = requests[0]
            warm = [SampleRequest(first.prompt, first.prompt_len, first.expected_output_len)]
            warm *= args.num_warmups
            outs, _ = await run_requests(
                client, warm, settings, [0.0] * len(warm), args.max_concurrency
            )
            if not any(o.success for o in outs):
                raise ConfigError(f"warm-up requests failed: {outs[0].error}")
        # The scraper has its own connection: the run's pool is full of streams during the run.
        scraper = MetricsScraper(make_client(1, 30.0), url) if args.scrape_metrics else None
        before = await scraper.read_or_fail() if scraper else {}
        bar = tqdm(total=len(requests), disable=args.disable_tqdm, desc=label)
        stop = asyncio.Event()
        sampler = (
            asyncio.create_task(scraper.sample(clock.perf_counter(), stop)) if scraper else None
        )
        outputs, duration = await run_requests(
            client, requests, settings, arrivals, args.max_concurrency, lambda _o: bar.update(1)
        )
        stop.set()
        if sampler is not None:
            await sampler
        bar.close()
        after = await scraper.read_or_fail() if scraper else {}
        if scraper is not None:
            await scraper.client.aclose()
    result = _result(args, label, url, endpoint, model, outputs, duration)
    if scraper is not None:
        result["server_metrics"] = server_deltas(before, after)
        result["server_timeline"] = scraper.timeline
    return result


def _result(
    args: argparse.Namespace,
    label: str | None,
    url: str,
    endpoint: str,
    model: str,
    outputs: list[Any],
    duration: float,
) -> dict[str, Any]:
    """vLLM's result keys: the run's settings, the metrics, then the per-request lists."""
    from bench.metrics import calculate_metrics, parse_goodput, parse_percentiles, token_times
    from bench.metrics import tpot as request_tpot

    result: dict[str, Any] = {
        "date": datetime.now().strftime("%Y%m%d-%H%M%S"),
        "label": label,
        "base_url": url,
        "endpoint": endpoint,
        "model_id": model,
        "dataset_name": args.dataset_name,
        "num_prompts": len(outputs),
        "request_rate": "inf" if math.isinf(args.request_rate) else args.request_rate,
        "burstiness": args.burstiness,
        "sim_speed": args.sim_speed,
        "max_concurrency": args.max_concurrency,
    }
    percentiles = parse_percentiles(args.metric_percentiles)
    result.update(calculate_metrics(outputs, duration, percentiles, parse_goodput(args.goodput)))
    times, counts = token_times([o for o in outputs if o.success])
    result.update(
        input_lens=[o.prompt_len for o in outputs],
        output_lens=[o.output_tokens for o in outputs],
        ttfts=[o.ttft for o in outputs],
        tpots=[request_tpot(o) for o in outputs],
        itls=[o.itl for o in outputs],
        e2els=[o.latency for o in outputs],
        start_times=[o.start_time for o in outputs],
        token_times=times.tolist(),
        token_counts=counts.tolist(),
        generated_texts=[o.generated_text for o in outputs],
        errors=[o.error for o in outputs],
    )
    return result


def default_filename(args: argparse.Namespace, label: str | None = None) -> str:
    rate = "inf" if math.isinf(args.request_rate) else f"{args.request_rate:g}"
    conc = args.max_concurrency or "inf"
    name = f"bench-{args.dataset_name}-{rate}qps-c{conc}-{datetime.now():%Y%m%d-%H%M%S}"
    return f"{name}-{label}.json" if label else f"{name}.json"


def save_result(result: dict[str, Any], args: argparse.Namespace, filename: str) -> list[Path]:
    """Write the JSON and (unless ``--no-plots``) the PNGs beside it; the paths written."""
    args.result_dir.mkdir(parents=True, exist_ok=True)
    path = args.result_dir / filename
    path.write_text(json.dumps(result, indent=1), encoding="utf-8")
    written = [path]
    if not args.no_plots:
        from bench.plots import plot_result

        written += plot_result(result, path.with_suffix(""))
    return written


def main(args: argparse.Namespace) -> int:
    from bench.metrics import format_table, parse_percentiles

    metrics = [m.strip() for m in args.percentile_metrics.split(",") if m.strip()]
    bad = set(metrics) - {"ttft", "tpot", "itl", "e2el"}
    if bad:
        raise ConfigError(f"--percentile-metrics: unknown {', '.join(sorted(bad))}")
    requests = build_requests(args)
    result = asyncio.run(benchmark(args, requests, base_url(args)))
    print(format_table(result, parse_percentiles(args.metric_percentiles), metrics))
    if result["failed"]:
        first = next(e for e in result["errors"] if e)
        print(f"{result['failed']} requests failed; the first: {first}")
    if not args.no_save:
        for path in save_result(result, args, args.result_filename or default_filename(args)):
            print(f"wrote {path}")
    return 0 if result["completed"] else 1


if __name__ == "__main__":
    import sys

    from services.model_loader import ModelLoadError

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_cli_args(parser)
    try:
        raise SystemExit(main(parser.parse_args()))
    except (ConfigError, ModelLoadError) as e:
        print(f"error: {e}", file=sys.stderr)
        raise SystemExit(2) from None
