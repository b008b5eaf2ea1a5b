"""HTTP plumbing for the app: OpenAI-shaped errors, strict body parsing, auth, disconnects."""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import uuid
from collections.abc import AsyncIterator, Awaitable
from typing import Any, TypeVar

import msgspec
import pydantic
from fastapi import Request
from fastapi.responses import JSONResponse

from services.api_server.serving import error_body
from services.protocol import SamplingParams

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
    async for chunk in request.stream():
        body += chunk
        if len(body) > limit:
            raise APIError(413, f"Request body is larger than the limit of {limit} bytes.")
    try:
        return msgspec.json.decode(body)  # strict: rejects invalid UTF-8 and lone surrogates
    except (msgspec.DecodeError, msgspec.ValidationError) as e:
        raise APIError(400, f"Invalid JSON body: {e}") from None


def parse_body(model: type[M], body: Any) -> M:
    try:
        return model.model_validate(body)
    except pydantic.ValidationError as e:
        err = e.errors()[0]
        loc = ".".join(str(x) for x in err["loc"]) or "body"
        param = str(err["loc"][0]) if err["loc"] else None
        raise APIError(400, f"{loc}: {err['msg']}", param) from None


def validate_sampling(sampling: SamplingParams) -> None:
    try:
        sampling.validate()
    except ValueError as e:
        raise APIError(400, str(e), str(e).split(" ", 1)[0]) from None


class ClientGone(Exception):
    pass


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
