"""Routing policies: which healthy replica gets a request.

Registered by name (``--policy``); each sees the request's routing facts (its session key,
its prompt's block hashes and token count) and the healthy replicas, and returns a
``Decision``. Policies that score by cache (``needs_prompt``) make the router tokenize and
hash the prompt first.

- ``random``, ``round_robin``: the baselines.
- ``session``: a session key (the ``--session-header`` header, else the body's ``user``)
  sticks to one replica by rendezvous hashing, so a replica leaving moves only its own
  sessions; requests without a key go to the replica with the fewest in flight.
- ``prefix_approx``: the replica believed to hold the longest leading run of the prompt's
  blocks (``ApproxPrefixIndex``); ties (a prefix nobody holds) go to the fewest in flight.
  Pure affinity: it ignores load, which is what ``cost`` adds.
- ``prefix_precise``: the same rule over the blocks the replicas report holding
  (``PreciseIndex``, from their KV events).
- ``burst``: prefix affinity, and requests that share a prefix nobody holds yet, arriving
  within ``--burst-window-ms``, go to one replica and wait for the first one's prefill.
- ``cost`` (the default): the least estimated time to first token (TTFT). For replica r
  and a request whose prompt has ``u(r)`` tokens r does not hold:

      ttft(r) = c(r) + a(r) * n(r) + b(r) * (t(r) + u(r))

  ``n(r)``: requests ahead of it there that have not produced their first token (the
  router's streaming requests not yet past their first byte, those it sent since the last
  load reading, and the replica's reported waiting requests beyond those); ``t(r)``: the
  prompt tokens they still have to compute (theirs as the router estimated them; the mean
  uncached size of the router's requests for the others). ``c(r)``: the time to first byte
  of a request that waits for nobody and computes nothing (its step, the hops, the
  replica's tokenizer); ``a(r)``: what each request ahead adds beyond its tokens (when it
  needs a step or a batch slot of its own); ``b(r)``: seconds per computed prompt token.
  (A first version had ``a * (1 + n)``: one constant for both, so the fixed latency, tens
  of milliseconds of hops and host time, was charged again for every request ahead, and
  a short queue of cached requests looked dearer than recomputing a 6k-token prompt
  elsewhere: 80 % prefix hits where pure affinity had 95 % in ``bench/routing.py scale``.)

  ``c``, ``a`` and ``b`` are measured per replica: recursive least squares over the
  router's own streaming requests (features ``1``, ``n`` and ``t + u`` when sent, the time
  to first byte when it came; forgetting factor ``FORGET`` = 0.95, so about the last 20
  requests count), kept >= 0, started at the prior (so that ``b`` stays there while
  every prompt is cached and says nothing about it). Until a replica has ``MIN_SAMPLES``
  of them the prior is used: ``c`` = ``a`` = its mean inter-token latency (one step, from
  ``vllm:inter_token_latency_seconds``: a request ahead costing a step is the pessimistic
  start), ``b`` = its prefill seconds per computed token
  (``vllm:request_prefill_time_seconds_sum`` over ``_kv_computed_tokens_sum``, from readings
  whose prompts averaged >= 128 computed tokens: a cached prompt's prefill is a step's
  time, whatever its length); where a replica has not measured one yet, the fleet's mean
  (of fitted models first: replicas of one fleet are alike), else ``DEFAULT_A_S`` and
  ``DEFAULT_B_S``. Non-streaming requests are routed the same way but teach the model
  nothing (their first byte is their last).
  ``cached(r)``: leading blocks the replica holds (its KV events where it publishes them,
  the router's own record elsewhere). Costs (below) within 1 ms of the best go to the
  fewest in flight.

  The replica chosen is the one with the least ``ttft(r) + MISS_WORK * b(r) * u(r)``: the
  request's own wait, and what its uncached tokens cost the others. Computing them keeps
  the replica busy for ``b * u``, which every request arriving behind it there waits too;
  and once its cache is full (a fleet's steady state) storing them evicts as many tokens
  of another prefix, which its next request recomputes: ``MISS_WORK`` = 2. Without the
  term a miss that costs this request no more than the holder's queue looked free: with
  150 tenants on eight simulated H200s the TTFT alone scattered 20 % of the requests off
  the replicas holding their context and lost 15 % of the throughput at 100 req/s to
  recomputation; with the first term alone 8 % still missed, and the copies they made
  evicted other tenants (``bench/routing.py scale``, bench/RESULTS.md). A miss counts
  three times its compute time, so affinity wins until the holder's queue is worth that.
  And a miss is priced at no less than the fleet's median ``b``: a replica's ``b`` fitted
  low (it is told apart from ``a`` only as far as queues mix short and long prompts; on
  that workload one of eight alike replicas fitted 2.5e-5 s a token against 1.8e-4 for
  the others) would otherwise draw misses it computes no faster. Underestimating a miss
  scatters prefixes and evicts; overestimating one costs a little balance.

  One formula weighs affinity against load. On top, a hot prefix is copied deliberately:
  when the cheapest replica holds the prompt's prefix and its queueing part ``a * n``
  already exceeds what sending the request to the best replica without it would cost
  extra (the difference of the two replicas' costs), the request goes there: it pays once for the copy
  that every later request sharing the prefix then splits over two replicas. It is the
  ski-rental rule (rent until the rent paid equals the price, then buy), which never pays
  more than twice the best choice in hindsight; the constant is 1 for that reason.

It stays whole because the policies are one family, compared with each other in every
routing experiment: they share the request and decision types, build on each other
(``burst`` and ``prefix_precise`` on ``prefix_approx``), and ``POLICIES`` lists them all.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import itertools
import logging
import math
import random
import time
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any, ClassVar, Protocol

from services.protocol import BlockHash
from services.router.kv_events import PreciseIndex
from services.router.prefix_index import ApproxPrefixIndex
from services.router.replicas import Replica

log = logging.getLogger(__name__)

DEFAULT_A_S = 0.01  # seconds per request ahead, before any replica was measured
DEFAULT_B_S = 1e-3  # seconds per prompt token to compute (a CPU's order)
FORGET = 0.95
MISS_WORK = 2.0  # a miss's cost to the others, in its compute times (see above)
MIN_SAMPLES = 4
_TIE_S = 1e-3


@dataclass
class RouteRequest:
    """What a policy may know of a request."""

    session: str | None = None
    hashes: list[BlockHash] = field(default_factory=list)  # its prompt's full blocks
    prompt_tokens: int = 0
    block_size: int = 16
    stream: bool = True
    follows: Any = None  # burst: the leader whose prefill this request waits for
    leads: Any = None  # burst: this request computes a new prefix others may wait for
    features: tuple[str, float, float] | None = None  # cost: (replica, n, t + u) when sent
    first_byte_seen: bool = False  # the current attempt's

    @property
    def lookup(self) -> list[BlockHash]:
        """The blocks a replica can serve from cache: the engine computes at least the last
        prompt token, so a prompt's last token never comes from a hit."""
        return self.hashes[: max(self.prompt_tokens - 1, 0) // self.block_size]


@dataclass
class Decision:
    replica: Replica
    cached_blocks: int = 0  # predicted
    predicted_ttft_s: float | None = None


class CacheIndex(Protocol):
    def matched_blocks(
        self, hashes: Sequence[BlockHash], replicas: Iterable[str]
    ) -> dict[str, int]: ...


class CombinedIndex:
    """The replicas' KV events where they publish them, the router's own record elsewhere."""

    def __init__(self, precise: PreciseIndex, approx: ApproxPrefixIndex) -> None:
        self.precise, self.approx = precise, approx

    def matched_blocks(
        self, hashes: Sequence[BlockHash], replicas: Iterable[str]
    ) -> dict[str, int]:
        urls = list(replicas)
        followed = [u for u in urls if self.precise.has(u)]
        out = self.approx.matched_blocks(hashes, [u for u in urls if u not in followed])
        out.update(self.precise.matched_blocks(hashes, followed))
        return out


class Policy:
    """Chooses among healthy replicas (never an empty list).

    The router calls ``choose``, then awaits ``admit`` (a policy may hold the request back:
    ``burst``) and sends it; ``first_byte`` when the replica's first byte arrived and
    ``done`` when the request ended (either way)."""

    name: ClassVar[str]
    needs_prompt: ClassVar[bool] = False

    def __init__(self, index: CacheIndex, rng: random.Random | None = None) -> None:
        self.index = index
        self.rng = rng or random.Random()

    @classmethod
    def index_for(cls, precise: PreciseIndex, approx: ApproxPrefixIndex) -> CacheIndex:
        """The cache view this policy scores with."""
        return CombinedIndex(precise, approx)

    def choose(self, req: RouteRequest, replicas: Sequence[Replica]) -> Decision:
        raise NotImplementedError

    async def admit(self, req: RouteRequest, decision: Decision) -> float:
        """Wait until the request may go; returns the seconds waited."""
        return 0.0

    def first_byte(self, req: RouteRequest, ttfb_s: float | None = None) -> None:
        """The replica's first byte came ``ttfb_s`` after the request was sent (None: failed)."""

    def done(self, req: RouteRequest) -> None:
        pass

    def least_busy(self, replicas: Sequence[Replica]) -> Replica:
        fewest = min(r.in_flight for r in replicas)
        return self.rng.choice([r for r in replicas if r.in_flight == fewest])


class RandomPolicy(Policy):
    name = "random"

    def choose(self, req: RouteRequest, replicas: Sequence[Replica]) -> Decision:
        return Decision(self.rng.choice(list(replicas)))


class RoundRobinPolicy(Policy):
    name = "round_robin"

    def __init__(self, index: CacheIndex, rng: random.Random | None = None) -> None:
        super().__init__(index, rng)
        self._counter = itertools.count()

    def choose(self, req: RouteRequest, replicas: Sequence[Replica]) -> Decision:
        ordered = sorted(replicas, key=lambda r: r.url)
        return Decision(ordered[next(self._counter) % len(ordered)])


def _rendezvous(key: str, url: str) -> bytes:
    return hashlib.blake2b(f"{key}\0{url}".encode(), digest_size=8).digest()


class SessionPolicy(Policy):
    name = "session"

    def choose(self, req: RouteRequest, replicas: Sequence[Replica]) -> Decision:
        if req.session is None:
            return Decision(self.least_busy(replicas))
        key = req.session
        return Decision(max(replicas, key=lambda r: _rendezvous(key, r.url)))


class PrefixApproxPolicy(Policy):
    name = "prefix_approx"
    needs_prompt = True

    @classmethod
    def index_for(cls, precise: PreciseIndex, approx: ApproxPrefixIndex) -> CacheIndex:
        return approx

    def choose(self, req: RouteRequest, replicas: Sequence[Replica]) -> Decision:
        matched = self.index.matched_blocks(req.lookup, (r.url for r in replicas))
        best = max(matched.values())
        holders = [r for r in replicas if matched[r.url] == best]
        return Decision(self.least_busy(holders), cached_blocks=best)


class PrefixPrecisePolicy(PrefixApproxPolicy):
    """``prefix_approx``'s rule over the blocks the replicas report holding (KV events);
    a replica that publishes none scores 0."""

    name = "prefix_precise"

    @classmethod
    def index_for(cls, precise: PreciseIndex, approx: ApproxPrefixIndex) -> CacheIndex:
        return precise


@dataclass
class _Leader:
    replica: Replica
    hashes: list[BlockHash]
    deadline: float  # monotonic: followers join until then
    computed: asyncio.Event = field(default_factory=asyncio.Event)  # its first byte came


class BurstPolicy(PrefixApproxPolicy):
    """Prefix affinity (``cost``'s view of the caches), plus: a request whose prefix nobody
    holds leads a burst; requests sharing at least one block of it that arrive within
    ``--burst-window-ms`` go to the leader's replica and wait there for the leader's first
    byte, when its prompt is cached, so that one replica computes the prefix once instead
    of several computing it side by side. The wait is part of their TTFT
    (``router:burst_wait_seconds``); it never exceeds ``MAX_WAIT_S``."""

    name = "burst"
    MAX_WAIT_S = 30.0

    def __init__(self, index: CacheIndex, rng: random.Random | None = None) -> None:
        super().__init__(index, rng)
        self.window_s = 0.05
        self._leaders: dict[BlockHash, _Leader] = {}

    @classmethod
    def index_for(cls, precise: PreciseIndex, approx: ApproxPrefixIndex) -> CacheIndex:
        return CombinedIndex(precise, approx)

    def _leader_for(self, req: RouteRequest, now: float) -> tuple[_Leader | None, int]:
        found, shared = None, 0
        for i, h in enumerate(req.lookup):
            leader = self._leaders.get(h)
            if leader is None:
                break
            if leader.deadline >= now:
                found, shared = leader, i + 1
        return found, shared

    def _expire(self, now: float) -> None:
        for h in [h for h, ld in self._leaders.items() if ld.deadline < now]:
            del self._leaders[h]

    def choose(self, req: RouteRequest, replicas: Sequence[Replica]) -> Decision:
        now = time.monotonic()
        self._expire(now)
        leader, shared = self._leader_for(req, now)
        if leader is not None and leader.replica in replicas:
            req.follows = leader
            return Decision(leader.replica, cached_blocks=shared)
        decision = super().choose(req, replicas)
        if decision.cached_blocks == 0 and req.lookup and req.stream:
            # (a streaming leader: a whole answer's first byte is its last)
            req.leads = _Leader(decision.replica, req.lookup, now + self.window_s)
            for h in req.lookup:
                self._leaders.setdefault(h, req.leads)
        return decision

    async def admit(self, req: RouteRequest, decision: Decision) -> float:
        leader = req.follows
        if leader is None or leader.computed.is_set():
            return 0.0
        start = time.monotonic()
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(leader.computed.wait(), self.MAX_WAIT_S)
        return time.monotonic() - start

    def first_byte(self, req: RouteRequest, ttfb_s: float | None = None) -> None:
        if req.leads is not None:
            req.leads.computed.set()

    def done(self, req: RouteRequest) -> None:
        self.first_byte(req)  # a failed leader releases its followers


class LatencyModel:
    """``ttft = c + a * n + b * x`` fitted by recursive least squares with forgetting,
    started at the prior ``(c0, a0, b0)``: a coefficient the requests do not inform (``b``
    when every prompt is cached) stays near its prior instead of absorbing the others'
    noise."""

    def __init__(self, c0: float, a0: float, b0: float) -> None:
        self.theta0 = (c0, a0, b0)
        self.theta = list(self.theta0)
        # Prior standard deviations of 30x the prior (at least 3 s for ``c`` and ``a``,
        # which every request informs): the data decide within a few dozen requests, and a
        # coefficient they leave unexcited (``b`` while every prompt is cached) stays near
        # where it started.
        floors = (0.1, 0.1, 1e-6)
        self.p0 = [(30 * max(v, f)) ** 2 for v, f in zip(self.theta0, floors, strict=True)]
        self.p = self._start_p()
        self.samples = 0

    def _start_p(self) -> list[list[float]]:
        return [[self.p0[i] if i == j else 0.0 for j in range(3)] for i in range(3)]

    def update(self, n: float, x: float, y: float) -> None:
        f = (1.0, n, x)
        p = self.p
        pf = [sum(p[i][j] * f[j] for j in range(3)) for i in range(3)]  # P f (P symmetric)
        denom = FORGET + sum(f[i] * pf[i] for i in range(3))
        err = y - sum(t * v for t, v in zip(self.theta, f, strict=True))
        theta = [t + pf[i] / denom * err for i, t in enumerate(self.theta)]
        # P <- (P - P f f^T P / denom) / FORGET, written so that P[i][j] and P[j][i] are
        # the same float (k[i] * pf[j] and k[j] * pf[i] round differently; the difference
        # would grow by 1/FORGET a request until P is no longer a covariance).
        p = [[(p[i][j] - pf[i] * pf[j] / denom) / FORGET for j in range(3)] for i in range(3)]
        # Bounded forgetting, per direction: a variance the requests do not shrink (``a``
        # while nobody is ever ahead) would otherwise grow by 1/FORGET per request until
        # the numbers overflow. P <- D P D keeps it a covariance.
        if all(math.isfinite(v) and v > 0 for v in (p[0][0], p[1][1], p[2][2])):
            d = [min(1.0, math.sqrt(self.p0[i] / p[i][i])) for i in range(3)]
            p = [[p[i][j] * d[i] * d[j] for j in range(3)] for i in range(3)]
        else:
            p = self._start_p()
        # Kept >= 0 (a negative cost means nothing; a direction the requests do not tell
        # apart, c against b for one prompt length, would drift into a negative coefficient),
        # projected in P's metric so that the others take up what it cannot.
        for _ in range(3):
            if all(t >= 0 for t in theta):
                break
            for i in range(3):
                if theta[i] < 0:
                    theta = [t - p[j][i] * theta[i] / p[i][i] for j, t in enumerate(theta)]
                    theta[i] = 0.0
        theta = [max(t, 0.0) for t in theta]
        if not all(math.isfinite(v) for v in (*theta, *p[0], *p[1], *p[2])):
            theta, p = list(self.theta0), self._start_p()
        self.theta, self.p = theta, p
        self.samples += 1

    @property
    def cab(self) -> tuple[float, float, float]:
        c, a, b = self.theta
        return c, a, b


class CostPolicy(Policy):
    name = "cost"
    needs_prompt = True

    def __init__(self, index: CacheIndex, rng: random.Random | None = None) -> None:
        super().__init__(index, rng)
        self.mean_uncached = 0.0  # running mean of the uncached tokens of routed requests
        self._routed = 0
        self.models: dict[str, LatencyModel] = {}
        self.copies = 0

    def coefficients(self, r: Replica, replicas: Sequence[Replica]) -> tuple[float, float, float]:
        """``(c, a, b)`` for ``r``: fitted, else its prior."""
        model = self.models.get(r.url)
        if model is not None and model.samples >= MIN_SAMPLES:
            return model.cab
        return self.prior(r, replicas)

    def prior(self, r: Replica, replicas: Sequence[Replica]) -> tuple[float, float, float]:
        """Its own measurements (``step_s`` for ``c`` and ``a``, ``prefill_s_per_token``),
        else the fleet's mean (fitted models first: replicas of one fleet are alike), else
        the defaults."""
        fitted = [m.cab for m in self.models.values() if m.samples >= MIN_SAMPLES]
        steps = [x.step_s for x in replicas if x.step_s is not None]
        per_token = [x.prefill_s_per_token for x in replicas if x.prefill_s_per_token is not None]

        def mean(values: Sequence[float], default: float) -> float:
            return sum(values) / len(values) if values else default

        if r.step_s is not None:
            c = a = r.step_s
        else:
            c = mean([m[0] for m in fitted] or steps, DEFAULT_A_S)
            a = mean([m[1] for m in fitted] or steps, DEFAULT_A_S)
        b = (r.prefill_s_per_token if r.prefill_s_per_token is not None
             else mean([m[2] for m in fitted] or per_token, DEFAULT_B_S))  # fmt: skip
        return c, a, b

    def ahead(self, r: Replica) -> tuple[float, float]:
        """Requests ahead without a first token, and the prompt tokens they still compute."""
        ours = r.pending + r.unseen
        others = max(0.0, r.waiting - ours)
        return ours + others, r.pending_tokens + r.unseen_tokens + others * self.mean_uncached

    def features(self, req: RouteRequest, r: Replica, cached: int) -> tuple[float, float]:
        """``(n, t + u)``."""
        n, t = self.ahead(r)
        return n, t + max(req.prompt_tokens - cached * req.block_size, 1)

    def estimate(
        self, req: RouteRequest, r: Replica, cached: int, replicas: Sequence[Replica]
    ) -> float:
        c, a, b = self.coefficients(r, replicas)
        n, x = self.features(req, r, cached)
        return c + a * n + b * x

    def median_b(self, replicas: Sequence[Replica]) -> float:
        fleet = sorted(self.coefficients(x, replicas)[2] for x in replicas)
        return fleet[len(fleet) // 2]

    def cost(self, req: RouteRequest, r: Replica, cached: int, replicas: Sequence[Replica],
             median_b: float | None = None) -> float:  # fmt: skip
        """The TTFT there, and what its uncached tokens cost the others (see above); those
        tokens at no less than the fleet's median seconds per token (see above)."""
        c, a, b = self.coefficients(r, replicas)
        b_miss = max(b, self.median_b(replicas) if median_b is None else median_b)
        n, t = self.ahead(r)
        uncached = max(req.prompt_tokens - cached * req.block_size, 1)
        return c + a * n + b * t + (1 + MISS_WORK) * b_miss * uncached

    def choose(self, req: RouteRequest, replicas: Sequence[Replica]) -> Decision:
        matched = self.index.matched_blocks(req.lookup, (r.url for r in replicas))
        floor = self.median_b(replicas)  # once per decision, not per replica
        costs = {r.url: self.cost(req, r, matched[r.url], replicas, floor) for r in replicas}
        costs = {u: c if math.isfinite(c) else math.inf for u, c in costs.items()}
        best = min(costs.values())
        ties = [r for r in replicas if costs[r.url] <= best + _TIE_S]
        chosen = self.least_busy(ties or list(replicas))
        if matched[chosen.url]:
            chosen = self._copy_if_hot(chosen, matched, costs, replicas)
        uncached = max(req.prompt_tokens - matched[chosen.url] * req.block_size, 0)
        self._routed += 1
        self.mean_uncached += (uncached - self.mean_uncached) / min(self._routed, 100)
        req.features = (chosen.url, *self.features(req, chosen, matched[chosen.url]))
        if chosen.url not in self.models:  # learning starts from what is known of it now
            self.models[chosen.url] = LatencyModel(*self.prior(chosen, replicas))
        ttft = self.estimate(req, chosen, matched[chosen.url], replicas)
        if log.isEnabledFor(logging.DEBUG) and matched[chosen.url] < max(matched.values()):
            log.debug("cost: a miss on %s (%s); costs %s, (n, t) %s, (c, a, b) %s",
                      chosen.url, matched,
                      {u: round(v, 4) for u, v in costs.items()},
                      {r.url: self.ahead(r) for r in replicas},
                      {r.url: tuple(round(v, 6) for v in self.coefficients(r, replicas))
                       for r in replicas})  # fmt: skip
        return Decision(chosen, matched[chosen.url], ttft)

    def _copy_if_hot(self, holder: Replica, matched: dict[str, int], costs: dict[str, float],
                     replicas: Sequence[Replica]) -> Replica:  # fmt: skip
        """The ski-rental rule: once the wait at the holder exceeds the copy's extra cost,
        send this request to the best replica without the prefix."""
        others = [r for r in replicas if matched[r.url] < matched[holder.url]]
        if not others:
            return holder
        other = min(others, key=lambda r: costs[r.url])
        _, a, _ = self.coefficients(holder, replicas)
        n, _ = self.ahead(holder)
        if n > 0 and a * n >= costs[other.url] - costs[holder.url]:
            self.copies += 1
            return other
        return holder

    def first_byte(self, req: RouteRequest, ttfb_s: float | None = None) -> None:
        if ttfb_s is None or not req.stream or req.features is None:
            return
        url, n, x = req.features
        if (model := self.models.get(url)) is not None:  # made when it was chosen
            model.update(n, x, ttfb_s)


POLICIES: dict[str, type[Policy]] = {
    p.name: p
    for p in (
        RandomPolicy,
        RoundRobinPolicy,
        SessionPolicy,
        PrefixApproxPolicy,
        PrefixPrecisePolicy,
        BurstPolicy,
        CostPolicy,
    )  # fmt: skip
}
