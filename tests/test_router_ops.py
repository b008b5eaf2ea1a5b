"""Operating the router and the PD proxy (issue 34): SIGTERM drains in-flight streams and
exits 0, the log says where they listen and how each backend fares, in the servers' format
(every line prefixed), a backend URL without a scheme or a taken port is one ``error:``
line and exit 2, and an access line per request (the api_server's too).

The router and the proxy run as the user starts them (``python -m launch.cli``) in front of
scriptable replicas (tests/router_fakes.py); the api_server's access line is checked on the
fake engine (tests/fake_engine.py).
"""

from __future__ import annotations

import contextlib
import logging
import re
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import httpx
import pytest
from fastapi import Request
from fastapi.responses import JSONResponse

from launch.ports import check_port
from services.flags import ConfigError
from services.logging_utils import PrefixedFormatter
from tests.router_fakes import FakeReplica, free_port, wait_for

REPO = Path(__file__).resolve().parent.parent
# The servers' line (services/logging_utils.py): ``INFO 11-29 17:02:03 [file.py:42] message``.
LINE = re.compile(
    r"^(DEBUG|INFO|WARNING|ERROR|CRITICAL) \d\d-\d\d \d\d:\d\d:\d\d \[[\w.\-]+:\d+\] "
)
ACCESS = re.compile(r"POST /v1/completions 200 id=\S+ .*latency=\d+\.\d{3}s")


class Proc:
    """``python -m launch.cli ARGS`` with its output in a file; killed on exit if still up."""

    def __init__(self, *args: str) -> None:
        self._out = tempfile.NamedTemporaryFile(prefix="router-ops-", suffix=".log")  # noqa: SIM115 - closed in close()
        self.popen = subprocess.Popen(
            [sys.executable, "-m", "launch.cli", *args],
            cwd=REPO,
            stdin=subprocess.DEVNULL,
            stdout=self._out,
            stderr=subprocess.STDOUT,
        )

    @property
    def log(self) -> str:
        return Path(self._out.name).read_text(errors="replace")

    def wait_log(self, pattern: str, timeout_s: float = 30.0) -> None:
        wait_for(f"{pattern!r} in the log", lambda: re.search(pattern, self.log) or (
            self.popen.poll() is not None and pytest.fail(f"exited:\n{self.log}")
        ), timeout_s)  # fmt: skip

    def wait_healthy(self, url: str, timeout_s: float = 60.0) -> None:
        def ok() -> bool:
            if self.popen.poll() is not None:
                pytest.fail(f"exited with {self.popen.returncode}:\n{self.log}")
            with contextlib.suppress(httpx.HTTPError):
                return httpx.get(url + "/health", timeout=2).status_code == 200
            return False

        wait_for("the process to answer /health", ok, timeout_s)

    def close(self) -> None:
        if self.popen.poll() is None:
            self.popen.kill()
        self.popen.wait(10)
        self._out.close()


@pytest.fixture
def procs() -> Iterator[Callable[..., Proc]]:
    started: list[Proc] = []

    def start(*args: str) -> Proc:
        started.append(Proc(*args))
        return started[-1]

    yield start
    for p in started:
        p.close()


@pytest.fixture
def replica() -> Iterator[FakeReplica]:
    r = FakeReplica("a")
    yield r
    r.stop()


class FakePrefill(FakeReplica):
    """A prefill instance: a whole answer of one token with its ``kv_transfer_params``."""

    def app(self):  # noqa: ANN201
        app = super().app()

        @app.middleware("http")
        async def prefill(request: Request, call_next):  # noqa: ANN001, ANN202
            if request.method == "POST" and request.url.path.endswith("completions"):
                body = await request.json()
                self.bodies.append(body)
                return JSONResponse({"id": "p", "object": "text_completion", "created": 0,
                                     "model": "fake", "choices": [{"index": 0, "text": " p",
                                     "finish_reason": "length"}],
                                     "kv_transfer_params": {"remote_host": "h"}})  # fmt: skip
            return await call_next(request)

        return app


class Stream(threading.Thread):
    """A streamed completion through ``url``; ``first`` is set at its first chunk."""

    def __init__(self, url: str, max_tokens: int) -> None:
        super().__init__(daemon=True)
        self.url, self.max_tokens = url, max_tokens
        self.first = threading.Event()
        self.body = ""
        self.status: int | None = None
        self.error: BaseException | None = None
        self.start()

    def run(self) -> None:
        body = {"model": "fake", "prompt": "once upon a time", "max_tokens": self.max_tokens,
                "stream": True}  # fmt: skip
        try:
            with httpx.stream("POST", self.url + "/v1/completions", json=body, timeout=60) as r:
                self.status = r.status_code
                for chunk in r.iter_text():
                    self.body += chunk
                    self.first.set()
        except BaseException as e:  # noqa: BLE001 - the test reads it
            self.error = e
        finally:
            self.first.set()


def _sigterm_drains(proc: Proc, url: str, replica: FakeReplica) -> None:
    """A stream in flight, then SIGTERM: /health turns 503 at once, the stream ends whole
    (every token, then [DONE]), and the process exits 0 with the drain in its log."""
    replica.chunk_delay = 0.1  # 50 tokens: 5 s of stream
    stream = Stream(url, 50)
    assert stream.first.wait(30) and stream.error is None, (stream.error, proc.log)
    proc.popen.send_signal(signal.SIGTERM)

    def health_503() -> bool:
        with contextlib.suppress(httpx.HTTPError):
            return httpx.get(url + "/health", timeout=2).status_code == 503
        return False

    wait_for("/health to answer 503 while draining", health_503, 10)
    assert stream.is_alive(), "the stream ended before the drain was seen"
    assert proc.popen.wait(30) == 0, proc.log
    stream.join(10)
    assert stream.error is None and stream.status == 200, (stream.error, proc.log)
    assert stream.body.count(" a") == 50 and stream.body.rstrip().endswith("data: [DONE]")
    log = proc.log
    assert re.search(r"draining 1 request", log) and " drained in " in log, log
    assert " stopped" in log, log


def test_router_sigterm_drains_an_in_flight_stream_and_exits_0(procs, replica) -> None:  # noqa: ANN001
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    proc = procs("router", "--backend", replica.url, "--port", str(port),
                 "--policy", "round_robin", "--shutdown-timeout", "30")  # fmt: skip
    proc.wait_healthy(url)
    _sigterm_drains(proc, url, replica)


def test_router_cuts_what_outlasts_the_shutdown_timeout_and_exits_0(procs, replica) -> None:  # noqa: ANN001
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    proc = procs("router", "--backend", replica.url, "--port", str(port),
                 "--shutdown-timeout", "0.5")  # fmt: skip
    proc.wait_healthy(url)
    replica.chunk_delay = 0.2  # 200 tokens: 40 s of stream
    stream = Stream(url, 200)
    assert stream.first.wait(30) and stream.error is None, (stream.error, proc.log)
    proc.popen.send_signal(signal.SIGTERM)
    assert proc.popen.wait(30) == 0, proc.log
    stream.join(10)
    assert not stream.is_alive() and "[DONE]" not in stream.body
    assert "shutdown timeout (0.5 s): cutting 1 request(s) still in flight" in proc.log, proc.log


def test_pd_proxy_sigterm_drains_an_in_flight_stream_and_exits_0(procs, replica) -> None:  # noqa: ANN001
    prefill = FakePrefill("p")
    try:
        port = free_port()
        url = f"http://127.0.0.1:{port}"
        proc = procs("pd-proxy", "--prefill", prefill.url, "--decode", replica.url,
                     "--port", str(port))  # fmt: skip
        proc.wait_healthy(url)
        _sigterm_drains(proc, url, replica)
        assert prefill.bodies and prefill.bodies[0]["max_tokens"] == 1
        assert replica.bodies[0]["kv_transfer_params"] == {"remote_host": "h"}
    finally:
        prefill.stop()


def test_router_logs_where_it_listens_backend_changes_and_requests(procs, replica) -> None:  # noqa: ANN001
    """Where it listens, each backend's arrival and health changes, and an access line per
    request; every line of its output in the servers' format."""
    port, dead = free_port(), free_port()
    url = f"http://127.0.0.1:{port}"
    proc = procs("router", "--backend", replica.url, "--backend", f"http://127.0.0.1:{dead}",
                 "--port", str(port), "--health-check-interval", "0.2",
                 "--uvicorn-log-level", "info")  # fmt: skip
    proc.wait_healthy(url)
    proc.wait_log(rf"router listening on {re.escape(url)}")
    assert re.search(rf"backend {re.escape(replica.url)} added: healthy", proc.log), proc.log
    assert re.search(rf"backend http://127.0.0.1:{dead} added: unhealthy \(\w+", proc.log)

    replica.healthy = False
    proc.wait_log(rf"backend {re.escape(replica.url)} unhealthy: GET /health answered 503")
    replica.healthy = True
    proc.wait_log(rf"backend {re.escape(replica.url)} healthy\n")
    proc.wait_healthy(url)

    r = httpx.post(url + "/v1/completions", json={"prompt": "hi", "max_tokens": 3}, timeout=30)
    assert r.status_code == 200, r.text
    proc.wait_log(ACCESS.pattern)
    proc.wait_log(r"POST /v1/completions 200 id=x prompt_tokens=1 completion_tokens=3 latency=")
    # A relayed stream's line (the answer keeps what it says: no middleware wraps its send)
    # and a request that fails in the router (a body that is not JSON: passed on, the fake
    # replica's 500 is the answer) have theirs too.
    body = {"prompt": "one two", "max_tokens": 5, "stream": True,
            "stream_options": {"include_usage": True}}  # fmt: skip
    with httpx.stream("POST", url + "/v1/completions", json=body, timeout=30) as s:
        assert s.status_code == 200 and "[DONE]" in "".join(s.iter_text())
    proc.wait_log(r"POST /v1/completions 200 id=x prompt_tokens=2 completion_tokens=5 latency=")
    r = httpx.post(url + "/v1/chat/completions", content=b"{", timeout=30)
    proc.wait_log(rf"POST /v1/chat/completions {r.status_code} latency=")
    assert (
        "GET /health 200" not in proc.log
    )  # probes have none (--disable-access-log-for-endpoints)

    proc.popen.send_signal(signal.SIGTERM)
    assert proc.popen.wait(30) == 0, proc.log
    lines = proc.log.splitlines()
    # uvicorn's own lines too; but its first two (INFO, before the app's lifespan starts)
    # are written before the router can set uvicorn's loggers up (services/http/server.py)
    early = ("INFO:     Started server process", "INFO:     Waiting for application startup.")
    odd = [line for line in lines if not LINE.match(line) and not line.startswith(early)]
    assert lines and not odd, "\n".join(odd)
    assert any(LINE.match(line) and "Application startup complete" in line for line in lines)


def test_access_lines_skip_each_generate_path_named(procs, replica) -> None:  # noqa: ANN001
    """``--disable-access-log-for-endpoints`` naming one generate route silences that one
    only (the generate routes log their lines themselves, before the middlewares)."""
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    proc = procs("router", "--backend", replica.url, "--port", str(port),
                 "--disable-access-log-for-endpoints", "/v1/completions,/health")  # fmt: skip
    proc.wait_healthy(url)
    r = httpx.post(url + "/v1/completions", json={"prompt": "hi", "max_tokens": 2}, timeout=30)
    assert r.status_code == 200, r.text
    chat = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
    r = httpx.post(url + "/v1/chat/completions", json=chat, timeout=30)
    assert r.status_code == 200, r.text
    proc.wait_log(r"POST /v1/chat/completions 200 ")  # (logged after the first request's)
    assert "POST /v1/completions" not in proc.log, proc.log


def _get_health(sock: socket.socket) -> bytes:
    """``GET /health`` on a kept-alive connection, its answer read to its end (the body's
    length from its header); the answer's status line."""
    sock.sendall(b"GET /health HTTP/1.1\r\nhost: x\r\n\r\n")
    got = b""
    while b"\r\n\r\n" not in got or len(got) < _answer_length(got):
        piece = sock.recv(65536)
        if not piece:
            return b"(closed by the server)"
        got += piece
    return got.split(b"\r\n", 1)[0]


def _answer_length(got: bytes) -> int:
    head, _, _ = got.partition(b"\r\n\r\n")
    length = re.search(rb"(?im)^content-length:\s*(\d+)", head)
    return len(head) + 4 + (int(length.group(1)) if length else 0)


def test_idle_client_connections_outlast_the_clients_own(procs, replica) -> None:  # noqa: ANN001
    """An idle client connection stays open longer than clients keep theirs (httpx's and
    the openai client's 5 s): the router closing it at 5 s, as uvicorn does by default,
    races a client's next request on it, which fails (``ReadError``, 1 request in ~800 in
    bench/router_cpu.py). ``--timeout-keep-alive`` sets it (the PD proxy's too)."""
    expiry = httpx.Limits(max_connections=None).keepalive_expiry or 5.0  # httpx's default
    ports = free_port(), free_port()
    router = procs("router", "--backend", replica.url, "--port", str(ports[0]))
    short = procs("pd-proxy", "--prefill", replica.url, "--decode", replica.url,
                  "--port", str(ports[1]), "--timeout-keep-alive", "1")  # fmt: skip
    for proc, port in zip((router, short), ports, strict=True):
        proc.wait_healthy(f"http://127.0.0.1:{port}")
    conns = [socket.create_connection(("127.0.0.1", port), timeout=10) for port in ports]
    try:
        assert [_get_health(c) for c in conns] == [b"HTTP/1.1 200 OK"] * 2
        idle_since = time.monotonic()
        conns[1].settimeout(10)
        assert conns[1].recv(1) == b"", "the PD proxy closes an idle connection after 1 s"
        assert time.monotonic() - idle_since < 5
        while time.monotonic() - idle_since < expiry + 1:  # idle past the client's expiry
            time.sleep(0.2)
        assert _get_health(conns[0]) == b"HTTP/1.1 200 OK"
    finally:
        for c in conns:
            c.close()


def test_pd_proxy_logs_its_sides_in_the_servers_format(procs, replica) -> None:  # noqa: ANN001
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    proc = procs("pd-proxy", "--prefill", f"http://127.0.0.1:{free_port()}",
                 "--decode", replica.url, "--port", str(port))  # fmt: skip
    proc.wait_log(rf"PD proxy listening on {re.escape(url)}")
    assert re.search(rf"decode {re.escape(replica.url)} added: healthy", proc.log), proc.log
    assert re.search(r"prefill http://\S+ added: unhealthy", proc.log), proc.log
    assert httpx.get(url + "/health", timeout=5).status_code == 503  # no healthy prefill
    proc.popen.send_signal(signal.SIGTERM)
    assert proc.popen.wait(30) == 0, proc.log
    assert all(LINE.match(line) for line in proc.log.splitlines()), proc.log


@pytest.mark.parametrize(
    "args, flag",
    [
        (["router", "--backend", "127.0.0.1:8001"], "--backend"),
        (["router", "--backend", "localhost:8001"], "--backend"),
        (["router", "--backend", "ftp://127.0.0.1:8001"], "--backend"),
        (
            ["pd-proxy", "--prefill", "http://127.0.0.1:8001", "--decode", "127.0.0.1:8002"],
            "--decode",
        ),
        (["router", "--backend", "http://127.0.0.1:8001", "--port", "70000"], "--port"),
        (
            [
                "pd-proxy",
                "--prefill",
                "http://127.0.0.1:1",
                "--decode",
                "http://127.0.0.1:2",
                "--port",
                "0",
            ],
            "--port",
        ),
    ],
)
def test_bad_backend_url_or_port_is_one_error_line_and_exit_2(args, flag) -> None:  # noqa: ANN001
    done = subprocess.run([sys.executable, "-m", "launch.cli", *args], cwd=REPO,
                          capture_output=True, text=True, timeout=120)  # fmt: skip
    assert done.returncode == 2, done.stderr
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"error: {flag}"), done.stderr


@pytest.mark.parametrize("kind", ["router", "pd-proxy"])
def test_a_taken_port_is_one_error_line_and_exit_2(kind) -> None:  # noqa: ANN001
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        sides = (["--backend", "http://127.0.0.1:1"] if kind == "router"
                 else ["--prefill", "http://127.0.0.1:1", "--decode", "http://127.0.0.1:2"])  # fmt: skip
        done = subprocess.run(
            [sys.executable, "-m", "launch.cli", kind, *sides, "--port", str(port)],
            cwd=REPO, capture_output=True, text=True, timeout=120,
        )  # fmt: skip
    assert done.returncode == 2, done.stderr
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: --port"), done.stderr
    assert f"127.0.0.1:{port}" in lines[0] and "already in use" in lines[0], done.stderr


def test_check_port() -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        with pytest.raises(ConfigError, match="already in use"):
            check_port("127.0.0.1", taken.getsockname()[1])
    for bad in (0, -1, 65536):
        with pytest.raises(ConfigError, match="not a port number"):
            check_port("127.0.0.1", bad)
    check_port("127.0.0.1", free_port())


def test_every_line_of_a_record_is_prefixed_and_one_line_records_are_unchanged() -> None:
    plain = logging.Formatter(
        "%(levelname)s %(asctime)s [%(filename)s:%(lineno)d] %(message)s", "%m-%d %H:%M:%S"
    )
    one = logging.LogRecord("services.x", logging.INFO, "/a/b.py", 7, "hello %s", ("you",), None)
    assert PrefixedFormatter().format(one) == plain.format(one)  # the server's lines as they were
    try:
        raise ValueError("first\nsecond")
    except ValueError:
        exc = sys.exc_info()
    many = logging.LogRecord("services.x", logging.ERROR, "/a/b.py", 9, "two\nlines", (), exc)
    lines = PrefixedFormatter().format(many).splitlines()
    assert len(lines) > 4 and all(LINE.match(line) for line in lines), lines
    assert lines[0].endswith("] two") and lines[1].endswith("] lines")
    assert any(line.endswith("] Traceback (most recent call last):") for line in lines)


def test_api_server_logs_an_access_line_per_request(server, caplog) -> None:  # noqa: ANN001
    """The api_server (on the fake engine): one line per request with its id, route,
    status, tokens and latency, without --enable-log-requests."""
    base = server[0]
    caplog.set_level(logging.INFO, logger="services.http.access")
    r = httpx.post(base + "/v1/completions",
                   json={"model": "smollm2-test", "prompt": "Hello", "max_tokens": 5}, timeout=30)  # fmt: skip
    assert r.status_code == 200, r.text
    usage = r.json()["usage"]
    want = (f"POST /v1/completions 200 id={r.json()['id']} "
            f"prompt_tokens={usage['prompt_tokens']} completion_tokens={usage['completion_tokens']} "
            "latency=")  # fmt: skip
    wait_for("the access line", lambda: any(
        m.startswith(want) for m in (rec.getMessage() for rec in caplog.records)
    ), 10)  # fmt: skip

    body = {"model": "smollm2-test", "prompt": "Hello", "max_tokens": 4, "stream": True,
            "stream_options": {"include_usage": True}}  # fmt: skip
    with httpx.stream("POST", base + "/v1/completions", json=body, timeout=30) as s:
        text = "".join(s.iter_text())
    stream_id = re.search(r'"id": ?"([^"]+)"', text).group(1)  # type: ignore[union-attr]
    wait_for("the stream's access line", lambda: any(
        re.match(rf"POST /v1/completions 200 id={re.escape(stream_id)} prompt_tokens=\d+ "
                 r"completion_tokens=4 latency=\d+\.\d{3}s", rec.getMessage())
        for rec in caplog.records
    ), 10)  # fmt: skip
