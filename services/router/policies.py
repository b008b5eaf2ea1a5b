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
- ``cost`` (the default): the least estimated time to first token,

      ttft(r) = s(r) * (queued(r) + prompt - cached(r) * block_size)

  ``s(r)``: the replica's measured prefill seconds per computed token (the increments of
  ``vllm:request_prefill_time_seconds_sum`` over ``vllm:request_prefill_kv_computed_tokens_sum``
  between two readings, averaged with weight 0.3), the fleet's mean until it has one, and
  ``DEFAULT_PREFILL_S_PER_TOKEN`` before any replica has one. It includes what slows a
  prefill on that replica on average (decode rows sharing its steps, chunking).
  ``queued(r)``: prompt tokens ahead of the request there: the uncached tokens of the
  router's streaming requests not yet past their first byte, of the requests it sent since
  the replica's last load reading, and ``vllm:num_requests_waiting`` beyond those, at the
  mean uncached size of the router's requests. ``cached(r)``: leading blocks the replica
  holds (its KV events where it publishes them, the router's own record elsewhere). Equal estimates (within 1 ms) go to the fewest in flight.

  One formula weighs affinity against load: a replica holding the prefix wins until its
  queue costs more than computing the prefix elsewhere; then the next request goes to a
  second replica, which computes the prefix once and from then on shares that prefix's
  traffic (a hot prefix is copied deliberately instead of piling up or scattering).
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import itertools
import random
import time
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any, ClassVar, Protocol

from services.router.kv_events import PreciseIndex
from services.router.prefix_index import ApproxPrefixIndex
from services.router.replicas import Replica
from services.scheduler.block_hash import BlockHash

DEFAULT_PREFILL_S_PER_TOKEN = 1e-3  # before any replica measured one (a CPU's order)
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
    ``burst``) and sends it; ``sent_first_byte`` when the replica's first byte arrived and
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

    def first_byte(self, req: RouteRequest) -> None:
        pass

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
        if decision.cached_blocks == 0 and req.lookup:
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

    def first_byte(self, req: RouteRequest) -> None:
        if req.leads is not None:
            req.leads.computed.set()

    def done(self, req: RouteRequest) -> None:
        self.first_byte(req)  # a failed leader releases its followers


class CostPolicy(Policy):
    name = "cost"
    needs_prompt = True

    def __init__(self, index: CacheIndex, rng: random.Random | None = None) -> None:
        super().__init__(index, rng)
        self.mean_uncached = 0.0  # running mean of the uncached tokens of routed requests
        self._routed = 0

    def prefill_s_per_token(self, replica: Replica, replicas: Sequence[Replica]) -> float:
        if replica.prefill_s_per_token is not None:
            return replica.prefill_s_per_token
        known = [r.prefill_s_per_token for r in replicas if r.prefill_s_per_token is not None]
        return sum(known) / len(known) if known else DEFAULT_PREFILL_S_PER_TOKEN

    def queued_tokens(self, r: Replica) -> float:
        ours = r.pending + r.unseen
        others = max(0.0, r.waiting - ours)
        return r.pending_tokens + r.unseen_tokens + others * self.mean_uncached

    def estimate(
        self, req: RouteRequest, r: Replica, cached: int, replicas: Sequence[Replica]
    ) -> float:
        uncached = max(req.prompt_tokens - cached * req.block_size, 1)
        return self.prefill_s_per_token(r, replicas) * (self.queued_tokens(r) + uncached)

    def choose(self, req: RouteRequest, replicas: Sequence[Replica]) -> Decision:
        matched = self.index.matched_blocks(req.lookup, (r.url for r in replicas))
        costs = {r.url: self.estimate(req, r, matched[r.url], replicas) for r in replicas}
        best = min(costs.values())
        chosen = self.least_busy([r for r in replicas if costs[r.url] <= best + _TIE_S])
        uncached = max(req.prompt_tokens - matched[chosen.url] * req.block_size, 0)
        self._routed += 1
        self.mean_uncached += (uncached - self.mean_uncached) / min(self._routed, 100)
        return Decision(chosen, matched[chosen.url], costs[chosen.url])


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
