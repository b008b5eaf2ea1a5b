"""vLLM's engine series (``vllm:*``), recorded in the scheduler process once per step.

Names, types, label names and buckets follow vLLM's ``PrometheusStatLogger``
(``vllm/v1/metrics/loggers.py``), so vLLM's dashboards, troubleshooting tables
and routers read them unchanged. Everything is recorded in bulk per step:
token counters from the step's outputs, gauges at most every
``GAUGE_INTERVAL_S`` (and whenever the engine goes idle), request histograms
once per finished request from its event timeline.

Request timeline (vLLM's ``RequestStateStats``; events are ``time.monotonic()``,
the api_server's ``arrival_time`` is wall clock, converted with one offset):

- queue     = QUEUED -> SCHEDULED          (``vllm:request_queue_time_seconds``)
- prefill   = SCHEDULED -> first NEW_TOKENS (``vllm:request_prefill_time_seconds``)
- decode    = first -> last NEW_TOKENS      (``vllm:request_decode_time_seconds``)
- inference = SCHEDULED -> last NEW_TOKENS  (``vllm:request_inference_time_seconds``)
- ITL       = successive NEW_TOKENS         (``vllm:inter_token_latency_seconds``)
- TTFT, E2E = arrival -> first / last token (``vllm:time_to_first_token_seconds``, ``..e2e..``)

SCHEDULED is the first one, as vLLM's code does: a request preempted before
its first token comes back with another SCHEDULED, and that wait counts into
its prefill time and TTFT; one preempted after it counts into ITL and decode
time. Without a preemption before the first token the first SCHEDULED is the
most recent one, the seeds' wording.
"""

from __future__ import annotations

import dataclasses
import itertools
from collections.abc import Iterable
from dataclasses import dataclass, field

from prometheus_client import Counter, Gauge, Histogram

from services import clock
from services.config import ServeConfig
from services.kv_cache.metrics import KVCacheResidency
from services.metrics.registry import LABEL_NAMES, label_values, observe_many
from services.metrics.stats import SchedulerStats
from services.protocol import KVTransferDone, RequestTokens, StepPlan
from services.request import Request, RequestEventType

GAUGE_INTERVAL_S = 0.1  # gauges need not move faster than anyone scrapes them
# Finished ids remembered, so that a step recorded late does not wait for their first token.
_RECENTLY_FINISHED_KEPT = 4096

TTFT_BUCKETS = (
    0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
    20.0, 40.0, 80.0, 160.0, 640.0, 2560.0,
)  # fmt: skip
ITL_BUCKETS = (
    0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
    20.0, 40.0, 80.0,
)  # fmt: skip
REQUEST_LATENCY_BUCKETS = (
    0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0,
    240.0, 480.0, 960.0, 1920.0, 7680.0,
)  # fmt: skip
ITERATION_TOKENS_BUCKETS = (1, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384)
# vLLM's for its NIXL connector's transfer histograms
XFER_TIME_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.2, 0.3, 0.5, 0.75, 1.0, 5.0)
XFER_BYTES_BUCKETS = tuple(2 ** (10 + i) for i in range(1, 25, 2))
N_BUCKETS = (1, 2, 5, 10, 20)
PREEMPTIONS_BUCKETS = (0, 1, 2, 5, 10, 20, 50, 100)
KV_RESIDENCY_BUCKETS = (
    0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1, 2, 5, 10, 20, 30, 60, 120, 300,
    600, 1200, 1800,
)  # fmt: skip


def build_1_2_5_buckets(max_value: int) -> list[int]:
    """1, 2, 5, 10, 20, 50, ... up to ``max_value`` (vLLM's token-count buckets)."""
    buckets: list[int] = []
    scale = 1
    while True:
        for m in (1, 2, 5):
            if m * scale > max_value:
                return buckets
            buckets.append(m * scale)
        scale *= 10


@dataclass
class RequestTimeline:
    """The intervals of one finished request that produced at least one token (seconds)."""

    queue_s: float
    prefill_s: float
    decode_s: float
    inference_s: float
    ttft_s: float
    e2e_s: float
    itl_s: list[float] = field(default_factory=list)

    @property
    def time_per_output_token_s(self) -> float | None:
        """Mean decode time per token after the first; None with a single token."""
        return self.decode_s / len(self.itl_s) if self.itl_s else None


def request_timeline(request: Request, wall_minus_monotonic: float) -> RequestTimeline | None:
    """Intervals from ``request.events``; None if it never produced a token."""
    queued = scheduled = None
    token_ts: list[float] = []
    for kind, ts in request.events:
        if kind is RequestEventType.NEW_TOKENS:
            token_ts.append(ts)
        elif kind is RequestEventType.SCHEDULED and scheduled is None:
            scheduled = ts
        elif kind is RequestEventType.QUEUED and queued is None:
            queued = ts
    if not token_ts or scheduled is None:
        return None
    queued = scheduled if queued is None else queued
    first, last = token_ts[0], token_ts[-1]
    return RequestTimeline(
        queue_s=scheduled - queued,
        prefill_s=first - scheduled,
        decode_s=last - first,
        inference_s=last - scheduled,
        ttft_s=max(first + wall_minus_monotonic - request.arrival_time, 0.0),
        e2e_s=max(last + wall_minus_monotonic - request.arrival_time, 0.0),
        itl_s=[b - a for a, b in itertools.pairwise(token_ts)],
    )


def cache_config_labels(config: ServeConfig) -> dict[str, str]:
    """``vllm:cache_config_info``'s labels: the cache flags plus the measured block count."""
    cache = config.engine.cache
    labels = {k: str(v) for k, v in dataclasses.asdict(cache).items()}
    labels["cache_dtype"] = labels.pop("kv_cache_dtype")
    labels["num_gpu_blocks"] = str(config.num_blocks)
    return labels


class EngineMetrics:
    """The ``vllm:*`` series of one engine (scheduler process); call from its busy loop only.

    Contract: ``record_step`` after every step with the step's plan and outputs;
    ``record_finished`` with the requests ``Scheduler.take_finished_requests``
    returned; ``record_scheduler_stats`` with fresh ``get_stats()`` (cumulative
    counters inside are turned into increments here).
    """

    def __init__(self, config: ServeConfig, engine_index: int = 0) -> None:
        self.labels = label_values(config, engine_index)
        max_len = config.engine.scheduler.max_model_len or 1
        tok_buckets = build_1_2_5_buckets(max_len)
        self.wall_minus_monotonic = clock.wall() - clock.monotonic()
        self._last_prefix = (0, 0)
        self._recently_finished: dict[str, None] = {}  # ordered set, the newest last
        self._last_preemptions = 0
        # req_id -> (prompt tokens, cached) until its first token: vLLM counts prompt tokens then.
        self._prefilling: dict[str, tuple[int, int]] = {}

        def gauge(name: str, doc: str, extra: tuple[str, ...] = ()) -> Gauge:
            return Gauge(name, doc, (*LABEL_NAMES, *extra), multiprocess_mode="mostrecent",
                         registry=None)  # fmt: skip

        def counter(name: str, doc: str, extra: tuple[str, ...] = ()) -> Counter:
            return Counter(name, doc, (*LABEL_NAMES, *extra), registry=None)

        def histogram(name: str, doc: str, buckets: Iterable[float]) -> Histogram:
            return Histogram(name, doc, LABEL_NAMES, buckets=tuple(buckets), registry=None)

        lv = self.labels
        self.running = gauge("vllm:num_requests_running",
                             "Number of requests in model execution batches.").labels(*lv)  # fmt: skip
        self.waiting = gauge("vllm:num_requests_waiting",
                             "Number of requests waiting to be processed.").labels(*lv)  # fmt: skip
        waiting_by_reason = gauge("vllm:num_requests_waiting_by_reason",
                                  "Number of requests waiting, by the reason they wait.",
                                  ("reason",))  # fmt: skip
        self.waiting_by_reason = {
            r: waiting_by_reason.labels(*lv, r) for r in ("capacity", "deferred")
        }
        self.kv_usage = gauge("vllm:kv_cache_usage_perc",
                              "KV-cache usage. 1 means 100 percent usage.").labels(*lv)  # fmt: skip
        self.cache_config_info = Gauge(
            "vllm:cache_config_info", "Information of the LLMEngine CacheConfig",
            (*LABEL_NAMES, *cache_config_labels(config)), multiprocess_mode="mostrecent",
            registry=None,
        ).labels(*lv, *cache_config_labels(config).values())  # fmt: skip
        self.cache_config_info.set(1)

        self.prompt_tokens = counter("vllm:prompt_tokens",
                                     "Number of prefill tokens processed.").labels(*lv)  # fmt: skip
        self.prompt_tokens_cached = counter(
            "vllm:prompt_tokens_cached", "Number of prompt tokens served from the prefix cache."
        ).labels(*lv)
        self.generation_tokens = counter("vllm:generation_tokens",
                                         "Number of generation tokens processed.").labels(*lv)  # fmt: skip
        self._request_success = counter("vllm:request_success",
                                        "Count of successfully processed requests.",
                                        ("finished_reason",))  # fmt: skip
        self.request_success = {
            r: self._request_success.labels(*lv, r) for r in ("stop", "length", "abort", "error")
        }
        self.num_preemptions = counter("vllm:num_preemptions",
                                       "Cumulative number of preemption from the engine.").labels(*lv)  # fmt: skip
        self.prefix_cache_queries = counter(
            "vllm:prefix_cache_queries",
            "Prefix cache queries, in terms of number of queried tokens.",
        ).labels(*lv)
        self.prefix_cache_hits = counter(
            "vllm:prefix_cache_hits", "Prefix cache hits, in terms of number of cached tokens."
        ).labels(*lv)
        self.external_prefix_cache_queries = counter(
            "vllm:external_prefix_cache_queries",
            "External prefix cache queries from KV connector cross-instance cache sharing, "
            "in terms of number of queried tokens.",
        ).labels(*lv)
        self.external_prefix_cache_hits = counter(
            "vllm:external_prefix_cache_hits",
            "External prefix cache hits from KV connector cross-instance cache sharing, "
            "in terms of number of cached tokens.",
        ).labels(*lv)
        self._last_external = (0, 0)

        h = histogram
        self.ttft = h("vllm:time_to_first_token_seconds",
                      "Histogram of time to first token in seconds.", TTFT_BUCKETS).labels(*lv)  # fmt: skip
        self.itl = h("vllm:inter_token_latency_seconds",
                     "Histogram of inter-token latency in seconds.", ITL_BUCKETS).labels(*lv)  # fmt: skip
        self.tpot = h("vllm:request_time_per_output_token_seconds",
                      "Histogram of time_per_output_token_seconds per request.",
                      ITL_BUCKETS).labels(*lv)  # fmt: skip
        self.e2e = h("vllm:e2e_request_latency_seconds",
                     "Histogram of e2e request latency in seconds.",
                     REQUEST_LATENCY_BUCKETS).labels(*lv)  # fmt: skip
        self.queue_time = h("vllm:request_queue_time_seconds",
                            "Histogram of time spent in WAITING phase for request.",
                            REQUEST_LATENCY_BUCKETS).labels(*lv)  # fmt: skip
        self.inference_time = h("vllm:request_inference_time_seconds",
                                "Histogram of time spent in RUNNING phase for request.",
                                REQUEST_LATENCY_BUCKETS).labels(*lv)  # fmt: skip
        self.prefill_time = h("vllm:request_prefill_time_seconds",
                              "Histogram of time spent in PREFILL phase for request.",
                              REQUEST_LATENCY_BUCKETS).labels(*lv)  # fmt: skip
        self.decode_time = h("vllm:request_decode_time_seconds",
                             "Histogram of time spent in DECODE phase for request.",
                             REQUEST_LATENCY_BUCKETS).labels(*lv)  # fmt: skip
        self.request_prompt_tokens = h("vllm:request_prompt_tokens",
                                       "Number of prefill tokens processed.",
                                       tok_buckets).labels(*lv)  # fmt: skip
        self.request_generation_tokens = h("vllm:request_generation_tokens",
                                           "Number of generation tokens processed.",
                                           tok_buckets).labels(*lv)  # fmt: skip
        self.request_max_tokens = h("vllm:request_params_max_tokens",
                                    "Histogram of the max_tokens request parameter.",
                                    tok_buckets).labels(*lv)  # fmt: skip
        self.request_n = h("vllm:request_params_n", "Histogram of the n request parameter.",
                           N_BUCKETS).labels(*lv)  # fmt: skip
        self.request_preemptions = h("vllm:request_num_preemptions",
                                     "Number of times each request was preempted.",
                                     PREEMPTIONS_BUCKETS).labels(*lv)  # fmt: skip
        self.request_prefill_kv_computed = h(
            "vllm:request_prefill_kv_computed_tokens",
            "Histogram of new KV tokens computed during prefill (excluding cached tokens).",
            tok_buckets,
        ).labels(*lv)
        self.iteration_tokens = h("vllm:iteration_tokens_total",
                                  "Histogram of number of tokens per engine_step.",
                                  ITERATION_TOKENS_BUCKETS).labels(*lv)  # fmt: skip
        self.kv_transfer = None
        if config.engine.kv_transfer is not None:
            # vLLM names these after its NIXL connector; ours mean the same for any connector.
            self.kv_transfer = (
                h("vllm:nixl_xfer_time_seconds",
                  "Histogram of transfer duration for NIXL KV Cache transfers.",
                  XFER_TIME_BUCKETS).labels(*lv),
                h("vllm:nixl_bytes_transferred",
                  "Histogram of bytes transferred per NIXL KV Cache transfers.",
                  XFER_BYTES_BUCKETS).labels(*lv),
                counter("vllm:nixl_num_failed_transfers",
                        "Number of failed NIXL KV Cache transfers.").labels(*lv),
                counter("vllm:nixl_num_kv_expired_reqs",
                        "Number of requests that had their KV expire.").labels(*lv),
            )  # fmt: skip
        self.kv_residency = None
        if config.engine.cache.kv_cache_metrics:
            self.kv_residency = (
                h("vllm:kv_block_lifetime_seconds",
                  "KV cache block lifetime from allocation to eviction.",
                  KV_RESIDENCY_BUCKETS).labels(*lv),
                h("vllm:kv_block_idle_before_evict_seconds",
                  "Idle time before KV cache block eviction.", KV_RESIDENCY_BUCKETS).labels(*lv),
                h("vllm:kv_block_reuse_gap_seconds",
                  "Time gaps between consecutive KV cache block accesses.",
                  KV_RESIDENCY_BUCKETS).labels(*lv),
            )  # fmt: skip

    # ------------------------------------------------------------------ per step

    def record_step(self, plan: StepPlan, outputs: list[RequestTokens]) -> tuple[int, int]:
        """Count a step's tokens; returns (prompt tokens, generation tokens) it completed.

        Prompt tokens count when a request's first token comes out (vLLM's rule),
        so a prefill split over several steps or redone after a preemption counts once.
        A step is recorded after the next plan went out, so a request it admitted may have
        finished, and been recorded finished, already: it is not waited for.
        """
        prefilling, finished = self._prefilling, self._recently_finished
        for new in plan.new_requests:
            if len(new.token_ids) == new.num_prompt_tokens and new.req_id not in finished:
                prefilling.setdefault(new.req_id, (new.num_prompt_tokens, new.num_computed_tokens))
        num_generation = sum([len(out.new_token_ids) for out in outputs])
        num_prompt = num_cached = 0
        if prefilling:  # only steps that finish a prefill pay for this loop
            for out in outputs:
                if out.new_token_ids:
                    first = prefilling.pop(out.req_id, None)
                    if first is not None:
                        num_prompt += first[0]
                        num_cached += first[1]
        if num_generation:
            self.generation_tokens.inc(num_generation)
        if num_prompt:
            self.prompt_tokens.inc(num_prompt)
            self.prompt_tokens_cached.inc(num_cached)
        if plan.num_scheduled_tokens:
            self.iteration_tokens.observe(plan.total_num_scheduled_tokens)
        return num_prompt, num_generation

    def record_finished(self, requests: list[Request]) -> None:
        """Request-level series for requests that finished (any reason)."""
        for r in requests:
            self._prefilling.pop(r.req_id, None)
            self._recently_finished[r.req_id] = None
            if len(self._recently_finished) > _RECENTLY_FINISHED_KEPT:
                del self._recently_finished[next(iter(self._recently_finished))]
            reason = r.finish_reason or "abort"
            self.request_success[reason].inc()
            timeline = request_timeline(r, self.wall_minus_monotonic)
            if timeline is None:
                continue  # never produced a token: no latencies to report
            self.ttft.observe(timeline.ttft_s)
            self.e2e.observe(timeline.e2e_s)
            self.queue_time.observe(timeline.queue_s)
            self.prefill_time.observe(timeline.prefill_s)
            self.decode_time.observe(timeline.decode_s)
            self.inference_time.observe(timeline.inference_s)
            observe_many(self.itl, timeline.itl_s)
            tpot = timeline.time_per_output_token_s
            if tpot is not None:
                self.tpot.observe(tpot)
            self.request_prompt_tokens.observe(r.num_prompt_tokens)
            self.request_generation_tokens.observe(r.num_output_tokens)
            if r.sampling_params.max_tokens is not None:
                self.request_max_tokens.observe(r.sampling_params.max_tokens)
            self.request_n.observe(r.sampling_params.n)
            self.request_preemptions.observe(r.num_preemptions)
            self.request_prefill_kv_computed.observe(
                r.num_prompt_tokens - max(r.num_cached_tokens, 0)
            )

    def record_scheduler_stats(self, stats: SchedulerStats) -> None:
        """Gauges from a fresh snapshot; its cumulative counters as increments."""
        self.running.set(stats.num_running_reqs)
        self.waiting.set(stats.num_waiting_reqs)
        for reason, child in self.waiting_by_reason.items():
            child.set(stats.num_waiting_by_reason.get(reason, 0))
        self.kv_usage.set(stats.kv_cache_usage)
        prefix = stats.prefix_cache_stats
        last_queries, last_hits = self._last_prefix
        if prefix.queries > last_queries:
            self.prefix_cache_queries.inc(prefix.queries - last_queries)
        if prefix.hits > last_hits:
            self.prefix_cache_hits.inc(prefix.hits - last_hits)
        self._last_prefix = (prefix.queries, prefix.hits)
        if (external := stats.connector_prefix_cache_stats) is not None:
            last_queries, last_hits = self._last_external
            self.external_prefix_cache_queries.inc(external.queries - last_queries)
            self.external_prefix_cache_hits.inc(external.hits - last_hits)
            self._last_external = (external.queries, external.hits)
        if stats.num_preemptions > self._last_preemptions:
            self.num_preemptions.inc(stats.num_preemptions - self._last_preemptions)
            self._last_preemptions = stats.num_preemptions

    def record_kv_transfer(self, done: KVTransferDone) -> None:
        """One worker rank's report: each load it finished is one transfer."""
        if self.kv_transfer is None:
            return
        xfer_time, xfer_bytes, failed, expired = self.kv_transfer
        if done.finished_recving:
            per = len(done.finished_recving)
            for _ in range(per):
                xfer_time.observe(done.seconds / per)
                xfer_bytes.observe(done.num_bytes / per)
        if done.failed_recving:
            failed.inc(len(done.failed_recving))
        if done.num_expired:
            expired.inc(done.num_expired)

    def record_kv_residency(self, residency: KVCacheResidency | None) -> None:
        if residency is None or self.kv_residency is None:
            return
        lifetime, idle, reuse = self.kv_residency
        observe_many(lifetime, residency.block_lifetime_s)
        observe_many(idle, residency.idle_before_evict_s)
        observe_many(reuse, residency.reuse_gap_s)
