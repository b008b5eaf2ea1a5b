"""KV events for ``prefix_precise``: vLLM's wire format both ways, and the router's index
staying correct through a dropped batch (gap -> replay), an unreplayable gap, a publisher
restart, evictions and ``AllBlocksCleared``.

The publisher side here is ``FakePublisher``: vLLM's protocol written directly on pyzmq
(PUB ``(topic, seq, payload)``, ROUTER replay answering ``start_seq`` with the buffered
batches then ``-1``), so the subscriber is checked against the protocol, not against our own
publisher; our publisher (``services/kv_cache/events.py``) is checked against vLLM's
struct definitions, copied below from ``vllm/distributed/kv_events.py``.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
from pathlib import Path
from typing import Any

import msgspec
import pytest
import zmq

from services.kv_cache.events import KVEventPublisher
from services.protocol import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    KVCacheEvent,
    KVEventBatch,
)
from services.router.kv_events import PreciseIndex, Publisher, Subscription, decode_batch
from tests.router_fakes import free_port

FIXTURES = json.loads((Path(__file__).parent / "data" / "kv_event_batches.json").read_text())


# vLLM's array-like structs (v0.9-v0.11), as its own subscriber example decodes them.
class VllmEventBatch(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    ts: float
    events: list[Any]
    data_parallel_rank: int | None = None


class VllmKVCacheEvent(msgspec.Struct, array_like=True, omit_defaults=True, gc=False, tag=True):
    pass


class VllmBlockStored(VllmKVCacheEvent, tag="BlockStored"):
    block_hashes: list[bytes | int]
    parent_block_hash: bytes | int | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None
    medium: str | None


class VllmBlockRemoved(VllmKVCacheEvent, tag="BlockRemoved"):
    block_hashes: list[bytes | int]
    medium: str | None


class VllmAllBlocksCleared(VllmKVCacheEvent, tag="AllBlocksCleared"):
    pass


class VllmKVEventBatch(VllmEventBatch):
    events: list[VllmBlockStored | VllmBlockRemoved | VllmAllBlocksCleared]


def test_vllm_fixtures_decode_in_both_encodings() -> None:
    for key in ("array_like_v0_9", "map_2026"):
        batch = decode_batch(bytes.fromhex(FIXTURES[key]))
        assert batch.ts == 1700000000.5 and batch.data_parallel_rank == 1
        stored, removed, cleared, stored2 = batch.events
        assert isinstance(stored, BlockStored) and stored.block_hashes == [
            b"\x01" * 32,
            b"\x02" * 32,
        ]
        assert (stored.parent_block_hash, stored.token_ids, stored.block_size, stored.medium) == (
            None, list(range(8)), 4, "GPU")  # fmt: skip
        assert isinstance(removed, BlockRemoved) and removed.block_hashes == [b"\x03" * 32]
        assert isinstance(cleared, AllBlocksCleared)
        assert isinstance(stored2, BlockStored) and stored2.parent_block_hash == 6
    with pytest.raises(ValueError):
        decode_batch(b"\x93\x01")  # truncated msgpack
    with pytest.raises(ValueError):
        decode_batch(msgspec.msgpack.encode({"ts": 1.0}))


def test_our_batches_decode_with_vllms_structs() -> None:
    ours = KVEventBatch(
        2.5,
        [BlockStored([b"\xaa" * 32], b"\xbb" * 32, [1, 2, 3, 4], 4), BlockRemoved([5]),
         AllBlocksCleared()],
        3,
    )  # fmt: skip
    theirs = msgspec.msgpack.decode(msgspec.msgpack.encode(ours), type=VllmKVEventBatch)
    stored, removed, cleared = theirs.events
    assert theirs.data_parallel_rank == 3 and theirs.ts == 2.5
    assert isinstance(stored, VllmBlockStored)
    assert (stored.block_hashes, stored.parent_block_hash, stored.token_ids, stored.block_size,
            stored.lora_id, stored.medium) == ([b"\xaa" * 32], b"\xbb" * 32, [1, 2, 3, 4], 4,
                                               None, "GPU")  # fmt: skip
    assert isinstance(removed, VllmBlockRemoved) and removed.block_hashes == [5]
    assert isinstance(cleared, VllmAllBlocksCleared)


def test_precise_index_counts_blocks_per_engine() -> None:
    index = PreciseIndex()
    index.apply(("r", 0), [BlockStored([1, 2, 3], None, [], 4)])
    index.apply(("r", 1), [BlockStored([1, 9], None, [], 4)])
    index.apply(("q", 0), [BlockStored([1, 2], None, [], 4), BlockStored([2], 1, [], 4)])
    assert index.matched_blocks([1, 2, 3, 4], ["r", "q", "x"]) == {"r": 3, "q": 2, "x": 0}
    index.apply(("q", 0), [BlockRemoved([2])])  # two blocks held hash 2: one is left
    assert index.matched_blocks([1, 2], ["q"]) == {"q": 2}
    index.apply(("q", 0), [BlockRemoved([2])])
    assert index.matched_blocks([1, 2], ["q"]) == {"q": 1}
    index.apply(("r", 0), [AllBlocksCleared()])
    assert index.matched_blocks([1, 9], ["r"]) == {"r": 2}  # engine 1 still has them
    # A connector's tier (offload: CPU) counts as held: the engine loads, not computes it;
    # its removal leaves the device pool's copy alone, and the device's removal the tier's.
    index.apply(("r", 1), [BlockStored([7, 8], None, [], 4, medium="CPU")])
    assert index.matched_blocks([1, 9, 7, 8], ["r"]) == {"r": 4}
    index.apply(("r", 1), [BlockRemoved([9], medium="CPU")])  # not in that tier: no change
    index.apply(("r", 1), [BlockRemoved([7], medium="CPU")])
    assert index.matched_blocks([1, 9, 7, 8], ["r"]) == {"r": 2}
    index.apply(("r", 1), [BlockStored([7], None, [], 4), BlockRemoved([8])])
    assert index.matched_blocks([1, 9, 7, 8], ["r"]) == {"r": 4}
    assert index.size("r") == 3  # device blocks only: 1, 9, 7 on engine 1 (engine 0 cleared)
    index.forget("r")
    assert not index.has("r") and index.has("q")


# ---- a publisher that speaks vLLM's protocol, and can drop, restart and forget


def _batch(*events: KVCacheEvent) -> bytes:
    return msgspec.msgpack.encode(VllmKVEventBatch(1.0, [_to_vllm(e) for e in events], 0))


def _to_vllm(e: KVCacheEvent) -> Any:
    if isinstance(e, BlockStored):
        return VllmBlockStored(e.block_hashes, e.parent_block_hash, e.token_ids, e.block_size,
                               None, "GPU")  # fmt: skip
    if isinstance(e, BlockRemoved):
        return VllmBlockRemoved(e.block_hashes, "GPU")
    return VllmAllBlocksCleared()


class FakePublisher:
    def __init__(
        self, ctx: zmq.Context, port: int, replay_port: int | None, buffer: int = 100
    ) -> None:
        self.pub = ctx.socket(zmq.PUB)
        self.pub.setsockopt(zmq.LINGER, 0)
        self.pub.bind(f"tcp://127.0.0.1:{port}")
        self.replay = None
        if replay_port is not None:
            self.replay = ctx.socket(zmq.ROUTER)
            self.replay.setsockopt(zmq.LINGER, 0)
            self.replay.bind(f"tcp://127.0.0.1:{replay_port}")
        self.seq = 0
        self.kept: list[tuple[int, bytes]] = []
        self.buffer = buffer

    def send(self, *events: KVCacheEvent, drop: bool = False) -> None:
        payload = _batch(*events)
        if not drop:
            self.pub.send_multipart((b"kv@r@m", self.seq.to_bytes(8, "big"), payload))
        self.kept = [*self.kept, (self.seq, payload)][-self.buffer :]
        self.seq += 1

    def serve_replays(self) -> None:
        while self.replay is not None and self.replay.poll(0):
            client, _, start = self.replay.recv_multipart()
            for seq, payload in self.kept:
                if seq >= int.from_bytes(start, "big"):
                    self.replay.send_multipart((client, b"", seq.to_bytes(8, "big"), payload))
            self.replay.send_multipart((client, b"", (-1).to_bytes(8, "big", signed=True), b""))

    def close(self) -> None:
        self.pub.close(linger=0)
        if self.replay is not None:
            self.replay.close(linger=0)


class Harness:
    """A subscription in an asyncio loop of its own; ``until(cond)`` serves replays meanwhile."""

    def __init__(self, replay: bool) -> None:
        import zmq.asyncio

        self.zctx = zmq.Context()
        self.port, self.replay_port = free_port(), (free_port() if replay else None)
        self.pub = self.new_publisher()
        self.index = PreciseIndex()
        self.ctx = zmq.asyncio.Context()
        where = f"tcp://127.0.0.1:{self.replay_port}" if self.replay_port else ""
        self.sub = Subscription("r", Publisher(f"tcp://127.0.0.1:{self.port}", where, "kv@r@m"),
                                self.index, self.ctx)  # fmt: skip

    def new_publisher(self) -> FakePublisher:
        """A publisher process on the harness's ports (again, after ``pub.close()``)."""
        return FakePublisher(self.zctx, self.port, self.replay_port)

    async def until(self, cond: Any, timeout_s: float = 5.0) -> None:
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout_s
        while not cond():
            assert loop.time() < deadline, "condition not reached"
            self.pub.serve_replays()
            await asyncio.sleep(0.01)

    def held(self, *hashes: int) -> list[bool]:
        return [self.index.holds(("r", 0), h) for h in hashes]


def _run(body: Any, replay: bool = True, before: Any = None) -> None:
    """``before(publisher)`` runs before the subscription exists, ``body(harness)`` after
    it has synced and reached the publisher."""
    harness = Harness(replay)
    if before is not None:
        before(harness.pub)

    async def main() -> None:
        task = asyncio.create_task(harness.sub.run())
        try:
            await harness.until(harness.sub.synced.is_set)
            await asyncio.sleep(0.3)  # the subscription reaches the publisher
            await body(harness)
        finally:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task

    try:
        asyncio.run(main())
    finally:
        harness.pub.close()
        harness.ctx.term()
        harness.zctx.term()


def test_a_dropped_batch_is_replayed() -> None:
    async def body(h: Harness) -> None:
        h.pub.send(BlockStored([1], None, [], 4))
        h.pub.send(BlockStored([2], 1, [], 4), drop=True)  # lost on the way
        h.pub.send(BlockRemoved([1]))
        h.pub.send(BlockStored([3], 2, [], 4))
        await h.until(lambda: h.sub.last == 3)
        assert h.held(1, 2, 3) == [False, True, True]
        assert h.sub.stats.replays >= 2 and not h.sub.stats.resyncs  # start + the gap

    _run(body)


def test_history_before_the_router_started_comes_from_the_replay() -> None:
    def before(pub: FakePublisher) -> None:  # nobody listens yet
        pub.send(BlockStored([1, 2], None, [], 4))
        pub.send(BlockRemoved([2]))

    async def body(h: Harness) -> None:
        assert h.held(1, 2) == [True, False] and h.sub.last == 1

    _run(body, before=before)


def test_a_gap_the_publisher_cannot_replay_forgets_rather_than_guesses() -> None:
    async def body(h: Harness) -> None:
        h.pub.send(BlockStored([1], None, [], 4))
        await h.until(lambda: h.sub.last == 0)
        h.pub.send(BlockRemoved([1]), drop=True)  # without it, 1 would look cached forever
        h.pub.send(BlockStored([5], None, [], 4))
        await h.until(lambda: h.sub.last == 2)
        assert h.held(1, 5) == [False, True]
        assert h.sub.stats.resyncs["gap not replayable"] == 1

    _run(body, replay=False)


def test_a_restarted_publisher_replaces_the_index() -> None:
    async def body(h: Harness) -> None:
        for n in range(5):
            h.pub.send(BlockStored([n], None, [], 4))
        await h.until(lambda: h.sub.last == 4)
        h.pub.close()  # the replica dies; a new process binds the same ports, numbers from 0
        await asyncio.sleep(0.3)
        h.pub = h.new_publisher()
        h.pub.send(BlockStored([100], None, [], 4))
        await h.until(lambda: h.held(100) == [True], timeout_s=10)
        assert h.held(0, 1, 4) == [False] * 3
        assert sum(h.sub.stats.resyncs.values()) >= 1
        h.pub.send(BlockStored([101], 100, [], 4))
        await h.until(lambda: h.held(101) == [True])

    _run(body)


def test_all_blocks_cleared_empties_the_engines_entries() -> None:
    async def body(h: Harness) -> None:
        h.pub.send(BlockStored([1, 2], None, [], 4))
        h.pub.send(AllBlocksCleared())
        h.pub.send(BlockStored([3], None, [], 4))
        await h.until(lambda: h.sub.last == 2)
        assert h.held(1, 2, 3) == [False, False, True]

    _run(body)


def test_our_publisher_serves_vllm_frames_and_replays() -> None:
    port, replay_port = free_port(), free_port()
    pub = KVEventPublisher(f"tcp://127.0.0.1:{port}", f"tcp://127.0.0.1:{replay_port}", "kv@x@m")
    ctx = zmq.Context()
    sub = ctx.socket(zmq.SUB)
    sub.setsockopt(zmq.SUBSCRIBE, b"kv@x@m")
    sub.connect(f"tcp://127.0.0.1:{port}")
    try:
        import time

        time.sleep(0.3)
        for i in range(3):
            pub.publish(float(i), [BlockStored([i], None, [i] * 4, 4)], None)
        for i in range(3):
            assert sub.poll(5000)
            topic, seq, payload = sub.recv_multipart()
            assert (topic, int.from_bytes(seq, "big")) == (b"kv@x@m", i)
            batch = msgspec.msgpack.decode(payload, type=VllmKVEventBatch)
            assert batch.events[0].block_hashes == [i]  # type: ignore[union-attr]
        dealer = ctx.socket(zmq.DEALER)
        dealer.connect(f"tcp://127.0.0.1:{replay_port}")
        dealer.send_multipart((b"", (1).to_bytes(8, "big")))
        got = []
        while True:
            assert dealer.poll(5000)
            _, seq, payload = dealer.recv_multipart()
            n = int.from_bytes(seq, "big", signed=True)
            if n == -1:
                break
            got.append((n, decode_batch(payload).ts))
        assert got == [(1, 1.0), (2, 2.0)]
        dealer.close(linger=0)
    finally:
        sub.close(linger=0)
        pub.close()
        ctx.term()


def test_vllms_int_hashes_meet_our_digests() -> None:
    """vLLM publishes the low 64 bits of each digest as an int by default."""
    digests = [bytes([i]) * 32 for i in range(1, 4)]
    index = PreciseIndex()
    index.apply(("v", 0), [BlockStored([int.from_bytes(d, "big") & ((1 << 64) - 1) for d in digests],
                                       None, [], 4)])  # fmt: skip
    assert index.matched_blocks(digests, ["v"]) == {"v": 3}
    index.apply(("v", 0), [BlockRemoved([digests[1]])])  # and back: a digest removes the int
    assert index.matched_blocks(digests, ["v"]) == {"v": 1}


def test_engines_that_publish_digests_are_matched_on_the_whole_digest() -> None:
    """Ours publish whole digests: kept as they are, so two that share their low 64 bits
    (what an int-publishing engine's hashes keep) are still told apart."""
    stored = [bytes([1]) * 24 + bytes([9]) * 8, bytes([2]) * 24 + bytes([9]) * 8]
    other = bytes([3]) * 24 + bytes([9]) * 8  # the same low 64 bits as both
    index = PreciseIndex()
    index.apply(("ours", 0), [BlockStored(stored, None, [], 4)])
    assert index.matched_blocks(stored, ["ours"]) == {"ours": 2}
    assert index.matched_blocks([stored[0], other], ["ours"]) == {"ours": 1}
    assert index.holds(("ours", 0), stored[1]) and not index.holds(("ours", 0), other)


@pytest.mark.parametrize(
    "batch",
    [
        [None, []],
        [1.0, [["BlockStored", [[1]], None, [], 4]]],
        {"ts": 1.0, "events": [{"type": "BlockRemoved", "block_hashes": {"a": 1}}]},
        [1.0, "events"],
    ],  # fmt: skip
)
def test_malformed_batches_are_value_errors(batch: Any) -> None:
    with pytest.raises(ValueError):
        decode_batch(msgspec.msgpack.encode(batch))


def test_a_long_history_replays_whole() -> None:
    """More batches than zmq's default queue (1,000): the replay must bring them all, and
    the index must hold exactly what the engine holds."""
    pub = KVEventPublisher("auto", "auto")
    n = 3000
    for i in range(n):  # stores 0..1499, then removes them all but the last
        h = (i % (n // 2)).to_bytes(32, "big")
        pub.publish(1.0, [BlockStored([h], None, [], 4) if i < n // 2 else BlockRemoved([h])], 0)
    pub.publish(1.0, [BlockStored([b"x" * 32], None, [], 4)], 0)

    async def main() -> None:
        import zmq.asyncio

        ctx = zmq.asyncio.Context()
        index = PreciseIndex()
        while len(pub._buffer) < n + 1:
            await asyncio.sleep(0.01)
        sub = Subscription("r", Publisher(pub.bound, pub.bound_replay), index, ctx)
        task = asyncio.create_task(sub.run())
        await asyncio.wait_for(sub.synced.wait(), 30)
        assert sub.last == n and index.size("r") == 1 and index.holds(("r", 0), b"x" * 32)
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task
        ctx.term()

    try:
        asyncio.run(main())
    finally:
        pub.close()
