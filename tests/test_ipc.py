"""Typed ZeroMQ sockets over real ipc:// endpoints."""

from __future__ import annotations

import asyncio
import os
import stat
import time

import pytest
import zmq

from services.ipc import (
    ZERO_COPY_THRESHOLD,
    AsyncPullSocket,
    AsyncPushSocket,
    PubSocket,
    PullSocket,
    PushSocket,
    SubSocket,
    ipc_dir,
)
from services.protocol import (
    Abort,
    EngineCoreInput,
    FinishRequest,
    RequestTokens,
    SamplingParams,
    TokenBatch,
    TokenizedRequest,
)


@pytest.fixture
def ipc():
    with ipc_dir() as d:
        yield d


def test_ipc_dir_is_private_and_removed():
    d = ipc_dir()
    try:
        assert stat.S_IMODE(os.stat(d.path).st_mode) == 0o700
        assert d.endpoint("sched_in") == f"ipc://{d.path}/sched_in"
        with pytest.raises(ValueError):
            d.endpoint("../escape")
    finally:
        d.cleanup()
    assert not os.path.exists(d.path)


def test_push_pull_roundtrip_small_and_big_frames(ipc):
    ep = ipc.endpoint("tokens")
    pull = PullSocket[TokenBatch](ep, TokenBatch, bind=True)
    push = PushSocket[TokenBatch](ep, TokenBatch)
    big = list(range(100_000))  # several hundred KB: the zero-copy path
    msgs = [
        TokenBatch([RequestTokens(f"r{i}", [i, i + 1], finish_reason="stop" if i % 2 else None)])
        for i in range(50)
    ]
    msgs.insert(25, TokenBatch([RequestTokens("big", big)]))
    for m in msgs:
        push.send(m)  # the reusable buffer must not corrupt messages still queued
    got = [pull.recv(timeout_ms=5000) for _ in msgs]
    assert got == msgs
    assert len(msgspec_encode(msgs[25])) > ZERO_COPY_THRESHOLD
    assert pull.recv(timeout_ms=10) is None
    assert pull.recv_nowait() is None
    push.close()
    pull.close()


def msgspec_encode(msg) -> bytes:
    import msgspec

    return msgspec.msgpack.encode(msg)


def test_tagged_union_on_one_socket(ipc):
    ep = ipc.endpoint("sched_in")
    pull = PullSocket[EngineCoreInput](ep, EngineCoreInput, bind=True)
    push = PushSocket[EngineCoreInput](ep, EngineCoreInput)
    msgs = [
        TokenizedRequest("a", [1, 2, 3], SamplingParams(max_tokens=4), eos_token_id=2),
        Abort(["a", "b"]),
        FinishRequest("c", stop_reason="###"),
    ]
    for m in msgs:
        push.send(m)
    got = [pull.recv(timeout_ms=5000) for _ in msgs]
    assert got == msgs and [type(g) for g in got] == [type(m) for m in msgs]
    push.close()
    pull.close()


def test_no_pickle_fallback(ipc):
    push = PushSocket[Abort](ipc.endpoint("x"), Abort, bind=True)
    with pytest.raises(TypeError):
        push.send(object())  # type: ignore[arg-type]
    push.close()


def test_wrong_message_type_is_rejected(ipc):
    import msgspec

    ep = ipc.endpoint("typed")
    pull = PullSocket[Abort](ep, Abort, bind=True)
    push = PushSocket[TokenBatch](ep, TokenBatch)
    push.send(TokenBatch([RequestTokens("a", [1])]))
    with pytest.raises(msgspec.ValidationError):
        pull.recv(timeout_ms=5000)
    push.close()
    pull.close()


def test_pub_sub_broadcast(ipc):
    ep = ipc.endpoint("plan")
    pub = PubSocket[Abort](ep, Abort, bind=True)
    subs = [SubSocket[Abort](ep, Abort) for _ in range(2)]
    # PUB drops messages until a subscription arrives: retry the first one.
    deadline = time.monotonic() + 5
    while all(s.recv_nowait() is None for s in subs[:1]) and time.monotonic() < deadline:
        pub.send(Abort(["ping"]))
        time.sleep(0.01)
    for s in subs:
        while (m := s.recv(timeout_ms=50)) is not None and m.req_ids == ["ping"]:
            pass
    pub.send(Abort(["x"]))
    assert [s.recv(timeout_ms=5000) for s in subs] == [Abort(["x"])] * 2
    for s in [pub, *subs]:
        s.close()


def test_async_push_pull(ipc):
    ep = ipc.endpoint("async")

    async def main():
        pull = AsyncPullSocket[TokenBatch](ep, TokenBatch, bind=True)
        push = AsyncPushSocket[TokenBatch](ep, TokenBatch)
        msgs = [TokenBatch([RequestTokens(str(i), list(range(i * 1000)))]) for i in range(40)]
        for m in msgs:
            await push.send(m)
        got = [await asyncio.wait_for(pull.recv(), 5) for _ in msgs]
        push.close()
        pull.close()
        return msgs, got

    msgs, got = asyncio.run(main())
    assert got == msgs
    zmq.asyncio.Context.instance()  # still usable after the loop closed


def test_async_push_queued_sends_keep_their_own_bytes(ipc):
    """Sends queued before a peer connects must each deliver their own message.

    zmq.asyncio keeps a reference to a frame it could not send at once (no peer yet,
    or earlier sends still queued) and sends it later; a reused encode buffer would
    by then hold the next message (the api_server then sent one request twice and
    lost the other).
    """
    ep = ipc.endpoint("queued")

    async def main():
        push = AsyncPushSocket[TokenBatch](ep, TokenBatch, bind=True)
        msgs = [TokenBatch([RequestTokens(f"req-{i}", [i] * (i + 1))]) for i in range(5)]
        sends = [asyncio.create_task(push.send(m)) for m in msgs]
        await asyncio.sleep(0.05)  # every send is now queued: nobody is connected
        assert not any(t.done() for t in sends)
        pull = AsyncPullSocket[TokenBatch](ep, TokenBatch)
        got = [await asyncio.wait_for(pull.recv(), 5) for _ in msgs]
        await asyncio.gather(*sends)
        push.close()
        pull.close()
        return msgs, got

    msgs, got = asyncio.run(main())
    assert got == msgs
