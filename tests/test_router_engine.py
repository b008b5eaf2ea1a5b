"""``actorserve router`` (the command, as a user starts it) in front of two real servers on
the simulated backend: the router's block hashes are the engine's, so the cache hits it
predicts are exactly the hits the replicas report (``vllm:prefix_cache_hits``), through the
replicas' ``/tokenize`` and through the router's own tokenizer, for completions and chat.
"""

from __future__ import annotations

import contextlib
import sys
import time
from collections.abc import Iterator

import httpx
import pytest

from tests.server_utils import RemoteServer, free_port, http_process, metric

MODEL = "qwen3-0.6b"


@pytest.fixture(scope="module")
def replicas() -> Iterator[list[RemoteServer]]:
    servers = []
    with contextlib.ExitStack() as stack:
        for _ in range(2):
            servers.append(stack.enter_context(RemoteServer(
                "--worker-backend", "sim", "--sim-model", MODEL, "--sim-hardware", "h200",
                "--kv-cache-memory-bytes", "512MiB", "--max-model-len", "2048",
            )))  # fmt: skip
        for s in servers:
            s.wait_ready()
        yield servers


@contextlib.contextmanager
def router(backends: list[RemoteServer], *args: str) -> Iterator[str]:
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    cmd = [sys.executable, "-m", "launch.cli", "router", "--port", str(port),
           "--health-check-interval", "0.2", "--seed", "0", *args]  # fmt: skip
    for s in backends:
        cmd += ["--backend", s.url]
    with http_process(cmd, url, "router") as served:
        yield served


def _hits(servers: list[RemoteServer]) -> float:
    return sum(metric(s, "vllm:prefix_cache_hits_total") or 0.0 for s in servers)


def _router_sum(url: str, name: str) -> float:
    text = httpx.get(url + "/metrics").text
    return sum(float(line.split()[-1]) for line in text.splitlines() if line.startswith(name + "{"))


def _check_predictions(
    url: str, servers: list[RemoteServer], bodies: list[tuple[str, dict]]
) -> None:
    before = _hits(servers)
    for path, body in bodies:
        r = httpx.post(url + path, json={"model": MODEL, "max_tokens": 4, **body}, timeout=60)
        assert r.status_code == 200, r.text
    predicted = _router_sum(url, "router:predicted_cached_tokens_total")
    assert predicted > 0
    assert _hits(servers) - before == predicted
    decisions = _router_sum(url, "router:decisions_total")
    assert decisions == len(bodies)


def test_prefix_approx_predicts_the_replicas_hits_via_their_tokenize(replicas) -> None:  # noqa: ANN001
    prefixes = [f"Document {g}: " + " ".join(f"clause {g}-{i} says nothing new." for i in range(40))
                for g in range(4)]  # fmt: skip
    bodies = [("/v1/completions", {"prompt": f"{p}\nQuestion {q}: what does it say?"})
              for q in range(2) for p in prefixes]  # fmt: skip
    with router(replicas, "--policy", "prefix_approx") as url:
        _check_predictions(url, replicas, bodies)
        used = [metric(s, "vllm:request_success_total") or 0 for s in replicas]
        assert all(u > 0 for u in used)  # the four prefixes spread over both


def test_cost_with_the_routers_own_tokenizer_predicts_chat_hits(replicas) -> None:  # noqa: ANN001
    system = "You are terse. " + " ".join(f"Rule {i}: answer in one line." for i in range(60))
    bodies = [("/v1/chat/completions", {"messages": [{"role": "system", "content": system + f" Tenant {t}."},
                                                     {"role": "user", "content": f"Question {q}?"}]})
              for q in range(3) for t in range(3)]  # fmt: skip
    with router(replicas, "--tokenizer", "default") as url:  # --policy cost is the default
        _check_predictions(url, replicas, bodies)


# ---- prefix_precise: the replicas' KV events, under evictions and across a restart

SIM_SMALL = ("--worker-backend", "sim", "--sim-model", MODEL, "--sim-hardware", "h200",
             "--kv-cache-memory-bytes", "128MiB", "--max-model-len", "1024",
             "--kv-events-endpoint", "auto")  # fmt: skip


def _documents(n: int, tag: str) -> list[str]:
    return [f"Case {tag}{g}: " + " ".join(f"fact {g}.{i} is plain." for i in range(45))
            for g in range(n)]  # fmt: skip


def _hits_and_predictions(
    url: str, servers: list[RemoteServer], prompts: list[str]
) -> tuple[float, float]:
    before, predicted = _hits(servers), _router_sum(url, "router:predicted_cached_tokens_total")
    for p in prompts:
        r = httpx.post(url + "/v1/completions", json={"model": MODEL, "prompt": p, "max_tokens": 4},
                       timeout=60)  # fmt: skip
        assert r.status_code == 200, r.text
    return (_hits(servers) - before,
            _router_sum(url, "router:predicted_cached_tokens_total") - predicted)  # fmt: skip


def _flood(servers: list[RemoteServer], tag: str) -> None:
    """Traffic that bypasses the router: enough new documents to evict every pool."""
    for s in servers:
        for d in _documents(6, f"{tag}{s.port}"):
            r = httpx.post(s.url + "/v1/completions", json={"model": MODEL, "prompt": d,
                           "max_tokens": 1}, timeout=60)  # fmt: skip
            assert r.status_code == 200


def test_prefix_precise_follows_evictions_that_prefix_approx_cannot_see() -> None:
    with contextlib.ExitStack() as stack:
        servers = [stack.enter_context(RemoteServer(*SIM_SMALL)) for _ in range(2)]
        for s in servers:
            s.wait_ready()
        info = httpx.get(servers[0].url + "/kv_events").json()
        assert info["block_size"] == 16 and info["publishers"][0]["topic"] == (
            f"kv@127.0.0.1:{servers[0].port}@{MODEL}")  # fmt: skip
        # 10 documents of ~290 tokens, asked about three times in turn: the 73-block pools
        # hold about two and a half each, so most are evicted before they come back.
        docs = _documents(10, "a")
        with router(servers, "--policy", "prefix_precise") as url:
            prompts = [f"{d}\nQ{q}?" for q in range(3) for d in docs]
            measured, predicted = _hits_and_predictions(url, servers, prompts)
            assert predicted == measured
            assert _router_sum(url, "router:kv_event_batches_total") > 0
            # Other clients evict what the router sent: the events tell it.
            _hits_and_predictions(url, servers, [f"{docs[0]}\nQ3?"])
            _flood(servers, "p")
            assert _hits_and_predictions(url, servers, [f"{docs[0]}\nQ4?"]) == (0, 0)
        with router(servers, "--policy", "prefix_approx") as url:
            _hits_and_predictions(url, servers, [f"{docs[1]}\nQ5?"])
            _flood(servers, "q")
            measured, predicted = _hits_and_predictions(url, servers, [f"{docs[1]}\nQ6?"])
            assert measured == 0 and predicted > 0  # it still believes in evicted blocks


def _backend(url: str, replica: RemoteServer) -> dict:
    auth = {"authorization": "Bearer k"}
    listed = httpx.get(url + "/admin/backends", headers=auth).json()["backends"]
    return next(b for b in listed if b["url"] == replica.url)


@pytest.mark.slow  # make test-slow; make test: prefix_precise following evictions
def test_prefix_precise_after_a_replica_restart() -> None:
    with contextlib.ExitStack() as stack:
        a = stack.enter_context(RemoteServer(*SIM_SMALL)).wait_ready()
        b = stack.enter_context(RemoteServer(*SIM_SMALL)).wait_ready()
        doc = _documents(1, "r")[0]
        with router([a, b], "--policy", "prefix_precise", "--api-key", "k") as url:
            _hits_and_predictions(url, [a, b], [f"{doc}\nQ0?"])
            holder = a if (metric(a, "vllm:request_success_total") or 0) else b
            other = b if holder is a else a
            assert _backend(url, holder)["precise_index_blocks"] > 0
            holder.close()  # restart it on the same port: it comes back with an empty cache
            again = stack.enter_context(RemoteServer(*SIM_SMALL, port=holder.port)).wait_ready()
            deadline = time.monotonic() + 30
            while True:  # the router saw it go and come back, and follows its new sockets
                entry = _backend(url, again)
                if entry["healthy"] and entry["precise_index_blocks"] == 0:
                    break
                assert time.monotonic() < deadline, entry
                time.sleep(0.2)
            measured, predicted = _hits_and_predictions(url, [again, other], [f"{doc}\nQ1?"])
            assert predicted == measured == 0  # nobody holds it any more
            measured, predicted = _hits_and_predictions(url, [again, other], [f"{doc}\nQ2?"])
            assert predicted == measured > 0
