"""The race between a request's work and its client leaving."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Awaitable
from typing import TypeVar

from starlette.requests import Request

from services.http.errors import ClientGone

T = TypeVar("T")


async def until_disconnect(request: Request, aw: Awaitable[T]) -> T:
    """Await ``aw``, cancelling it (which aborts its requests) if the client disconnects;
    then ``ClientGone`` (answered with a 499: ``errors.client_closed``)."""

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
