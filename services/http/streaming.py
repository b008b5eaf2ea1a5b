"""Streamed responses: our own SSE streams, and upstream answers relayed as they come."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncGenerator, AsyncIterator, Awaitable, Callable, Mapping
from typing import Any, cast

import anyio
from starlette.background import BackgroundTask
from starlette.responses import StreamingResponse
from starlette.types import Receive, Scope, Send

logger = logging.getLogger(__name__)


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


class RelayResponse(StreamingResponse):
    """An upstream answer passed on as it comes (status and headers as given).

    ``on_close`` runs exactly once, however the response ends: its body read to the end,
    the body failing, the client leaving, the response cancelled, or the body read by hand
    instead of sent (its end, or ``background``, runs it then). It is where the upstream
    connection closes and whatever was booked for the request is released; it runs
    shielded from cancellation, so a client that left cannot cut it short."""

    def __init__(
        self,
        chunks: AsyncIterator[bytes],
        status_code: int,
        headers: Mapping[str, str],
        on_close: Callable[[], Awaitable[None]],
    ) -> None:
        self._chunks = chunks
        self._on_close: Callable[[], Awaitable[None]] | None = on_close
        super().__init__(
            self._body(), status_code=status_code, headers=headers,
            background=BackgroundTask(self.close),
        )  # fmt: skip

    async def _body(self) -> AsyncIterator[bytes]:
        try:
            async for chunk in self._chunks:
                yield chunk
        finally:
            await self.close()

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:  # the client may have left: neither the body's end nor background ran
            await self.close()

    async def close(self) -> None:
        """Run ``on_close`` unless it already ran (or is running)."""
        on_close, self._on_close = self._on_close, None
        if on_close is None:
            return
        with anyio.CancelScope(shield=True):
            aclose = getattr(self._chunks, "aclose", None)
            try:
                if aclose is not None:
                    await aclose()
            finally:
                await on_close()
