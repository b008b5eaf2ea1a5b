"""p2p's side channel: the ZeroMQ sockets between a prefill and a decode instance.

Each prefill worker rank binds a ROUTER at ``kv_ip:kv_port + rank``. On it arrive the
decode scheduler's renewals and releases (``ControlSender``, one DEALER per rank) and the
decode worker ranks' pulls (``PullChannel``, one DEALER per pull); the answer to a pull
(``Reply``) is a msgpack header frame and, for ZeroMQ's transport, raw KV frames after it.
Every transport talks over this channel: it carries the holds' protocol, and NIXL's
answer and the simulated link's empty frames too. This is the one file of p2p that opens
sockets (``RAW_SOCKETS`` in ``services/ipc.py``).
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Any

import msgspec
import zmq

from services.flags import ConfigError
from services.protocol import (
    KVPullRefused,
    KVRelease,
    KVRenew,
    KVSideChannelInput,
    KVSideChannelReply,
)

logger = logging.getLogger(__name__)

encoder = msgspec.msgpack.Encoder()
_input_decoder = msgspec.msgpack.Decoder(KVSideChannelInput)
_reply_decoder = msgspec.msgpack.Decoder(KVSideChannelReply)


def tcp(host: str, port: int) -> str:
    return f"tcp://[{host}]:{port}" if ":" in host else f"tcp://{host}:{port}"


def _dealer(host: str, port: int) -> zmq.Socket[Any]:
    sock: zmq.Socket[Any] = zmq.Context.instance().socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(tcp(host, port))
    return sock


class Reply:
    """The way back to one pull's sender: a header message, then any raw frames."""

    def __init__(self, sock: zmq.Socket[Any], identity: bytes) -> None:
        self._sock, self._identity = sock, identity

    def send(self, header: Any, frames: Sequence[Any] = (), copy: bool = True) -> None:
        self._sock.send_multipart([self._identity, encoder.encode(header), *frames], copy=copy)

    def refuse(self, reason: str) -> None:
        self.send(KVPullRefused(reason))


class SideChannelServer:
    """A prefill rank's ROUTER; ``recv`` gives each decodable message with its ``Reply``.
    Only the thread that serves it may use it (ZeroMQ sockets are not thread-safe)."""

    def __init__(self, host: str, port: int) -> None:
        self._sock: zmq.Socket[Any] = zmq.Context.instance().socket(zmq.ROUTER)
        self._sock.setsockopt(zmq.LINGER, 0)
        try:
            self._sock.bind(tcp(host, port))
        except zmq.ZMQError as e:
            self._sock.close()
            raise ConfigError(
                f"p2p side channel: cannot listen on {host}:{port} ({e}); "
                "choose another kv_port in --kv-transfer-config"
            ) from None

    def recv(self, timeout_ms: int) -> tuple[Reply, KVSideChannelInput] | None:
        """The next message within ``timeout_ms``; None if none came (or it was garbage)."""
        if not self._sock.poll(timeout_ms):
            return None
        frames = self._sock.recv_multipart()
        try:
            msg = _input_decoder.decode(frames[-1])
        except msgspec.DecodeError:
            logger.warning("p2p: dropping an undecodable side-channel message")
            return None
        return Reply(self._sock, frames[0]), msg

    def close(self) -> None:
        self._sock.close()


class PullChannel:
    """A decode rank's connection to one prefill rank for one pull: the ``KVPull`` out,
    its answers back, and at the end the release (sent whatever happened)."""

    def __init__(self, host: str, port: int) -> None:
        self._sock = _dealer(host, port)

    def send(self, msg: KVSideChannelInput) -> None:
        self._sock.send(encoder.encode(msg))

    def recv(self, timeout_s: float) -> tuple[KVSideChannelReply, list[zmq.Frame]] | None:
        """The next answer (its header, decoded, and the raw frames after it) within
        ``timeout_s``; None if none came."""
        if not self._sock.poll(int(timeout_s * 1000)):
            return None
        frames = self._sock.recv_multipart(copy=False)
        return _reply_decoder.decode(frames[0].buffer), frames[1:]

    def release(self, remote_request_id: str) -> None:
        """Let the prefill rank free the hold, and close (waiting briefly for it to leave)."""
        self._sock.send(encoder.encode(KVRelease(remote_request_id)), zmq.NOBLOCK)
        self._sock.close(linger=1000)


class ControlSender:
    """The decode scheduler's renewals and releases of holds, one DEALER per prefill rank.
    Never blocks: a prefill instance not taking messages lets its lease lapse."""

    def __init__(self) -> None:
        self._sockets: dict[tuple[str, int], zmq.Socket[Any]] = {}

    def send(self, host: str, port: int, msg: KVRelease | KVRenew) -> None:
        sock = self._sockets.get((host, port))
        if sock is None:
            sock = self._sockets[host, port] = _dealer(host, port)
        try:
            sock.send(encoder.encode(msg), zmq.NOBLOCK)
        except zmq.Again:
            logger.warning("p2p: could not reach %s:%d", host, port)
