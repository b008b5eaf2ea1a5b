"""The router's state and decisions: its replicas and what it knows of them, the policy,
and the loop that sends a request to a replica (another one if it fails before its first
byte). Talking to a replica is ``forward.py``'s; the FastAPI routes are ``app.py``'s."""

from __future__ import annotations

import asyncio
import logging
import time
from collections import Counter
from dataclasses import dataclass, field
from typing import Any

import httpx
from fastapi import Request, Response

from services.http.body import read_body
from services.http.errors import APIError, error_response
from services.kv_cache.block_hash import BlockHasher
from services.registry import HASH_ALGORITHMS
from services.router.config import RouterConfig
from services.router.forward import (
    Forwarder,
    Upstream,
    forward_head,
    forward_headers,
    parse_object,
)
from services.router.kv_events import (
    DecodedBatch,
    EventFollower,
    PreciseIndex,
    Publisher,
    Subscription,
)
from services.router.load_guard import LoadGuard
from services.router.metrics import RouterMetrics
from services.router.policies import (
    POLICIES,
    BurstPolicy,
    CombinedIndex,
    CostPolicy,
    Decision,
    Policy,
    RouteRequest,
)
from services.router.prefix_index import ApproxPrefixIndex
from services.router.prompts import PromptTokenizer
from services.router.replicas import CacheGeometry, Replica, ReplicaSet

log = logging.getLogger(__name__)

_GENERATE_PATHS = {"/v1/completions": False, "/v1/chat/completions": True}


@dataclass
class Router:
    """An OpenAI-compatible front for several replicas: it knows them (health, load, cache
    geometry, KV events), asks its policy where each request goes, books the request's load
    there (``LoadGuard``) and hands it to the ``Forwarder``."""

    config: RouterConfig
    client: httpx.AsyncClient
    replicas: ReplicaSet = field(init=False)
    metrics: RouterMetrics = field(default_factory=RouterMetrics)
    index: ApproxPrefixIndex = field(default_factory=ApproxPrefixIndex)
    precise: PreciseIndex = field(default_factory=PreciseIndex)
    geometry: CacheGeometry | None = None
    hasher: BlockHasher | None = None

    def __post_init__(self) -> None:
        import random

        policy_cls = POLICIES[self.config.policy]
        view = policy_cls.index_for(self.precise, self.index)
        self.policy: Policy = policy_cls(view, random.Random(self.config.seed))
        if isinstance(self.policy, BurstPolicy):
            self.policy.window_s = self.config.burst_window_ms / 1000
        # The router's own record of what it sent where (``prefix_approx``), kept where the
        # policy's view reads it: for every replica, or (combined) those without KV events.
        self._record_all = view is self.index
        self._record_unfollowed = isinstance(view, CombinedIndex)
        self.follower = EventFollower(self.precise, on_batch=self._on_events)
        self.refused: dict[str, str] = {}  # replica -> why it is kept out
        self._publishers: dict[str, list[Publisher]] = {}
        self._tasks: set[asyncio.Task[None]] = set()
        c = self.config
        if c.block_size is not None:
            self._adopt(CacheGeometry(c.block_size, c.prefix_caching_hash_algo or "sha256"))
        wants_load = self.config.policy == "cost"
        self.replicas = ReplicaSet(
            self.client,
            c.health_check_interval,
            c.load_interval_ms / 1000 if wants_load else None,
            on_metrics=self._on_metrics,
            on_geometry=self._on_geometry,
            on_change=self._on_change,
            new_client=self.new_client,
            role=c.role,
        )
        self.tokenizer = PromptTokenizer(c.tokenizer)
        self.forward = Forwarder(self.replicas, self.metrics, self.client)

    @staticmethod
    def new_client() -> httpx.AsyncClient:
        """A connection pool (one for health and load readings, one per replica for requests:
        httpx looks through a pool's connections for each request it sends)."""
        limits = httpx.Limits(max_connections=None, max_keepalive_connections=256)
        return httpx.AsyncClient(limits=limits, timeout=httpx.Timeout(None, connect=5.0))

    def _adopt(self, geometry: CacheGeometry) -> None:
        self.geometry = geometry
        if geometry.hash_algo in HASH_ALGORITHMS:
            self.hasher = BlockHasher(geometry.block_size, geometry.hash_algo)
        else:  # vLLM's xxhash, say: the router cannot hash as the replicas do
            log.warning("the replicas hash blocks with %s, which the router does not know: "
                        "routing by load only", geometry.hash_algo)  # fmt: skip
            self.hasher = None

    def _on_geometry(self, replica: Replica) -> bool:
        g = replica.geometry
        assert g is not None
        if self.geometry is None:
            self._adopt(g)
        elif not self.geometry.same_hashes(g):
            why = (f"it hashes blocks of {g.block_size} tokens with {g.hash_algo}, the router "
                   f"{self.geometry.block_size} with {self.geometry.hash_algo}")  # fmt: skip
            log.error("%s %s kept out: %s", self.config.role, replica.url, why)
            self.refused[replica.url] = why
            return False
        self.index.set_capacity(replica.url, g.num_blocks)
        return True

    def _on_change(self, replica: Replica) -> None:
        self.metrics.healthy.labels(replica.url).set(1 if replica.healthy else 0)
        if not replica.healthy:  # a restarted replica comes back empty
            self.index.forget(replica.url)
        else:  # (back) in rotation: where does it publish its KV events now?
            task = asyncio.create_task(self.follow_events(replica))
            self._tasks.add(task)
            task.add_done_callback(self._tasks.discard)

    async def add_replica(self, url: str) -> Replica:
        """Watch a replica and, once it is healthy, follow its KV events."""
        replica = await self.replicas.add(url)
        if replica.healthy:
            await self.follow_events(replica)
        return replica

    async def remove_replica(self, url: str) -> bool:
        if await self.replicas.remove(url) is None:
            return False
        await self.follower.stop(url)
        self._publishers.pop(url, None)
        self.index.forget(url)
        self.metrics.remove_replica(url)
        return True

    async def follow_events(self, replica: Replica) -> None:
        """Subscribe to the replica's KV events: from ``--kv-events`` or its ``GET /kv_events``
        (our servers with ``--kv-events-endpoint``), checking that its hashes are ours."""
        publishers = (
            [self.config.kv_events[replica.url]] if replica.url in self.config.kv_events else []
        )
        if not publishers:
            try:
                r = await self.client.get(f"{replica.url}/kv_events", timeout=5.0)
                info = r.json() if r.status_code == 200 else None
            except (httpx.HTTPError, ValueError):
                info = None
            if not isinstance(info, dict):
                return
            g = self.geometry
            block_size, algo = info.get("block_size"), info.get("prefix_caching_hash_algo")
            if g is not None and (block_size, algo) != (g.block_size, g.hash_algo):
                why = (f"its KV events hash blocks of {block_size} tokens with {algo}, the "
                       f"router {g.block_size} with {g.hash_algo}")  # fmt: skip
                log.error("%s %s kept out: %s", self.config.role, replica.url, why)
                self.refused[replica.url] = why
                replica.admitted = False
                self.replicas.mark_failed(replica, why)
                return
            publishers = [
                Publisher(
                    reachable(p["endpoint"], replica.url),
                    reachable(p.get("replay_endpoint") or "", replica.url),
                    p.get("topic") or "",
                    int(p.get("data_parallel_rank") or 0),
                )  # fmt: skip
                for p in info.get("publishers", [])
            ]
        if publishers and publishers != self._publishers.get(replica.url):
            self._publishers[replica.url] = publishers
            await self.follower.follow(replica.url, publishers)

    def _on_events(self, sub: Subscription, batch: DecodedBatch) -> None:
        """After each batch (the lag gauge is set when /metrics is read)."""
        self.metrics.child(self.metrics.event_batches, sub.replica).inc()

    def event_stats(self, url: str) -> dict[str, Any]:
        subs = self.follower.subscriptions(url)
        resyncs: Counter[str] = Counter()
        for sub in subs:
            resyncs.update(sub.stats.resyncs)
        return {
            "publishers": len(subs),
            "batches": sum(s.stats.batches for s in subs),
            "replays": sum(s.stats.replays for s in subs),
            "resyncs": dict(resyncs),
        }

    def _on_metrics(self, replica: Replica, deltas: dict[str, float]) -> None:
        if deltas.get("cache_hits"):
            self.metrics.measured_cached.labels(replica.url).inc(deltas["cache_hits"])
        if deltas.get("cache_queries"):
            self.metrics.measured_queries.labels(replica.url).inc(deltas["cache_queries"])

    # ---- routing

    async def route_facts(self, chat: bool, body: dict[str, Any], headers: Any) -> RouteRequest:
        session = headers.get(self.config.session_header) or body.get("user")
        req = RouteRequest(session=str(session) if session is not None else None,
                           stream=bool(body.get("stream")))  # fmt: skip
        if self.policy.needs_prompt and self.hasher is not None:
            healthy = self.replicas.healthy()
            via = min(healthy, key=lambda r: r.in_flight) if healthy else None
            salt = body.get("cache_salt")
            n, hashes = await self.tokenizer.prompt_blocks(
                chat, body, via, self.hasher, salt if isinstance(salt, str) else None
            )
            if n:
                req.prompt_tokens = n
                req.block_size = self.hasher.block_size
                req.hashes = hashes
        return req

    def _book(self, req: RouteRequest, d: Decision) -> LoadGuard:
        """Book a request on the replica chosen for it: its load (the guard, released
        once whatever ends the request), the prefix it will hold, the decision's metrics."""
        r = d.replica
        uncached = max(req.prompt_tokens - d.cached_blocks * req.block_size, 0)
        load = LoadGuard(r, req, self.policy, uncached)
        if req.hashes and (self._record_all or (self._record_unfollowed
                                                and not self.precise.has(r.url))):  # fmt: skip
            self.index.record(r.url, req.hashes)
        m, url = self.metrics, r.url
        m.child(m.decisions, self.policy.name, url).inc()
        if req.prompt_tokens:
            m.child(m.prompt_tokens, url).inc(req.prompt_tokens)
            m.child(m.predicted_cached, url).inc(d.cached_blocks * req.block_size)
        if d.predicted_ttft_s is not None:
            m.child(m.predicted_ttft, url).observe(d.predicted_ttft_s)
        return load

    async def _read_body(self, request: Request) -> bytes | Response:
        """The body, or 413 as soon as it is known to exceed ``max_body_bytes``."""
        try:
            return await read_body(request, self.config.max_body_bytes)
        except APIError as e:
            return error_response(e.status, e.message, "RequestEntityTooLargeError")

    async def generate(self, request: Request, path: str) -> Response:
        arrived = time.perf_counter()
        raw = await self._read_body(request)
        if isinstance(raw, Response):
            return raw
        return await self.route(request, path, raw, parse_object(raw), arrived)

    async def route(
        self, request: Request, path: str, raw: bytes, body: dict[str, Any], arrived: float
    ) -> Response:
        """Send ``raw`` (``body`` parsed, {} if it is not a JSON object: the replica
        answers that with its own error) to the replica the policy picks; retry another
        when one fails before its first byte. ``request`` gives the headers and the
        client's connection."""
        req = await self.route_facts(_GENERATE_PATHS[path], body, request.headers)
        head = forward_head(request)
        tried: set[str] = set()
        last_error: Upstream | None = None
        while True:
            candidates = [r for r in self.replicas.healthy() if r.url not in tried]
            if not candidates:
                reason = "all_failed" if tried else "no_replica"
                self.metrics.errors.labels(reason).inc()
                if last_error is not None and last_error.response is not None:
                    return last_error.response  # the last replica's own answer
                message = ("every replica failed this request" if tried
                           else "no healthy replica to serve the request")  # fmt: skip
                return error_response(503, message, "ServiceUnavailableError")
            decision = self.policy.choose(req, candidates)
            replica = decision.replica
            waited = await self.policy.admit(req, decision)
            if waited:
                self.metrics.burst_wait.labels(replica.url).observe(waited)
            try:
                with self._book(req, decision) as load:
                    return await self.forward.generate(path, raw, head, load, arrived)
            except Upstream as e:  # anything else (cancelled, a bug) goes on up, released
                last_error = e
                tried.add(replica.url)
                self.metrics.retries.labels(replica.url).inc()
                log.warning("request moved off %s %s before its first byte: %s",
                            self.config.role, replica.url, e)  # fmt: skip

    async def passthrough(self, request: Request, path: str) -> Response:
        """Any other route: the least busy healthy replica (another one if it cannot be
        reached), its answer streamed through as it comes."""
        raw = await self._read_body(request)
        if isinstance(raw, Response):
            return raw
        headers = forward_headers(request)
        tried: set[str] = set()
        while True:
            candidates = [r for r in self.replicas.healthy() if r.url not in tried]
            if not candidates:
                return error_response(503, "no healthy replica to serve the request",
                                      "ServiceUnavailableError")  # fmt: skip
            replica = self.policy.least_busy(candidates)
            try:  # (its pool stays open until this answer is through)
                with LoadGuard(replica) as load:
                    return await self.forward.passthrough(request, path, raw, headers, load)
            except Upstream:
                tried.add(replica.url)

    def describe(self) -> list[dict[str, Any]]:
        out = []
        for r in self.replicas.replicas.values():
            g = r.geometry
            out.append({
                "url": r.url, "healthy": r.healthy, "in_flight": r.in_flight,
                "running": r.running, "waiting": r.waiting, "kv_cache_usage": r.kv_usage,
                "prefill_seconds_per_token": r.prefill_s_per_token,
                "step_seconds": r.step_s,
                "ttft_model": self._ttft_model(r),
                "index_blocks": self.index.size(r.url),
                "precise_index_blocks": self.precise.size(r.url),
                "kv_events": self.event_stats(r.url),
                "refused": self.refused.get(r.url),
                "block_size": g.block_size if g else None,
                "hash_algo": g.hash_algo if g else None, "num_blocks": g.num_blocks if g else None,
            })  # fmt: skip
        return out

    def _ttft_model(self, r: Replica) -> dict[str, float] | None:
        if not isinstance(self.policy, CostPolicy):
            return None
        c, a, b = self.policy.coefficients(r, self.replicas.healthy() or [r])
        model = self.policy.models.get(r.url)
        return {"seconds_fixed": c, "seconds_per_request_ahead": a, "seconds_per_token": b,
                "samples": model.samples if model else 0}  # fmt: skip

    def refresh_gauges(self) -> None:
        if isinstance(self.policy, CostPolicy):
            self.metrics.hot_copies.set(self.policy.copies)
        for r in self.replicas.replicas.values():
            followed = self.precise.has(r.url)
            size = self.precise.size(r.url) if followed else self.index.size(r.url)
            self.metrics.index_blocks.labels(r.url).set(size)
            subs = self.follower.subscriptions(r.url)
            for sub in subs:
                for reason, n in sub.stats.resyncs.items():
                    self.metrics.resyncs.labels(r.url, reason).set(n)
            if subs:
                lag = max(sub.stats.last_lag_s for sub in subs)
                self.metrics.event_lag.labels(r.url).set(lag)
            self.metrics.in_flight.labels(r.url).set(r.in_flight)
            self.metrics.healthy.labels(r.url).set(1 if r.healthy else 0)
            if r.prefill_s_per_token is not None:
                self.metrics.prefill_s_per_token.labels(r.url).set(r.prefill_s_per_token)


def reachable(endpoint: str, replica_url: str) -> str:
    """A KV event endpoint as the replica reports it, made one the router can connect to: a
    replica bound to every interface (``tcp://*:5556``, ``0.0.0.0``, ``::``; a pod's, as
    llm-d starts vLLM) is reached at its own URL's host."""
    scheme, sep, rest = endpoint.partition("://")
    host, colon, port = rest.rpartition(":")
    if scheme != "tcp" or not sep or not colon or host not in ("*", "0.0.0.0", "[::]", "::"):
        return endpoint
    host = httpx.URL(replica_url).host
    return f"tcp://[{host}]:{port}" if ":" in host else f"tcp://{host}:{port}"
