"""Plain ASGI middlewares (streamed responses pass through them untouched)."""

from __future__ import annotations

import asyncio
import hmac
import logging
import re
import time
import uuid
from collections.abc import Iterable
from typing import Any

from services.http.errors import error_response

logger = logging.getLogger(__name__)
access_logger = logging.getLogger("services.http.access")


class InternalErrorMiddleware:
    """An unexpected exception in a route: a 500 in OpenAI's error shape, with the traceback
    in the log. Starlette's own last-resort handler re-raises after answering, and uvicorn
    then drops the connection: a keep-alive client's next request would fail too."""

    def __init__(self, app: Any) -> None:
        self.app = app

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        started = False

        async def send_started(message: dict[str, Any]) -> None:
            nonlocal started
            started = started or message["type"] == "http.response.start"
            await send(message)

        try:
            await self.app(scope, receive, send_started)
        except Exception as e:
            logger.exception("internal error in %s %s", scope["method"], scope["path"])
            if started:  # a stream already under way: the connection is all there is to end
                raise
            response = error_response(500, f"Internal server error: {type(e).__name__}")
            await response(scope, receive, send)


class AuthMiddleware:
    """``--api-key``: every /v1 route needs ``Authorization: Bearer <key>``, or
    ``X-Api-Key: <key>`` as Anthropic's clients send it (constant-time compares)."""

    def __init__(self, app: Any, api_key: str) -> None:
        self.app, self._expected = app, f"Bearer {api_key}".encode()
        self._key = api_key.encode()

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        if (
            scope["type"] == "http"
            and scope["path"].startswith("/v1")
            and scope["method"] != "OPTIONS"
        ):
            headers = dict(scope["headers"])
            bearer = hmac.compare_digest(headers.get(b"authorization", b""), self._expected)
            key = hmac.compare_digest(headers.get(b"x-api-key", b""), self._key)
            if not (bearer or key):
                await error_response(401, "Unauthorized")(scope, receive, send)
                return
        await self.app(scope, receive, send)


class XRequestIdMiddleware:
    """``--enable-request-id-headers``: every HTTP response carries an X-Request-Id header,
    the request's own or a new random one (vLLM's middleware)."""

    def __init__(self, app: Any) -> None:
        self.app = app

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        given = next((v for k, v in scope["headers"] if k == b"x-request-id"), None)
        request_id = given or uuid.uuid4().hex.encode()

        async def send_with_id(message: Any) -> None:
            if message["type"] == "http.response.start":
                headers = [(k, v) for k, v in message.get("headers", []) if k != b"x-request-id"]
                message = {**message, "headers": [*headers, (b"x-request-id", request_id)]}
            await send(message)

        await self.app(scope, receive, send_with_id)


_ID = re.compile(rb'^(?:data: ?)?\{\s*"id"\s*:\s*"([^"\\]{1,200})"')
_PROMPT_TOKENS = re.compile(rb'"prompt_tokens"\s*:\s*(\d+)')
_COMPLETION_TOKENS = re.compile(rb'"completion_tokens"\s*:\s*(\d+)')
_HEAD_BYTES = 512  # where the response's id is (its first key)
_TAIL_BYTES = 4096  # where its usage is (the last object of a whole answer or a stream)


class AccessLogMiddleware:
    """One INFO line per HTTP request once its response has ended (vLLM's uvicorn access
    log, with what an operator needs): client, method and path, status, the response's id
    (its body's ``id``, else its ``X-Request-Id``), prompt and completion tokens where the
    response reports its ``usage`` (a whole answer, or a stream with ``include_usage``),
    and the seconds from the request's arrival to the response's last byte. No prompt or
    output text (that is ``--enable-log-requests``'). A response that did not end (the
    client left, the server stopped) is marked ``incomplete``. ``skip_paths``: paths
    logged not at all (vLLM's ``--disable-access-log-for-endpoints``; the servers' default:
    the probes /health, /load and /metrics)."""

    def __init__(self, app: Any, skip_paths: Iterable[str] = ()) -> None:
        self.app, self.skip = app, frozenset(skip_paths)

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] != "http" or scope["path"] in self.skip:
            await self.app(scope, receive, send)
            return
        record = AccessRecord(scope)
        try:
            await self.app(scope, receive, record.wrap(send))
        finally:
            record.log()


class AccessRecord:
    """What one request's access line says (``AccessLogMiddleware``): filled by the
    messages through ``wrap(send)``, or set by a response that keeps them itself
    (``status``, ``head``: its body's first bytes, ``tail``: its last, ``ended``)."""

    __slots__ = ("scope", "started", "status", "header_id", "head", "tail", "ended")

    def __init__(self, scope: dict[str, Any]) -> None:
        self.scope = scope
        self.started = time.perf_counter()
        self.status: int | None = None
        self.header_id: bytes | None = None
        self.head = self.tail = b""
        self.ended = False

    def wrap(self, send: Any) -> Any:
        async def send_logged(message: dict[str, Any]) -> None:
            if message["type"] == "http.response.start":
                self.status = message["status"]
                self.header_id = next((v for k, v in message.get("headers", [])
                                       if k.lower() == b"x-request-id"), None)  # fmt: skip
            elif message["type"] == "http.response.body":
                body = message.get("body", b"")
                if len(self.head) < _HEAD_BYTES:
                    self.head += body[: _HEAD_BYTES - len(self.head)]
                self.tail = (self.tail + body)[-_TAIL_BYTES:]
            await send(message)
            if message["type"] == "http.response.body":
                self.ended = not message.get("more_body", False)  # and sent

        return send_logged

    def log(self) -> None:
        scope = self.scope
        latency = time.perf_counter() - self.started
        fields = [f"{scope['method']} {scope['path']}", str(self.status or "-")]
        found = _ID.match(self.head)
        request_id = found.group(1) if found else self.header_id
        if request_id:
            fields.append(f"id={request_id.decode('latin-1')}")
        for name, pattern in (("prompt_tokens", _PROMPT_TOKENS),
                              ("completion_tokens", _COMPLETION_TOKENS)):  # fmt: skip
            matches = pattern.findall(self.tail[-_TAIL_BYTES:])
            if matches:
                fields.append(f"{name}={int(matches[-1])}")
        fields.append(f"latency={latency:.3f}s")
        client = scope.get("client")
        if client:
            fields.append(f"client={client[0]}:{client[1]}")
        if not self.ended:
            fields.append("incomplete")
        access_logger.info(" ".join(fields))


class Drain:
    """A server's requests in flight and its drain (``DrainMiddleware`` counts them).

    ``await drain.finish(timeout_s)`` starts the drain: from then on new requests get 503
    (``/health`` too, so a balancer in front stops sending here), while those in flight
    (a stream until its last byte) get up to ``timeout_s`` seconds to end; it returns how
    many are still in flight then."""

    def __init__(self) -> None:
        self.in_flight = 0
        self.draining = False

    async def finish(self, timeout_s: float) -> int:
        self.draining = True
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout_s
        while self.in_flight and loop.time() < deadline:
            await asyncio.sleep(0.05)
        return self.in_flight


class DrainMiddleware:
    """Counts the requests in flight on ``drain``; while it drains, answers new ones 503
    (with ``Connection: close``: the client's next request goes to a new connection)."""

    def __init__(
        self, app: Any, drain: Drain, message: str = "the server is shutting down"
    ) -> None:
        self.app, self.drain, self.message = app, drain, message

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        if self.drain.draining:
            response = error_response(503, self.message, "ServiceUnavailableError")
            response.headers["connection"] = "close"
            await response(scope, receive, send)
            return
        self.drain.in_flight += 1
        try:
            await self.app(scope, receive, send)
        finally:
            self.drain.in_flight -= 1
