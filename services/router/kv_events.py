"""``prefix_precise``: the blocks each replica really holds, from its KV events.

Each replica's engine cores publish their prefix cache's changes in vLLM's wire format
(``services/kv_cache/events.py``; vLLM's ``--kv-events-config`` does the same): a ZMQ
PUB message ``(topic, seq, payload)`` per batch, and a ROUTER socket that replays buffered
batches from a sequence number. The router subscribes to each and keeps, per engine core,
the count of cached blocks per hash (``PreciseIndex``).

Where the anchors lose track, this keeps the index correct:

- **a gap** in sequence numbers (a dropped message, or the first messages lost while a
  subscription propagates) is filled by a replay from the first missing number; if the
  publisher no longer has them (or has no replay socket), that engine's entries are dropped
  and rebuilt from what it still has: the index may then miss blocks, never invent them;
- **a publisher restart** (its connection drops, or its numbers go back) clears the engine's
  entries and replays the new process's history from 0;
- ``AllBlocksCleared`` clears the engine's entries.

Both encodings vLLM has used are read: array-like structs (``[ts, events, dp_rank]``,
events ``["BlockStored", hashes, parent, tokens, block_size, lora_id, medium, ...]``; ours)
and maps (``{"ts": ..., "events": [{"type": "BlockStored", ...}]}``, vLLM since late 2026).
Blocks of the engine's own pool (medium ``GPU`` or none) and of the tiers a KV connector
keeps beyond it (``CPU``: offload; ``DISK``: storage) are indexed apart, so that one
tier's removal never drops another's; a prompt block held in any tier counts as matched,
since the engine loads it instead of computing it.

It stays whole because its parts are one protocol read end to end: the wire format
(``decode_batch``), the index it fills (``PreciseIndex``) and the subscription that keeps
the two in step (gaps, replays, restarts) change together.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections import Counter
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

import msgspec
import zmq
import zmq.asyncio
from zmq.utils.monitor import parse_monitor_message

from services.protocol import (
    AllBlocksCleared,
    BlockHash,
    BlockRemoved,
    BlockStored,
    KVCacheEvent,
    KVEventBatch,
)

log = logging.getLogger(__name__)

END_SEQ = -1
_POLLIN = int(zmq.POLLIN)
_DEVICE_MEDIA = (None, "GPU", "gpu")
_STORED_FIELDS = (
    "block_hashes",
    "parent_block_hash",
    "token_ids",
    "block_size",
    "lora_id",
    "medium",
)


@dataclass
class DecodedBatch:
    ts: float
    events: list[KVCacheEvent]
    data_parallel_rank: int | None = None


def _event(raw: Any) -> KVCacheEvent | None:
    """One event from either encoding; None for a kind this router does not know."""
    tag: Any
    fields: dict[str, Any]
    if isinstance(raw, list | tuple):
        if not raw or not isinstance(raw[0], str):
            raise ValueError("an array-encoded event starts with its tag")
        tag, values = raw[0], list(raw[1:])
        if tag == "BlockStored":
            fields = dict(zip(_STORED_FIELDS, values, strict=False))
        elif tag == "BlockRemoved":
            fields = dict(zip(("block_hashes", "medium"), values, strict=False))
        else:
            fields = {}
    elif isinstance(raw, dict):
        tag, fields = raw.get("type"), raw
    else:
        raise ValueError(f"an event is an array or a map, not {type(raw).__name__}")
    if tag == "BlockStored":
        return BlockStored(
            block_hashes=list(fields["block_hashes"]),
            parent_block_hash=fields.get("parent_block_hash"),
            token_ids=list(fields.get("token_ids") or []),
            block_size=int(fields.get("block_size") or 0),
            lora_id=fields.get("lora_id"),
            medium=fields.get("medium"),
        )
    if tag == "BlockRemoved":
        return BlockRemoved(block_hashes=list(fields["block_hashes"]), medium=fields.get("medium"))
    if tag == "AllBlocksCleared":
        return AllBlocksCleared()
    return None


def _check_hashes(hashes: Any) -> list[BlockHash]:
    if not isinstance(hashes, list) or not all(isinstance(h, bytes | int) for h in hashes):
        raise ValueError("block hashes are a list of bytes or ints")
    return hashes


_BATCH = msgspec.msgpack.Decoder(KVEventBatch)


def decode_batch(payload: bytes) -> DecodedBatch:
    """A ``KVEventBatch`` payload (msgpack) in either of vLLM's encodings; ValueError for
    anything else. Ours (array-like, the kinds it knows) decode straight into the event
    structs; anything else through the generic path."""
    try:
        batch = _BATCH.decode(payload)
    except (msgspec.DecodeError, msgspec.ValidationError):
        return _decode_any(payload)
    return DecodedBatch(batch.ts, list(batch.events), batch.data_parallel_rank)


def _decode_any(payload: bytes) -> DecodedBatch:
    try:
        raw = msgspec.msgpack.decode(payload)
    except msgspec.DecodeError as e:
        raise ValueError(f"not msgpack: {e}") from None
    if isinstance(raw, list | tuple) and len(raw) >= 2:
        ts, events, rank = raw[0], raw[1], raw[2] if len(raw) > 2 else None
    elif isinstance(raw, dict) and "events" in raw:
        ts, events, rank = raw.get("ts", 0.0), raw["events"], raw.get("data_parallel_rank")
    else:
        raise ValueError("not a KV event batch")
    try:
        decoded = [e for e in (_event(x) for x in events) if e is not None]
        for event in decoded:
            if isinstance(event, BlockStored | BlockRemoved):
                _check_hashes(event.block_hashes)
        return DecodedBatch(float(ts), decoded, rank if isinstance(rank, int) else None)
    except (KeyError, TypeError, AttributeError, OverflowError) as e:
        raise ValueError(f"malformed batch: {type(e).__name__}: {e}") from None


Source = tuple[str, int]  # (replica URL, data-parallel rank)
_LOW64 = (1 << 64) - 1


def key(h: BlockHash) -> int:
    """A block hash as an engine that publishes ints has it: its low 64 bits, as vLLM
    publishes hashes by default (``VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES``)."""
    return int.from_bytes(h[-8:], "big") if isinstance(h, bytes) else h & _LOW64


class PreciseIndex:
    """Per engine core of each replica, how many cached blocks carry each hash: in its
    device pool (``_held``) and in its connector's other tiers (``_lower``). Hashes are
    kept as the engine publishes them (ours: digests; vLLM's by default: ints, the
    digest's low 64 bits); a prompt's digests meet an engine that publishes ints through
    ``key``."""

    def __init__(self) -> None:
        self._held: dict[Source, Counter[BlockHash]] = {}
        self._lower: dict[Source, Counter[BlockHash]] = {}
        self._ints: set[Source] = set()  # engines that publish ints

    def apply(self, source: Source, events: Iterable[KVCacheEvent]) -> None:
        device = self._held.setdefault(source, Counter())
        lower = self._lower.setdefault(source, Counter())
        for event in events:
            if isinstance(event, BlockStored):
                held = device if event.medium in _DEVICE_MEDIA else lower
                hashes = event.block_hashes
                if hashes and type(hashes[0]) is int:
                    self._ints.add(source)
                held.update(map(key, hashes) if source in self._ints else hashes)
            elif isinstance(event, BlockRemoved):
                held = device if event.medium in _DEVICE_MEDIA else lower
                hashes = event.block_hashes
                for k in map(key, hashes) if source in self._ints else hashes:
                    if held[k] > 1:
                        held[k] -= 1
                    else:
                        held.pop(k, None)
            elif isinstance(event, AllBlocksCleared):  # the engine forgets its tiers too
                device.clear()
                lower.clear()

    def clear(self, source: Source) -> None:
        self._held.pop(source, None)
        self._lower.pop(source, None)
        self._ints.discard(source)

    def forget(self, replica: str) -> None:
        for source in [s for s in self._held if s[0] == replica]:
            self.clear(source)

    def holds(self, source: Source, h: BlockHash) -> bool:
        k = key(h) if source in self._ints else h
        return k in self._held.get(source, ()) or k in self._lower.get(source, ())

    def matched_blocks(
        self, hashes: Sequence[BlockHash], replicas: Iterable[str]
    ) -> dict[str, int]:
        """For each replica, the longest leading run of ``hashes`` one of its engines holds."""
        wanted = set(replicas)
        out = dict.fromkeys(wanted, 0)
        empty: Counter[BlockHash] = Counter()
        ints: list[BlockHash] | None = None  # the hashes as ints, once an engine needs them
        total = len(hashes)
        for source, held in self._held.items():
            replica = source[0]
            if replica not in wanted:
                continue
            lower = self._lower.get(source, empty)
            probe = hashes
            if source in self._ints:
                if ints is None:
                    ints = [key(h) for h in hashes]
                probe = ints
            n = 0
            while n < total:
                k = probe[n]
                if k not in held and k not in lower:
                    break
                n += 1
            if n > out[replica]:
                out[replica] = n
        return out

    def size(self, replica: str) -> int:
        """Blocks the replica's device pools hold."""
        return sum(len(held) for (r, _), held in self._held.items() if r == replica)

    def has(self, replica: str) -> bool:
        return any(r == replica for r, _ in self._held)


@dataclass
class Publisher:
    """Where one engine core publishes (from the replica's ``GET /kv_events``, or a flag)."""

    endpoint: str
    replay_endpoint: str = ""
    topic: str = ""
    data_parallel_rank: int = 0


@dataclass
class SubscriptionStats:
    batches: int = 0
    replays: int = 0
    resyncs: Counter[str] = field(default_factory=Counter)
    last_lag_s: float = 0.0


class Subscription:
    """Follows one engine core's events into the index; ``run()`` until cancelled."""

    def __init__(
        self,
        replica: str,
        publisher: Publisher,
        index: PreciseIndex,
        ctx: zmq.asyncio.Context,
        on_batch: Any = None,
        replay_timeout_s: float = 10.0,
    ) -> None:
        self.replica, self.publisher, self.index, self.ctx = replica, publisher, index, ctx
        self.source: Source = (replica, publisher.data_parallel_rank)
        self.stats = SubscriptionStats()
        self.last = -1  # the last sequence number applied
        self._duplicates_possible = False  # after a replay, live batches it already covered
        self._baseline = False  # no usable history: take the next live batch as the start
        self._on_batch = on_batch
        self.replay_timeout_s = replay_timeout_s
        self.synced = asyncio.Event()  # set once the first resync finished

    async def run(self) -> None:
        # Plain sockets, read when the event loop sees their file descriptors readable
        # (ZMQ's FD signals that something may have changed; EVENTS says what), in the
        # loop's callback itself (``_readable``): a batch that follows the last one costs a
        # read and its decoding, no task woken. Anything else (the monitor's news, a batch
        # out of order: a replay or a resync to await) wakes this task, which reads on
        # until both sockets are empty. zmq.asyncio's poller cost futures and watchers for
        # both sockets per batch (~0.8 ms of the router's CPU per request at 8 replicas).
        # (the same context; its sockets plain)
        plain: zmq.Context[zmq.Socket[bytes]] = zmq.Context.shadow(self.ctx.underlying)
        sub = plain.socket(zmq.SUB)
        sub.setsockopt(zmq.LINGER, 0)
        sub.setsockopt(zmq.SUBSCRIBE, self.publisher.topic.encode())
        where = f"inproc://kv-events-monitor-{id(self):x}"
        sub.monitor(where, zmq.EVENT_CONNECTED | zmq.EVENT_DISCONNECTED)
        monitor = plain.socket(zmq.PAIR)
        monitor.setsockopt(zmq.LINGER, 0)
        monitor.connect(where)
        sub.connect(self.publisher.endpoint)
        loop = asyncio.get_running_loop()
        wake = asyncio.Event()
        held: list[tuple[int, bytes]] = []  # a batch ``_readable`` left to this task
        idle = False  # this task waits for ``wake``: ``_readable`` may apply batches

        def readable() -> None:
            if not idle or self._read(sub, held):
                wake.set()

        fds = [int(sub.getsockopt(zmq.FD)), int(monitor.getsockopt(zmq.FD))]
        loop.add_reader(fds[0], readable)
        loop.add_reader(fds[1], wake.set)  # (the monitor's news: the task reads it)
        disconnected = False
        try:
            await self.resync("start")
            self.synced.set()
            while True:
                if held:
                    await self.on_message(*held.pop())
                    continue
                if int(monitor.getsockopt(zmq.EVENTS)) & _POLLIN:  # first, as a poll would
                    event = parse_monitor_message(monitor.recv_multipart(zmq.NOBLOCK))
                    if event["event"] == zmq.EVENT_DISCONNECTED:
                        disconnected = True
                    elif event["event"] == zmq.EVENT_CONNECTED and disconnected:
                        disconnected = False  # the publisher came back: a new process
                        await self.resync("reconnected")
                    continue
                if int(sub.getsockopt(zmq.EVENTS)) & _POLLIN:
                    frames = sub.recv_multipart(zmq.NOBLOCK)
                    if len(frames) == 3 and len(frames[1]) == 8:
                        await self.on_message(int.from_bytes(frames[1], "big"), frames[2])
                    continue
                wake.clear()
                idle = True
                try:
                    await wake.wait()
                finally:
                    idle = False
        finally:
            for fd in fds:
                loop.remove_reader(fd)
            with contextlib.suppress(zmq.ZMQError):
                sub.monitor(None, 0)
            monitor.close(linger=0)
            sub.close(linger=0)

    def _read(self, sub: zmq.Socket[bytes], held: list[tuple[int, bytes]]) -> bool:
        """Apply the live batches that follow the last one applied, until the socket is
        empty (False) or one does not follow it (True: kept in ``held`` for the task)."""
        while int(sub.getsockopt(zmq.EVENTS)) & _POLLIN:
            frames = sub.recv_multipart(zmq.NOBLOCK)
            if len(frames) != 3 or len(frames[1]) != 8:
                continue
            seq = int.from_bytes(frames[1], "big")
            if self._baseline or seq != self.last + 1:
                held.append((seq, frames[2]))
                return True
            self._duplicates_possible = False
            self.apply(seq, frames[2])
        return False

    async def on_message(self, seq: int, payload: bytes) -> None:
        if self._baseline:  # no history to rebuild from: the index starts here, empty
            self._baseline = False
            self.last = seq - 1
        if seq <= self.last:
            if self._duplicates_possible:
                return  # a replay already applied it
            await self.resync("sequence went back")  # a restarted publisher
            if seq <= self.last:
                return
        elif seq > self.last + 1:
            await self.catch_up(self.last + 1)
            if seq <= self.last:
                return
            if seq > self.last + 1:  # the publisher no longer has what was missed
                await self.resync("gap not replayable", live_seq=seq)
                if self._baseline:
                    self._baseline = False
                    self.last = seq - 1
                elif seq <= self.last:
                    return
                elif seq > self.last + 1:  # still a hole: start over from here, empty
                    self.index.clear(self.source)
                    self.index.apply(self.source, [])
                    self.last = seq - 1
        self._duplicates_possible = False
        self.apply(seq, payload)

    def apply(self, seq: int, payload: bytes) -> None:
        try:
            batch = decode_batch(payload)
        except ValueError as e:
            log.warning("KV event batch %d from %s ignored: %s", seq, self.replica, e)
            batch = DecodedBatch(time.time(), [])
        self.index.apply(self.source, batch.events)
        self.last = seq
        self.stats.batches += 1
        self.stats.last_lag_s = max(time.time() - batch.ts, 0.0) if batch.ts else 0.0
        if self._on_batch is not None:
            self._on_batch(self, batch)

    async def catch_up(self, start: int) -> None:
        """Apply the publisher's buffered batches from ``start`` that follow ``last``."""
        for seq, payload in await self.replay(start) or []:
            if seq == self.last + 1:
                self.apply(seq, payload)
        self._duplicates_possible = True

    async def resync(self, reason: str, live_seq: int | None = None) -> None:
        """Forget this engine's blocks and rebuild them from everything it still buffers:
        a complete, unbroken replay (up to ``live_seq``, the batch that showed the need),
        or nothing, and the index starts empty at the next live batch."""
        if reason != "start":
            log.info("KV events of %s (engine %d): resync (%s)", self.replica,
                     self.publisher.data_parallel_rank, reason)  # fmt: skip
            self.stats.resyncs[reason] += 1
        self.index.clear(self.source)
        self.index.apply(self.source, [])
        self.last = -1
        self._duplicates_possible = True
        batches = await self.replay(0)
        seqs = [seq for seq, _ in batches or []]
        unbroken = seqs == list(range(seqs[0], seqs[0] + len(seqs))) if seqs else True
        reaches = live_seq is None or (seqs[-1] if seqs else -1) >= live_seq - 1
        if batches is None or not unbroken or not reaches:
            self._baseline = True
            return
        if batches:
            self.last = batches[0][0] - 1  # the oldest it kept: what came before is gone
        for seq, payload in batches:
            self.apply(seq, payload)

    async def replay(self, start: int) -> list[tuple[int, bytes]] | None:
        """The publisher's buffered batches from ``start``; None without a replay socket or
        when the answer did not end with its end marker in time."""
        if not self.publisher.replay_endpoint:
            return None
        self.stats.replays += 1
        sock = self.ctx.socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.RCVHWM, 0)
        sock.connect(self.publisher.replay_endpoint)
        out: list[tuple[int, bytes]] = []
        try:
            await sock.send_multipart((b"", start.to_bytes(8, "big")))
            deadline = time.monotonic() + self.replay_timeout_s
            while True:
                left = deadline - time.monotonic()
                if left <= 0 or not await sock.poll(int(left * 1000)):
                    log.warning("KV event replay from %s timed out", self.publisher.replay_endpoint)
                    return None
                frames = await sock.recv_multipart()
                if len(frames) != 3 or len(frames[1]) != 8:
                    continue
                seq = int.from_bytes(frames[1], "big", signed=True)
                if seq == END_SEQ:
                    return out
                out.append((seq, frames[2]))
        finally:
            sock.close(linger=0)


class EventFollower:
    """Every replica's subscriptions; ``follow(replica, publishers)`` starts them."""

    def __init__(self, index: PreciseIndex, on_batch: Any = None) -> None:
        self.index = index
        self.ctx = zmq.asyncio.Context()
        self._subs: dict[str, list[tuple[Subscription, asyncio.Task[None]]]] = {}
        self._on_batch = on_batch

    def subscriptions(self, replica: str) -> list[Subscription]:
        return [s for s, _ in self._subs.get(replica, [])]

    async def follow(self, replica: str, publishers: list[Publisher]) -> list[Subscription]:
        await self.stop(replica)
        subs = []
        for p in publishers:
            sub = Subscription(replica, p, self.index, self.ctx, self._on_batch)
            task = asyncio.create_task(sub.run())
            subs.append((sub, task))
        self._subs[replica] = subs
        for sub, task in subs:  # the first replay, so the index is filled when this returns
            done = asyncio.ensure_future(sub.synced.wait())
            await asyncio.wait({done, task}, timeout=5.0, return_when=asyncio.FIRST_COMPLETED)
            done.cancel()
        return [s for s, _ in subs]

    async def stop(self, replica: str) -> None:
        for _, task in self._subs.pop(replica, []):
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError, zmq.ZMQError):
                await task
        self.index.forget(replica)

    async def close(self) -> None:
        for replica in list(self._subs):
            await self.stop(replica)
        self.ctx.term()
