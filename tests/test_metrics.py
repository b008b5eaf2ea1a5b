"""Metrics: vLLM's series with the values a known workload must produce, on real servers.

A real server runs for the module: the default model with 256 MiB of KV
cache, 2048 tokens, ``--kv-cache-metrics`` and a 1 s stats line; the slow
preemption test starts a tiny one (4 usable blocks of 4 tokens). The
references are independent of the exporter: the ``usage`` the API returned,
the token ids sent, the block arithmetic of the prefix cache, and
prometheus_client's own ``Histogram.observe``. Pure parts (the request
timeline, bulk observation, the hit-rate window, the log line) are tested
without a server.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import json
import logging
import os
import queue
import re
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest
from prometheus_client import CollectorRegistry, Histogram, generate_latest
from prometheus_client.parser import text_string_to_metric_families

from services.config import ServeConfig
from services.kv_cache.metrics import PrefixCacheStats
from services.metrics.engine_metrics import build_1_2_5_buckets, request_timeline
from services.metrics.registry import observe_many
from services.metrics.stats import SchedulerStats
from services.metrics.stats_logger import LoggingStatLogger, PrefixCacheHitRate
from services.protocol import RequestTokens, SamplingParams, StepPlan
from services.request import Request, RequestEventType
from services.scheduler.metrics import EngineCoreMetrics

ROOT = Path(__file__).resolve().parents[1]
MODEL = "SmolLM2-135M-Instruct"
REQUEST_HISTOGRAMS = (
    "vllm:time_to_first_token_seconds", "vllm:e2e_request_latency_seconds",
    "vllm:request_queue_time_seconds", "vllm:request_prefill_time_seconds",
    "vllm:request_decode_time_seconds", "vllm:request_inference_time_seconds",
    "vllm:request_time_per_output_token_seconds", "vllm:request_prompt_tokens",
    "vllm:request_generation_tokens", "vllm:request_params_max_tokens", "vllm:request_params_n",
    "vllm:request_num_preemptions", "vllm:request_prefill_kv_computed_tokens",
)  # fmt: skip
STATS_LINE = re.compile(
    r"Engine 000: Avg prompt throughput: ([\d.]+) tokens/s, Avg generation throughput: "
    r"([\d.]+) tokens/s, Running: \d+ reqs, Waiting: \d+ reqs, GPU KV cache usage: [\d.]+%, "
    r"Prefix cache hit rate: [\d.]+%"
)


# ---------------------------------------------------------------- pure parts


def _request(events: list[tuple[RequestEventType, float]], arrival: float) -> Request:
    r = Request("r", [1, 2, 3], SamplingParams(), arrival_time=arrival)
    r.events = events
    return r


def test_timeline_intervals_and_preemption_attribution() -> None:
    q, s, t = RequestEventType.QUEUED, RequestEventType.SCHEDULED, RequestEventType.NEW_TOKENS
    p = RequestEventType.PREEMPTED
    offset = 1000.0  # wall = monotonic + offset; the request arrived 0.5 s before QUEUED
    # Preempted during prefill (10.2), rescheduled at 11.0: that wait is prefill, not queue.
    r = _request(
        [(q, 10.0), (s, 10.1), (p, 10.2), (s, 11.0), (t, 11.5), (t, 11.7), (t, 12.0)], 1009.5
    )
    tl = request_timeline(r, offset)
    assert tl is not None
    assert tl.queue_s == pytest.approx(0.1)
    assert tl.prefill_s == pytest.approx(1.4)
    assert tl.ttft_s == pytest.approx(2.0)
    assert tl.decode_s == pytest.approx(0.5)
    assert tl.inference_s == pytest.approx(1.9)
    assert tl.e2e_s == pytest.approx(2.5)
    assert tl.itl_s == pytest.approx([0.2, 0.3])
    assert tl.time_per_output_token_s == pytest.approx(0.25)
    # Preempted during decode: the gap lands in one ITL and in decode time.
    r = _request([(q, 0.0), (s, 0.0), (t, 1.0), (p, 1.1), (s, 4.0), (t, 4.5)], offset)
    tl = request_timeline(r, offset)
    assert tl is not None and tl.itl_s == pytest.approx([3.5]) and tl.decode_s == pytest.approx(3.5)
    assert request_timeline(_request([(q, 0.0), (s, 1.0)], offset), offset) is None


def test_observe_many_matches_observe_per_value() -> None:
    values = [0.0, 0.01, 0.0100001, 0.3, 7.0, 80.0, 1e6, 0.049999]
    buckets = (0.01, 0.025, 0.05, 0.5, 80.0)
    texts = []
    for bulk in (False, True):
        registry = CollectorRegistry()
        h = Histogram("h", "h", ("a",), buckets=buckets, registry=registry).labels("x")
        if bulk:
            observe_many(h, values)
        else:
            for v in values:
                h.observe(v)
        texts.append(re.sub(r"h_created.*\n", "", generate_latest(registry).decode()))
    assert texts[0] == texts[1]


def test_1_2_5_buckets() -> None:
    assert build_1_2_5_buckets(100) == [1, 2, 5, 10, 20, 50, 100]
    assert build_1_2_5_buckets(2048) == [1, 2, 5, 10, 20, 50, 100, 200, 500, 1000, 2000]


def test_hit_rate_window_and_log_line(caplog: pytest.LogCaptureFixture) -> None:
    rate = PrefixCacheHitRate(window=10)
    rate.observe(PrefixCacheStats(requests=10, queries=100, hits=0))
    rate.observe(PrefixCacheStats(requests=20, queries=200, hits=50))
    assert rate.hit_rate == pytest.approx(0.5)  # the first 10 requests left the window
    logger = logging.getLogger("test_metrics.stats")
    stats_logger = LoggingStatLogger(logger, interval_s=2.0)
    stats_logger.record(300, 40)
    stats = SchedulerStats(num_running_reqs=3, num_waiting_reqs=1, kv_cache_usage=0.25)
    start = stats_logger._last_log
    with caplog.at_level(logging.DEBUG, logger="test_metrics.stats"):
        assert not stats_logger.maybe_log(stats, start + 1.0)
        assert stats_logger.maybe_log(stats, start + 2.0)
        assert stats_logger.maybe_log(stats, start + 4.0)  # idle after active: still INFO
        assert stats_logger.maybe_log(stats, start + 6.0)  # idle twice: DEBUG
    lines = [(r.levelno, r.getMessage()) for r in caplog.records]
    assert lines[0] == (
        logging.INFO,
        "Engine 000: Avg prompt throughput: 150.0 tokens/s, Avg generation throughput: "
        "20.0 tokens/s, Running: 3 reqs, Waiting: 1 reqs, GPU KV cache usage: 25.0%, "
        "Prefix cache hit rate: 0.0%",
    )
    assert [lvl for lvl, _ in lines] == [logging.INFO, logging.INFO, logging.DEBUG]


class _FakeScheduler:
    """What EngineCoreMetrics reads from a Scheduler, with fixed answers."""

    def __init__(self) -> None:
        self.finished = [_request([], 0.0)]

    def take_finished_requests(self) -> list[Request]:
        finished, self.finished = self.finished, []
        return finished

    def take_kv_cache_residency(self) -> None:
        return None

    def get_stats(self) -> SchedulerStats:
        return SchedulerStats(num_running_reqs=2, kv_cache_usage=0.5)


@pytest.mark.parametrize("disabled", [False, True])
def test_engine_core_hooks_and_disable_log_stats(disabled: bool) -> None:
    config = ServeConfig(served_model_names=["m"], disable_log_stats=disabled)
    sched = _FakeScheduler()
    hooks = EngineCoreMetrics(config, sched, logging.getLogger("test_metrics.hooks"))  # type: ignore[arg-type]
    hooks.on_step(StepPlan(0, num_scheduled_tokens=[1, 1]), [RequestTokens("a", [7]),
                  RequestTokens("b", [8], "length")], 0.001)  # fmt: skip
    assert sched.finished == []  # drained even when disabled: no unbounded growth
    engine = hooks.engine
    assert engine.generation_tokens._value.get() == (0 if disabled else 2)
    assert engine.request_success["abort"]._value.get() == (0 if disabled else 1)
    assert engine.running._value.get() == (0 if disabled else 2)
    inputs: queue.SimpleQueue[str] = queue.SimpleQueue()
    inputs.put("msg")
    assert hooks.wait_idle(inputs) == "msg"


# ---------------------------------------------------------------- real servers


@dataclass
class Server:
    port: int
    proc: subprocess.Popen[bytes]
    log: Path
    tmpdir: Path
    children: list[int]

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(60)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _children(pid: int) -> list[int]:
    out = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[1]) == pid:
            out.append(int(stat.parent.name))
    return out


def _alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"


def _start(tmp: Path, name: str, *flags: str) -> Server:
    port = _free_port()
    tmpdir = tmp / name
    tmpdir.mkdir()
    log = tmp / f"{name}.log"
    env = dict(os.environ, OMP_NUM_THREADS="1", TMPDIR=str(tmpdir))
    cmd = [sys.executable, "-m", "launch.cli", "serve", "--port", str(port), *flags]
    with log.open("wb") as f:
        proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=f, stderr=subprocess.STDOUT)
    return Server(port, proc, log, tmpdir, [])


def _wait_up(server: Server, deadline: float) -> None:
    while time.monotonic() < deadline:
        if server.proc.poll() is not None:
            pytest.fail(f"server exited early:\n{server.log.read_text()[-3000:]}")
        try:
            if httpx.get(f"{server.url}/health", timeout=1).status_code == 200:
                server.children = _children(server.proc.pid)
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    pytest.fail(f"server did not start:\n{server.log.read_text()[-3000:]}")


@contextlib.contextmanager
def running_server(tmp: Path, name: str, *flags: str) -> Iterator[Server]:
    """A server for the module; every process it started is gone afterwards."""
    server = _start(tmp, name, *flags)
    try:
        _wait_up(server, time.monotonic() + 240)
        yield server
    finally:
        server.stop()
        for pid in server.children:
            if _alive(pid):
                os.kill(pid, signal.SIGKILL)


@pytest.fixture(scope="module")
def main(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    flags = ("--kv-cache-memory-bytes", "256MiB", "--max-model-len", "2048",
             "--log-stats-interval", "1", "--kv-cache-metrics", "--kv-cache-metrics-sample", "1.0")  # fmt: skip
    with running_server(tmp_path_factory.mktemp("metrics"), "main", *flags) as server:
        yield server


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    """4 usable KV blocks of 4 tokens."""
    flags = ("--max-model-len", "16", "--block-size", "4", "--num-gpu-blocks-override", "5")
    with running_server(tmp_path_factory.mktemp("metrics"), "tiny", *flags) as server:
        yield server


Samples = dict[tuple[str, frozenset[tuple[str, str]]], float]


def scrape(server: Server) -> Samples:
    text = httpx.get(f"{server.url}/metrics", timeout=10).text
    return {
        (s.name, frozenset(s.labels.items())): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
    }


def value(samples: Samples, name: str, **labels: str) -> float:
    want = {"model_name": MODEL, "engine": "0", **labels}
    return sum(
        v for (n, lab), v in samples.items() if n == name and want.items() <= dict(lab).items()
    )


def delta(after: Samples, before: Samples, name: str, **labels: str) -> float:
    return value(after, name, **labels) - value(before, name, **labels)


def complete(server: Server, prompt: list[int] | str, max_tokens: int, **extra: object) -> dict:
    body = {"model": MODEL, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0,
            "ignore_eos": True, **extra}  # fmt: skip
    r = httpx.post(f"{server.url}/v1/completions", json=body, timeout=120)
    assert r.status_code == 200, r.text
    return r.json()


def wait_for(server: Server, name: str, target: float, **labels: str) -> Samples:
    """Scrape until ``name`` reaches ``target`` (the scheduler records just after it replies)."""
    deadline = time.monotonic() + 10
    while True:
        samples = scrape(server)
        if value(samples, name, **labels) >= target or time.monotonic() > deadline:
            return samples
        time.sleep(0.1)


def run_concurrently(server: Server, prompts: list[list[int]], max_tokens: int) -> list[dict]:
    with concurrent.futures.ThreadPoolExecutor(len(prompts)) as pool:
        return list(pool.map(lambda p: complete(server, p, max_tokens), prompts))


def test_counters_and_histograms_match_a_known_workload(main: Server) -> None:
    before = scrape(main)
    prompts = [[1, 2, 3, 4, 5], [100, 200, 300], [4000, 4001, 4002, 4003, 4004, 4005, 4006]]
    replies = run_concurrently(main, prompts, max_tokens=4)
    n = len(prompts)
    after = wait_for(main, "vllm:request_success_total",
                     value(before, "vllm:request_success_total") + n)  # fmt: skip
    prompt_tokens = sum(r["usage"]["prompt_tokens"] for r in replies)
    completion_tokens = [r["usage"]["completion_tokens"] for r in replies]
    assert prompt_tokens == sum(map(len, prompts))
    assert delta(after, before, "vllm:prompt_tokens_total") == prompt_tokens
    assert delta(after, before, "vllm:generation_tokens_total") == sum(completion_tokens)
    assert delta(after, before, "vllm:request_success_total", finished_reason="length") == n
    for name in REQUEST_HISTOGRAMS:
        assert delta(after, before, f"{name}_count") == n, name
        assert delta(after, before, f"{name}_bucket", le="+Inf") == n, name
    assert delta(after, before, "vllm:inter_token_latency_seconds_count") == sum(
        c - 1 for c in completion_tokens
    )
    assert delta(after, before, "vllm:request_prompt_tokens_sum") == prompt_tokens
    assert delta(after, before, "vllm:request_generation_tokens_sum") == sum(completion_tokens)
    assert delta(after, before, "vllm:request_params_max_tokens_sum") == 4 * n
    assert delta(after, before, "vllm:request_num_preemptions_sum") == 0
    # The intervals nest: TTFT (from the api_server) >= queue + prefill; E2E >= inference.
    ttft = delta(after, before, "vllm:time_to_first_token_seconds_sum")
    queue = delta(after, before, "vllm:request_queue_time_seconds_sum")
    prefill = delta(after, before, "vllm:request_prefill_time_seconds_sum")
    assert 0 < queue + prefill <= ttft
    e2e = delta(after, before, "vllm:e2e_request_latency_seconds_sum")
    assert delta(after, before, "vllm:request_inference_time_seconds_sum") <= e2e
    assert delta(after, before, "vllm:inter_token_latency_seconds_sum") == pytest.approx(
        delta(after, before, "vllm:request_decode_time_seconds_sum")
    )
    # Our own series, one per process kind, all in this one scrape.
    assert delta(after, before, "actorserve:api_requests_total") == n
    assert delta(after, before, "actorserve:tokenizer_time_seconds_count") == n
    for name in ("actorserve:detokenizer_batch_time_seconds_count",
                 "actorserve:worker_forward_time_seconds_count",
                 "actorserve:scheduler_step_time_seconds_count",
                 "actorserve:socket_sent_bytes_total"):  # fmt: skip
        assert delta(after, before, name) > 0, name
    assert value(after, "actorserve:max_num_seqs") == 256


def test_every_series_is_labelled(main: Server) -> None:
    samples = scrape(main)
    ours = [(n, dict(lab)) for n, lab in samples if n.startswith(("vllm:", "actorserve:"))]
    assert len({n for n, _ in ours}) > 40
    for name, labels in ours:
        assert labels.get("model_name") == MODEL and labels.get("engine") == "0", name
    info = next(lab for n, lab in ours if n == "vllm:cache_config_info")
    assert info["block_size"] == "16" and info["enable_prefix_caching"] == "True"
    assert info["num_gpu_blocks"] == "364"  # 256 MiB / (30 layers * 2 * 3 heads * 64 * 4 B * 16)


def test_prefix_cache_hits_and_computed_tokens(main: Server) -> None:
    prefix = list(range(1000, 1070))  # 70 tokens: 4 full blocks of 16
    complete(main, [*prefix, 5, 6, 7], max_tokens=1)
    second = [*prefix, 8, 9, 10, 11]
    expected_hits = min(len(prefix), len(second) - 1) // 16 * 16
    for salt, hits in ((None, expected_hits), ("another-tenant", 0)):
        before = scrape(main)
        extra = {"cache_salt": salt} if salt else {}
        reply = complete(main, second, max_tokens=1, **extra)
        after = wait_for(main, "vllm:request_success_total",
                         value(before, "vllm:request_success_total") + 1)  # fmt: skip
        assert reply["usage"]["prompt_tokens_details"]["cached_tokens"] == hits
        assert delta(after, before, "vllm:prefix_cache_queries_total") == len(second)
        assert delta(after, before, "vllm:prefix_cache_hits_total") == hits
        assert delta(after, before, "vllm:prompt_tokens_cached_total") == hits
        assert delta(after, before, "vllm:request_prefill_kv_computed_tokens_sum") == (
            len(second) - hits
        )


def test_kv_usage_returns_to_zero_when_idle(main: Server) -> None:
    complete(main, [7, 8, 9], max_tokens=2)
    deadline = time.monotonic() + 5
    while value(samples := scrape(main), "vllm:kv_cache_usage_perc") != 0.0:
        assert time.monotonic() < deadline, "KV cache usage stayed above 0 when idle"
        time.sleep(0.1)
    assert value(samples, "vllm:num_requests_running") == 0
    assert value(samples, "vllm:num_requests_waiting") == 0


def test_preemption_counted_under_a_tiny_kv_pool(tiny: Server) -> None:
    # 4 usable blocks of 4 tokens: two requests of 5 + 6 tokens (3 blocks each) cannot both fit.
    before = scrape(tiny)
    prompts = [list(range(10, 15)), list(range(30, 35))]
    replies = run_concurrently(tiny, prompts, max_tokens=6)
    after = wait_for(tiny, "vllm:request_success_total",
                     value(before, "vllm:request_success_total") + 2)  # fmt: skip
    preemptions = delta(after, before, "vllm:num_preemptions_total")
    assert preemptions >= 1
    assert delta(after, before, "vllm:request_num_preemptions_sum") == preemptions
    assert delta(after, before, "vllm:request_num_preemptions_count") == 2
    # Recomputation after a preemption does not count the prompt twice.
    assert delta(after, before, "vllm:prompt_tokens_total") == 10
    assert delta(after, before, "vllm:generation_tokens_total") == sum(
        r["usage"]["completion_tokens"] for r in replies
    )
    assert "is preempted by PreemptionMode.RECOMPUTE" in tiny.log.read_text()


def test_grafana_dashboard_queries_existing_series(main: Server) -> None:
    dashboard = json.loads((ROOT / "deploy/grafana/actorserve.json").read_text())
    exprs = [t["expr"] for p in dashboard["panels"] for t in p["targets"]]
    used = {m for e in exprs for m in re.findall(r"\b(?:vllm|actorserve):[a-z0-9_]+", e)}
    scraped = {n for n, _ in scrape(main)}
    assert used and used <= scraped, used - scraped
    for series in ("vllm:time_to_first_token_seconds_bucket", "vllm:request_queue_time_seconds_bucket",
                   "vllm:request_prefill_time_seconds_bucket", "vllm:num_preemptions_total",
                   "vllm:request_prefill_kv_computed_tokens_sum", "actorserve:max_num_seqs"):  # fmt: skip
        assert series in used, series


def test_logs_and_shutdown(main: Server) -> None:
    complete(main, [11, 12, 13], max_tokens=2)
    time.sleep(2.2)  # at least one 1 s stats interval after the request
    log = main.log.read_text()
    assert "KV cache size: 5,808 tokens" in log
    assert "Maximum concurrency for 2,048 tokens per request: 2.84x" in log
    rates = [tuple(map(float, m)) for m in STATS_LINE.findall(log)]
    assert any(gen > 0 for _, gen in rates) and any(p > 0 for p, _ in rates)
    metrics_dirs = list(main.tmpdir.glob("actorserve-metrics-*"))
    assert len(metrics_dirs) == 1 and any(metrics_dirs[0].iterdir())
    main.stop()
    assert main.proc.returncode == 0
    assert not list(main.tmpdir.glob("actorserve-metrics-*"))
    assert main.children and not [pid for pid in main.children if _alive(pid)]


def test_a_restarted_engines_old_gauges_are_dropped_and_its_counts_kept(tmp_path, monkeypatch):
    """--restart-on-failure: the stopped processes' gauge files go (a gauge whose labels
    changed would stay on /metrics beside the new one's), counters and histograms stay."""
    from services.metrics.registry import MULTIPROC_ENV, forget_process_gauges

    monkeypatch.setenv(MULTIPROC_ENV, str(tmp_path))
    names = ["gauge_mostrecent_123.db", "gauge_livesum_123.db", "counter_123.db",
             "histogram_123.db", "gauge_mostrecent_1234.db", "gauge_mostrecent_23.db"]  # fmt: skip
    for name in names:
        (tmp_path / name).write_bytes(b"")
    forget_process_gauges(123)
    assert sorted(p.name for p in tmp_path.iterdir()) == [
        "counter_123.db", "gauge_mostrecent_1234.db", "gauge_mostrecent_23.db", "histogram_123.db"
    ]  # fmt: skip
