"""The router (``actorserve router``): policies on scripted scenarios, the approximate prefix
index, and the pass-through against scriptable replicas (tests/router_fakes.py): streaming
with the official client, retries before the first byte, a dead replica skipped, a broken
stream ending with an error event, the admin endpoint. The real-engine check (the router's
block hashes are the engine's: predicted hits = measured hits) is in test_router_engine.py.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import json
import math
import random
import threading
import time
from collections.abc import Iterator

import httpx
import openai
import pytest

from services.router.app import RouterConfig, build_app
from services.router.policies import (
    DEFAULT_A_S,
    DEFAULT_B_S,
    POLICIES,
    CostPolicy,
    PrefixApproxPolicy,
    RouteRequest,
    SessionPolicy,
)
from services.router.prefix_index import ApproxPrefixIndex
from services.router.replicas import Replica, normalize_url, parse_cache_config, parse_load
from tests.router_fakes import FakeReplica, ServerThread, word_ids

# ---- policies on scripted replicas


def _replicas(n: int) -> list[Replica]:
    return [Replica(f"http://r{i}", healthy=True) for i in range(n)]


def _req(n_blocks: int, bs: int = 16, tail: int = 1, first: int = 0, **kw: object) -> RouteRequest:
    """A prompt of ``n_blocks`` full blocks (hashes first..first+n) plus ``tail`` tokens."""
    hashes: list[int | bytes] = list(range(first, first + n_blocks))
    return RouteRequest(hashes=hashes, prompt_tokens=n_blocks * bs + tail, block_size=bs, **kw)  # type: ignore[arg-type]


def test_round_robin_and_random_cover_every_replica() -> None:
    reps = _replicas(3)
    rr = POLICIES["round_robin"](ApproxPrefixIndex())
    assert [rr.choose(RouteRequest(), reps).replica.url for _ in range(6)] == [
        r.url for r in reps
    ] * 2
    rnd = POLICIES["random"](ApproxPrefixIndex(), random.Random(0))
    seen = [rnd.choose(RouteRequest(), reps).replica.url for _ in range(200)]
    assert {u: seen.count(u) for u in seen}.keys() == {r.url for r in reps}
    assert min(seen.count(r.url) for r in reps) > 40


def test_session_sticks_and_only_a_lost_replicas_sessions_move() -> None:
    reps = _replicas(4)
    policy = SessionPolicy(ApproxPrefixIndex(), random.Random(0))
    keys = [f"user-{i}" for i in range(200)]
    before = {k: policy.choose(RouteRequest(session=k), reps).replica.url for k in keys}
    assert before == {k: policy.choose(RouteRequest(session=k), reps).replica.url for k in keys}
    assert len(set(before.values())) == 4  # spread over all
    gone = reps[1].url
    after = {k: policy.choose(RouteRequest(session=k), [r for r in reps if r.url != gone]).replica.url
             for k in keys}  # fmt: skip
    moved = {k for k in keys if before[k] != after[k]}
    assert moved == {k for k in keys if before[k] == gone}
    # No key: the fewest in flight.
    reps[0].in_flight = reps[2].in_flight = reps[3].in_flight = 2
    assert policy.choose(RouteRequest(), reps).replica is reps[1]


def test_prefix_approx_prefers_the_longest_leading_run() -> None:
    index = ApproxPrefixIndex()
    reps = _replicas(3)
    policy = PrefixApproxPolicy(index, random.Random(0))
    index.record(reps[0].url, [0, 1])
    index.record(reps[2].url, [0, 1, 2, 3])
    index.record(reps[1].url, [1, 2, 3, 4, 5])  # not a leading run: block 0 missing
    d = policy.choose(_req(6), reps)
    assert d.replica is reps[2] and d.cached_blocks == 4
    # A prefix nobody holds: the fewest in flight, whatever the index says.
    reps[0].in_flight, reps[2].in_flight = 3, 1
    assert policy.choose(_req(3, first=100), reps).replica is reps[1]
    # The engine always computes the last prompt token: a prompt of exactly 4 blocks can
    # hit 3 of them at most.
    assert policy.choose(_req(4, tail=0), reps).cached_blocks == 3


def test_cost_weighs_cache_against_queue_and_copies_a_hot_prefix() -> None:
    index = ApproxPrefixIndex()
    a, b = _replicas(2)
    for r in (a, b):  # the priors: one step 10 ms, 1 ms per prompt token
        r.step_s, r.prefill_s_per_token = 0.01, 1e-3
    policy = CostPolicy(index, random.Random(0))
    index.record(a.url, list(range(10)))  # a holds 160 of the 200-token prompt
    d = policy.choose(_req(12, tail=8), [a, b])
    assert d.replica is a and d.cached_blocks == 10
    assert d.predicted_ttft_s == pytest.approx(0.01 + 1e-3 * 40)
    # a's queue of long prompts costs more than computing the whole prompt on b
    a.pending, a.pending_tokens = 4, 600
    d = policy.choose(_req(12, tail=8), [a, b])
    assert d.replica is b and d.predicted_ttft_s == pytest.approx(0.01 + 0.2)
    # A miss costs its TTFT and twice its compute time for the others (0.21 + 0.4 s):
    # with a queue of short (cached) requests a is still the cheapest, 0.16 s ...
    a.pending, a.pending_tokens = 3, 0
    assert policy.cost(_req(12, tail=8), a, 10, [a, b]) == pytest.approx(0.01 + 0.03 + 0.12)
    assert policy.cost(_req(12, tail=8), b, 0, [a, b]) == pytest.approx(0.61)
    assert policy.choose(_req(12, tail=8), [a, b]).replica is a
    # ... and with 30 of them (0.43 s), until the wait there (a * n = 0.3 s) exceeds the
    # copy's extra cost (0.61 - 0.43): the ski-rental rule sends this one to b, which then
    # holds the prefix too.
    a.pending = 30
    req = _req(12, tail=8)
    assert policy.cost(req, a, 10, [a, b]) < policy.cost(req, b, 0, [a, b])
    d = policy.choose(req, [a, b])
    assert d.replica is b and d.cached_blocks == 0 and policy.copies == 1
    # Waiting requests the router did not send count too, at the mean uncached size.
    a.pending = 0
    b.waiting = 50
    assert policy.ahead(b) == (50, pytest.approx(50 * policy.mean_uncached))
    assert policy.choose(_req(10, first=900), [a, b]).replica is a


def test_cost_learns_each_replicas_latency_from_its_first_bytes() -> None:
    a, b = _replicas(2)
    a.step_s, a.prefill_s_per_token = 0.05, 2e-3  # priors
    policy = CostPolicy(ApproxPrefixIndex())
    assert policy.coefficients(a, [a, b]) == (0.05, 0.05, 2e-3)
    assert policy.coefficients(b, [a, b]) == (0.05, 0.05, 2e-3)  # the fleet's until b's own
    assert policy.coefficients(b, [b]) == (DEFAULT_A_S, DEFAULT_A_S, DEFAULT_B_S)
    rng = random.Random(1)
    # b really takes 30 ms whatever the queue, 20 ms more per request ahead, 0.5 ms a token:
    # the fixed part is told apart from the queue's (charging it per request ahead would
    # make a short queue of cached requests look dearer than it is).
    for _ in range(60):
        b.pending, b.pending_tokens = rng.randrange(8), rng.randrange(3000)
        req = _req(rng.randrange(1, 100))
        policy.choose(req, [b])
        assert req.features is not None
        _, n, x = req.features
        policy.first_byte(req, 0.03 + 0.02 * n + 5e-4 * x)
    c_s, a_s, b_s = policy.coefficients(b, [a, b])
    assert c_s == pytest.approx(0.03, rel=0.05) and a_s == pytest.approx(0.02, rel=0.05)
    assert b_s == pytest.approx(5e-4, rel=0.05)


def test_approx_index_is_an_lru_of_the_replicas_size() -> None:
    index = ApproxPrefixIndex()
    index.set_capacity("r", 4)
    index.record("r", [1, 2, 3])
    index.record("r", [1, 9, 10])  # 1 is used again; 2 is the oldest and leaves
    assert index.size("r") == 4
    assert index.matched_blocks([1, 2], ["r"]) == {"r": 1}
    assert index.matched_blocks([1, 9, 10], ["r", "other"]) == {"r": 3, "other": 0}
    index.forget("r")
    assert index.matched_blocks([1], ["r"]) == {"r": 0}


def test_metrics_page_parsing() -> None:
    text = (
        "# HELP vllm:num_requests_running Number of requests in model execution batches.\n"
        '\nvllm:num_requests_running{engine="0",model_name="m"} 3.0\n'
        'vllm:num_requests_running{engine="1",model_name="m"} 2.0\n'
        'vllm:num_requests_waiting{engine="0",model_name="m"} 7.0\n'
        'vllm:kv_cache_usage_perc{engine="0",model_name="m"} 0.25\n'
        'vllm:prefix_cache_hits_total{engine="0",model_name="m"} 128.0\n'
        'vllm:prefix_cache_hits_created{engine="0",model_name="m"} 1.7e9\n'
        'vllm:request_prefill_time_seconds_sum{engine="0",model_name="m"} 1.5\n'
        'vllm:request_prefill_time_seconds_bucket{engine="0",le="0.3",model_name="m"} 1.0\n'
        'vllm:cache_config_info{block_size="32",cache_dtype="auto",enable_prefix_caching="True",'
        'num_gpu_blocks="2048",prefix_caching_hash_algo="sha256_cbor"} 1.0\n'
    )
    load = parse_load(text)
    assert load == {"running": 5.0, "waiting": 7.0, "kv_usage": 0.25, "cache_hits": 128.0,
                    "prefill_seconds": 1.5}  # fmt: skip
    labels = parse_cache_config(text)
    assert labels is not None
    assert (labels["block_size"], labels["prefix_caching_hash_algo"], labels["num_gpu_blocks"]) == (
        "32", "sha256_cbor", "2048")  # fmt: skip
    assert normalize_url("127.0.0.1:8000/v1/") == "http://127.0.0.1:8000"


def test_replica_measures_prefill_time_per_token_and_survives_a_restart() -> None:
    r = Replica("http://r")
    r.update_load({"prefill_seconds": 1.0, "prefill_tokens": 1000.0, "prefill_count": 1}, 0.0)
    assert r.prefill_s_per_token is None  # the first reading is only a baseline
    r.update_load({"prefill_seconds": 1.5, "prefill_tokens": 2000.0, "prefill_count": 2}, 0.1)
    assert r.prefill_s_per_token == pytest.approx(5e-4)
    deltas = r.update_load({"prefill_seconds": 0.1, "prefill_tokens": 100.0, "prefill_count": 1},
                           0.2)  # restarted  # fmt: skip
    assert deltas["prefill_tokens"] == 0.0 and r.prefill_s_per_token == pytest.approx(5e-4)
    # Twenty cached prompts of 10 tokens at 0.2 s each: a step's time, not 20 ms a token.
    r.update_load({"prefill_seconds": 4.1, "prefill_tokens": 300.0, "prefill_count": 21}, 0.3)
    assert r.prefill_s_per_token == pytest.approx(5e-4)


# ---- the router in front of scriptable replicas


@pytest.fixture
def replicas() -> Iterator[list[FakeReplica]]:
    reps = [FakeReplica("a"), FakeReplica("b")]
    yield reps
    for r in reps:
        r.stop()


def _router(backends: list[str], **kw: object) -> ServerThread:
    settings: dict = {"health_check_interval": 0.2, "seed": 0, **kw}
    config = RouterConfig(backends=backends, **settings)
    return ServerThread(build_app(config))


@pytest.fixture
def router_for(replicas: list[FakeReplica]) -> Iterator:  # noqa: ANN001
    started: list[ServerThread] = []

    def start(policy: str = "round_robin", **kw: object) -> ServerThread:
        server = _router([r.url for r in replicas], policy=policy, **kw)
        started.append(server)
        return server

    yield start
    for s in started:
        s.stop()


def _served_by(replicas: list[FakeReplica]) -> list[int]:
    return [len(r.bodies) for r in replicas]


def test_openai_client_streams_through_the_router(replicas, router_for) -> None:  # noqa: ANN001
    router = router_for("round_robin")
    client = openai.OpenAI(base_url=router.url + "/v1", api_key="k", max_retries=0)
    assert [m.id for m in client.models.list().data] == ["fake"]
    texts = []
    for _ in range(2):
        stream = client.completions.create(
            model="fake", prompt="hi there", max_tokens=3, stream=True
        )
        texts.append("".join(c.choices[0].text for c in stream))
    assert sorted(texts) == [" a0 a1 a2", " b0 b1 b2"]  # one on each replica
    chat = client.chat.completions.create(
        model="fake", messages=[{"role": "user", "content": "hi"}], max_tokens=2
    )
    assert chat.choices[0].message.content in (" a0 a1", " b0 b1")
    # The client's headers reach the replica (auth included); hop-by-hop ones do not.
    assert replicas[0].headers[0]["authorization"] == "Bearer k"
    metrics = httpx.get(router.url + "/metrics").text
    decided = {r.url: f'router:decisions_total{{policy="round_robin",replica="{r.url}"}} {n}.0'
               for r, n in zip(replicas, _served_by(replicas), strict=True)}  # fmt: skip
    assert sorted(_served_by(replicas)) == [1, 2] and all(d in metrics for d in decided.values())


def test_a_dead_replica_is_skipped_and_put_back(replicas, router_for) -> None:  # noqa: ANN001
    router = router_for("round_robin")
    client = openai.OpenAI(base_url=router.url + "/v1", api_key="k", max_retries=0)
    replicas[0].fail_status = 503  # answers, but every request fails before its first byte
    for _ in range(4):
        out = client.completions.create(model="fake", prompt="x", max_tokens=1)
        assert out.choices[0].text == " b0"
    assert len(replicas[0].bodies) >= 1  # tried, then moved
    metrics = httpx.get(router.url + "/metrics").text
    assert f'router:retries_total{{replica="{replicas[0].url}"}}' in metrics
    replicas[0].fail_status = None
    replicas[0].healthy = False  # its health check fails: out of the rotation
    time.sleep(0.6)
    before = _served_by(replicas)
    for _ in range(4):
        client.completions.create(model="fake", prompt="x", max_tokens=1)
    assert _served_by(replicas)[0] == before[0]
    replicas[0].healthy = True  # back
    time.sleep(0.6)
    for _ in range(4):
        client.completions.create(model="fake", prompt="x", max_tokens=1)
    assert _served_by(replicas)[0] > before[0]


def test_a_killed_replica_fails_no_request_that_had_not_started(replicas, router_for) -> None:  # noqa: ANN001
    router = router_for("round_robin", health_check_interval=60.0)  # no health check helps
    replicas[1].stop()  # connection refused from now on
    client = openai.OpenAI(base_url=router.url + "/v1", api_key="k", max_retries=0)
    outs = [client.completions.create(model="fake", prompt="x", max_tokens=1).choices[0].text
            for _ in range(6)]  # fmt: skip
    assert outs == [" a0"] * 6
    assert httpx.get(router.url + "/admin/backends").status_code == 403  # no --api-key
    replicas[0].stop()
    r = httpx.post(router.url + "/v1/completions", json={"model": "fake", "prompt": "x"})
    assert r.status_code == 503 and r.json()["error"]["type"] == "ServiceUnavailableError"
    assert httpx.get(router.url + "/health").status_code == 503


def test_a_stream_whose_replica_dies_ends_with_an_error_event(replicas, router_for) -> None:  # noqa: ANN001
    router = router_for("round_robin")
    for r in replicas:
        r.break_after = 2
    body = {"model": "fake", "prompt": "x", "max_tokens": 5, "stream": True}
    with httpx.stream("POST", router.url + "/v1/completions", json=body, timeout=10) as r:
        assert r.status_code == 200
        events = [line[5:].strip() for line in r.iter_lines() if line.startswith("data:")]
    assert len(events) == 4 and events[-1] == "[DONE]"
    assert json.loads(events[2])["error"]["code"] == 502
    assert [json.loads(e)["choices"][0]["text"] for e in events[:2]] in (
        [" a0", " a1"],
        [" b0", " b1"],
    )
    client = openai.OpenAI(base_url=router.url + "/v1", api_key="k", max_retries=0)
    with pytest.raises(openai.APIError):
        for _ in client.completions.create(model="fake", prompt="x", max_tokens=5, stream=True):
            pass


def test_a_client_that_leaves_mid_stream_frees_its_slot(replicas, router_for) -> None:  # noqa: ANN001
    router = router_for("round_robin", api_key="secret")
    for r in replicas:
        r.chunk_delay = 0.05
    body = {"model": "fake", "prompt": "x", "max_tokens": 100, "stream": True}
    with httpx.stream("POST", router.url + "/v1/completions", json=body, timeout=10) as r:
        next(r.iter_lines())
    auth = {"authorization": "Bearer secret"}
    deadline = time.monotonic() + 5
    while True:
        backends = httpx.get(router.url + "/admin/backends", headers=auth).json()["backends"]
        if all(b["in_flight"] == 0 for b in backends) or time.monotonic() > deadline:
            break
        time.sleep(0.05)
    assert [b["in_flight"] for b in backends] == [0, 0]


def test_admin_endpoint_adds_and_removes_backends(replicas) -> None:  # noqa: ANN001
    router = _router([replicas[0].url], policy="round_robin", api_key="secret")
    try:
        url = router.url + "/admin/backends"
        assert httpx.get(url).status_code == 401
        assert httpx.get(url, headers={"authorization": "Bearer nope"}).status_code == 401
        auth = {"authorization": "Bearer secret"}
        assert httpx.post(url, json={"nope": 1}, headers=auth).status_code == 400
        for bad in ("ftp://x:1", "http://[::1", "http://127.0.0.1:99999"):
            assert httpx.post(url, json={"url": bad}, headers=auth).status_code == 400
        r = httpx.post(url, json={"url": replicas[1].url + "/v1"}, headers=auth)
        assert r.json() == {"url": replicas[1].url, "healthy": True}
        listed = httpx.get(url, headers=auth).json()["backends"]
        assert [b["url"] for b in listed] == [replicas[0].url, replicas[1].url]
        assert listed[0]["block_size"] == 4 and listed[0]["num_blocks"] == 64
        for _ in range(4):
            httpx.post(router.url + "/v1/completions", json={"model": "fake", "prompt": "x"})
        assert _served_by(replicas) == [2, 2]
        assert (
            httpx.request("DELETE", url, json={"url": replicas[0].url}, headers=auth).status_code
            == 200
        )
        assert (
            httpx.request("DELETE", url, json={"url": replicas[0].url}, headers=auth).status_code
            == 404
        )
        for _ in range(2):
            httpx.post(router.url + "/v1/completions", json={"model": "fake", "prompt": "x"})
        assert _served_by(replicas) == [2, 4]
        # /admin is the router's own: other methods and paths are refused, never passed on
        put = httpx.put(url, json={"url": replicas[0].url}, headers=auth)
        assert put.status_code == 405 and put.headers["allow"] == "GET, POST, DELETE"
        assert httpx.get(router.url + "/admin/nope", headers=auth).status_code == 404
        assert httpx.get(router.url + "/admin/nope").status_code == 401
        assert _served_by(replicas) == [2, 4]
    finally:
        router.stop()


def test_session_header_and_user_stick(replicas, router_for) -> None:  # noqa: ANN001
    router = router_for("session")
    for i in range(6):
        httpx.post(router.url + "/v1/completions", headers={"x-session-id": "s1"},
                   json={"model": "fake", "prompt": f"q{i}"})  # fmt: skip
    assert sorted(_served_by(replicas)) == [0, 6]
    for i in range(4):
        httpx.post(router.url + "/v1/chat/completions",
                   json={"model": "fake", "user": "alice", "messages": [{"role": "user", "content": f"{i}"}]})  # fmt: skip
    assert sorted(_served_by(replicas)) in ([0, 10], [4, 6])


def test_prefix_approx_returns_a_prefix_to_its_replica(replicas, router_for) -> None:  # noqa: ANN001
    router = router_for("prefix_approx")  # tokenizes through the replicas' /tokenize
    prefixes = [" ".join(f"w{g}x{i}" for i in range(40)) for g in range(6)]
    first: dict[int, str] = {}
    for rnd in range(3):
        for g, prefix in enumerate(prefixes):
            before = _served_by(replicas)
            r = httpx.post(router.url + "/v1/completions",
                           json={"model": "fake", "prompt": f"{prefix} question {rnd}", "max_tokens": 1})  # fmt: skip
            assert r.status_code == 200
            served = "ab"[
                [a - b for a, b in zip(_served_by(replicas), before, strict=True)].index(1)
            ]
            assert first.setdefault(g, served) == served
    assert set(first.values()) == {"a", "b"}  # new prefixes spread by load
    metrics = httpx.get(router.url + "/metrics").text
    predicted = sum(float(line.split()[-1]) for line in metrics.splitlines()
                    if line.startswith("router:predicted_cached_tokens_total"))  # fmt: skip
    assert predicted == 6 * 2 * (len(word_ids(prefixes[0])) // 4) * 4  # rounds 2 and 3 hit


def test_burst_groups_a_new_prefix_on_one_replica_behind_its_leader() -> None:
    from services.router.policies import BurstPolicy

    async def scenario() -> None:
        a, b = _replicas(2)
        policy = BurstPolicy(ApproxPrefixIndex(), random.Random(0))
        policy.window_s = 0.2
        leader = _req(4)
        d = policy.choose(leader, [a, b])
        assert d.cached_blocks == 0 and leader.leads is not None
        d.replica.in_flight += 5  # busy: without the burst rule the next would go elsewhere
        follower = _req(6)  # shares the leader's 4 blocks, then goes on
        f = policy.choose(follower, [a, b])
        assert f.replica is d.replica and f.cached_blocks == 4
        other = _req(4, first=50)  # another prefix: its own leader, on the idle replica
        assert policy.choose(other, [a, b]).replica is not d.replica
        waiting = asyncio.create_task(policy.admit(follower, f))
        await asyncio.sleep(0.05)
        assert not waiting.done()  # holds until the leader's prompt is computed
        policy.first_byte(leader)
        assert await waiting >= 0.04
        await asyncio.sleep(0.25)  # the window closed: a late request is on its own
        late = _req(4)
        policy.choose(late, [a, b])
        assert late.follows is None

    asyncio.run(scenario())


def test_burst_through_the_router(replicas, router_for) -> None:  # noqa: ANN001
    router = router_for("burst", burst_window_ms=500.0)
    for r in replicas:
        r.chunk_delay = 0.2  # the first byte comes after 0.2 s
    prompt = " ".join(f"w{i}" for i in range(40))
    body = {"model": "fake", "prompt": prompt, "max_tokens": 2, "stream": True}

    def one(_: int) -> int:
        with httpx.stream("POST", router.url + "/v1/completions", json=body, timeout=10) as r:
            return sum(1 for line in r.iter_lines() if line.startswith("data:"))

    with concurrent.futures.ThreadPoolExecutor(4) as pool:
        assert list(pool.map(one, range(4))) == [3] * 4
    assert sorted(_served_by(replicas)) == [0, 4]
    metrics = httpx.get(router.url + "/metrics").text
    waits = [ln for ln in metrics.splitlines() if ln.startswith("router:burst_wait_seconds_count")]
    assert sum(float(ln.split()[-1]) for ln in waits) == 3


@pytest.mark.filterwarnings("ignore::pytest.PytestUnhandledThreadExceptionWarning")
def test_replicas_that_hash_differently_are_refused() -> None:
    a, b = FakeReplica("a", block_size=4), FakeReplica("b", block_size=8)
    try:
        with pytest.raises(RuntimeError, match="did not start"):
            _router([a.url, b.url], policy="prefix_approx")  # one index cannot serve both
        router = _router([a.url], policy="prefix_approx", api_key="k")
        try:
            r = httpx.post(router.url + "/admin/backends", json={"url": b.url},
                           headers={"authorization": "Bearer k"})  # fmt: skip
            assert r.status_code == 400 and "blocks of 8 tokens" in r.json()["error"]["message"]
            listed = httpx.get(router.url + "/admin/backends",
                               headers={"authorization": "Bearer k"}).json()["backends"]  # fmt: skip
            assert [x["url"] for x in listed] == [a.url]
        finally:
            router.stop()
    finally:
        a.stop()
        b.stop()


def test_cost_model_stays_finite_when_requests_never_vary() -> None:
    from services.router.policies import LatencyModel

    model = LatencyModel(0.01, 0.01, 1e-3)
    for _ in range(30_000):  # one prompt length, an idle replica: x never changes
        model.update(0.0, 200.0, 0.03)
    c, a, b = model.cab
    assert all(math.isfinite(v) for v in (c, a, b))
    assert c + b * 200 == pytest.approx(0.03, rel=0.01)


def test_vllm_cache_config_labels_and_unknown_hashes() -> None:
    from services.router.replicas import CacheGeometry

    g = CacheGeometry.from_labels({"block_size": "16", "num_gpu_blocks": "None",
                                   "prefix_caching_hash_algo": "xxhash"})  # fmt: skip
    assert (g.block_size, g.num_blocks, g.hash_algo) == (16, 0, "xxhash")
    r = FakeReplica("x", hash_algo="xxhash")
    try:
        router = _router([r.url], policy="cost")  # starts; routes by load (no hasher)
        try:
            out = httpx.post(
                router.url + "/v1/completions", json={"model": "fake", "prompt": "a b"}
            )
            assert out.status_code == 200
        finally:
            router.stop()
    finally:
        r.stop()


def test_only_unavailable_answers_move_a_request(replicas, router_for) -> None:  # noqa: ANN001
    router = router_for("round_robin")
    replicas[0].fail_status = replicas[1].fail_status = 500  # the request's own failure
    r = httpx.post(router.url + "/v1/completions", json={"model": "fake", "prompt": "x"})
    assert r.status_code == 500 and sum(_served_by(replicas)) == 1  # not sent everywhere
    replicas[0].fail_status = replicas[1].fail_status = 503  # nobody can serve now
    r = httpx.post(router.url + "/v1/completions", json={"model": "fake", "prompt": "x"})
    assert r.status_code == 503 and r.json()["error"]["message"] == "down"  # the replica's own
    assert sum(_served_by(replicas)) == 3


def test_a_whole_answer_never_leads_a_burst() -> None:
    from services.router.policies import BurstPolicy

    policy = BurstPolicy(ApproxPrefixIndex(), random.Random(0))
    whole = _req(4, stream=False)
    policy.choose(whole, _replicas(2))
    assert whole.leads is None  # its first byte is its last: followers would wait it out


def test_a_hung_replica_gives_up_its_requests_when_it_fails_its_health_check(
    replicas, router_for
) -> None:  # noqa: ANN001
    router = router_for("session")  # one session: both requests go to the same replica
    body = {"model": "fake", "prompt": "x", "max_tokens": 3, "stream": True, "user": "u"}
    out: list[list[str]] = []

    def stream() -> None:
        with httpx.stream("POST", router.url + "/v1/completions", json=body, timeout=20) as r:
            out.append([ln for ln in r.iter_lines() if ln.startswith("data:")])

    httpx.post(router.url + "/v1/completions", json={**body, "stream": False})
    hung = next(r for r in replicas if r.bodies)
    other = next(r for r in replicas if r is not hung)
    hung.chunk_delay = 60.0  # accepts, then never answers
    thread = threading.Thread(target=stream)
    thread.start()
    time.sleep(0.5)
    hung.healthy = False  # its health check fails: its open request moves before any byte
    thread.join(15)
    assert not thread.is_alive() and out and out[0][-1] == "data: [DONE]"
    assert len(other.bodies) == 1 and "error" not in out[0][0]


def test_load_comes_from_load_where_a_replica_has_it(replicas, router_for) -> None:  # noqa: ANN001
    """``cost`` reads ours' cheap ``/load`` every interval and its ``/metrics`` about once a
    second; a replica without ``/load`` (vLLM) has its ``/metrics`` read every interval."""
    from services.router.replicas import METRICS_INTERVAL_S

    ours, theirs = replicas
    ours.has_load, ours.waiting, theirs.waiting = True, 7.0, 3.0  # traffic from elsewhere
    router = router_for("cost", load_interval_ms=20, api_key="k")
    time.sleep(1.5)
    reads = {r.name: dict(r.reads) for r in replicas}
    assert reads["a"]["/load"] >= 20, reads
    assert reads["a"]["/metrics"] <= 2 + 1.5 / METRICS_INTERVAL_S, reads
    assert reads["b"]["/metrics"] >= 20 and reads["b"]["/load"] == 1, reads  # asked once
    listed = httpx.get(router.url + "/admin/backends",
                       headers={"authorization": "Bearer k"}).json()["backends"]  # fmt: skip
    assert [b["waiting"] for b in listed] == [7.0, 3.0]
    # Without traffic from elsewhere, ours is read once a second (its own counts suffice).
    ours.waiting = 0.0
    time.sleep(0.3)
    before = ours.reads["/load"]
    time.sleep(1.5)
    assert ours.reads["/load"] - before <= 3, ours.reads
    ours.waiting = 2.0  # and fast again once a reading shows some
    time.sleep(1.5)
    assert ours.reads["/load"] - before >= 15, ours.reads


def test_cost_model_stays_a_covariance_over_a_long_run() -> None:
    """Thousands of requests with a varying queue: P stays symmetric and positive, the fit
    stays on the truth (a skew that grew by 1/FORGET a request once blew it up after ~600),
    and a change of the truth is followed within a few dozen requests."""
    from services.router.policies import LatencyModel

    model = LatencyModel(0.01, 0.01, 1e-3)
    rng = random.Random(3)
    for i in range(8_000):
        c = 0.03 if i < 7_900 else 0.3
        n, x = rng.randrange(8), rng.randrange(20, 5_000)
        model.update(n, x, c + 0.02 * n + 5e-4 * x)
        if i == 7_899:
            assert model.cab == pytest.approx((0.03, 0.02, 5e-4), rel=0.05)
    p = model.p
    assert all(p[i][j] == p[j][i] for i in range(3) for j in range(3))
    assert all(p[i][i] > 0 for i in range(3))
    assert model.cab == pytest.approx((0.3, 0.02, 5e-4), rel=0.05)


def test_a_removed_replicas_pool_closes_after_its_requests() -> None:
    """Its open requests finish on their connections; then its pool closes (at shutdown
    at the latest), and a replica that fails its health meanwhile releases them."""
    from services.router.app import Router
    from services.router.replicas import ReplicaSet

    async def scenario() -> None:
        fake = FakeReplica("a")
        try:
            async with Router.new_client() as shared:
                rs = ReplicaSet(shared, 0.05, None, new_client=Router.new_client)
                r = await rs.add(fake.url)
                assert r.client is not None and r.client is not shared and r.healthy
                r.in_flight = 1
                await rs.remove(fake.url)
                await asyncio.sleep(0.2)
                assert not r.client.is_closed and not r.down.is_set()  # still in use
                fake.healthy = False  # hung and failing: its requests give up on it
                await asyncio.sleep(0.2)
                assert r.down.is_set()
                r.in_flight = 0
                await asyncio.sleep(0.2)
                assert r.client.is_closed
                r2 = await rs.add(fake.url)
                r2.in_flight = 1
                await rs.remove(fake.url)
                await rs.close()  # shutdown closes what is left
                assert r2.client is not None and r2.client.is_closed
        finally:
            fake.stop()

    asyncio.run(scenario())


def test_odd_load_answers_fall_back_to_metrics(replicas) -> None:  # noqa: ANN001
    """A /load that is not ours (bools, NaN, negative, missing fields) is not a load."""
    from services.router.app import Router
    from services.router.replicas import ReplicaSet

    async def sample(body: object) -> dict | None:
        replicas[0].load_body = body
        async with Router.new_client() as client:
            return await ReplicaSet(client, 1.0, None)._load_sample(Replica(replicas[0].url))

    async def scenario() -> None:
        ok = {"num_requests_waiting": 2, "num_requests_running": 3}
        assert await sample(ok) == {"waiting": 2.0, "running": 3.0}
        for bad in ({"server_load": 4}, {**ok, "num_requests_waiting": True},
                    {**ok, "num_requests_running": -1}, [1, 2], "not json",
                    '{"num_requests_waiting": Infinity, "num_requests_running": 1}'):  # fmt: skip
            assert await sample(bad) is None, bad

    asyncio.run(scenario())
    r = Replica("http://x", has_load=True)
    assert not r.needs_fast_reading()
    r.whole_open = 1  # a whole answer open: its place in the queue is unknown
    assert r.needs_fast_reading()


def test_replica_headers_pass_byte_for_byte(replicas, router_for) -> None:  # noqa: ANN001
    """A header value that is UTF-8 on the wire (not latin-1 text) reaches the client as sent,
    not as a 500 (httpx decodes it as UTF-8; Starlette encodes headers as latin-1)."""
    euro = "€".encode().decode("latin-1")  # the three bytes of UTF-8's euro sign
    for r in replicas:
        r.reply_headers = {"x-note": euro}
    router = router_for("round_robin")
    out = httpx.post(router.url + "/v1/completions", json={"model": "fake", "prompt": "x"})
    assert out.status_code == 200
    assert out.headers.raw[[k for k, _ in out.headers.raw].index(b"x-note")][1] == "€".encode()
