"""The router's per-replica load: booked once by a ``LoadGuard`` when a replica is chosen and
released exactly once, however the response ends — whole answer, finished stream, client
gone before or after the first byte, replica failing before or after it, a bug — through
the router and through the PD proxy, against the scriptable replicas of router_fakes.py.
"""

from __future__ import annotations

import time
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass, field

import httpx
import pytest

from services.router import forward
from services.router.app import RouterConfig, build_app
from services.router.load_guard import LoadGuard
from services.router.pd_proxy import build_pd_app
from services.router.policies import RouteRequest
from services.router.replicas import Replica
from tests.router_fakes import FakeReplica, ServerThread

# Back to 0 once every request ended; a whole answer delivered stays in ``unseen`` (its
# place in the replica's queue) until the next load reading, so those only never go below 0.
_OPEN = ("in_flight", "pending", "pending_tokens", "whole_open")
_COUNTS = (*_OPEN, "unseen", "unseen_tokens")
_AUTH = {"authorization": "Bearer secret"}


def test_guard_books_once_and_releases_once() -> None:
    r = Replica("http://r", healthy=True)
    stream = RouteRequest(stream=True)
    with LoadGuard(r, stream, uncached=7) as load:
        assert (r.in_flight, r.pending, r.pending_tokens, r.whole_open) == (1, 1, 7, 0)
        load.first_byte(0.1)
        load.first_byte(0.2)  # only the first counts
        assert (r.pending, r.pending_tokens) == (0, 0)
        load.hand_over()
    assert r.in_flight == 1 and not load.released  # the response holds it now
    load.release()
    load.release()
    assert all(getattr(r, c) == 0 for c in _COUNTS)
    # A whole answer that never reached the client: its queue place is taken back too.
    whole = RouteRequest(stream=False)
    with pytest.raises(RuntimeError), LoadGuard(r, whole, uncached=5):
        assert (r.in_flight, r.whole_open, r.unseen, r.unseen_tokens) == (1, 1, 1, 5)
        raise RuntimeError("a bug")
    assert all(getattr(r, c) == 0 for c in _COUNTS)
    assert whole.first_byte_seen  # the first byte that never came was ended
    with LoadGuard(r) as load:  # a passed-through request: in flight only
        assert r.in_flight == 1
    assert r.in_flight == 0 and load.released


@dataclass
class Ledger:
    """Every guard made, and how many times each actually released its booking."""

    guards: list[LoadGuard] = field(default_factory=list)
    releases: Counter[int] = field(default_factory=Counter)
    negative: list[str] = field(default_factory=list)

    def settle(self, timeout: float = 10.0) -> None:
        """Wait for every guard to be released; then each was, exactly once, and every
        replica's open counts are back to 0, none below it on the way."""
        deadline = time.monotonic() + timeout
        while not all(g.released for g in self.guards) and time.monotonic() < deadline:
            time.sleep(0.02)
        assert self.guards, "no request was booked"
        assert all(self.releases[id(g)] == 1 for g in self.guards), [
            (g.replica.url, self.releases[id(g)]) for g in self.guards
        ]
        for r in {id(g.replica): g.replica for g in self.guards}.values():
            assert {c: getattr(r, c) for c in _OPEN} == dict.fromkeys(_OPEN, 0), r.url
        assert not self.negative


@pytest.fixture
def ledger(monkeypatch: pytest.MonkeyPatch) -> Ledger:
    led = Ledger()
    init, release = LoadGuard.__init__, LoadGuard.release

    def tracked_init(self: LoadGuard, *args: object, **kw: object) -> None:
        init(self, *args, **kw)  # type: ignore[arg-type]
        led.guards.append(self)

    def tracked_release(self: LoadGuard) -> None:
        if not self.released:
            led.releases[id(self)] += 1
        release(self)
        r = self.replica
        led.negative += [f"{r.url} {c}" for c in _COUNTS if getattr(r, c) < 0]

    monkeypatch.setattr(LoadGuard, "__init__", tracked_init)
    monkeypatch.setattr(LoadGuard, "release", tracked_release)
    return led


@pytest.fixture
def replicas() -> Iterator[list[FakeReplica]]:
    reps = [FakeReplica("a"), FakeReplica("b")]
    yield reps
    for r in reps:
        if r.thread.thread.is_alive():
            r.stop()


@pytest.fixture
def router(replicas: list[FakeReplica]) -> Iterator[ServerThread]:
    config = RouterConfig(backends=[r.url for r in replicas], policy="round_robin",
                          api_key="secret", health_check_interval=60.0, seed=0)  # fmt: skip
    server = ServerThread(build_app(config))
    yield server
    server.stop()


def _in_flight(router: ServerThread) -> list[int]:
    backends = httpx.get(router.url + "/admin/backends", headers=_AUTH).json()["backends"]
    return [b["in_flight"] for b in backends]


def _completion(router: ServerThread, stream: bool = False, **kw: object) -> httpx.Response:
    body = {"model": "fake", "prompt": "x", "max_tokens": 3, "stream": stream, **kw}
    return httpx.post(router.url + "/v1/completions", json=body, timeout=10)


def test_whole_answers_streams_and_passthrough_release(ledger, router) -> None:  # noqa: ANN001
    for stream in (False, True, False, True):
        assert _completion(router, stream).status_code == 200
    chat = {"model": "fake", "messages": [{"role": "user", "content": "hi"}], "stream": True}
    assert httpx.post(router.url + "/v1/chat/completions", json=chat).status_code == 200
    assert httpx.get(router.url + "/v1/models").status_code == 200
    assert httpx.get(router.url + "/v1/nope").status_code == 404  # the replica's own answer
    ledger.settle()
    assert len(ledger.guards) == 7
    assert _in_flight(router) == [0, 0]
    # The two whole answers were delivered: each keeps its place in its replica's queue
    # until that replica's next load reading (none in this test: health checks every 60 s).
    whole = [g for g in ledger.guards if g.req is not None and not g.req.stream]
    holders = {id(g.replica): g.replica for g in whole}.values()
    assert len(whole) == 2 and sum(r.unseen for r in holders) == 2


def test_a_client_that_leaves_releases(ledger, replicas, router) -> None:  # noqa: ANN001
    for r in replicas:
        r.chunk_delay = 0.05
    body = {"model": "fake", "prompt": "x", "max_tokens": 100, "stream": True}
    with httpx.stream("POST", router.url + "/v1/completions", json=body, timeout=10) as r:
        lines = r.iter_lines()  # kept: a dropped line iterator closes the connection
        next(lines)  # mid-stream: the booking is held while the answer streams
        assert sum(_in_flight(router)) == 1 and not ledger.guards[0].released
    for r in replicas:
        r.chunk_delay = 1.0
    with pytest.raises(httpx.ReadTimeout):  # before the first byte
        httpx.post(router.url + "/v1/completions", json={**body, "max_tokens": 2}, timeout=0.2)
    ledger.settle()
    assert len(ledger.guards) == 2


def test_replica_failures_release(ledger, replicas, router) -> None:  # noqa: ANN001
    a, b = replicas
    a.fail_status = 503  # before the first byte: retried on b
    for stream in (False, True):
        r = _completion(router, stream)
        assert r.status_code == 200 and " b0" in r.text
    a.fail_status = 500  # the request's own failure: passed on
    while (r := _completion(router)).status_code == 200:
        pass
    assert r.status_code == 500
    a.fail_status = b.fail_status = 503  # every replica: the last one's answer
    assert _completion(router).status_code == 503
    a.fail_status = b.fail_status = None
    a.stop()  # connection refused: retried on b (and a leaves the rotation)
    for _ in range(2):
        assert _completion(router).status_code == 200
        assert httpx.get(router.url + "/v1/models").status_code == 200
    b.break_after = 1  # after the first byte: an error event
    body = {"model": "fake", "prompt": "x", "stream": True}
    with httpx.stream("POST", router.url + "/v1/completions", json=body, timeout=10) as r:
        assert '"code": 502' in r.read().decode()
    ledger.settle()
    assert _in_flight(router) == [0, 0]


def test_a_bug_while_relaying_releases(
    ledger: Ledger, router: ServerThread, monkeypatch: pytest.MonkeyPatch
) -> None:
    def broken(resp: httpx.Response) -> dict[str, str]:
        raise RuntimeError("a bug")

    monkeypatch.setattr(forward, "reply_headers", broken)
    assert _completion(router).status_code == 500
    assert httpx.get(router.url + "/v1/models").status_code == 500
    ledger.settle()
    assert len(ledger.guards) == 2


def test_pd_proxy_releases_both_sides(ledger, replicas) -> None:  # noqa: ANN001
    prefill, decode = (RouterConfig(backends=[r.url], policy="round_robin", seed=0,
                                    health_check_interval=60.0) for r in replicas)  # fmt: skip
    proxy = ServerThread(build_pd_app(prefill, decode))
    try:
        # The fake prefill answers without kv_transfer_params: read whole, then a 502.
        r = _completion(proxy)
        assert r.status_code == 502 and r.json()["error"]["type"] == "BadGatewayError"
        replicas[0].fail_status = 400  # the request's own error: passed on
        assert _completion(proxy).status_code == 400
        assert httpx.get(proxy.url + "/v1/models").status_code == 200
    finally:
        proxy.stop()
    ledger.settle()
    decode_url = replicas[1].url
    assert sum(g.replica.url == decode_url for g in ledger.guards) == 1
