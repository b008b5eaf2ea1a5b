"""OpenAI-shaped errors: ``{"error": {"message", "type", "param", "code"}}``."""

from __future__ import annotations

import json
from typing import Any, cast

from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response

# nginx's "client closed request": the status of a response no one reads (logs show it).
CLIENT_CLOSED_REQUEST = 499

_ERROR_TYPES = {
    400: "BadRequestError",
    401: "AuthenticationError",
    404: "NotFoundError",
    413: "RequestEntityTooLargeError",
    429: "RateLimitError",
    500: "InternalServerError",
    503: "ServiceUnavailableError",
}


class ClientGone(Exception):
    """The client left before its answer was ready: the work for it was cancelled."""


class APIError(Exception):
    """An error response: status, message and the OpenAI error fields."""

    def __init__(self, status: int, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.param = status, message, param


def error_body(
    status: int, message: str, error_type: str, param: str | None = None
) -> dict[str, Any]:
    return {"error": {"message": message, "type": error_type, "param": param, "code": status}}


def error_response(
    status: int, message: str, error_type: str | None = None, param: str | None = None
) -> JSONResponse:
    """The error as a JSON response; ``error_type`` defaults to OpenAI's name for ``status``."""
    error_type = error_type or _ERROR_TYPES.get(status, "APIError")
    return JSONResponse(error_body(status, message, error_type, param), status_code=status)


def sse_error(status: int, message: str, error_type: str) -> bytes:
    """The end of an SSE stream that failed after it began: an error event, then ``[DONE]``
    (a client waiting for either stops waiting)."""
    body = error_body(status, message, error_type)
    return f"data: {json.dumps(body)}\n\ndata: [DONE]\n\n".encode()


def client_closed() -> Response:
    """The answer to a request whose client left before it: no one reads it."""
    return Response(status_code=CLIENT_CLOSED_REQUEST)


def add_error_handlers(app: Starlette) -> None:
    """``APIError`` answers as its OpenAI error; ``ClientGone`` as a 499."""

    async def api_error(_: Request, e: Exception) -> Response:
        err = cast(APIError, e)
        return error_response(err.status, err.message, param=err.param)

    async def client_gone(_: Request, e: Exception) -> Response:
        return client_closed()

    app.add_exception_handler(APIError, api_error)
    app.add_exception_handler(ClientGone, client_gone)
