"""Fault tests: each starts its own short-lived ``actorserve serve`` and breaks it.

What must hold: a dead engine process turns in-flight requests into errors
and takes the whole server down (exit non-zero), or with ``--restart-on-failure``
restarts the engine behind the same port (requests still waiting run there with
``--retry-waiting-on-restart``); SIGTERM drains (in-flight
requests finish, every process exits 0); ``kill -9`` of the launcher leaves no
orphan; a client that hangs up gives its KV blocks back. After every test no
process of the server's process group is left (``RemoteServer.close``
SIGKILLs leftovers so one failure never leaks into the next test).
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator

import httpx
import openai
import psutil
import pytest

from tests.server_utils import RemoteServer, free_port, metric, wait_metric

MODEL = "SmolLM2-135M-Instruct"


@pytest.fixture
def make_server() -> Iterator[Callable[..., RemoteServer]]:
    servers: list[RemoteServer] = []

    def make(*args: str) -> RemoteServer:
        servers.append(RemoteServer(*args))
        return servers[-1]

    yield make
    for s in servers:
        s.close()


class StreamInThread:
    """One streaming completion in a thread: ``first`` is set at the first chunk."""

    def __init__(
        self, url: str, prompt: str, max_tokens: int, *, ignore_eos: bool = True, model: str = MODEL
    ) -> None:
        self.first = threading.Event()
        self.text: list[str] = []
        self.finish_reason: str | None = None
        self.usage: openai.types.CompletionUsage | None = None
        self.error: BaseException | None = None
        self.ended_at: float | None = None
        client = openai.OpenAI(base_url=f"{url}/v1", api_key="x", max_retries=0, timeout=120)
        self.model = model
        self._thread = threading.Thread(
            target=self._run, args=(client, prompt, max_tokens, ignore_eos), daemon=True
        )
        self._thread.start()

    def _run(self, client: openai.OpenAI, prompt: str, max_tokens: int, ignore_eos: bool) -> None:
        try:
            stream = client.completions.create(
                model=self.model,
                prompt=prompt,
                max_tokens=max_tokens,
                temperature=0,
                stream=True,
                stream_options={"include_usage": True},
                extra_body={"ignore_eos": ignore_eos},
            )
            for chunk in stream:
                self.first.set()
                for c in chunk.choices:
                    self.text.append(c.text)
                    self.finish_reason = c.finish_reason or self.finish_reason
                self.usage = chunk.usage or self.usage
        except BaseException as e:  # noqa: BLE001 - reported to the test
            self.error = e
        finally:
            self.ended_at = time.monotonic()
            self.first.set()

    def join(self, timeout_s: float) -> None:
        self._thread.join(timeout_s)
        assert not self._thread.is_alive(), "the request did not end"


def _assert_all_gone(server: RemoteServer, timeout_s: float) -> None:
    left = server.wait_all_gone(timeout_s)
    assert not left, f"processes left: {[(p.pid, p.cmdline()) for p in left]}\n{server.log}"


def test_disconnect_frees_blocks_then_sigterm_drains(make_server) -> None:
    # 20 blocks of 16 tokens. The hung-up request holds ~7 of them; the probe
    # needs 15: it can only run if the hung-up request's blocks came back.
    server = make_server(
        "--max-model-len", "256", "--num-gpu-blocks-override", "20", "--shutdown-timeout", "60"
    ).wait_ready()
    with httpx.stream(
        "POST",
        f"{server.url}/v1/completions",
        timeout=120,
        json={"prompt": " hello" * 100, "max_tokens": 150, "ignore_eos": True, "stream": True},
    ) as r:
        assert r.status_code == 200
        events = (line for line in r.iter_lines() if line)  # SSE: blank lines between
        for _ in range(3):
            assert next(events).startswith("data: ")
    if metric(server, "vllm:num_requests_running") is not None:
        assert wait_metric(server, "vllm:num_requests_running", 0.0, timeout_s=20)
        # Cut short by the abort (not finished by itself), so the probe below
        # tests the abort path's freeing.
        assert (metric(server, "vllm:generation_tokens_total") or 0) < 150
    client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="x", max_retries=0, timeout=90)
    probe = client.completions.create(
        model=MODEL,
        prompt=" world" * 230,
        max_tokens=8,
        temperature=0,
        extra_body={"ignore_eos": True},
    )
    assert probe.usage is not None and probe.usage.completion_tokens == 8

    # SIGTERM under load: what is running finishes, new work is refused, all exit 0.
    streams = [StreamInThread(server.url, f"Count to {i}:", 8) for i in range(3)]
    for s in streams:
        assert s.first.wait(120), server.log
    assert not any(s.error for s in streams)
    server.popen.send_signal(signal.SIGTERM)
    refused = None
    deadline = time.monotonic() + 30
    while refused is None and time.monotonic() < deadline:
        try:
            r = httpx.post(f"{server.url}/v1/completions", json={"prompt": "hi"}, timeout=30)
        except httpx.TransportError:
            break  # already closed: the in-flight checks below still apply
        if r.status_code == 503:
            refused = r.json()["error"]
        time.sleep(0.05)
    for s in streams:
        s.join(120)
        assert s.error is None, repr(s.error)
        assert s.finish_reason == "length"
        assert s.usage is not None and s.usage.completion_tokens == 8
        assert "".join(s.text)
    assert refused is None or refused["code"] == 503
    assert server.wait_exit(60) == 0, server.log
    _assert_all_gone(server, 5)


@pytest.mark.slow  # make test-slow; make test: a stopped scheduler, the same path
def test_kill9_worker_fails_requests_and_stops_server(make_server) -> None:
    server = make_server().wait_ready()
    pids = server.children()
    streams = [StreamInThread(server.url, f"Story number {i}:", 300) for i in range(2)]
    for s in streams:
        assert s.first.wait(120), server.log
    health: list[int] = []

    def watch_health() -> None:
        while server.popen.poll() is None:
            try:
                health.append(httpx.get(f"{server.url}/health", timeout=5).status_code)
            except httpx.TransportError:
                if health and health[-1] == 503:
                    return
            time.sleep(0.05)

    watcher = threading.Thread(target=watch_health, daemon=True)
    watcher.start()
    killed_at = time.monotonic()
    os.kill(pids["worker"], signal.SIGKILL)
    for s in streams:
        s.join(60)
        # The engine's error, sent as an SSE error event: not a dropped connection.
        assert isinstance(s.error, openai.APIError), repr(s.error)
        assert not isinstance(s.error, openai.APIConnectionError), repr(s.error)
        assert "engine stopped" in str(s.error), repr(s.error)
        assert s.ended_at is not None and s.ended_at - killed_at < 10
    code = server.wait_exit(60)
    watcher.join(10)
    assert code not in (None, 0), server.log
    assert 503 in health, health
    assert "worker rank 0 process died" in server.log
    _assert_all_gone(server, 5)


def test_kill9_launcher_leaves_no_orphans(make_server) -> None:
    server = make_server().wait_ready()
    assert set(server.children()) == {
        "worker",
        "scheduler",
        "detokenizer",
        "tokenizer",
        "api_server",
    }
    os.kill(server.popen.pid, signal.SIGKILL)
    _assert_all_gone(server, 5)


def _wait_for_child(server: RemoteServer, role: str, timeout_s: float = 120) -> int:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        assert server.popen.poll() is None, server.log
        pid = server.children().get(role)
        if pid is not None:
            return pid
        time.sleep(0.1)
    raise AssertionError(f"no {role} process after {timeout_s} s:\n{server.log}")


def test_sigterm_during_startup_exits_cleanly(make_server) -> None:
    server = make_server()
    _wait_for_child(server, "worker")  # loading the model
    server.popen.send_signal(signal.SIGTERM)
    assert server.wait_exit(60) == 0, server.log
    _assert_all_gone(server, 5)


def test_child_death_during_startup_fails_fast(make_server) -> None:
    server = make_server()
    os.kill(_wait_for_child(server, "worker"), signal.SIGKILL)
    assert server.wait_exit(60) == 1, server.log
    assert "worker rank 0 process exited with code -9 during start-up" in server.log
    _assert_all_gone(server, 5)


def _fault(role: str, sig: signal.Signals, make_server, *flags: str) -> None:
    """Under load (two streams and two plain requests in flight), ``sig`` to the ``role``
    process: every request ends with an error within 20 s (none waits forever), the
    launcher names the process and exits non-zero, and no process is left."""
    server = make_server(*flags).wait_ready()
    pid = server.children()[role]
    streams = [StreamInThread(server.url, f"Story number {i}:", 400) for i in range(2)]
    for s in streams:
        assert s.first.wait(120), server.log
    plain: list[BaseException | int] = []
    plain_ended: list[float] = []

    def complete(i: int) -> None:
        try:
            r = httpx.post(f"{server.url}/v1/completions", timeout=120,
                           json={"prompt": f"Tale {i}:", "max_tokens": 400, "ignore_eos": True})  # fmt: skip
            plain.append(r.status_code)
        except httpx.HTTPError as e:
            plain.append(e)
        plain_ended.append(time.monotonic())

    threads = [threading.Thread(target=complete, args=(i,), daemon=True) for i in range(2)]
    for t in threads:
        t.start()
    time.sleep(0.5)
    hit_at = time.monotonic()
    os.kill(pid, sig)
    try:
        for s in streams:
            s.join(30)
            assert s.error is not None, f"a stream finished normally: {s.finish_reason}"
            assert s.ended_at is not None and s.ended_at - hit_at < 20
        for t in threads:
            t.join(30)
            assert not t.is_alive(), "a plain request did not end"
        assert all(not isinstance(p, int) or p >= 500 for p in plain), plain
        code = server.wait_exit(60)
        assert code not in (None, 0), server.log
        ended = [s.ended_at - hit_at for s in streams if s.ended_at] + [
            t - hit_at for t in plain_ended
        ]
        kinds = sorted({type(e).__name__ if not isinstance(e, int) else str(e) for e in plain})
        print(f"\nFAULT {role} {sig.name}: requests ended {min(ended):.1f}-{max(ended):.1f} s "
              f"after; plain requests got {kinds}; exit {code} "
              f"{time.monotonic() - hit_at:.1f} s after")  # fmt: skip
        name = "worker rank 0" if role == "worker" else role
        verb = "was stopped" if sig == signal.SIGSTOP else "died"
        assert f"the {name} process {verb}" in server.log, server.log
        _assert_all_gone(server, 10)
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGCONT)


def test_a_stopped_scheduler_fails_requests_and_stops_server(make_server) -> None:
    """SIGSTOP leaves a process alive but silent: the launcher sees it stopped and treats
    it as dead (no request waits forever)."""
    _fault("scheduler", signal.SIGSTOP, make_server)


_ROLES = ("api_server", "tokenizer", "scheduler", "worker", "detokenizer")


@pytest.mark.slow
@pytest.mark.parametrize("sig", [signal.SIGKILL, signal.SIGSTOP], ids=["kill9", "sigstop"])
@pytest.mark.parametrize("role", _ROLES)
def test_every_process_kind_killed_or_stopped_under_load(role, sig, make_server) -> None:
    _fault(role, sig, make_server)


def _post_completion(url: str, prompt: str, max_tokens: int, out: list) -> None:
    try:
        r = httpx.post(f"{url}/v1/completions", timeout=180,
                       json={"prompt": prompt, "max_tokens": max_tokens, "ignore_eos": True,
                             "temperature": 0})  # fmt: skip
        out.append(r)
    except httpx.HTTPError as e:
        out.append(e)


def _restart(role: str, sig: signal.Signals, make_server) -> None:
    """``--restart-on-failure --retry-waiting-on-restart`` with one request running and two
    waiting behind it (``--max-num-seqs 1``): ``sig`` to ``role``. The running stream ends
    with the engine's error event; meanwhile /health and new requests get 503; the new
    engine (new processes, same api_server and port) runs the two waiting requests to the
    same greedy text a fresh request gets, with an empty KV cache after; SIGTERM then
    drains and every process exits."""
    server = make_server(
        "--restart-on-failure", "--retry-waiting-on-restart", "--max-num-seqs", "1",
        "--enable-log-requests", "--enable-log-outputs",
    ).wait_ready()  # fmt: skip
    before = server.children()
    running = StreamInThread(server.url, "Story number 1:", 400)
    assert running.first.wait(120), server.log
    waiting_stream = StreamInThread(server.url, "Count to five:", 12)
    waiting_plain: list = []
    plain = threading.Thread(
        target=_post_completion, args=(server.url, "Tale 2:", 12, waiting_plain), daemon=True
    )
    plain.start()
    deadline = time.monotonic() + 30
    while httpx.get(f"{server.url}/load", timeout=10).json()["num_requests_waiting"] < 2:
        assert time.monotonic() < deadline, "the two requests never queued"
        time.sleep(0.05)
    hit_at = time.monotonic()
    os.kill(before[role], sig)
    try:
        refused: dict | None = None
        health: list[int] = []
        while 503 not in health or health[-1] != 200:  # the launcher sees it, then recovers
            assert 503 in health or time.monotonic() - hit_at < 10, "still healthy"
            assert time.monotonic() - hit_at < 180, f"no recovery:\n{server.log}"
            assert server.popen.poll() is None, server.log
            health.append(httpx.get(f"{server.url}/health", timeout=10).status_code)
            if health[-1] == 503 and refused is None:
                r = httpx.post(f"{server.url}/v1/completions", json={"prompt": "hi"}, timeout=10)
                if r.status_code == 503:
                    refused = r.json()["error"]
            time.sleep(0.1)
        serving_at = time.monotonic()
        assert refused is not None and "restarting" in refused["message"], refused

        running.join(60)
        assert isinstance(running.error, openai.APIError), repr(running.error)
        assert not isinstance(running.error, openai.APIConnectionError), repr(running.error)
        assert "engine stopped" in str(running.error), repr(running.error)
        assert running.ended_at is not None and running.ended_at - hit_at < 20

        waiting_stream.join(120)
        plain.join(120)
        assert waiting_stream.error is None, repr(waiting_stream.error)
        assert waiting_stream.usage is not None and waiting_stream.usage.completion_tokens == 12
        [r] = waiting_plain
        assert isinstance(r, httpx.Response) and r.status_code == 200, r
        again: list = []
        _post_completion(server.url, "Tale 2:", 12, again)
        assert again[0].json()["choices"][0]["text"] == r.json()["choices"][0]["text"]

        after = server.children()
        assert after["api_server"] == before["api_server"]
        assert after[role] != before[role]
        assert not psutil.pid_exists(before[role]) or psutil.Process(before[role]).status() == (
            psutil.STATUS_ZOMBIE
        )
        assert metric(server, "actorserve:engine_restarts_total") == 1.0
        recovery_s = metric(server, "actorserve:engine_recovery_seconds_sum")
        assert recovery_s is not None and 0 < recovery_s < serving_at - hit_at
        assert wait_metric(server, "vllm:kv_cache_usage_perc", 0.0, timeout_s=20)
        assert wait_metric(server, "vllm:num_requests_running", 0.0, timeout_s=20)
        name = "worker rank 0" if role == "worker" else role
        verb = "was stopped" if sig == signal.SIGSTOP else "died"
        assert f"the {name} process {verb}" in server.log, server.log
        assert "the engine restarted in" in server.log
        # The old tokenizer took it, the new one again (--enable-log-requests shows it).
        received = [ln for ln in server.log.splitlines() if "Received request" in ln]
        assert sum("prompt: 'Tale 2:'" in ln for ln in received) == 3, received  # with `again`
        text = r.json()["choices"][0]["text"]
        assert any(f"output: {text!r}" in ln for ln in server.log.splitlines()), server.log
        print(f"\nRESTART {role} {sig.name}: serving again {recovery_s:.1f} s after the "
              f"launcher saw it ({serving_at - hit_at:.1f} s after the signal, as polled)")  # fmt: skip
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.kill(before[role], signal.SIGCONT)
    server.popen.send_signal(signal.SIGTERM)
    assert server.wait_exit(60) == 0, server.log
    _assert_all_gone(server, 5)


def test_restart_on_failure_after_a_worker_is_killed(make_server) -> None:
    _restart("worker", signal.SIGKILL, make_server)


@pytest.mark.slow
@pytest.mark.parametrize("sig", [signal.SIGKILL, signal.SIGSTOP], ids=["kill9", "sigstop"])
@pytest.mark.parametrize("role", ("tokenizer", "scheduler", "worker", "detokenizer"))
def test_restart_on_failure_for_every_engine_process(role, sig, make_server) -> None:
    _restart(role, sig, make_server)


@pytest.mark.slow
def test_restart_on_failure_does_not_cover_the_api_server(make_server) -> None:
    """The api_server holds the port and every client connection: its death still ends
    the server (exit 1, no orphans), with or without the flag."""
    _fault("api_server", signal.SIGKILL, make_server, "--restart-on-failure")


# ---- the router and the PD proxy: one process each, in front of (simulated) servers

_SIM = ("--worker-backend", "sim", "--sim-model", "llama-3-8b", "--sim-hardware", "h200",
        "--kv-cache-memory-bytes", "1GiB", "--sim-speed", "2")  # fmt: skip


def _p2p(role: str) -> tuple[str, str]:
    cfg = {"kv_connector": "p2p", "kv_role": role, "kv_port": free_port(),
           "kv_connector_extra_config": {"lease_s": 5}}  # fmt: skip
    return "--kv-transfer-config", json.dumps(cfg)


def _start_proxy(kind: str, servers: list[RemoteServer]) -> tuple[subprocess.Popen[bytes], str]:
    port = free_port()
    cmd = [sys.executable, "-m", "launch.cli", kind, "--port", str(port)]
    if kind == "router":
        cmd += ["--backend", servers[0].url]
    else:
        cmd += ["--prefill", servers[0].url, "--decode", servers[1].url]
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 60
    while True:
        with contextlib.suppress(httpx.HTTPError):
            if httpx.get(url + "/health", timeout=2).status_code == 200:
                return proc, url
        assert proc.poll() is None and time.monotonic() < deadline, f"{kind} did not start"
        time.sleep(0.2)


def _proxy_fault(kind: str, sig: signal.Signals, make_server) -> None:
    """Two streams and two plain requests in flight through the router (or the PD proxy),
    then ``sig`` to it. kill -9: every client's request ends at once (its connection
    closes); either way the servers behind it are not held: their requests end (aborted
    when the connection drops, or run to the end into the socket buffers of a stopped
    proxy) and every KV block comes back (a prefill hold lapses with its 5 s lease)."""
    roles = [("kv_producer",), ("kv_consumer",)] if kind == "pd-proxy" else [()]
    servers = [make_server(*_SIM, *(_p2p(r[0]) if r else ())) for r in roles]
    for server in servers:
        server.wait_ready()
    proc, url = _start_proxy(kind, servers)
    try:
        streams = [StreamInThread(url, f"Story {i}:", 400, model="llama-3-8b") for i in range(2)]
        plain: list = []
        threads = [
            threading.Thread(
                target=_post_completion, args=(url, f"Tale {i}:", 400, plain), daemon=True
            )
            for i in range(2)
        ]
        for t in threads:
            t.start()
        for st in streams:
            assert st.first.wait(60), [s.log for s in servers]
        hit_at = time.monotonic()
        os.kill(proc.pid, sig)
        if sig == signal.SIGKILL:
            for st in streams:
                st.join(10)
                assert st.error is not None and st.ended_at is not None
                assert st.ended_at - hit_at < 5, st.ended_at - hit_at
            for t in threads:
                t.join(10)
                assert not t.is_alive()
            assert all(isinstance(r, httpx.HTTPError) for r in plain), plain
        idle_after = []
        for server in servers:
            assert wait_metric(server, "vllm:num_requests_running", 0.0, 60), server.log
            assert wait_metric(server, "vllm:kv_cache_usage_perc", 0.0, 60), server.log
            idle_after.append(time.monotonic() - hit_at)
            assert (
                server.popen.poll() is None and httpx.get(server.url + "/health").status_code == 200
            )
        print(f"\nFAULT {kind} {sig.name}: the servers behind it idle, KV 0, "
              f"{max(idle_after):.1f} s after")  # fmt: skip
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.kill(proc.pid, signal.SIGCONT)
        proc.kill()
        proc.wait(10)


@pytest.mark.slow
@pytest.mark.parametrize("sig", [signal.SIGKILL, signal.SIGSTOP], ids=["kill9", "sigstop"])
@pytest.mark.parametrize("kind", ["router", "pd-proxy"])
def test_the_router_or_pd_proxy_killed_or_stopped_under_load(kind, sig, make_server) -> None:
    _proxy_fault(kind, sig, make_server)
