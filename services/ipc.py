"""Typed ZeroMQ sockets: one small class per socket kind, generic over the message type.

Every message is a msgspec Struct (or a tagged union of them) encoded as
msgpack; no pickle. Synchronous senders encode into a reusable buffer (ZeroMQ
has copied or taken the frame before ``send`` returns); a frame past
``ZERO_COPY_THRESHOLD`` bytes (large token arrays) is handed to ZeroMQ without
a copy and the sender starts a fresh buffer. Asyncio senders encode into fresh
bytes. Receivers decode straight from ZeroMQ's frame memory. High-water marks
are off (0): messages between our own processes are never dropped, and
back-pressure is the scheduler's job.

``ipc_dir()`` makes the private directory (mode 0700) that holds the ``ipc://``
endpoints of one server instance.

Every ZeroMQ socket between our processes goes through these classes. The few that
speak a wire format of their own are listed in ``RAW_SOCKETS`` with the reason
(tests/test_layers.py fails on a raw socket anywhere else).
"""

from __future__ import annotations

import asyncio
import os
import shutil
import signal
import tempfile
import time
from typing import Any, Generic, Self, TypeVar

import msgspec
import zmq
import zmq.asyncio

T = TypeVar("T")

# How the launcher stops a child process: a signal nothing sends to a whole process group
# (SIGTERM, SIGINT, SIGHUP and SIGQUIT all reach every process from a shell, ``timeout`` or
# systemd; a SIGTERM to the group is the launcher's to handle, by draining).
STOP_SIGNAL = signal.SIGUSR1

# Files that open ZeroMQ sockets themselves, and why a typed wrapper does not fit.
RAW_SOCKETS: dict[str, str] = {
    "services/kv_cache/events.py": (
        "vLLM's KV-event wire format: multipart (topic, sequence, msgpack batch) on PUB, "
        "and a ROUTER that replays missed batches, so vLLM's subscribers read ours"
    ),
    "services/router/kv_events.py": (
        "the subscriber side of that format (SUB, and a DEALER asking for replays), "
        "which reads vLLM's publishers too"
    ),
    "services/kv_transfer/side_channel.py": (
        "the p2p side channel: ROUTER/DEALER with a header and then raw frames (one per "
        "layer's K or V bytes for the zmq transport; zero-copy buffers, not msgspec "
        "messages), between engines on different hosts"
    ),
}

# Below this, copying into ZeroMQ's own buffer is cheaper than tracking a zero-copy frame.
ZERO_COPY_THRESHOLD = 64 * 1024
_INITIAL_BUFFER = 4096


class IpcDir:
    """A private temporary directory (0700) for ``ipc://`` endpoints; removed by ``cleanup()``."""

    def __init__(self, prefix: str = "actorserve-") -> None:
        self.path = tempfile.mkdtemp(prefix=prefix)  # mkdtemp creates it 0700
        os.chmod(self.path, 0o700)

    def endpoint(self, name: str) -> str:
        if not name.isidentifier():
            raise ValueError(f"endpoint name must be an identifier, got {name!r}")
        return f"ipc://{os.path.join(self.path, name)}"

    def cleanup(self) -> None:
        shutil.rmtree(self.path, ignore_errors=True)

    def __enter__(self) -> IpcDir:
        return self

    def __exit__(self, *exc: object) -> None:
        self.cleanup()


def ipc_dir(prefix: str = "actorserve-") -> IpcDir:
    return IpcDir(prefix)


def _make_socket(
    ctx: zmq.Context[Any],
    kind: int,
    endpoint: str,
    bind: bool,
    options: dict[int, int] | None = None,
) -> zmq.Socket[Any]:
    sock = ctx.socket(kind)
    sock.setsockopt(zmq.LINGER, 0)
    for option, value in (options or {}).items():  # before connecting: some apply only then
        sock.setsockopt(option, value)
    if kind in (zmq.PUSH, zmq.PUB, zmq.XPUB):
        sock.setsockopt(zmq.SNDHWM, 0)
    else:
        sock.setsockopt(zmq.RCVHWM, 0)
    if kind == zmq.SUB:
        sock.setsockopt(zmq.SUBSCRIBE, b"")
    if bind:
        sock.bind(endpoint)
    else:
        sock.connect(endpoint)
    return sock


class _Encoding:
    """msgpack encoding into a reusable buffer; big frames leave it for ZeroMQ to own."""

    def __init__(self) -> None:
        self._encoder = msgspec.msgpack.Encoder()
        self._buf = bytearray(_INITIAL_BUFFER)

    def encode(self, msg: object) -> bytes:
        """A new immutable frame, for senders that may hold it past the call."""
        return self._encoder.encode(msg)

    def frame(self, msg: object) -> tuple[bytearray, bool]:
        """Return (frame, copy): with copy False the frame now belongs to ZeroMQ."""
        buf = self._buf
        self._encoder.encode_into(msg, buf)
        if len(buf) < ZERO_COPY_THRESHOLD:
            return buf, True
        self._buf = bytearray(_INITIAL_BUFFER)
        return buf, False


class _Base(Generic[T]):
    _kind: int
    socket: zmq.Socket[Any]

    def __init__(
        self,
        endpoint: str,
        msg_type: Any,
        *,
        bind: bool = False,
        ctx: zmq.Context[Any] | None = None,
        options: dict[int, int] | None = None,
    ) -> None:
        self.endpoint = endpoint
        self.socket = _make_socket(ctx or self._default_ctx(), self._kind, endpoint, bind, options)
        self._encoding = _Encoding()
        self._decoder: msgspec.msgpack.Decoder[T] = msgspec.msgpack.Decoder(msg_type)

    @staticmethod
    def _default_ctx() -> zmq.Context[Any]:
        return zmq.Context.instance()

    def close(self) -> None:
        self.socket.close(linger=0)

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class _SyncSender(_Base[T]):
    def send(self, msg: T) -> None:
        frame, copy = self._encoding.frame(msg)
        self.socket.send(frame, 0, copy=copy)


class _SyncReceiver(_Base[T]):
    def recv(self, timeout_ms: int | None = None) -> T | None:
        """Block for the next message; None if ``timeout_ms`` passes first."""
        if timeout_ms is not None and not self.socket.poll(timeout_ms, zmq.POLLIN):
            return None
        frame = self.socket.recv(copy=False)
        return self._decoder.decode(frame.buffer)

    def recv_nowait(self) -> T | None:
        try:
            frame = self.socket.recv(flags=zmq.NOBLOCK, copy=False)
        except zmq.Again:
            return None
        return self._decoder.decode(frame.buffer)


class PushSocket(_SyncSender[T]):
    """PUSH: send messages of type T to PULL peers (round robin across them)."""

    _kind = zmq.PUSH


class PullSocket(_SyncReceiver[T]):
    """PULL: receive messages of type T, fair-queued from every PUSH peer."""

    _kind = zmq.PULL


class PubSocket(_SyncSender[T]):
    """PUB: broadcast messages of type T to every subscriber."""

    _kind = zmq.PUB


class XPubSocket(PubSocket[T]):
    """PUB that sees its subscribers: ``wait_for_subscribers`` closes PUB/SUB's slow-joiner gap.

    A SUB peer's subscription reaches the publisher some time after it connects;
    a message published before then is silently lost. Bind this, wait until all
    N expected subscribers have subscribed, then publish.
    """

    _kind = zmq.XPUB

    def __init__(
        self,
        endpoint: str,
        msg_type: Any,
        *,
        bind: bool = True,
        ctx: zmq.Context[Any] | None = None,
    ) -> None:
        super().__init__(endpoint, msg_type, bind=bind, ctx=ctx)
        self.socket.setsockopt(zmq.XPUB_VERBOSE, 1)

    def wait_for_subscribers(self, n: int, timeout_s: float) -> bool:
        """Block until ``n`` subscriptions have arrived; False if ``timeout_s`` passes first."""
        deadline = time.monotonic() + timeout_s
        seen = 0
        while seen < n:
            remaining_ms = int((deadline - time.monotonic()) * 1000)
            if remaining_ms <= 0 or not self.socket.poll(remaining_ms, zmq.POLLIN):
                return False
            if self.socket.recv()[:1] == b"\x01":
                seen += 1
        return True


class SubSocket(_SyncReceiver[T]):
    """SUB: receive every message a PUB peer broadcasts (subscribed to all)."""

    _kind = zmq.SUB


class _AsyncBase(_Base[T]):
    @staticmethod
    def _default_ctx() -> zmq.Context[Any]:
        return zmq.asyncio.Context.instance()


class AsyncPushSocket(_AsyncBase[T]):
    """PUSH for asyncio code (zmq.asyncio); create it inside the running event loop."""

    _kind = zmq.PUSH

    def send_nowait(self, msg: T) -> asyncio.Future[Any]:
        """Queue ``msg``; the future is done once ZeroMQ has it, at once unless no peer is
        connected or earlier sends wait. Cancelling it before then drops the message."""
        # Fresh bytes, never the reused buffer: zmq.asyncio keeps a frame it cannot
        # send at once and sends it later, by which time a reused buffer would hold
        # the next message.
        frame = self._encoding.encode(msg)
        return self.socket.send(frame, 0, copy=len(frame) < ZERO_COPY_THRESHOLD)  # type: ignore[return-value]

    async def send(self, msg: T) -> None:
        await self.send_nowait(msg)


class AsyncPullSocket(_AsyncBase[T]):
    """PULL for asyncio code (zmq.asyncio); create it inside the running event loop."""

    _kind = zmq.PULL

    async def recv(self) -> T:
        frame = await self.socket.recv(copy=False)  # type: ignore[misc]
        return self._decoder.decode(frame.buffer)


def report_ready(
    control_endpoint: str,
    role: str,
    num_blocks: int = 0,
    rank: int = 0,
    engine: int = 0,
    kv_events: tuple[str, str] = ("", ""),
    kv_block_bytes: int = 0,
) -> None:
    """Tell the launcher this process is up (its control socket is bound by the launcher)."""
    from services.protocol import Ready

    sock = PushSocket[Ready](control_endpoint, Ready)
    sock.send(Ready(role, os.getpid(), num_blocks, rank, engine, *kv_events, kv_block_bytes))
    # Unlike our other sockets (linger 0), wait for the message to leave before closing.
    sock.socket.close(linger=10_000)
