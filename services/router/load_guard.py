"""One request's share of a replica's load, booked once and released once."""

from __future__ import annotations

from types import TracebackType

from services.router.policies import Policy, RouteRequest
from services.router.replicas import Replica


class LoadGuard:
    """The router's counts for one request on one replica: booked when the replica is
    chosen, released exactly once however the request ends.

    Booked: ``in_flight``; for a routed request (``req`` given) also ``whole_open`` and its
    place in the replica's queue (``pending`` for a stream until its first byte,
    ``unseen`` for a whole answer until the next load reading). Released by ``release()``,
    which later calls ignore: the counts come back down, a first byte that never came is
    ended, the policy hears ``done``.

    As a context manager it releases on the way out (an error, a retry elsewhere) unless
    ``hand_over()`` gave the release to the response, whose close hook
    (``services.http.streaming.RelayResponse``) calls it when the answer ends: read to
    the end, broken, or left by its client. A request that never reached the client also
    takes back its place in the queue (``unseen``); a delivered one stays counted there
    until the replica's next load reading, which includes it."""

    def __init__(
        self,
        replica: Replica,
        req: RouteRequest | None = None,
        policy: Policy | None = None,
        uncached: int = 0,
    ) -> None:
        self.replica, self.req, self.policy, self.uncached = replica, req, policy, uncached
        self.released = False
        self.handed_over = False
        replica.in_flight += 1
        if req is None:
            return
        req.first_byte_seen = False
        replica.whole_open += not req.stream
        if req.stream:
            replica.pending += 1
            replica.pending_tokens += uncached
        else:
            replica.unseen += 1
            replica.unseen_tokens += uncached

    def first_byte(self, ttfb_s: float | None = None) -> None:
        """The replica's first byte came ``ttfb_s`` after the request was sent (None: it
        never will)."""
        req, r = self.req, self.replica
        if req is None or req.first_byte_seen:
            return
        req.first_byte_seen = True
        if req.stream:
            r.pending -= 1
            r.pending_tokens -= self.uncached
        if self.policy is not None:
            self.policy.first_byte(req, ttfb_s)

    def hand_over(self) -> None:
        """The response now holds the request: it calls ``release`` when it ends."""
        self.handed_over = True

    def release(self) -> None:
        if self.released:
            return
        self.released = True
        self.first_byte()
        r, req = self.replica, self.req
        r.in_flight -= 1
        if req is None:
            return
        r.whole_open -= not req.stream
        if not req.stream and not self.handed_over:  # it never reached the replica's queue
            r.unseen = max(r.unseen - 1, 0)
            r.unseen_tokens = max(r.unseen_tokens - self.uncached, 0)
        if self.policy is not None:
            self.policy.done(req)

    def __enter__(self) -> LoadGuard:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        if exc_type is not None or not self.handed_over:
            self.release()
