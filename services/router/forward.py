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
from collections.abc import AsyncIterator, Awaitable
from dataclasses import dataclass
from typing import Any, TypeVar

import httpx
from fastapi import Request, Response

from services.http.errors import sse_error
from services.http.streaming import RelayResponse
from services.router.load_guard import LoadGuard
from services.router.metrics import RouterMetrics
from services.router.replicas import Replica, ReplicaSet

log = logging.getLogger(__name__)
T = TypeVar("T")

_HOP_HEADERS = {"host", "content-length", "connection", "keep-alive", "transfer-encoding",
                "te", "upgrade", "accept-encoding", "proxy-authorization", "trailer"}  # fmt: skip
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


def reply_headers(resp: httpx.Response) -> dict[str, str]:
    """A replica's response headers to pass on, byte for byte (latin-1 both ways, as HTTP
    carries them: a value httpx would decode as UTF-8 could not be encoded back)."""
    return {k.decode("latin-1"): v.decode("latin-1") for k, v in resp.headers.raw
            if k.decode("latin-1").lower() not in _RESPONSE_DROP}  # fmt: skip


def forward_headers(request: Request) -> dict[str, str]:
    headers = {k: v for k, v in request.headers.items() if k.lower() not in _HOP_HEADERS}
    headers["accept-encoding"] = "identity"  # bytes pass through as they come: no encoding
    return headers


async def until_down(awaitable: Awaitable[T], replica: Replica) -> T:
    """``awaitable``'s result, or a TransportError once the replica leaves rotation."""
    work = asyncio.ensure_future(awaitable)
    down = asyncio.ensure_future(replica.down.wait())
    try:
        await asyncio.wait({work, down}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        down.cancel()
    if not work.done():
        work.cancel()
        raise httpx.ReadError("the replica left the rotation (failed its health check)")
    return work.result()


async def _close_when_down(replica: Replica, resp: httpx.Response) -> None:
    await replica.down.wait()
    await resp.aclose()


@dataclass
class Forwarder:
    """Sends requests to replicas and relays their answers; marks a replica failed when
    it fails one. Each request's ``LoadGuard`` is handed to the response it becomes."""

    replicas: ReplicaSet
    metrics: RouterMetrics
    client: httpx.AsyncClient  # for replicas without a pool of their own

    async def generate(self, path: str, raw: bytes, headers: dict[str, str],
                       load: LoadGuard, arrived: float) -> Response:  # fmt: skip
        """POST ``raw`` to ``load``'s replica and wait for its first byte; then commit to
        it: the response streams the rest. ``Upstream`` when it fails before."""
        replica = load.replica
        sent = time.perf_counter()
        client = replica.client or self.client
        if client.is_closed:  # removed (and its pool closed) while this request waited
            raise Upstream("the replica was removed")
        upstream = client.build_request("POST", replica.url + path, content=raw, headers=headers)
        try:
            resp = await until_down(client.send(upstream, stream=True), replica)
        except httpx.TransportError as e:
            self.replicas.mark_failed(replica, f"{type(e).__name__}: {e}")
            raise Upstream(str(e) or type(e).__name__) from None
        chunks = resp.aiter_raw()
        # A replica that hangs with its connections open leaves the rotation when its health
        # check fails: then its requests give up on it (before the first byte: another
        # replica; after it: an error event), instead of waiting forever.
        watch = asyncio.create_task(_close_when_down(replica, resp))
        try:
            if resp.status_code in RETRIED_STATUS:  # the replica cannot serve now
                content = await resp.aread()
                raise Upstream(
                    f"HTTP {resp.status_code}: {content[:200].decode(errors='replace')}",
                    Response(content, status_code=resp.status_code, headers=reply_headers(resp)),
                )
            try:
                first = await until_down(chunks.__anext__(), replica)
            except StopAsyncIteration:
                first = b""
            now = time.perf_counter()
            load.first_byte(now - sent)
            self.metrics.ttfb.labels(replica.url).observe(now - arrived)
            return self._commit(resp, chunks, first, load, watch)
        except (httpx.TransportError, httpx.StreamError) as e:
            watch.cancel()
            await resp.aclose()
            self.replicas.mark_failed(replica, f"{type(e).__name__}: {e}")
            raise Upstream(str(e) or type(e).__name__) from None
        except BaseException:
            watch.cancel()
            await resp.aclose()
            raise

    def _commit(self, resp: httpx.Response, chunks: AsyncIterator[bytes], first: bytes,
                load: LoadGuard, watch: asyncio.Task[None]) -> Response:  # fmt: skip
        """The response that streams the rest of the replica's answer to the client."""
        replica = load.replica
        sse = resp.headers.get("content-type", "").startswith("text/event-stream")

        async def body() -> AsyncIterator[bytes]:
            last = first or b"\n\n"  # the last chunk sent (SSE chunks end with their events)
            try:
                if first:
                    yield first
                async for chunk in chunks:
                    last = chunk
                    yield chunk
                if replica.down.is_set() and sse and b"[DONE]" not in last:
                    raise httpx.ReadError("the replica left the rotation (failed its health check)")
            except (httpx.TransportError, httpx.StreamError) as e:
                self.metrics.errors.labels("stream_broken").inc()
                log.warning("replica %s broke a response: %s", replica.url, e)
                self.replicas.mark_failed(replica, f"{type(e).__name__}: {e}")
                if not sse:  # a whole answer cut short: cut the connection, never a clean end
                    raise
                event = sse_error(
                    502,
                    f"the replica serving this request failed: {type(e).__name__}",
                    "BadGatewayError",
                )
                yield event if last.endswith(b"\n\n") else b"\n\n" + event  # not inside its line

        async def close() -> None:
            watch.cancel()
            load.release()
            await resp.aclose()

        response = RelayResponse(body(), resp.status_code, reply_headers(resp), close)
        load.hand_over()
        return response

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
