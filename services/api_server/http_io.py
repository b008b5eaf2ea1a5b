"""HTTP plumbing for the app: OpenAI-shaped errors, strict body parsing, auth, disconnects."""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import logging
import uuid
from collections.abc import AsyncGenerator, AsyncIterator, Awaitable
from typing import Any, TypeVar, cast

import msgspec
import pydantic
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, StreamingResponse
from starlette.requests import ClientDisconnect

from services.api_server.serving import error_body
from services.protocol import SamplingParams

logger = logging.getLogger(__name__)
_msgpack = msgspec.msgpack.Encoder()
M = TypeVar("M", bound=pydantic.BaseModel)
T = TypeVar("T")

_ERROR_TYPES = {
    400: "BadRequestError",
    401: "AuthenticationError",
    404: "NotFoundError",
    413: "RequestEntityTooLargeError",
    429: "RateLimitError",
    500: "InternalServerError",
    503: "ServiceUnavailableError",
}


class APIError(Exception):
    """An error response: status, message and the OpenAI error fields."""

    def __init__(self, status: int, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.param = status, message, param


def error_response(
    status: int, message: str, error_type: str | None = None, param: str | None = None
) -> JSONResponse:
    error_type = error_type or _ERROR_TYPES.get(status, "APIError")
    return JSONResponse(error_body(status, message, error_type, param), status_code=status)


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
    """``--api-key``: every /v1 route needs ``Authorization: Bearer <key>`` (constant-time compare)."""

    def __init__(self, app: Any, api_key: str) -> None:
        self.app, self._expected = app, f"Bearer {api_key}".encode()

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        if (
            scope["type"] == "http"
            and scope["path"].startswith("/v1")
            and scope["method"] != "OPTIONS"
        ):
            given = dict(scope["headers"]).get(b"authorization", b"")
            if not hmac.compare_digest(given, self._expected):
                await error_response(401, "Unauthorized")(scope, receive, send)
                return
        await self.app(scope, receive, send)


async def read_json(request: Request, limit: int) -> Any:
    length = request.headers.get("content-length")
    if length is not None and length.isdigit() and int(length) > limit:
        raise APIError(413, f"Request body is larger than the limit of {limit} bytes.")
    body = bytearray()
    try:
        async for chunk in request.stream():
            body += chunk
            if len(body) > limit:
                raise APIError(413, f"Request body is larger than the limit of {limit} bytes.")
    except ClientDisconnect:
        raise ClientGone from None
    try:
        value = msgspec.json.decode(body)  # strict: rejects invalid UTF-8 and lone surrogates
    except (msgspec.DecodeError, msgspec.ValidationError) as e:
        raise APIError(400, f"Invalid JSON body: {e}") from None
    except RecursionError:
        raise APIError(400, "Invalid JSON body: nested too deeply") from None
    _check_integers(value)
    return value


def _check_integers(body: Any) -> None:
    """Every integer of the body fits the engine's messages (msgpack: -2**63 to 2**64), in
    free-form fields (``chat_template_kwargs``, ``tools``, ...) too; else a 400 naming the
    top-level field."""
    try:
        _msgpack.encode(body)
    except OverflowError:
        fields = body.items() if isinstance(body, dict) else ()
        param = next((k for k, v in fields if not _encodes(v)), None)
        raise APIError(400, "An integer in the request is out of range.", param) from None


def _encodes(value: Any) -> bool:
    try:
        _msgpack.encode(value)
    except OverflowError:
        return False
    return True


def parse_body(model: type[M], body: Any) -> M:
    try:
        return model.model_validate(body)
    except pydantic.ValidationError as e:
        err = e.errors()[0]
        loc = ".".join(str(x) for x in err["loc"]) or "body"
        param = str(err["loc"][0]) if err["loc"] else None
        raise APIError(400, f"{loc}: {err['msg']}", param) from None


def document_bodies(app: FastAPI, bodies: dict[str, tuple[type[pydantic.BaseModel], ...]]) -> None:
    """Put the request bodies of routes that read their own JSON (``read_json`` +
    ``parse_body``) into ``/openapi.json``: POST ``path`` takes one of ``bodies[path]``.
    Clients and schema-driven fuzzers (schemathesis) then see what the routes accept."""
    generate = app.openapi

    def openapi() -> dict[str, Any]:
        if app.openapi_schema is not None:
            return app.openapi_schema
        schema = generate()
        components = schema.setdefault("components", {}).setdefault("schemas", {})
        for path, models in bodies.items():
            refs = []
            for model in models:
                body = model.model_json_schema(ref_template="#/components/schemas/{model}")
                components.update(body.pop("$defs", {}))
                components[model.__name__] = body
                refs.append({"$ref": f"#/components/schemas/{model.__name__}"})
            schema["paths"][path]["post"]["requestBody"] = {
                "required": True,
                "content": {
                    "application/json": {"schema": refs[0] if len(refs) == 1 else {"anyOf": refs}}
                },
            }
        app.openapi_schema = schema
        return schema

    app.openapi = openapi  # type: ignore[method-assign]


def validate_sampling(sampling: SamplingParams, max_logprobs: int) -> None:
    try:
        sampling.validate(max_logprobs)
    except ValueError as e:
        param = getattr(e, "param", None) or str(e).split(" ", 1)[0]
        raise APIError(400, str(e), param) from None


class ClientGone(Exception):
    pass


class BoundedStreamingResponse(StreamingResponse):
    """A stream whose client must keep reading. Between us and it are only the socket
    buffers and uvicorn's (its writes pause past 64 KiB): a chunk that cannot be handed
    over within ``send_timeout_s`` ends the stream, the body iterator is closed (which
    aborts the engine requests behind it) and uvicorn drops the connection. A client that
    reads one byte a minute holds neither the engine nor unbounded memory.

    One timer per stream checks the send in progress (a few times per timeout), so a chunk
    costs two stores, not a timer of its own."""

    def __init__(self, content: AsyncIterator[bytes], send_timeout_s: float) -> None:
        super().__init__(content, media_type="text/event-stream")
        self.send_timeout_s = send_timeout_s

    async def stream_response(self, send: Any) -> None:
        loop = asyncio.get_running_loop()
        task = asyncio.current_task()
        assert task is not None
        sending_since: float | None = None
        timed_out = False
        timer: asyncio.TimerHandle | None = None

        async def watched_send(message: Any) -> None:
            nonlocal sending_since
            sending_since = loop.time()
            await send(message)
            sending_since = None

        every = min(1.0, self.send_timeout_s / 4)

        def watch() -> None:
            nonlocal timed_out, timer
            if sending_since is not None and loop.time() - sending_since >= self.send_timeout_s:
                timed_out = True
                task.cancel()
            else:
                timer = loop.call_later(every, watch)

        timer = loop.call_later(every, watch)
        try:
            await super().stream_response(watched_send)
        except asyncio.CancelledError:
            if not timed_out or task.uncancel() > 0:  # someone else cancelled it too
                raise
            logger.warning(
                "a streaming client took nothing for %g s (--stream-send-timeout): "
                "ending its stream and aborting its request",
                self.send_timeout_s,
            )
            await cast(AsyncGenerator[bytes, None], self.body_iterator).aclose()
        finally:
            if timer is not None:
                timer.cancel()


async def until_disconnect(request: Request, aw: Awaitable[T]) -> T:
    """Await ``aw``, cancelling it (which aborts its requests) if the client disconnects."""

    async def disconnected() -> None:
        while (await request.receive())["type"] != "http.disconnect":
            pass

    task = asyncio.ensure_future(aw)
    watcher = asyncio.ensure_future(disconnected())
    try:
        await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        watcher.cancel()
        if not task.done():
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await task
    if task.cancelled():
        raise ClientGone
    return task.result()


async def prepend(first: tuple[int, Any], rest: AsyncIterator[Any]) -> AsyncIterator[Any]:
    yield first
    async for item in rest:
        yield item


class XRequestIdMiddleware:
    """``--enable-request-id-headers``: every HTTP response carries an X-Request-Id header,
    the request's own or a new random one (vLLM's middleware). Plain ASGI, so streamed
    responses pass through untouched."""

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
