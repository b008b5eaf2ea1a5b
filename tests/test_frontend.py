"""The api_server's EngineFrontend under hostile timing, over real ipc:// sockets.

Fake peers stand in for the tokenizer (a PULL the test drains, or nothing at all)
and for the launcher/detokenizer (a PUSH into the frontend's output socket).
"""

from __future__ import annotations

import asyncio
import queue
import threading
import time

import pytest
import zmq

from services.api_server.frontend import EngineFrontend, EngineRequestError, FrontendEndpoints
from services.ipc import PullSocket, PushSocket, ipc_dir
from services.protocol import (
    Abort,
    ApiServerInput,
    EngineCoreInput,
    EngineDead,
    EngineRestarted,
    GenerateBatch,
    GenerateRequest,
    SamplingParams,
    TextDelta,
    TextDeltaBatch,
    TokenizeRequest,
    TokenizeResult,
    TokenizerInput,
)
from services.scheduler.service import EngineCoreProc


@pytest.fixture
def endpoints():
    with ipc_dir() as d:
        yield FrontendEndpoints(d.endpoint("tok"), d.endpoint("out"), (d.endpoint("core"),))


def _gen(req_id: str) -> GenerateRequest:
    return GenerateRequest(req_id, SamplingParams(), prompt="x")


async def _drain(front: EngineFrontend, reqs: list[GenerateRequest], **kw) -> list:
    return [item async for item in front.generate(reqs, **kw)]


def test_engine_dead_right_after_a_tokenize_result(endpoints):
    """Both messages are in the socket before the tokenize call runs again: the receive
    loop must route the death to every live request and keep running."""

    async def main():
        front = EngineFrontend(endpoints, max_model_len=100)
        await front.start()
        tokenizer = PullSocket[TokenizerInput](endpoints.tokenizer_requests, TokenizerInput)
        back = PushSocket[ApiServerInput](endpoints.outputs, ApiServerInput)
        tokenize = asyncio.create_task(front.tokenize(TokenizeRequest("tok-1", prompt="hi")))
        generate = asyncio.create_task(_drain(front, [_gen("gen-1")]))
        deadline = time.monotonic() + 5
        seen = 0
        while seen < 2 and time.monotonic() < deadline:
            seen += tokenizer.recv(timeout_ms=0) is not None
            await asyncio.sleep(0.01)
        assert seen == 2
        back.send(TokenizeResult("tok-1", [1, 2], 100))
        back.send(EngineDead("engine died"))
        assert (await asyncio.wait_for(tokenize, 5)).token_ids == [1, 2]
        with pytest.raises(EngineRequestError) as err:
            await asyncio.wait_for(generate, 5)
        assert err.value.status == 503
        assert front._recv_task is not None and not front._recv_task.done()
        assert front.num_live == 0
        for sock in (tokenizer, back):
            sock.close()
        await front.close()

    asyncio.run(main())


def test_engine_dead_while_a_send_waits_for_a_tokenizer(endpoints):
    """No tokenizer is connected, so the send is queued: the death still ends it with a 503,
    and the queued request is never sent."""

    async def main():
        front = EngineFrontend(endpoints, max_model_len=100)
        await front.start()
        back = PushSocket[ApiServerInput](endpoints.outputs, ApiServerInput)
        generate = asyncio.create_task(_drain(front, [_gen("g-0"), _gen("g-1")]))
        await asyncio.sleep(0.1)
        assert not generate.done()
        back.send(EngineDead("the tokenizer process died"))
        with pytest.raises(EngineRequestError) as err:
            await asyncio.wait_for(generate, 5)
        assert err.value.status == 503
        assert front.num_live == 0 and front.num_waiting == 0
        tokenizer = PullSocket[TokenizerInput](endpoints.tokenizer_requests, TokenizerInput)
        assert tokenizer.recv(timeout_ms=300) is None  # the cancelled send never went out
        for sock in (tokenizer, back):
            sock.close()
        await front.close()

    asyncio.run(main())


def test_queue_cap_is_checked_and_counted_in_one_step(endpoints):
    """Ten groups arriving together with max_waiting=2: exactly two are admitted."""

    async def main():
        front = EngineFrontend(endpoints, max_model_len=100)
        await front.start()
        tokenizer = PullSocket[TokenizerInput](endpoints.tokenizer_requests, TokenizerInput)
        sent: list[int] = []
        tasks = [
            asyncio.create_task(_drain(front, [_gen(f"r{i}")], max_waiting=2, on_sent=sent.append))
            for i in range(10)
        ]
        await asyncio.sleep(0.2)
        refused = [t for t in tasks if t.done()]
        assert len(refused) == 8
        for t in refused:
            with pytest.raises(EngineRequestError) as err:
                t.result()
            assert err.value.status == 429
        assert front.num_waiting == 2
        assert sent == [1, 1]  # only the admitted groups count as sent
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        tokenizer.close()
        await front.close()

    asyncio.run(main())


def test_duplicate_id_in_a_group_leaves_the_other_request_alone(endpoints):
    async def main():
        front = EngineFrontend(endpoints, max_model_len=100)
        await front.start()
        tokenizer = PullSocket[TokenizerInput](endpoints.tokenizer_requests, TokenizerInput)
        core = PullSocket[EngineCoreInput](endpoints.engine_cores[0], EngineCoreInput, bind=True)
        first = asyncio.create_task(_drain(front, [_gen("a")]))
        await asyncio.sleep(0.05)
        with pytest.raises(EngineRequestError) as err:
            await _drain(front, [_gen("b"), _gen("a")])
        assert err.value.status == 400
        assert front.live_request_ids() == ["a"]  # "b" released; "a" still the first's
        assert core.recv(timeout_ms=200) is None  # nothing was sent, so nothing to abort
        first.cancel()
        await asyncio.gather(first, return_exceptions=True)
        await asyncio.sleep(0.05)
        assert core.recv(timeout_ms=2000) == Abort(["a"])
        for sock in (tokenizer, core):
            sock.close()
        await front.close()

    asyncio.run(main())


def test_scheduler_input_thread_survives_a_bad_frame():
    with ipc_dir() as d:
        core = EngineCoreProc.__new__(EngineCoreProc)  # only the input thread's state
        core._input_endpoint = d.endpoint("core")
        core._bound = threading.Event()
        core._inputs = queue.SimpleQueue()
        thread = threading.Thread(target=core._input_loop, daemon=True)
        thread.start()
        assert core._bound.wait(5)
        raw = zmq.Context.instance().socket(zmq.PUSH)
        raw.setsockopt(zmq.LINGER, 0)
        raw.connect(core._input_endpoint)
        raw.send(b"\x92\xa5Abort\x91\x01")  # an Abort whose ids are ints, not strings
        with PushSocket[EngineCoreInput](core._input_endpoint, EngineCoreInput) as push:
            push.send(Abort(["r1"]))
            assert core._inputs.get(timeout=5) == Abort(["r1"])
        assert thread.is_alive()
        raw.close()


def test_tokenize_calls_are_no_engine_load() -> None:
    """/load's counts are engine requests: a router's /tokenize calls are not waiting ones."""
    front = EngineFrontend(FrontendEndpoints("a", "b", ("c",)), max_model_len=8)
    q: asyncio.Queue = asyncio.Queue()
    front._register("tok-1", q, 0, generates=False)
    front._register("gen-1", q, 0)
    assert (front.num_live, front.num_in_flight, front.num_waiting) == (2, 1, 1)
    front._release("tok-1")
    front._release("gen-1")
    assert (front.num_live, front.num_in_flight, front.num_waiting) == (0, 0, 0)


class _Peers:
    """A tokenizer (PULL, drained by ``batches``) and a launcher/detokenizer (PUSH)."""

    def __init__(self, endpoints: FrontendEndpoints) -> None:
        self.tokenizer = PullSocket[TokenizerInput](endpoints.tokenizer_requests, TokenizerInput)
        self.back = PushSocket[ApiServerInput](endpoints.outputs, ApiServerInput)

    async def batches(self, count: int) -> list[list[str]]:
        """The request ids of the next ``count`` messages the tokenizer gets."""
        got: list[list[str]] = []
        deadline = time.monotonic() + 5
        while len(got) < count and time.monotonic() < deadline:
            msg = self.tokenizer.recv(timeout_ms=0)
            if isinstance(msg, GenerateBatch):
                got.append([r.req_id for r in msg.requests])
            elif msg is not None:
                got.append([msg.req_id])  # type: ignore[union-attr]
            await asyncio.sleep(0.01)
        return got

    def close(self) -> None:
        self.tokenizer.close()
        self.back.close()


def _delta(req_id: str, finish: str | None = None) -> TextDeltaBatch:
    return TextDeltaBatch([TextDelta(req_id, "t", [1], finish_reason=finish)])


def test_restart_keeps_waiting_groups_and_sends_them_again_once(endpoints):
    """--retry-waiting-on-restart: a group with output and a tokenize call fail with the
    death; groups with no output yet wait, go to the new engine under the same ids, and
    finish there; a group that was kept once fails at the next death."""

    async def main():
        front = EngineFrontend(endpoints, max_model_len=100, retry_waiting_on_restart=True)
        recoveries: list[float] = []
        front.on_restarted = recoveries.append
        await front.start()
        peers = _Peers(endpoints)
        started = asyncio.create_task(_drain(front, [_gen("a0")]))
        waiting = asyncio.create_task(_drain(front, [_gen("b0"), _gen("b1")]))
        unlucky = asyncio.create_task(_drain(front, [_gen("c0")]))
        tokenize = asyncio.create_task(front.tokenize(TokenizeRequest("t0", prompt="hi")))
        assert sorted(await peers.batches(4)) == [["a0"], ["b0", "b1"], ["c0"], ["t0"]]
        peers.back.send(_delta("a0"))
        await asyncio.sleep(0.1)
        assert front.num_waiting == 3  # b0, b1, c0

        peers.back.send(EngineDead("the worker died", restarting=True))
        for task in (started, tokenize):
            with pytest.raises(EngineRequestError) as err:
                await asyncio.wait_for(task, 5)
            assert (err.value.status, err.value.message) == (503, "the worker died")
        await asyncio.sleep(0.1)
        assert not waiting.done() and not unlucky.done()
        assert front.unavailable is not None and "restarting" in front.unavailable
        with pytest.raises(EngineRequestError) as err:
            await _drain(front, [_gen("new")])
        assert err.value.status == 503 and "restarting" in err.value.message
        assert front.num_waiting == 3 and front.num_live == 3

        peers.back.send(EngineRestarted(2.5))
        assert sorted(await peers.batches(2)) == [["b0", "b1"], ["c0"]]
        assert recoveries == [2.5] and front.unavailable is None
        peers.back.send(_delta("b0", "length"))
        peers.back.send(_delta("b1", "stop"))
        items = await asyncio.wait_for(waiting, 5)
        assert [(i, d.req_id, d.finish_reason) for i, d in items] == [
            (0, "b0", "length"),
            (1, "b1", "stop"),
        ]

        peers.back.send(EngineDead("the worker died again", restarting=True))
        with pytest.raises(EngineRequestError) as err:
            await asyncio.wait_for(unlucky, 5)
        assert err.value.message == "the worker died again"
        assert front.num_live == 0 and front.num_waiting == 0
        assert await peers.batches(1) == []  # nothing was sent a third time
        peers.close()
        await front.close()

    asyncio.run(main())


def test_restart_without_retry_fails_waiting_groups_and_serves_again(endpoints):
    async def main():
        front = EngineFrontend(endpoints, max_model_len=100)
        await front.start()
        peers = _Peers(endpoints)
        waiting = asyncio.create_task(_drain(front, [_gen("w0")]))
        assert await peers.batches(1) == [["w0"]]
        peers.back.send(EngineDead("the scheduler died", restarting=True))
        with pytest.raises(EngineRequestError) as err:
            await asyncio.wait_for(waiting, 5)
        assert err.value.status == 503
        assert front.errored and front.unavailable is not None
        peers.back.send(EngineRestarted(1.0))
        await asyncio.sleep(0.1)
        assert not front.errored and front.unavailable is None
        after = asyncio.create_task(_drain(front, [_gen("w1")]))
        assert await peers.batches(1) == [["w1"]]
        peers.back.send(_delta("w1", "length"))
        assert len(await asyncio.wait_for(after, 5)) == 1
        peers.close()
        await front.close()

    asyncio.run(main())


def test_a_failed_restart_fails_the_kept_groups(endpoints):
    async def main():
        front = EngineFrontend(endpoints, max_model_len=100, retry_waiting_on_restart=True)
        await front.start()
        peers = _Peers(endpoints)
        kept = asyncio.create_task(_drain(front, [_gen("k0")]))
        assert await peers.batches(1) == [["k0"]]
        peers.back.send(EngineDead("the detokenizer died", restarting=True))
        await asyncio.sleep(0.2)
        assert not kept.done()
        peers.back.send(EngineDead("the engine did not restart"))
        with pytest.raises(EngineRequestError) as err:
            await asyncio.wait_for(kept, 5)
        assert err.value.message == "the engine did not restart"
        assert front.unavailable == "The engine is not running."
        assert front.num_live == 0
        peers.close()
        await front.close()

    asyncio.run(main())


def test_a_kept_group_ignores_the_dead_engines_last_output(endpoints):
    """Output the old engine sent just before it was stopped can be read after EngineDead
    (ZeroMQ takes turns between its peers): a kept group drops it and runs once, whole, on
    the new engine, instead of showing the old engine's start and then a second run."""

    async def main():
        front = EngineFrontend(endpoints, max_model_len=100, retry_waiting_on_restart=True)
        await front.start()
        peers = _Peers(endpoints)
        old_detokenizer = PushSocket[ApiServerInput](endpoints.outputs, ApiServerInput)
        group = asyncio.create_task(_drain(front, [_gen("k0")]))
        assert await peers.batches(1) == [["k0"]]
        peers.back.send(EngineDead("the tokenizer died", restarting=True))
        await asyncio.sleep(0.1)
        old_detokenizer.send(_delta("k0", "abort"))
        await asyncio.sleep(0.1)
        assert front.num_waiting == 1 and not group.done()
        peers.back.send(EngineRestarted(1.0))
        assert await peers.batches(1) == [["k0"]]
        peers.back.send(TextDeltaBatch([TextDelta("k0", "new", [8], finish_reason="length")]))
        [(_, delta)] = await asyncio.wait_for(group, 5)
        assert (delta.text, delta.finish_reason) == ("new", "length")
        old_detokenizer.close()
        peers.close()
        await front.close()

    asyncio.run(main())


def test_a_group_no_tokenizer_took_is_kept_too(endpoints):
    """The only tokenizer died: a group admitted before the launcher noticed waits for a
    tokenizer to connect. It never reached an engine, so it is kept and sent to the new one
    (not failed with a 503)."""

    async def main():
        front = EngineFrontend(endpoints, max_model_len=100, retry_waiting_on_restart=True)
        sent: list[int] = []
        await front.start()
        back = PushSocket[ApiServerInput](endpoints.outputs, ApiServerInput)
        group = asyncio.create_task(_drain(front, [_gen("p0")], on_sent=sent.append))
        await asyncio.sleep(0.2)
        assert not group.done() and sent == []
        back.send(EngineDead("the tokenizer died", restarting=True))
        await asyncio.sleep(0.2)
        assert not group.done()
        tokenizer = PullSocket[TokenizerInput](endpoints.tokenizer_requests, TokenizerInput)
        back.send(EngineRestarted(1.0))
        deadline = time.monotonic() + 5
        msg = None
        while msg is None and time.monotonic() < deadline:
            msg = tokenizer.recv(timeout_ms=0)
            await asyncio.sleep(0.01)
        assert isinstance(msg, GenerateBatch) and [r.req_id for r in msg.requests] == ["p0"]
        assert sent == [1]
        back.send(_delta("p0", "length"))
        assert len(await asyncio.wait_for(group, 5)) == 1
        tokenizer.close()
        back.close()
        await front.close()

    asyncio.run(main())
