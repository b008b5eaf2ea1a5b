"""Shutdown and health (issue 34): a SIGTERM to the whole process group drains as one to the
launcher does, ``/health`` turns 503 the moment a drain starts and says why, restarts are
limited and back off, and no native library's "leaked" report ends the log.

The server tests start their own ``actorserve serve`` (``tests/server_utils.py``) and leave
no process behind; the others check the pieces without one.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import re
import signal
import time
from datetime import datetime
from pathlib import Path

import httpx
import psutil
import pytest

from launch.launcher import Launcher
from services.api_server.app import ServerSettings, build_app
from services.api_server.frontend import EngineFrontend, FrontendEndpoints
from services.config import ConfigError, ServeConfig
from tests.server_utils import RemoteServer
from tests.test_server_faults import StreamInThread, _assert_all_gone

# ---- without a server


def _health(frontend: EngineFrontend) -> httpx.Response:
    app = build_app(frontend, ServerSettings(["m"]))

    async def get() -> httpx.Response:
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://t") as client:
            return await client.get("/health")

    return asyncio.run(get())


def test_health_says_why_it_is_503() -> None:
    """200 (empty, as vLLM's) while serving; 503 with the reason from the moment a drain
    starts, while the engine restarts, and once it is dead."""
    frontend = EngineFrontend(FrontendEndpoints("a", "b", ("c",)), max_model_len=8)
    r = _health(frontend)
    assert r.status_code == 200 and r.content == b""
    frontend.draining = True
    r = _health(frontend)
    assert r.status_code == 503
    assert r.json() == {"status": "draining", "message": "The server is shutting down."}
    frontend.draining = False
    frontend.fail_all("The engine stopped: x.", restarting=True)
    r = _health(frontend)
    assert r.status_code == 503 and r.json()["status"] == "restarting"
    assert "restarting" in r.json()["message"]
    frontend.fail_all("The engine stopped: x.")
    r = _health(frontend)
    assert r.status_code == 503 and r.json()["status"] == "dead"
    frontend.restarted(1.0)
    assert _health(frontend).status_code == 200


def _launcher(tmp_path: Path, *argv: str) -> Launcher:
    from launch.cli import build_parser

    config = ServeConfig.from_cli(build_parser().parse_args(["serve", *argv]))
    config.endpoints.control = f"ipc://{tmp_path}/control"
    return Launcher(config, None)  # type: ignore[arg-type]  # (it keeps no IpcDir)


def test_restart_backoff_doubles_and_the_limit_counts_within_the_window(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    launcher = _launcher(tmp_path, "--max-restarts", "3", "--restart-window", "100",
                         "--restart-backoff", "0.5")  # fmt: skip
    now = [1000.0]
    monkeypatch.setattr(time, "monotonic", lambda: now[0])
    try:
        assert [launcher._next_restart() for _ in range(4)] == [0.5, 1.0, 2.0, None]
        now[0] += 101  # the window forgets them: the backoff starts over
        assert launcher._next_restart() == 0.5
        launcher.config.max_restarts = 100
        delays = [launcher._next_restart() for _ in range(20)]
        assert max(d for d in delays if d is not None) == 60.0  # capped
    finally:
        launcher.control.close()


def test_default_restart_limits_and_their_errors(tmp_path: Path) -> None:
    launcher = _launcher(tmp_path)
    try:
        config = launcher.config
        assert (config.max_restarts, config.restart_window, config.restart_backoff) == (5, 600, 1)
    finally:
        launcher.control.close()
    for argv, message in [
        (["--max-restarts", "-1"], "--max-restarts must be at least 0"),
        (["--restart-window", "0"], "--restart-window must be a positive number"),
        (["--restart-backoff", "nan"], "--restart-backoff must be a number of seconds"),
    ]:
        with pytest.raises(ConfigError, match=message):
            _launcher(tmp_path, *argv)


# ---- a server each


def _no_leak_report(server: RemoteServer) -> None:
    leaked = [line for line in server.log.splitlines() if "leaked" in line]
    assert not leaked, "\n".join(leaked[:5])


def test_sigterm_to_the_process_group_drains_and_exits_0() -> None:
    """What ``timeout`` and systemd (KillMode=control-group) send: SIGTERM to every process
    at once. The streams in flight finish, every process exits 0, nothing is left."""
    with RemoteServer("--shutdown-timeout", "120") as server:
        server.wait_ready()
        streams = [StreamInThread(server.url, f"Count to {i}:", 150) for i in range(2)]
        for s in streams:
            assert s.first.wait(120), server.log
        signalled_at = time.monotonic()
        os.killpg(server.pgid, signal.SIGTERM)
        for s in streams:
            s.join(180)
            assert s.error is None, f"{s.error!r}\n{server.log}"
            assert s.finish_reason == "length"
            assert s.usage is not None and s.usage.completion_tokens == 150
        assert any(s.ended_at is not None and s.ended_at > signalled_at for s in streams)
        assert server.wait_exit(60) == 0, server.log
        _assert_all_gone(server, 5)
        assert "process died" not in server.log, server.log
        _no_leak_report(server)


def test_health_is_503_from_the_moment_a_drain_starts() -> None:
    """SIGTERM to the launcher: while the stream in flight still runs, ``/health`` already
    answers 503 ``draining`` (a balancer stops sending here); the stream then finishes."""
    with RemoteServer("--shutdown-timeout", "120") as server:
        server.wait_ready()
        stream = StreamInThread(server.url, "Once upon a time", 200)
        assert stream.first.wait(120), server.log
        server.popen.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + 30
        while True:
            r = httpx.get(f"{server.url}/health", timeout=10)
            if r.status_code != 200:
                break
            assert time.monotonic() < deadline, "still 200 after SIGTERM"
            time.sleep(0.05)
        assert stream.ended_at is None, "the stream ended before /health turned 503"
        assert r.status_code == 503, r
        assert r.json() == {"status": "draining", "message": "The server is shutting down."}
        stream.join(180)
        assert stream.error is None and stream.finish_reason == "length", repr(stream.error)
        assert server.wait_exit(60) == 0, server.log
        _assert_all_gone(server, 5)
        _no_leak_report(server)


def _log_time(line: str) -> datetime:
    """The timestamp of a log line (``WARNING 12-05 03:03:24 [file.py:1] ...``)."""
    found = re.search(r"\b(\d\d-\d\d \d\d:\d\d:\d\d) \[", line)
    assert found, line
    return datetime.strptime(found.group(1), "%m-%d %H:%M:%S")


def test_an_engine_that_dies_at_once_is_restarted_a_limited_number_of_times() -> None:
    """``--max-restarts 2``: the worker is killed each time it comes up. Two restarts, the
    second one waiting twice as long (``--restart-backoff`` 2 s, then 4 s, in the log's
    timestamps and as the test saw it), ``/health`` 503 ``restarting`` meanwhile, then the
    server stops with exit 1 and says why; no process is left."""
    backoff = 2.0
    with RemoteServer(
        "--restart-on-failure", "--max-restarts", "2", "--restart-backoff", str(backoff)
    ) as server:
        server.wait_ready()
        killed: dict[int, float] = {}  # worker pid -> when the test killed it
        appeared: list[float] = []  # when each worker after the first one showed up
        health: list[httpx.Response] = []
        deadline = time.monotonic() + 300
        while server.popen.poll() is None:
            assert time.monotonic() < deadline, f"still running after 300 s:\n{server.log}"
            pid = server.children().get("worker")
            if pid is not None and pid not in killed:
                if killed:
                    appeared.append(time.monotonic())
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)
                killed[pid] = time.monotonic()
            if killed and not any(r.status_code == 503 for r in health):
                with contextlib.suppress(httpx.TransportError):
                    health.append(httpx.get(f"{server.url}/health", timeout=10))
            time.sleep(0.05)
        assert server.wait_exit(10) == 1, server.log
        _assert_all_gone(server, 10)
        log = server.log
        assert len(killed) == 3, (killed, log)  # the first worker and one per restart
        [r] = [r for r in health if r.status_code == 503]
        assert r.json()["status"] == "restarting", r.json()

        # The backoff, in the log: "restart k of at most 2 ...: starting the engine in D s",
        # then D seconds later "restart k: starting the engine processes".
        lines = log.splitlines()
        for k, delay in ((1, backoff), (2, 2 * backoff)):
            [planned] = [ln for ln in lines if f"restart {k} of at most 2 within 600 s" in ln]
            assert f"starting the engine in {delay:.1f} s" in planned, planned
            [began] = [ln for ln in lines if f"restart {k}: starting the engine processes" in ln]
            waited = (_log_time(began) - _log_time(planned)).total_seconds()
            assert delay - 1 <= waited <= delay + 3, (k, waited, planned, began)
        # ... and as the test saw it: each new worker came up at least the backoff after the
        # previous one was killed.
        kill_times = sorted(killed.values())
        gaps = [up - down for up, down in zip(appeared, kill_times, strict=False)]
        assert len(gaps) == 2 and gaps[0] >= backoff and gaps[1] >= 2 * backoff, gaps
        assert "restart 1 failed: the worker rank 0 process exited with code -9" in log, log
        assert "not restarting the engine again: 2 restart(s) within 600 s already" in log
        assert "(--max-restarts 2, --restart-window 600); shutting the server down" in log
        _no_leak_report(server)


def test_a_worker_that_ends_on_its_own_prints_no_leak_report() -> None:
    """A worker ends by itself when its scheduler goes away (its plan socket's peer is gone):
    the interpreter's teardown then made triton's bindings (imported by torch) print dozens
    of "nanobind: leaked ..." lines. The launcher is held (SIGSTOP) so that the worker
    surely ends on its own, not on the launcher's stop."""
    with RemoteServer() as server:
        server.wait_ready()
        pids = server.children()
        worker = psutil.Process(pids["worker"])
        os.kill(server.popen.pid, signal.SIGSTOP)
        try:
            os.kill(pids["scheduler"], signal.SIGKILL)
            deadline = time.monotonic() + 60
            while worker.status() != psutil.STATUS_ZOMBIE:  # its parent is held: not reaped
                assert time.monotonic() < deadline, "the worker did not end"
                time.sleep(0.1)
        finally:
            os.kill(server.popen.pid, signal.SIGCONT)
        assert server.wait_exit(60) == 1, server.log
        _assert_all_gone(server, 10)
        assert "the scheduler at" in server.log and "went away; exiting" in server.log
        _no_leak_report(server)
