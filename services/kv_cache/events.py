"""Publishing the prefix cache's KV events in vLLM's wire format, with replay.

As vLLM's ``ZmqEventPublisher``: a PUB socket sends each batch as the multipart message
``(topic, seq, payload)`` (``seq``: 8-byte big-endian, from 0 per publisher; ``payload``:
msgpack ``KVEventBatch``), and the last ``buffer_steps`` batches are kept for a ROUTER
replay socket: a client sends ``(b"", start_seq)`` (8-byte big-endian) and receives every
kept batch with ``seq >= start_seq`` as ``(b"", seq, payload)``, then ``(b"", -1, b"")``.

A thread of its own encodes, sends and answers replays, so the scheduler's busy loop only
puts the step's events on a queue, and a replay is answered while the engine is idle.

``--kv-events-endpoint auto`` binds both sockets to free loopback ports (``bound`` and
``bound_replay`` then name them; the server reports them at ``GET /kv_events``).
"""

from __future__ import annotations

import contextlib
import logging
import queue
import threading
from collections import deque
from itertools import count

import msgspec
import zmq

from services.protocol import KVCacheEvent, KVEventBatch

log = logging.getLogger(__name__)

END_SEQ = (-1).to_bytes(8, "big", signed=True)
AUTO = "auto"
_LOOPBACK_ANY_PORT = "tcp://127.0.0.1:*"


def _bind(sock: zmq.Socket, endpoint: str) -> str:
    sock.bind(_LOOPBACK_ANY_PORT if endpoint == AUTO else endpoint)
    bound = sock.getsockopt(zmq.LAST_ENDPOINT)
    return bound.decode() if isinstance(bound, bytes) else str(bound)


class KVEventPublisher:
    """PUB + ROUTER replay, served by a thread; ``publish`` is cheap and never blocks."""

    def __init__(
        self,
        endpoint: str,
        replay_endpoint: str | None,
        topic: str = "",
        buffer_steps: int = 10_000,
        hwm: int = 100_000,
        ctx: zmq.Context | None = None,
    ) -> None:
        self._ctx = ctx or zmq.Context.instance()
        self._pub = self._ctx.socket(zmq.PUB)
        self._pub.set_hwm(hwm)
        self._pub.setsockopt(zmq.LINGER, 0)
        self.bound = _bind(self._pub, endpoint)
        self._replay: zmq.Socket | None = None
        self.bound_replay = ""
        if replay_endpoint:
            self._replay = self._ctx.socket(zmq.ROUTER)
            self._replay.setsockopt(zmq.LINGER, 0)
            # A replay is the whole buffer in one go: zmq's default of 1,000 queued messages
            # would drop the rest (and the end marker) without a word.
            self._replay.setsockopt(zmq.SNDHWM, 0)
            self.bound_replay = _bind(self._replay, replay_endpoint)
        self.topic = topic.encode()
        self._buffer: deque[tuple[int, bytes]] = deque(maxlen=buffer_steps)
        self._queue: queue.SimpleQueue[KVEventBatch | None] = queue.SimpleQueue()
        self._seq = count()
        self._thread = threading.Thread(target=self._run, name="kv-events", daemon=True)
        self._thread.start()

    def publish(self, ts: float, events: list[KVCacheEvent], dp_rank: int | None) -> None:
        self._queue.put(KVEventBatch(ts, events, dp_rank))

    def close(self, timeout_s: float = 1.0) -> None:
        self._queue.put(None)
        self._thread.join(timeout_s)
        self._pub.close(linger=0)
        if self._replay is not None:
            self._replay.close(linger=0)

    def _run(self) -> None:
        encode = msgspec.msgpack.Encoder().encode
        while True:
            if self._replay is not None:
                with contextlib.suppress(zmq.ZMQError):
                    while self._replay.poll(0):
                        self._answer_replay()
            try:
                batch = self._queue.get(timeout=0.05)
            except queue.Empty:
                continue
            if batch is None:
                return
            seq = next(self._seq)
            payload = encode(batch)
            try:
                self._pub.send_multipart((self.topic, seq.to_bytes(8, "big"), payload))
            except zmq.ZMQError as e:  # the batch stays replayable
                log.warning("KV event batch %d not sent: %s", seq, e)
            self._buffer.append((seq, payload))

    def _answer_replay(self) -> None:
        assert self._replay is not None
        frames = self._replay.recv_multipart()
        if len(frames) != 3 or len(frames[2]) != 8:
            log.warning("ignored a malformed KV event replay request (%d frames)", len(frames))
            return
        client, _, start = frames
        start_seq = int.from_bytes(start, "big")
        for seq, payload in list(self._buffer):
            if seq >= start_seq:
                self._replay.send_multipart((client, b"", seq.to_bytes(8, "big"), payload))
        self._replay.send_multipart((client, b"", END_SEQ, b""))
