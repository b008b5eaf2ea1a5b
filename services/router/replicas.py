"""The replicas behind the router: health, load and cache geometry, as the router sees them.

A replica is an OpenAI-compatible server (ours or vLLM's) named by its base URL. The
router learns about it three ways:

- ``GET /health`` every ``--health-check-interval`` seconds, then ``/metrics``: a replica
  that fails it (or refuses a connection while forwarding) leaves the rotation; one that
  answers 200 again comes back.
- Its load every ``--load-interval-ms`` (the ``cost`` policy's, at most that old): ``GET
  /load`` where the replica has ours (requests waiting for their first output and running,
  as its front end counts them: a few bytes, where ``/metrics`` merges every process's
  series, which costs the replica milliseconds of CPU ten times a second), else ``GET
  /metrics`` (vLLM: ``vllm:num_requests_running``/``_waiting``). A replica with ``/load``
  whose last reading showed no request the router did not send, and no whole (non-streamed)
  answer of the router's open, is read once a second instead: the router's own counts of
  its requests are current without it (streams until their first byte, all in flight), and
  a reading that shows outside traffic brings the faster rate back.
- ``GET /metrics`` at most every ``METRICS_INTERVAL_S`` (every load reading without
  ``/load``): ``vllm:kv_cache_usage_perc``, the prefill time and computed-token sums that
  give its measured prefill time per token, the inter-token latency, and the prefix cache
  counters that show the hits it really had. ``vllm:cache_config_info`` gives its block
  size, hash algorithm and block count, read once.
- Its own bookkeeping: requests in flight here, and those not yet past their first byte
  with their uncached prompt tokens (the router's freshest view of the replica's queue).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import math
import re
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, TypeGuard

import httpx

from services.router.upstream import UpstreamPool

log = logging.getLogger(__name__)

# The /metrics samples the router reads, summed over label sets (engines of one replica).
_LOAD_SAMPLES = {
    "vllm:num_requests_running": "running",
    "vllm:num_requests_waiting": "waiting",
    "vllm:kv_cache_usage_perc": "kv_usage",
    "vllm:request_prefill_time_seconds_sum": "prefill_seconds",
    "vllm:request_prefill_kv_computed_tokens_sum": "prefill_tokens",
    "vllm:request_prefill_time_seconds_count": "prefill_count",
    "vllm:prefix_cache_hits_total": "cache_hits",
    "vllm:prefix_cache_queries_total": "cache_queries",
    "vllm:inter_token_latency_seconds_sum": "itl_seconds",
    "vllm:inter_token_latency_seconds_count": "itl_count",
}
METRICS_INTERVAL_S = 1.0  # /metrics at most this often where /load gives the load
LONG_PROMPT_TOKENS = 128  # computed prompt tokens per request for a per-token reading
_LABEL = re.compile(r'(\w+)="((?:[^"\\]|\\.)*)"')


def parse_load(text: str) -> dict[str, float]:
    """The load samples of a Prometheus text page. Each sample's lines are found with
    ``str.find`` (pages are tens of KiB, read every second or more often: a line scan or
    a regex over the page cost ~1 ms each)."""
    out: dict[str, float] = {}
    for name, key in _LOAD_SAMPLES.items():
        at = text.find(name)
        while at >= 0:
            end = at + len(name)
            if (at == 0 or text[at - 1] == "\n") and text[end : end + 1] in ("{", " "):
                eol = text.find("\n", end)
                line = text[at : eol if eol >= 0 else len(text)].rstrip()
                with contextlib.suppress(ValueError):
                    out[key] = out.get(key, 0.0) + float(line[line.rfind(" ") + 1 :])
            at = text.find(name, end)
    return out


def parse_cache_config(text: str) -> dict[str, str] | None:
    """The labels of ``vllm:cache_config_info`` (block_size, the hash algorithm, ...)."""
    for line in text.splitlines():
        if line.startswith("vllm:cache_config_info{"):
            return dict(_LABEL.findall(line[: line.rfind("}") + 1]))
    return None


@dataclass(frozen=True)
class CacheGeometry:
    """What a replica's block hashes depend on: two replicas must agree to share an index."""

    block_size: int
    hash_algo: str
    num_blocks: int = 0

    @classmethod
    def from_labels(cls, labels: dict[str, str]) -> CacheGeometry:
        def number(name: str, default: int) -> int:
            value = labels.get(name, "")
            return int(value) if value.isdigit() else default  # vLLM writes "None" too

        return cls(
            block_size=number("block_size", 16),
            hash_algo=labels.get("prefix_caching_hash_algo") or "sha256",
            num_blocks=number("num_gpu_blocks", 0),
        )

    def same_hashes(self, other: CacheGeometry) -> bool:
        return (self.block_size, self.hash_algo) == (other.block_size, other.hash_algo)


@dataclass(eq=False)  # one per server: compared (and hashed) by identity
class Replica:
    """One backend server and everything the router knows of it."""

    url: str
    # Its own connection pool for requests (httpx scans a pool's connections per request).
    client: httpx.AsyncClient | None = field(default=None, repr=False)
    # And the pool generate requests go through (``upstream.py``: their answers, relayed).
    upstream: UpstreamPool | None = field(default=None, repr=False)
    healthy: bool = False
    geometry: CacheGeometry | None = None
    # The router's own counts: requests open here, and those still before their first byte.
    in_flight: int = 0
    pending: int = 0  # streaming requests before their first byte
    pending_tokens: int = 0  # and their uncached prompt tokens
    whole_open: int = 0  # non-streaming requests open (their first byte is their last)
    unseen: int = 0  # non-streaming requests sent since the last load reading
    unseen_tokens: int = 0  # (after it, the replica's waiting count includes them)
    # The replica's reported load (``/metrics``) and when it was read (monotonic seconds).
    running: float = 0.0
    waiting: float = 0.0
    kv_usage: float = 0.0
    load_at: float = 0.0
    metrics_at: float = 0.0  # when /metrics was last read
    has_load: bool | None = None  # answers our GET /load (None: not asked yet)
    # Measured prefill seconds per computed token (None until it computed a prompt).
    prefill_s_per_token: float | None = None
    step_s: float | None = None  # measured mean inter-token latency: one step at its load
    _sums: dict[str, float] = field(default_factory=dict)
    failures: int = 0
    checked: bool = False  # its first health check ran (the log tells changes after it)
    admitted: bool = True  # False: its block hashes differ from the router's, kept out
    down: asyncio.Event = field(default_factory=asyncio.Event)  # set when it leaves rotation

    def set_down(self) -> None:
        """It left the rotation: its open requests give up on it (``down``, and its pool
        fails the exchanges under way)."""
        self.down.set()
        if self.upstream is not None:
            self.upstream.fail_active("the replica left the rotation (failed its health check)")

    def needs_fast_reading(self) -> bool:
        """Read every load interval: no ``/load`` (vLLM: its ``/metrics`` is its load), a
        whole answer of the router's open (its count is unknown once it started), or
        requests the router did not send."""
        return not self.has_load or self.whole_open > 0 or self.outside_traffic()

    def outside_traffic(self) -> bool:
        """Did the last reading show requests the router did not send (or not see start)?
        Only those need the reading: the router's own counts are current for its own."""
        return self.waiting > self.pending + self.unseen or (
            self.waiting + self.running > self.in_flight
        )

    def update_load(self, sample: dict[str, float], now: float) -> dict[str, float]:
        """Take a load reading (``/load`` or ``/metrics``: a key it lacks keeps its last
        value); returns the counters' increments since the last reading of them."""
        self.running = sample.get("running", self.running)
        self.waiting = sample.get("waiting", self.waiting)
        self.kv_usage = sample.get("kv_usage", self.kv_usage)
        self.load_at = now
        self.unseen = self.unseen_tokens = 0
        deltas: dict[str, float] = {}
        for key in ("prefill_seconds", "prefill_tokens", "prefill_count", "cache_hits", "cache_queries",
                    "itl_seconds", "itl_count"):  # fmt: skip
            if key in sample:
                before = self._sums.get(key)
                # A counter going back is a restarted replica: count from its new zero.
                deltas[key] = (
                    sample[key] - before if before is not None and sample[key] >= before else 0.0
                )
                self._sums[key] = sample[key]
        tokens, seconds = deltas.get("prefill_tokens", 0.0), deltas.get("prefill_seconds", 0.0)
        count = deltas.get("prefill_count", 0.0)
        # Only readings whose prompts were long on average: a short (cached) prompt's prefill
        # time is a step's, whatever its length, and would read as seconds per token.
        if tokens >= LONG_PROMPT_TOKENS * max(count, 1.0) and seconds > 0:
            measured = seconds / tokens
            prev = self.prefill_s_per_token
            # An exponential average over readings: one odd batch does not swing routing.
            self.prefill_s_per_token = measured if prev is None else 0.7 * prev + 0.3 * measured
        if deltas.get("itl_count", 0.0) >= 8:
            step = deltas["itl_seconds"] / deltas["itl_count"]
            self.step_s = step if self.step_s is None else 0.7 * self.step_s + 0.3 * step
        return deltas


class ReplicaSet:
    """The replicas, their health loop and their load loop.

    ``on_metrics(replica, deltas)`` is called after each ``/metrics`` reading (the router's
    metrics count measured cache hits from it); ``on_geometry(replica)`` when a replica's
    cache geometry is first read, and returns whether the replica may serve (a replica
    whose block hashes differ from the router's is kept out); ``on_change(replica)`` when
    it enters or leaves the rotation.

    The log tells each replica's arrival (healthy or not, and why), each change of its
    health after that, and its removal; ``role`` names the replicas in it ("backend",
    the PD proxy's "prefill" and "decode").
    """

    def __init__(
        self,
        client: httpx.AsyncClient,
        health_interval_s: float,
        load_interval_s: float | None,
        on_metrics: Callable[[Replica, dict[str, float]], None] | None = None,
        on_geometry: Callable[[Replica], bool] | None = None,
        on_change: Callable[[Replica], None] | None = None,
        new_client: Callable[[], httpx.AsyncClient] | None = None,
        role: str = "backend",
    ) -> None:
        self.client = client  # health and load readings
        self.role = role
        self._new_client = new_client  # each replica's pool for requests (else ``client``)
        self.health_interval_s = health_interval_s
        self.load_interval_s = load_interval_s
        self.replicas: dict[str, Replica] = {}
        self._on_metrics = on_metrics
        self._on_geometry = on_geometry
        self._on_change = on_change
        self._tasks: dict[str, list[asyncio.Task[None]]] = {}
        self._closing: set[asyncio.Task[None]] = set()
        self._retired: set[Replica] = set()  # removed, their pools not closed yet

    def healthy(self) -> list[Replica]:
        return [r for r in self.replicas.values() if r.healthy]

    async def add(self, url: str) -> Replica:
        """Start watching ``url`` (its first health check runs before this returns)."""
        url = normalize_url(url)
        if url in self.replicas:
            return self.replicas[url]
        pool = self._new_client() if self._new_client is not None else self.client
        replica = self.replicas[url] = Replica(url, pool, UpstreamPool(url))
        problem = await self.check_health(replica)
        replica.checked = True
        if problem is None:
            log.info("%s %s added: healthy", self.role, url)
        else:
            log.warning("%s %s added: unhealthy (%s)", self.role, url, problem)
        tasks = [asyncio.create_task(self._health_loop(replica))]
        if self.load_interval_s is not None:
            tasks.append(asyncio.create_task(self._load_loop(replica)))
        self._tasks[url] = tasks
        return replica

    async def remove(self, url: str) -> Replica | None:
        url = normalize_url(url)
        replica = self.replicas.pop(url, None)
        for task in self._tasks.pop(url, []):
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
        if replica is not None:
            log.info("%s %s removed", self.role, url)
        if replica is not None:
            # Its open requests finish on their connections; then the pool closes.
            self._retired.add(replica)
            task = asyncio.create_task(self._close_pool(replica))
            self._closing.add(task)
            task.add_done_callback(self._closing.discard)
        return replica

    async def _close_pool(self, replica: Replica) -> None:
        """Close a removed replica's pool once its requests are through; while they are not,
        keep checking its health: if it fails, they give up on it (``down``)."""
        try:
            while replica.in_flight:
                await asyncio.sleep(self.health_interval_s)
                if replica.in_flight and not await self._answers_health(replica):
                    replica.set_down()
        finally:
            self._retired.discard(replica)
            await self._close_pools(replica)

    async def _close_pools(self, replica: Replica) -> None:
        if replica.upstream is not None:
            await replica.upstream.aclose()
        if replica.client is not None and replica.client is not self.client:
            await replica.client.aclose()

    async def _answers_health(self, replica: Replica) -> bool:
        return await self._health_problem(replica) is None

    async def _get(self, replica: Replica, path: str) -> tuple[int, bytes]:
        """``GET path`` on the replica (5 s at most): its status and body. Through its own
        pool (``upstream.py``: a reading through httpx cost ~1 ms of CPU, and eight
        replicas are read several times a second), else (a removed replica's, closed) the
        shared client."""
        pool = replica.upstream
        if pool is not None and not pool.is_closed:
            return await pool.get(path, 5.0)
        r = await self.client.get(f"{replica.url}{path}", timeout=5.0)
        return r.status_code, r.content

    async def _health_problem(self, replica: Replica) -> str | None:
        """Why the replica fails ``GET /health``; None when it answers 200."""
        try:
            status, _ = await self._get(replica, "/health")
        except (httpx.HTTPError, OSError) as e:
            return _why(e)
        return None if status == 200 else f"GET /health answered {status}"

    async def close(self) -> None:
        for url in list(self.replicas):
            await self.remove(url)
        for task in list(self._closing):
            task.cancel()
        for replica in list(self._retired):  # (each task's own close may not have run)
            self._retired.discard(replica)
            await self._close_pools(replica)

    def mark_failed(self, replica: Replica, reason: str) -> None:
        """A forwarded request could not reach the replica: out until its health check passes."""
        replica.failures += 1
        if replica.healthy:
            log.warning("%s %s unhealthy: %s", self.role, replica.url, reason)
            self._set_health(replica, False)

    def _set_health(self, replica: Replica, ok: bool) -> None:
        changed = ok != replica.healthy
        replica.healthy = ok
        if not ok:
            replica.set_down()  # its open requests give up on it
            replica.has_load = None  # what comes back may be another server
        elif replica.down.is_set():
            replica.down = asyncio.Event()
        if changed and self._on_change is not None:
            self._on_change(replica)

    async def check_health(self, replica: Replica) -> str | None:
        """One health check: ``/health`` (then ``/metrics``, at most every
        ``METRICS_INTERVAL_S``); returns why the replica is out of rotation, None if in."""
        problem = await self._health_problem(replica)
        if problem is None:
            try:
                new = replica.geometry is None
                if new or time.monotonic() - replica.metrics_at >= METRICS_INTERVAL_S:
                    await self.read_metrics(replica)
                if replica.geometry is None:  # a server without vllm:cache_config_info
                    replica.geometry = CacheGeometry(16, "sha256")
                if new and self._on_geometry is not None:
                    replica.admitted = self._on_geometry(replica)
                if not replica.admitted:
                    problem = "kept out: its block hashes differ from the router's"
            except (httpx.HTTPError, OSError) as e:
                problem = f"GET /metrics: {_why(e)}"
        ok = problem is None
        if replica.checked and ok != replica.healthy:
            if ok:
                log.info("%s %s healthy", self.role, replica.url)
            else:
                log.warning("%s %s unhealthy: %s", self.role, replica.url, problem)
        self._set_health(replica, ok)
        return problem

    async def read_metrics(self, replica: Replica) -> None:
        status, content = await self._get(replica, "/metrics")
        if not 200 <= status < 300:
            raise httpx.HTTPError(f"answered {status}")
        text = content.decode("utf-8", errors="replace")
        if replica.geometry is None:
            labels = parse_cache_config(text)
            if labels is not None:
                replica.geometry = CacheGeometry.from_labels(labels)
        replica.metrics_at = now = time.monotonic()
        sample = parse_load(text)
        if replica.has_load:  # /load's waiting (no first token yet) is the one to keep:
            sample.pop("waiting", None)  # the scheduler's excludes requests in prefill
            sample.pop("running", None)
        deltas = replica.update_load(sample, now)
        if self._on_metrics is not None:
            self._on_metrics(replica, deltas)

    async def read_load(self, replica: Replica) -> None:
        """One load reading: ``/load`` where the replica has ours, else ``/metrics``; and
        ``/metrics`` anyway once ``METRICS_INTERVAL_S`` passed since it was last read."""
        if replica.has_load is None:
            replica.has_load = await self._load_sample(replica) is not None
        if not replica.has_load or time.monotonic() - replica.metrics_at >= METRICS_INTERVAL_S:
            await self.read_metrics(replica)
        elif (sample := await self._load_sample(replica)) is not None:
            replica.update_load(sample, time.monotonic())
        else:  # no longer ours (restarted as another server?): ask again next time
            replica.has_load = None
            await self.read_metrics(replica)

    async def _load_sample(self, replica: Replica) -> dict[str, float] | None:
        """``GET /load`` as ours answers it (vLLM's has only ``server_load``: None)."""
        status, content = await self._get(replica, "/load")
        try:
            body = json.loads(content) if status == 200 else None
        except ValueError:
            return None
        if not isinstance(body, dict):
            return None
        waiting, running = body.get("num_requests_waiting"), body.get("num_requests_running")
        if not (_count(waiting) and _count(running)):
            return None
        return {"waiting": float(waiting), "running": float(running)}

    async def _health_loop(self, replica: Replica) -> None:
        while True:
            await asyncio.sleep(self.health_interval_s)
            await self.check_health(replica)

    async def _load_loop(self, replica: Replica) -> None:
        assert self.load_interval_s is not None
        while True:
            fast = replica.needs_fast_reading()
            await asyncio.sleep(self.load_interval_s if fast else METRICS_INTERVAL_S)
            if replica.healthy:
                with contextlib.suppress(httpx.HTTPError, OSError):
                    await self.read_load(replica)


def _count(value: Any) -> TypeGuard[float]:
    """A request count as JSON can write one (not a bool, NaN, infinite or negative)."""
    return (
        isinstance(value, int | float)
        and not isinstance(value, bool)
        and math.isfinite(value)
        and value >= 0
    )


def _why(e: BaseException) -> str:
    """An HTTP failure in one line: its type, and its message where it has one."""
    message = str(e).strip().splitlines()
    return f"{type(e).__name__}: {message[0]}" if message else type(e).__name__


def check_url(url: str) -> str:
    """``url`` (normalized) if it names a server: http or https, a host, a port in range;
    else ValueError saying what is wrong, in one line."""
    try:
        parsed = httpx.URL(url)
        port = parsed.port
    except (httpx.InvalidURL, ValueError, TypeError) as e:
        raise ValueError(f"{url!r} is not a URL ({e})") from None
    if parsed.scheme not in ("http", "https"):
        raise ValueError(f"{url!r}: the scheme must be http or https")
    if not parsed.host:
        raise ValueError(f"{url!r} names no host")
    if port is not None and not 0 < port < 65536:
        raise ValueError(f"{url!r}: the port must be between 1 and 65535")
    return url


def backend_url(url: str) -> str:
    """A replica's URL as given on the command line, normalized (``normalize_url``); the
    scheme is required there (``host:port`` alone is refused: a typo would otherwise start
    a router that answers 503 forever). ValueError in one line."""
    text = url.strip()
    if "://" not in text:
        raise ValueError(f"{url!r} has no scheme: give it as http://{text}")
    return check_url(normalize_url(text))


def normalize_url(url: str) -> str:
    """``http://host:port`` for any of ``host:port``, ``http://host:port/``, ``…/v1``."""
    url = url.strip().rstrip("/").removesuffix("/v1")
    if "://" not in url:
        url = "http://" + url
    return url
