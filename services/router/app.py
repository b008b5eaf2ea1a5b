"""``actorserve router``: an OpenAI-compatible front for several replicas (ours or vLLM's).

Routes ``POST /v1/completions`` and ``/v1/chat/completions`` by ``--policy``
(``services/router/policies.py``), streams the replica's answer through unchanged, and
passes every other path (``/v1/models``, ``/tokenize``, ``/version``, ...) to the least busy
healthy replica. A request moves to another replica only before its first byte reached the
client: a refused connection, a 5xx answer or a connection lost before the first byte. After
that, a replica that dies ends a stream with an OpenAI error event and ``[DONE]``, never a hang.

Its own routes: ``/health`` (200 while a replica is healthy), ``/metrics`` (the router's,
``services/router/metrics.py``), and with ``--api-key`` the admin endpoint
``/admin/backends`` (``GET`` lists the replicas with what the router knows of them,
``POST {"url": ...}`` adds one, ``DELETE {"url": ...}`` removes one; ``Authorization:
Bearer KEY``). Clients' ``Authorization`` headers pass through to the replicas.
"""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import json
import logging
import os
import time
from collections import Counter
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

import httpx
from fastapi import FastAPI, Request, Response
from fastapi.responses import JSONResponse, StreamingResponse
from starlette.background import BackgroundTask

from services.api_server.http_io import error_response
from services.api_server.serving import error_body
from services.kv_cache.block_hash import BlockHasher
from services.registry import HASH_ALGORITHMS
from services.router.kv_events import (
    DecodedBatch,
    EventFollower,
    PreciseIndex,
    Publisher,
    Subscription,
)
from services.router.metrics import RouterMetrics
from services.router.policies import (
    POLICIES,
    BurstPolicy,
    CostPolicy,
    Decision,
    Policy,
    RouteRequest,
)
from services.router.prefix_index import ApproxPrefixIndex
from services.router.prompts import PromptTokenizer
from services.router.replicas import CacheGeometry, Replica, ReplicaSet, normalize_url

log = logging.getLogger("actorserve.router")

_HOP_HEADERS = {"host", "content-length", "connection", "keep-alive", "transfer-encoding",
                "te", "upgrade", "accept-encoding", "proxy-authorization", "trailer"}  # fmt: skip
_RESPONSE_DROP = {"content-length", "connection", "transfer-encoding", "content-encoding",
                  "keep-alive", "date", "server"}  # fmt: skip
_GENERATE_PATHS = {"/v1/completions": False, "/v1/chat/completions": True}


@dataclass
class RouterConfig:
    backends: list[str]
    policy: str = "cost"
    host: str = "127.0.0.1"
    port: int = 8080
    api_key: str | None = None
    tokenizer: str | None = None  # local tokenization; None: the replicas' /tokenize
    block_size: int | None = None  # None: the replicas' (vllm:cache_config_info)
    prefix_caching_hash_algo: str | None = None
    session_header: str = "x-session-id"
    burst_window_ms: float = 50.0
    health_check_interval: float = 2.0
    load_interval_ms: float = 100.0
    max_body_bytes: int = 64 << 20
    log_level: str = "warning"
    seed: int | None = None
    # Replicas that do not report their KV event sockets (vLLM's): URL -> where they publish.
    kv_events: dict[str, Publisher] = field(default_factory=dict)


def _sse_error(message: str) -> bytes:
    body = error_body(502, message, "BadGatewayError")
    return f"data: {json.dumps(body)}\n\ndata: [DONE]\n\n".encode()


class _Upstream(Exception):
    """The replica failed before the first byte: try another. ``response``: its answer,
    given to the client if no replica does better."""

    def __init__(self, message: str, response: Response | None = None) -> None:
        super().__init__(message)
        self.response = response


# Answers that say "not here, not now" (a replica starting, draining, overloaded or dead):
# another replica may serve the request. A 500 is the request's own failure: passed on,
# so that one bad request does not visit every replica.
_RETRIED_STATUS = {502, 503, 504}


@dataclass
class Router:
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
        )
        self.tokenizer = PromptTokenizer(c.tokenizer)

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
            log.error("replica %s kept out: %s", replica.url, why)
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
                log.error("replica %s kept out: %s", replica.url, why)
                self.refused[replica.url] = why
                replica.admitted = False
                self.replicas.mark_failed(replica, why)
                return
            publishers = [
                Publisher(
                    p["endpoint"],
                    p.get("replay_endpoint") or "",
                    p.get("topic") or "",
                    int(p.get("data_parallel_rank") or 0),
                )  # fmt: skip
                for p in info.get("publishers", [])
            ]
        if publishers and publishers != self._publishers.get(replica.url):
            self._publishers[replica.url] = publishers
            await self.follower.follow(replica.url, publishers)

    def _on_events(self, sub: Subscription, batch: DecodedBatch) -> None:
        self.metrics.event_lag.labels(sub.replica).set(sub.stats.last_lag_s)
        self.metrics.event_batches.labels(sub.replica).inc()

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
            tokens = await self.tokenizer.token_ids(chat, body, via)
            if tokens:
                salt = body.get("cache_salt")
                req.prompt_tokens = len(tokens)
                req.block_size = self.hasher.block_size
                req.hashes = self.hasher.hash_blocks(
                    tokens, salt if isinstance(salt, str) else None
                )
        return req

    def _sent(self, req: RouteRequest, d: Decision) -> int:
        """Book a request on its replica; returns its uncached prompt tokens."""
        r = d.replica
        uncached = max(req.prompt_tokens - d.cached_blocks * req.block_size, 0)
        r.in_flight += 1
        r.whole_open += not req.stream
        if req.stream:
            r.pending += 1
            r.pending_tokens += uncached
        else:
            r.unseen += 1
            r.unseen_tokens += uncached
        if req.hashes:
            self.index.record(r.url, req.hashes)
        url = r.url
        self.metrics.decisions.labels(self.policy.name, url).inc()
        if req.prompt_tokens:
            self.metrics.prompt_tokens.labels(url).inc(req.prompt_tokens)
            self.metrics.predicted_cached.labels(url).inc(d.cached_blocks * req.block_size)
        if d.predicted_ttft_s is not None:
            self.metrics.predicted_ttft.labels(url).observe(d.predicted_ttft_s)
        return uncached

    def _first_byte(
        self, req: RouteRequest, r: Replica, uncached: int, ttfb_s: float | None = None
    ) -> None:
        req.first_byte_seen = True
        if req.stream:
            r.pending -= 1
            r.pending_tokens -= uncached
        self.policy.first_byte(req, ttfb_s)

    async def _read_body(self, request: Request) -> bytes | Response:
        """The body, or 413 as soon as it is known to exceed ``max_body_bytes``."""
        limit = self.config.max_body_bytes
        length = request.headers.get("content-length", "")
        too_large = error_response(413, f"Request body is larger than the limit of {limit} bytes.",
                                   "RequestEntityTooLargeError")  # fmt: skip
        if length.isdigit() and int(length) > limit:
            return too_large
        body = bytearray()
        async for chunk in request.stream():
            body += chunk
            if len(body) > limit:
                return too_large
        return bytes(body)

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
        headers = _forward_headers(request)
        tried: set[str] = set()
        last_error: _Upstream | None = None
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
            uncached = self._sent(req, decision)
            req.first_byte_seen = False
            try:
                return await self._open(
                    request, path, raw, headers, req, replica, uncached, arrived
                )
            except _Upstream as e:
                self._undo(req, replica, uncached)
                last_error = e
                tried.add(replica.url)
                self.metrics.retries.labels(replica.url).inc()
                log.warning("request moved off %s before its first byte: %s", replica.url, e)
            except BaseException:  # cancelled (client gone) or a bug: book nothing
                self._undo(req, replica, uncached)
                raise

    def _undo(self, req: RouteRequest, replica: Replica, uncached: int) -> None:
        if not req.first_byte_seen:
            self._first_byte(req, replica, uncached)
        replica.in_flight -= 1
        replica.whole_open -= not req.stream
        if not req.stream:  # it never reached the replica's queue
            replica.unseen = max(replica.unseen - 1, 0)
            replica.unseen_tokens = max(replica.unseen_tokens - uncached, 0)
        self.policy.done(req)

    async def _open(self, request: Request, path: str, raw: bytes, headers: dict[str, str],
                    req: RouteRequest, replica: Replica, uncached: int, arrived: float) -> Response:  # fmt: skip
        """Send to ``replica`` and wait for its first byte; then commit to it."""
        sent = time.perf_counter()
        client = replica.client or self.client
        if client.is_closed:  # removed (and its pool closed) while this request waited
            raise _Upstream("the replica was removed")
        upstream = client.build_request("POST", replica.url + path, content=raw, headers=headers)
        try:
            resp = await self._until_down(client.send(upstream, stream=True), replica)
        except httpx.TransportError as e:
            self.replicas.mark_failed(replica, f"{type(e).__name__}: {e}")
            raise _Upstream(str(e) or type(e).__name__) from None
        chunks = resp.aiter_raw()
        # A replica that hangs with its connections open leaves the rotation when its health
        # check fails: then its requests give up on it (before the first byte: another
        # replica; after it: an error event), instead of waiting forever.
        watch = asyncio.create_task(self._close_when_down(replica, resp))
        try:
            if resp.status_code in _RETRIED_STATUS:  # the replica cannot serve now
                content = await resp.aread()
                keep = _reply_headers(resp)
                raise _Upstream(
                    f"HTTP {resp.status_code}: {content[:200].decode(errors='replace')}",
                    Response(content, status_code=resp.status_code, headers=keep),
                )
            try:
                first = await self._until_down(chunks.__anext__(), replica)
            except StopAsyncIteration:
                first = b""
        except (httpx.TransportError, httpx.StreamError) as e:
            watch.cancel()
            await resp.aclose()
            self.replicas.mark_failed(replica, f"{type(e).__name__}: {e}")
            raise _Upstream(str(e) or type(e).__name__) from None
        except BaseException:
            watch.cancel()
            await resp.aclose()
            raise
        now = time.perf_counter()
        self._first_byte(req, replica, uncached, now - sent)
        self.metrics.ttfb.labels(replica.url).observe(now - arrived)
        try:
            return self._commit(resp, chunks, first, req, replica, watch)
        except BaseException:
            watch.cancel()
            await resp.aclose()
            raise

    @staticmethod
    async def _until_down(awaitable: Any, replica: Replica) -> Any:
        """``awaitable``'s result, or a TransportError once the replica leaves rotation."""
        work = asyncio.ensure_future(awaitable)
        down = asyncio.ensure_future(replica.down.wait())
        try:
            await asyncio.wait({work, down}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            down.cancel()
        if not work.done():
            work.cancel()
            raise httpx.ReadError("the replica left the rotation (failed its health check)")
        return work.result()

    @staticmethod
    async def _close_when_down(replica: Replica, resp: httpx.Response) -> None:
        await replica.down.wait()
        await resp.aclose()

    def _commit(self, resp: httpx.Response, chunks: AsyncIterator[bytes], first: bytes,
                req: RouteRequest, replica: Replica, watch: asyncio.Task[None]) -> Response:  # fmt: skip
        """The response that streams the rest of the replica's answer to the client."""
        done = False

        async def finish() -> None:
            nonlocal done
            if not done:
                done = True
                watch.cancel()
                replica.in_flight -= 1
                replica.whole_open -= not req.stream
                self.policy.done(req)
                await resp.aclose()

        sse = resp.headers.get("content-type", "").startswith("text/event-stream")

        async def body() -> AsyncIterator[bytes]:
            last = first or b"\n\n"  # the last chunk sent (SSE chunks end with their events)
            try:
                if first:
                    yield first
                async for chunk in chunks:
                    last = chunk
                    yield chunk
                if replica.down.is_set() and sse and b"[DONE]" not in last:
                    raise httpx.ReadError("the replica left the rotation (failed its health check)")
            except (httpx.TransportError, httpx.StreamError) as e:
                self.metrics.errors.labels("stream_broken").inc()
                log.warning("replica %s broke a response: %s", replica.url, e)
                self.replicas.mark_failed(replica, f"{type(e).__name__}: {e}")
                if not sse:  # a whole answer cut short: cut the connection, never a clean end
                    raise
                event = _sse_error(f"the replica serving this request failed: {type(e).__name__}")
                yield event if last.endswith(b"\n\n") else b"\n\n" + event  # not inside its line
            finally:
                await finish()

        return StreamingResponse(
            body(),
            status_code=resp.status_code,
            headers=_reply_headers(resp),
            background=BackgroundTask(finish),
        )

    async def passthrough(self, request: Request, path: str) -> Response:
        """Any other route: the least busy healthy replica (another one if it cannot be
        reached), its answer streamed through as it comes."""
        raw = await self._read_body(request)
        if isinstance(raw, Response):
            return raw
        headers = _forward_headers(request)
        tried: set[str] = set()
        while True:
            candidates = [r for r in self.replicas.healthy() if r.url not in tried]
            if not candidates:
                return error_response(503, "no healthy replica to serve the request",
                                      "ServiceUnavailableError")  # fmt: skip
            replica = self.policy.least_busy(candidates)
            client = replica.client or self.client
            if client.is_closed:
                tried.add(replica.url)
                continue
            upstream = client.build_request(
                request.method, replica.url + path, content=raw, headers=headers,
                params=request.query_params,
            )  # fmt: skip
            replica.in_flight += 1  # (its pool stays open until this answer is through)
            try:
                resp = await client.send(upstream, stream=True)
            except httpx.TransportError as e:
                replica.in_flight -= 1
                self.replicas.mark_failed(replica, f"{type(e).__name__}: {e}")
                tried.add(replica.url)
                continue
            except BaseException:
                replica.in_flight -= 1
                raise

            return self._relay(resp, replica)

    @staticmethod
    def _relay(resp: httpx.Response, replica: Replica) -> Response:
        """A passed-through answer, streamed as it comes; the replica's request ends once."""
        done = False

        async def release() -> None:
            nonlocal done
            if not done:
                done = True
                replica.in_flight -= 1
                await resp.aclose()

        async def body() -> AsyncIterator[bytes]:
            try:
                async for chunk in resp.aiter_raw():
                    yield chunk
            finally:  # the client may have left: the background task would not run then
                await release()

        keep = _reply_headers(resp)
        return StreamingResponse(body(), status_code=resp.status_code, headers=keep,
                                 background=BackgroundTask(release))  # fmt: skip

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
            for sub in self.follower.subscriptions(r.url):
                for reason, n in sub.stats.resyncs.items():
                    self.metrics.resyncs.labels(r.url, reason).set(n)
            self.metrics.in_flight.labels(r.url).set(r.in_flight)
            self.metrics.healthy.labels(r.url).set(1 if r.healthy else 0)
            if r.prefill_s_per_token is not None:
                self.metrics.prefill_s_per_token.labels(r.url).set(r.prefill_s_per_token)


def parse_object(raw: bytes) -> dict[str, Any]:
    """A request body as a JSON object; {} when it is not one."""
    try:
        body = json.loads(raw)
    except ValueError:
        return {}
    return body if isinstance(body, dict) else {}


def _reply_headers(resp: httpx.Response) -> dict[str, str]:
    """A replica's response headers to pass on, byte for byte (latin-1 both ways, as HTTP
    carries them: a value httpx would decode as UTF-8 could not be encoded back)."""
    return {k.decode("latin-1"): v.decode("latin-1") for k, v in resp.headers.raw
            if k.decode("latin-1").lower() not in _RESPONSE_DROP}  # fmt: skip


def _forward_headers(request: Request) -> dict[str, str]:
    headers = {k: v for k, v in request.headers.items() if k.lower() not in _HOP_HEADERS}
    headers["accept-encoding"] = "identity"  # bytes pass through as they come: no encoding
    return headers


def build_app(config: RouterConfig) -> FastAPI:
    if config.policy not in POLICIES:
        raise ValueError(f"unknown policy {config.policy!r}")
    state: dict[str, Router] = {}

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        async with Router.new_client() as client:
            router = state["router"] = Router(config, client)
            try:
                for url in config.backends:
                    await router.add_replica(url)
                if router.refused:
                    # Started with replicas whose hashes differ: no index could serve them all.
                    why = "; ".join(f"{u}: {w}" for u, w in router.refused.items())
                    log.error("refusing to start: %s", why)
                    raise RuntimeError(why)
                yield
            finally:
                await router.replicas.close()
                await router.follower.close()

    app = FastAPI(lifespan=lifespan, docs_url=None, redoc_url=None, openapi_url=None)

    def admin_denied(request: Request) -> Response | None:
        if config.api_key is None:
            return error_response(403, "start the router with --api-key to use /admin",
                                  "PermissionDeniedError")  # fmt: skip
        given = request.headers.get("authorization", "").encode()
        if not hmac.compare_digest(given, f"Bearer {config.api_key}".encode()):
            return error_response(401, "Unauthorized", "AuthenticationError")
        return None

    async def admin_target(request: Request) -> str | Response:
        """The replica URL an admin request names, or the response refusing it."""
        if (denied := admin_denied(request)) is not None:
            return denied
        try:
            body = await request.json()
            url = normalize_url(str(body["url"]))
            parsed = httpx.URL(url)
            port_ok = parsed.port is None or 0 < parsed.port < 65536
            if parsed.scheme not in ("http", "https") or not parsed.host or not port_ok:
                raise ValueError(url)
            return url
        except (ValueError, KeyError, TypeError, httpx.InvalidURL):
            return error_response(
                400, 'the body must be {"url": "http://host:port"}', "BadRequestError"
            )

    @app.get("/health")
    async def health() -> Response:
        n = len(state["router"].replicas.healthy())
        if n == 0:
            return error_response(503, "no healthy replica", "ServiceUnavailableError")
        return JSONResponse({"status": "ok", "healthy_replicas": n})

    @app.get("/metrics")
    async def metrics() -> Response:
        router = state["router"]
        router.refresh_gauges()
        return Response(router.metrics.render(), media_type="text/plain; version=0.0.4")

    @app.get("/admin/backends")
    async def list_backends(request: Request) -> Response:
        return admin_denied(request) or JSONResponse({"backends": state["router"].describe()})

    @app.post("/admin/backends")
    async def add_backend(request: Request) -> Response:
        url = await admin_target(request)
        if isinstance(url, Response):
            return url
        router = state["router"]
        replica = await router.add_replica(url)
        if url in router.refused:
            await router.remove_replica(url)
            return error_response(
                400, f"{url} refused: {router.refused.pop(url)}", "BadRequestError"
            )
        return JSONResponse({"url": replica.url, "healthy": replica.healthy})

    @app.delete("/admin/backends")
    async def remove_backend(request: Request) -> Response:
        url = await admin_target(request)
        if isinstance(url, Response):
            return url
        if not await state["router"].remove_replica(url):
            return error_response(404, f"no backend {url}", "NotFoundError")
        return JSONResponse({"url": url, "removed": True})

    @app.post("/v1/completions")
    async def completions(request: Request) -> Response:
        return await state["router"].generate(request, "/v1/completions")

    @app.post("/v1/chat/completions")
    async def chat(request: Request) -> Response:
        return await state["router"].generate(request, "/v1/chat/completions")

    @app.api_route("/admin/{rest:path}", methods=["GET", "POST", "PUT", "DELETE", "PATCH"])
    async def admin_other(request: Request, rest: str) -> Response:
        """/admin is the router's own: never passed on to a replica."""
        if (denied := admin_denied(request)) is not None:
            return denied
        if rest == "backends":
            response = error_response(405, f"{request.method} is not allowed on "
                                      "/admin/backends", "MethodNotAllowedError")  # fmt: skip
            response.headers["allow"] = "GET, POST, DELETE"
            return response
        return error_response(404, f"no admin endpoint /admin/{rest}", "NotFoundError")

    @app.api_route("/{path:path}", methods=["GET", "POST", "PUT", "DELETE", "PATCH"])
    async def other(request: Request, path: str) -> Response:
        return await state["router"].passthrough(request, "/" + path)

    return app


def run_router(config: RouterConfig) -> int:
    import uvicorn

    level = os.environ.get("ACTORSERVE_LOGGING_LEVEL", "INFO").upper()  # as the server's
    logging.basicConfig(level=level, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    logging.getLogger("httpx").setLevel(logging.WARNING)
    app = build_app(config)
    uvicorn.run(app, host=config.host, port=config.port, loop="uvloop", log_level=config.log_level)
    return 0
