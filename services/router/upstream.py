"""The router's HTTP/1.1 client for generate requests: one keep-alive pool per replica,
responses parsed by llhttp (``httptools``, uvicorn's parser) in the connection's protocol.

Why not httpx: a streamed answer is ~130 SSE events, and each one through httpx (httpcore,
h11 in Python, anyio) cost the router ~50 us of CPU before it was relayed, about half of
its whole CPU per request (``bench/router_cpu.py``). Here an event costs a C parse and a
list append; what arrives while the relay is busy is handed over joined, in one piece.

The parts of httpx the router relied on, kept: a connect timeout (``CONNECT_TIMEOUT_S``)
and none after it (a stream may be silent for minutes); the errors are httpx's
(``ConnectError``, ``ConnectTimeout``, ``ReadError``, ``RemoteProtocolError``: the router
catches ``httpx.TransportError``), https through httpx's default SSL context; a
connection whose answer was not read to its end is closed, never reused (the replica
sees the disconnect and aborts the request). A request on a reused connection that the
replica closed meanwhile (its keep-alive timeout) is sent again on a new one before
anything else happens. Not kept: proxies from the environment (the router talks to its
replicas directly) and HTTP/2.
"""

from __future__ import annotations

import asyncio
import contextlib
import ssl
from collections.abc import Callable
from urllib.parse import urlsplit

import httptools
import httpx

CONNECT_TIMEOUT_S = 5.0
MAX_IDLE = 256  # connections kept open per replica between requests
_PAUSE_BYTES = 1 << 20  # a consumer this far behind: stop reading the socket until it catches up
_ssl_context: ssl.SSLContext | None = None


def _default_ssl() -> ssl.SSLContext:
    global _ssl_context
    if _ssl_context is None:
        _ssl_context = httpx.create_ssl_context()
    return _ssl_context


class UpstreamResponse:
    """An answer arriving: status and headers once they came, then its body as it comes.

    Two ways to take the body: pull (``receive``: whatever arrived since the last call,
    joined; b"" at the end), or push (``sink``: called with each piece from the
    connection's ``data_received``, no task woken for it; it returns False to stop, and
    the pieces after that are buffered for ``take`` until a sink is set again)."""

    def __init__(self, conn: _Connection) -> None:
        self._conn: _Connection | None = conn
        self.status_code = 0
        self.raw_headers: list[tuple[bytes, bytes]] = []
        self.content_type = b""
        self.sink: Callable[[bytes], bool] | None = None
        self._chunks: list[bytes] = []
        self._buffered = 0
        self._complete = False
        self._error: Exception | None = None
        self._waiter: asyncio.Future[None] | None = None
        self._paused = False

    # ---- the consumer's side

    @property
    def complete(self) -> bool:
        return self._complete

    @property
    def ended(self) -> bool:
        """Complete, failed or closed: nothing more will come."""
        return self._complete or self._error is not None

    def take(self) -> bytes:
        """What is buffered, joined (b"" when nothing is)."""
        chunks = self._chunks
        if not chunks:
            return b""
        data = chunks[0] if len(chunks) == 1 else b"".join(chunks)
        chunks.clear()
        self._buffered = 0
        if self._paused and self._conn is not None:
            self._paused = False
            self._conn.resume()
        return data

    def raise_error(self) -> None:
        """The connection's error, if it failed (or was closed before the end)."""
        if self._error is not None:
            raise self._error

    async def wait(self) -> None:
        """Until something happens: bytes buffered, the sink stopped, the end, a failure."""
        self._waiter = asyncio.get_running_loop().create_future()
        try:
            await self._waiter
        finally:
            self._waiter = None

    async def receive(self) -> bytes:
        """The body bytes that arrived since the last call (waits for some); b"" once the
        answer is complete. The connection's error once it failed (after what came before)."""
        while not self._chunks:
            self.raise_error()
            if self._complete:
                return b""
            await self.wait()
        return self.take()

    async def aread(self) -> bytes:
        parts = []
        while data := await self.receive():
            parts.append(data)
        return b"".join(parts)

    async def aclose(self) -> None:
        self.close()

    def close(self) -> None:
        """Done with it: a complete answer's connection went back to its pool already; an
        incomplete one's connection is closed (the replica aborts the request)."""
        conn, self._conn = self._conn, None
        if conn is not None and not self._complete:
            conn.abort()
        if self._error is None and not self._complete:
            self._error = httpx.ReadError("the response was closed")
            self._wake()  # a consumer waiting for more hears it

    # ---- the connection's side

    def _feed(self, data: bytes) -> None:
        sink = self.sink
        if sink is not None:
            if not sink(data):
                self.sink = None
                self._wake()
            return
        self._chunks.append(data)
        self._buffered += len(data)
        if self._buffered > _PAUSE_BYTES and not self._paused and self._conn is not None:
            self._paused = True
            self._conn.pause()
        self._wake()

    def _finish(self, error: Exception | None) -> None:
        if self._complete or self._error is not None:
            return
        if error is None:
            self._complete = True
        else:
            self._error = error
        self._conn = None
        self._wake()

    def _wake(self) -> None:
        w = self._waiter
        if w is not None and not w.done():
            w.set_result(None)


class _Connection(asyncio.Protocol):
    """One connection to a replica: one exchange at a time."""

    def __init__(self, pool: UpstreamPool) -> None:
        self.pool = pool
        self.transport: asyncio.Transport | None = None
        self.parser = httptools.HttpResponseParser(self)
        self.response: UpstreamResponse | None = None
        self.headers_done: asyncio.Future[None] | None = None
        self.closed = False
        self._until_close = False  # the answer's body ends when the connection does

    # ---- asyncio.Protocol

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]

    def data_received(self, data: bytes) -> None:
        if self.response is None:  # nothing asked: a replica talking out of turn
            self.abort()
            return
        try:
            self.parser.feed_data(data)
        except httptools.HttpParserError as e:
            self._fail(httpx.RemoteProtocolError(f"the replica's answer: {e}"))
            self.abort()

    def eof_received(self) -> bool:
        return False  # close the transport: connection_lost follows

    def connection_lost(self, exc: Exception | None) -> None:
        self.closed = True
        self.pool._forget(self)
        if self.response is not None:
            if self._until_close and self.headers_done is not None and self.headers_done.done():
                self._finish_response(None)
            else:
                why = f": {exc}" if exc else ""
                self._fail(httpx.ReadError(f"the replica closed the connection{why}"))

    # ---- httptools callbacks

    def on_header(self, name: bytes, value: bytes) -> None:
        assert self.response is not None
        self.response.raw_headers.append((name, value))

    def on_headers_complete(self) -> None:
        r = self.response
        assert r is not None
        r.status_code = self.parser.get_status_code()
        framed = False
        for name, value in r.raw_headers:
            lower = name.lower()
            if lower == b"content-type":
                r.content_type = value
            elif lower in (b"content-length", b"transfer-encoding"):
                framed = True
        self._until_close = not framed and r.status_code not in (204, 304)
        if self.headers_done is not None and not self.headers_done.done():
            self.headers_done.set_result(None)

    def on_body(self, body: bytes) -> None:
        if self.response is not None:
            self.response._feed(body)

    def on_message_complete(self) -> None:
        self._finish_response(None)

    # ---- the pool's side

    def send(self, head: bytes, body: bytes) -> UpstreamResponse:
        assert self.transport is not None
        self.response = UpstreamResponse(self)
        self.headers_done = asyncio.get_running_loop().create_future()
        self.transport.write(head + body if len(body) < 65536 else head)
        if len(body) >= 65536:
            self.transport.write(body)
        return self.response

    def _finish_response(self, error: Exception | None) -> None:
        r, self.response = self.response, None
        self.pool._active.discard(self)
        if r is not None:
            r._finish(error)
        if error is None and r is not None and not self.closed and self.parser.should_keep_alive():
            self.pool._release(self)
        elif not self.closed:
            self.abort()

    def _fail(self, error: Exception) -> None:
        self.pool._active.discard(self)
        r, self.response = self.response, None
        if self.headers_done is not None and not self.headers_done.done():
            self.headers_done.set_exception(error)
            self.headers_done.exception()  # (retrieved: the pool may not await it)
        if r is not None:
            r._finish(error)

    def pause(self) -> None:
        if self.transport is not None and not self.closed:
            self.transport.pause_reading()

    def resume(self) -> None:
        if self.transport is not None and not self.closed:
            self.transport.resume_reading()

    def abort(self) -> None:
        self.closed = True
        self.pool._active.discard(self)
        if self.transport is not None:
            self.transport.abort()


class UpstreamPool:
    """Keep-alive connections to one replica (``http://`` or ``https://host:port``)."""

    def __init__(self, url: str) -> None:
        parts = urlsplit(url)
        self.https = parts.scheme == "https"
        self.host = parts.hostname or "localhost"
        self.port = parts.port or (443 if self.https else 80)
        default = (parts.scheme == "https" and self.port == 443) or self.port == 80
        netloc = f"[{self.host}]" if ":" in self.host else self.host
        self.host_header = (netloc if default else f"{netloc}:{self.port}").encode()
        self._idle: list[_Connection] = []
        self._active: set[_Connection] = set()  # with an exchange under way
        self._failures = 0  # how many times ``fail_active`` ran
        self._why = ""
        self.is_closed = False

    async def request(
        self, method: bytes, path: bytes, headers: bytes, body: bytes
    ) -> UpstreamResponse:
        """Send the request; returns once the answer's status and headers came.
        ``headers``: the header lines (``name: value\\r\\n`` each) besides host and
        content-length."""
        if self.is_closed:
            raise httpx.ConnectError("the replica's pool is closed")
        head = b"%s %s HTTP/1.1\r\nhost: %s\r\n%scontent-length: %d\r\n\r\n" % (
            method, path, self.host_header, headers, len(body),
        )  # fmt: skip
        failures = self._failures
        while True:
            conn = self._take_idle()
            reused = conn is not None
            if conn is None:
                conn = await self._connect()
                if self._failures != failures:  # the replica left the rotation meanwhile
                    conn.abort()
                    raise httpx.ReadError(self._why)
            self._active.add(conn)
            response = conn.send(head, body)
            assert conn.headers_done is not None
            try:
                await conn.headers_done
            except httpx.ReadError:
                # A reused connection the replica had closed (its keep-alive timeout) and
                # nothing came back: send it again on a new connection.
                if reused and not response.raw_headers and self._failures == failures:
                    continue
                raise
            except BaseException:
                conn.abort()
                raise
            return response

    async def get(self, path: str, timeout_s: float) -> tuple[int, bytes]:
        """``GET path``: the status and the whole body; ``httpx.ReadTimeout`` when it did not
        all come within ``timeout_s``."""
        try:
            async with asyncio.timeout(timeout_s):
                resp = await self.request(b"GET", path.encode(), b"", b"")
                try:
                    return resp.status_code, await resp.aread()
                finally:
                    resp.close()
        except TimeoutError:
            raise httpx.ReadTimeout(f"GET {path}: no answer in {timeout_s:g} s") from None

    def _take_idle(self) -> _Connection | None:
        while self._idle:
            conn = self._idle.pop()
            if not conn.closed:
                return conn
        return None

    async def _connect(self) -> _Connection:
        loop = asyncio.get_running_loop()
        ssl_context = _default_ssl() if self.https else None
        try:
            async with asyncio.timeout(CONNECT_TIMEOUT_S):
                _, conn = await loop.create_connection(
                    lambda: _Connection(self), self.host, self.port, ssl=ssl_context,
                    server_hostname=self.host if self.https else None,
                )  # fmt: skip
        except TimeoutError:
            raise httpx.ConnectTimeout(f"connecting to {self.host}:{self.port} timed out") from None
        except OSError as e:
            raise httpx.ConnectError(f"{type(e).__name__}: {e}") from None
        return conn

    def fail_active(self, why: str) -> None:
        """Fail the exchanges under way (``httpx.ReadError(why)``): before its answer's
        headers, a request raises it; after them, its body does (after what came). For a
        replica that left the rotation: its requests give up on it, never wait forever."""
        self._failures += 1
        self._why = why
        for conn in list(self._active):
            conn._fail(httpx.ReadError(why))
            conn.abort()

    def _forget(self, conn: _Connection) -> None:
        """A connection closed (an idle one by the replica's keep-alive timeout)."""
        self._active.discard(conn)
        with contextlib.suppress(ValueError):
            self._idle.remove(conn)

    def _release(self, conn: _Connection) -> None:
        if self.is_closed or len(self._idle) >= MAX_IDLE:
            conn.abort()
        else:
            self._idle.append(conn)

    async def aclose(self) -> None:
        self.is_closed = True
        for conn in self._idle:
            with contextlib.suppress(Exception):
                conn.abort()
        self._idle.clear()
