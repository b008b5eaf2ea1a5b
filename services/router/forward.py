"""Talking to the chosen replica: send, wait for its first byte, relay its answer.

A request moves to another replica only before its first byte reached the client
(``Upstream``: a refused connection, a 502/503/504 answer, a connection lost or a replica
leaving the rotation before the first byte). After that, a replica that fails ends an SSE
stream with an OpenAI error event and ``[DONE]``, a whole answer by cutting the connection:
never a hang, never a clean end that is not one."""

from __future__ import annotations

import asyncio
import json
import logging
import time
from collections.abc import AsyncIterator, Callable, Coroutine
from dataclasses import dataclass
from typing import Any

import httpx
from fastapi import Request, Response

from services.http.errors import sse_error
from services.http.middleware import AccessRecord
from services.http.streaming import RelayResponse
from services.router.load_guard import LoadGuard
from services.router.metrics import RouterMetrics
from services.router.replicas import Replica, ReplicaSet
from services.router.upstream import UpstreamResponse

log = logging.getLogger(__name__)

_HOP_HEADERS = {"host", "content-length", "connection", "keep-alive", "transfer-encoding",
                "te", "upgrade", "accept-encoding", "proxy-authorization", "trailer"}  # fmt: skip
_HOP_HEADERS_RAW = {h.encode() for h in _HOP_HEADERS}
_RESPONSE_DROP = {"content-length", "connection", "transfer-encoding", "content-encoding",
                  "keep-alive", "date", "server"}  # fmt: skip

# Answers that say "not here, not now" (a replica starting, draining, overloaded or dead):
# another replica may serve the request. A 500 is the request's own failure: passed on,
# so that one bad request does not visit every replica.
RETRIED_STATUS = {502, 503, 504}


class Upstream(Exception):
    """The replica failed before the first byte: try another. ``response``: its answer,
    given to the client if no replica does better."""

    def __init__(self, message: str, response: Response | None = None) -> None:
        super().__init__(message)
        self.response = response


def parse_object(raw: bytes) -> dict[str, Any]:
    """A request body as a JSON object; {} when it is not one."""
    try:
        body = json.loads(raw)
    except ValueError:
        return {}
    return body if isinstance(body, dict) else {}


def reply_headers(resp: httpx.Response | UpstreamResponse) -> dict[str, str]:
    """A replica's response headers to pass on, byte for byte (latin-1 both ways, as HTTP
    carries them: a value httpx would decode as UTF-8 could not be encoded back)."""
    raw = resp.raw_headers if isinstance(resp, UpstreamResponse) else resp.headers.raw
    return {k.decode("latin-1"): v.decode("latin-1") for k, v in raw
            if k.decode("latin-1").lower() not in _RESPONSE_DROP}  # fmt: skip


def forward_head(request: Request) -> bytes:
    """The client's headers for the replica as header lines (hop-by-hop ones dropped, no
    encoding asked for: bytes pass through as they come)."""
    lines = [b"%s: %s\r\n" % (k, v) for k, v in request.scope["headers"]
             if k.lower() not in _HOP_HEADERS_RAW]  # fmt: skip
    lines.append(b"accept-encoding: identity\r\n")
    return b"".join(lines)


def forward_headers(request: Request) -> dict[str, str]:
    headers = {k: v for k, v in request.headers.items() if k.lower() not in _HOP_HEADERS}
    headers["accept-encoding"] = "identity"  # bytes pass through as they come: no encoding
    return headers


def _body(data: bytes, more: bool = True) -> dict[str, Any]:
    return {"type": "http.response.body", "body": data, "more_body": more}


async def _finish(coro: Coroutine[Any, Any, None], waits_for: Any) -> None:
    """Run a coroutine that was started by hand and suspended, waiting for ``waits_for``
    (what it yielded: a future, or None for a bare yield), to its end, as a task would."""
    try:
        while True:
            if waits_for is None:
                await asyncio.sleep(0)
            else:
                waits_for._asyncio_future_blocking = False  # (as a task does with it)
                await asyncio.wait([waits_for])
            try:
                waits_for = coro.send(None)
            except StopIteration:
                return
    except asyncio.CancelledError:
        coro.close()
        raise


def chunk_writer(send: Any) -> Callable[[bytes], bool] | None:
    """uvicorn's ``send`` of a body piece (httptools' protocol), without the ASGI message
    and the coroutine: the piece written to the client's transport in chunked framing
    where uvicorn's ``send`` would do just that and nothing else (the response started
    chunked and has not ended, the client is there, its socket not full); False otherwise,
    and ``send`` it. None where ``send`` is not that protocol's (another server, another
    uvicorn: ``send`` always). ~2 us of CPU a piece, ~130 pieces a stream."""
    cycle: Any = getattr(send, "__self__", None)
    if type(cycle).__module__ != "uvicorn.protocols.http.httptools_impl":
        return None
    try:
        transport, flow = cycle.transport, cycle.flow
        _ = (cycle.chunked_encoding, cycle.disconnected, cycle.response_complete,
             flow.write_paused)  # fmt: skip
    except AttributeError:
        return None

    def write(data: bytes) -> bool:
        if not data:  # (an empty chunk would end the body: uvicorn's send writes nothing)
            return True
        if (cycle.chunked_encoding is not True or flow.write_paused or cycle.disconnected
                or cycle.response_complete):  # fmt: skip
            return False
        transport.write(b"%x\r\n%s\r\n" % (len(data), data))
        return True

    return write


class RelayedAnswer(Response):
    """A replica's answer passed on as it comes: its status and headers, then its body's
    bytes as they arrive (what arrived together, in one piece), unparsed.

    After the first byte a replica that fails (or leaves the rotation) ends an SSE stream
    with an OpenAI error event and ``[DONE]``, a whole answer by cutting the connection.
    The request's ``LoadGuard`` is released, and the replica's connection closed unless the
    answer was read to its end, exactly once, however it ends: its end, its failure, the
    client leaving (watched: the replica then aborts the request), or, read by hand
    (``body_iterator``, as the PD proxy reads the prefill's), its end or ``background``.

    Sent, the body is pushed: each piece goes from the replica's connection
    (``UpstreamResponse.sink``) straight to the client: written to uvicorn's transport
    (``chunk_writer``) or through its ``send`` (no middleware between: ``GenerateRoutes``;
    the access line comes from ``fill``), which returns without suspending unless the
    client's socket is full. Then the suspended send is finished in this response's task,
    what came meanwhile is sent from the buffer, and pushing resumes. Not Starlette's
    ``StreamingResponse``: that would wake this task and pass two generators for each of a
    stream's ~130 events, and open an anyio task group per answer (``RelayResponse`` in
    ``services/http/streaming.py`` remains for the other routes)."""

    def __init__(self, forward: Forwarder, resp: UpstreamResponse, first: bytes,
                 load: LoadGuard, headers: dict[str, str]) -> None:  # fmt: skip
        self.status_code = resp.status_code
        self.raw_headers = [(k.lower().encode("latin-1"), v.encode("latin-1"))
                            for k, v in headers.items()]  # fmt: skip
        self.body_iterator = self._chunks()
        self.background = self._background  # type: ignore[assignment]
        self._forward, self._resp, self._first, self._load = forward, resp, first, load
        self._sse = resp.content_type.startswith(b"text/event-stream")
        self._last = first or b"\n\n"  # the last bytes sent (SSE chunks end with their events)
        self._prev = b""  # those before them (the access line's usage: ``fill``)
        self._ended = False  # the body's end sent
        self._send: Any = None
        self._write: Callable[[bytes], bool] | None = None  # ``chunk_writer(send)``
        self._suspended: tuple[Coroutine[Any, Any, None], Any] | None = None
        self._push_error: BaseException | None = None
        self._client_gone = False
        self._closed = False

    # ---- sent (ASGI)

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        watch = asyncio.ensure_future(self._watch(receive))
        try:
            await send({"type": "http.response.start", "status": self.status_code,
                        "headers": self.raw_headers})  # fmt: skip
            try:
                if self._first:
                    await send(_body(self._first))
                    await self._relay(send)
                self._check_end()
            except (httpx.TransportError, httpx.StreamError) as e:
                if (event := self._failed(e)) is not None:
                    await send(_body(event))
            await send(_body(b"", more=False))
            self._ended = True
        finally:
            watch.cancel()
            self.close()

    def fill(self, record: AccessRecord) -> None:
        """What this answer's access line says (``GenerateRoutes``; no ``send`` wrapped)."""
        record.status = self.status_code
        record.head = self._first[:512]
        record.tail = self._prev + self._last if self._first else b""
        record.ended = self._ended

    async def _relay(self, send: Any) -> None:
        """The body after the first bytes: pushed while the client keeps up."""
        resp = self._resp
        self._send = send
        self._write = chunk_writer(send)
        while True:
            if data := resp.take():
                self._prev, self._last = self._last, data
                await send(_body(data))
                continue
            if resp.ended:
                resp.raise_error()
                return
            resp.sink = self._push
            try:
                await resp.wait()
            except BaseException:  # cancelled: a send it suspended is not finished
                resp.sink = None
                if self._suspended is not None:
                    self._suspended[0].close()
                raise
            resp.sink = None
            suspended, self._suspended = self._suspended, None
            if suspended is not None:  # the client's socket is full: finish that send here
                await _finish(*suspended)
            if self._push_error is not None:
                raise self._push_error

    def _push(self, data: bytes) -> bool:
        """One piece from the replica, sent now; False when the send had to wait (or
        failed): this response's task takes over."""
        self._prev, self._last = self._last, data
        if self._write is not None and self._write(data):
            return True
        coro = self._send(_body(data))
        try:
            fut = coro.send(None)
        except StopIteration:
            return True
        except BaseException as e:  # raised in the task
            self._push_error = e
            return False
        self._suspended = (coro, fut)
        return False

    async def _watch(self, receive: Any) -> None:
        """The client leaving: the replica's connection closes (it aborts the request)."""
        while (await receive())["type"] != "http.disconnect":
            pass
        self._client_gone = True
        self._resp.close()

    # ---- read by hand

    async def _chunks(self) -> AsyncIterator[bytes]:
        try:
            try:
                if self._first:
                    yield self._first
                    while chunk := await self._resp.receive():
                        self._prev, self._last = self._last, chunk
                        yield chunk
                self._check_end()
            except (httpx.TransportError, httpx.StreamError) as e:
                if (event := self._failed(e)) is not None:
                    yield event
        finally:
            self.close()

    async def _background(self) -> None:
        self.close()

    # ---- either way

    def _check_end(self) -> None:
        """A replica taken out of rotation may have ended a stream that is not complete."""
        if self._load.replica.down.is_set() and self._sse and b"[DONE]" not in self._last:
            raise httpx.ReadError("the replica left the rotation (failed its health check)")

    def _failed(self, e: Exception) -> bytes | None:
        """The replica broke the answer: the SSE error event to end it with (None: the
        client left, no one reads on); a whole answer's error raised again (the connection
        is cut)."""
        if self._client_gone:
            return None
        self._forward.broken(self._load.replica, e)
        if not self._sse:  # a whole answer cut short: cut the connection, never a clean end
            raise e
        event = sse_error(
            502, f"the replica serving this request failed: {type(e).__name__}", "BadGatewayError"
        )
        return event if self._last.endswith(b"\n\n") else b"\n\n" + event  # not inside its line

    def close(self) -> None:
        """Release the request's load and the replica's connection (once)."""
        if self._closed:
            return
        self._closed = True
        try:
            self._load.release()
        finally:
            self._resp.close()


@dataclass
class Forwarder:
    """Sends requests to replicas and relays their answers; marks a replica failed when
    it fails one. Each request's ``LoadGuard`` is handed to the response it becomes."""

    replicas: ReplicaSet
    metrics: RouterMetrics
    client: httpx.AsyncClient  # for replicas without a pool of their own

    async def generate(self, path: str, raw: bytes, head: bytes, load: LoadGuard,
                       arrived: float) -> Response:  # fmt: skip
        """POST ``raw`` (``head``: its header lines, ``forward_head``) to ``load``'s replica
        and wait for its first byte; then commit to it: the response streams the rest.
        ``Upstream`` when it fails before."""
        replica = load.replica
        sent = time.perf_counter()
        pool = replica.upstream
        if pool is None or pool.is_closed:  # removed (its pool closed) while this request waited
            raise Upstream("the replica was removed")
        # A replica that hangs with its connections open leaves the rotation when its health
        # check fails: then its pool fails its requests (before the first byte: another
        # replica; after it: an error event), instead of waiting forever.
        try:
            if replica.down.is_set():
                raise httpx.ReadError("the replica left the rotation (failed its health check)")
            resp = await pool.request(b"POST", path.encode(), head, raw)
        except httpx.TransportError as e:
            self.replicas.mark_failed(replica, f"{type(e).__name__}: {e}")
            raise Upstream(str(e) or type(e).__name__) from None
        try:
            if resp.status_code in RETRIED_STATUS:  # the replica cannot serve now
                content = await resp.aread()
                raise Upstream(
                    f"HTTP {resp.status_code}: {content[:200].decode(errors='replace')}",
                    Response(content, status_code=resp.status_code, headers=reply_headers(resp)),
                )
            first = await resp.receive()  # b"": an empty answer
            now = time.perf_counter()
            load.first_byte(now - sent)
            self.metrics.child(self.metrics.ttfb, replica.url).observe(now - arrived)
            return self._commit(resp, first, load)
        except (httpx.TransportError, httpx.StreamError) as e:
            resp.close()
            self.replicas.mark_failed(replica, f"{type(e).__name__}: {e}")
            raise Upstream(str(e) or type(e).__name__) from None
        except BaseException:
            resp.close()
            raise

    def _commit(self, resp: UpstreamResponse, first: bytes, load: LoadGuard) -> Response:
        """The response that streams the rest of the replica's answer to the client."""
        response = RelayedAnswer(self, resp, first, load, reply_headers(resp))
        load.hand_over()
        return response

    def broken(self, replica: Replica, e: Exception) -> None:
        """A replica broke an answer after its first byte."""
        self.metrics.errors.labels("stream_broken").inc()
        log.warning("replica %s broke a response: %s", replica.url, e)
        self.replicas.mark_failed(replica, f"{type(e).__name__}: {e}")

    async def passthrough(self, request: Request, path: str, raw: bytes,
                          headers: dict[str, str], load: LoadGuard) -> Response:  # fmt: skip
        """Send the request as it came to ``load``'s replica; its answer streams through as
        it comes. ``Upstream`` when the replica cannot be reached."""
        replica = load.replica
        client = replica.client or self.client
        if client.is_closed:
            raise Upstream("the replica was removed")
        upstream = client.build_request(
            request.method, replica.url + path, content=raw, headers=headers,
            params=request.query_params,
        )  # fmt: skip
        try:
            resp = await client.send(upstream, stream=True)
        except httpx.TransportError as e:
            self.replicas.mark_failed(replica, f"{type(e).__name__}: {e}")
            raise Upstream(str(e) or type(e).__name__) from None

        async def close() -> None:
            load.release()
            await resp.aclose()

        try:
            response = RelayResponse(resp.aiter_raw(), resp.status_code, reply_headers(resp), close)
        except BaseException:
            await resp.aclose()
            raise
        load.hand_over()
        return response
