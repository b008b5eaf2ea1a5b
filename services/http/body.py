"""Request bodies read with a size cap."""

from __future__ import annotations

from starlette.requests import ClientDisconnect, Request

from services.http.errors import APIError, ClientGone


async def read_body(request: Request, limit: int) -> bytes:
    """The whole body; ``APIError(413)`` as soon as it is known to exceed ``limit`` bytes,
    ``ClientGone`` if the client leaves while sending it."""
    too_large = f"Request body is larger than the limit of {limit} bytes."
    length = request.headers.get("content-length")
    if length is not None and length.isdigit() and int(length) > limit:
        raise APIError(413, too_large)
    body = bytearray()
    try:
        async for chunk in request.stream():
            body += chunk
            if len(body) > limit:
                raise APIError(413, too_large)
    except ClientDisconnect:
        raise ClientGone from None
    return bytes(body)
