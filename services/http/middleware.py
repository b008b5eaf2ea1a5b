"""Plain ASGI middlewares (streamed responses pass through them untouched)."""

from __future__ import annotations

import hmac
import logging
import uuid
from typing import Any

from services.http.errors import error_response

logger = logging.getLogger(__name__)


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
