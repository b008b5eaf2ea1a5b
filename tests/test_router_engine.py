"""``actorserve router`` (the command, as a user starts it) in front of two real servers on
the simulated backend: the router's block hashes are the engine's, so the cache hits it
predicts are exactly the hits the replicas report (``vllm:prefix_cache_hits``), through the
replicas' ``/tokenize`` and through the router's own tokenizer, for completions and chat.
"""

from __future__ import annotations

import contextlib
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator

import httpx
import pytest

from tests.server_utils import REPO, RemoteServer, free_port, metric

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
    with tempfile.TemporaryFile() as log:
        proc = subprocess.Popen(cmd, cwd=REPO, stdout=log, stderr=subprocess.STDOUT)
        try:
            deadline = time.monotonic() + 60
            while True:
                with contextlib.suppress(httpx.HTTPError):
                    if httpx.get(url + "/health", timeout=2).status_code == 200:
                        break
                if proc.poll() is not None or time.monotonic() > deadline:
                    log.seek(0)
                    raise RuntimeError(f"router did not start:\n{log.read().decode()}")
                time.sleep(0.2)
            yield url
        finally:
            proc.terminate()
            proc.wait(10)


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
