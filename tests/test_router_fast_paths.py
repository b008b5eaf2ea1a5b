"""The router's CPU-saving paths (issue 34): the prompt cache gives exactly the whole
prompt's tokens and block hashes, the HTTP/1.1 pool to the replicas (keep-alive, a
replica's closed idle connection, failures), and the pushed relay with a client that
stops reading for a while."""

from __future__ import annotations

import asyncio
import json
import random
import threading
import time
from collections.abc import Awaitable, Callable

import httpx
import pytest

from services.kv_cache.block_hash import BlockHasher
from services.router.app import RouterConfig, build_app
from services.router.prompt_cache import PrefixTokenCache
from services.router.upstream import UpstreamPool
from tests.router_fakes import FakeReplica, ServerThread, free_port

# ---- the prompt cache


@pytest.fixture(scope="module")
def info():  # noqa: ANN201
    from services.tokenizer.loader import load_serving_tokenizer

    return load_serving_tokenizer(None)


_WORDS = ["the", "committee", "reviewed", "12", "3.5", "naïve", "日本語", "\n", "  ", "x,",
          "'s", "<|im_start|>", "é", "\t", "a", "don't", "$1,234", "  \n "]  # fmt: skip


def _prompts(rng: random.Random, n: int) -> list[str]:
    """Prompts that share prefixes of all lengths with earlier ones (cut anywhere)."""
    bases = [" ".join(rng.choice(_WORDS) for _ in range(rng.randrange(50, 1500)))
             for _ in range(6)]  # fmt: skip
    out = []
    for _ in range(n):
        base = rng.choice(bases + out[-5:])
        cut = rng.randrange(len(base) + 1)
        tail = " ".join(rng.choice(_WORDS) for _ in range(rng.randrange(0, 40)))
        out.append(base[:cut] + rng.choice(["", " ", "\n", "x"]) + tail)
    return out


@pytest.mark.parametrize("segment_chars", [16, 512])
def test_the_prompt_cache_gives_the_whole_prompts_tokens_and_hashes(info, segment_chars) -> None:  # noqa: ANN001
    """Segments of any size, a cache that evicts, block sizes that do not divide the
    segments, salts: always the whole prompt's count and hashes."""
    rng = random.Random(segment_chars)
    cache = PrefixTokenCache(info, capacity_tokens=20_000, segment_chars=segment_chars)
    assert cache.segmenting and cache.fast is not None  # (later segments through tiktoken)
    hashers = [BlockHasher(16, "sha256"), BlockHasher(5, "sha256_cbor")]
    for text in _prompts(rng, 150):
        add_special, salt = rng.random() < 0.7, rng.choice([None, "tenant-1"])
        hasher = rng.choice(hashers)
        plan = cache.plan(text, add_special)
        n, hashes = cache.commit(plan, cache.tokenize(plan), hasher, salt)
        whole = info.encode(text, add_special)
        assert n == len(whole)
        assert hashes == hasher.hash_blocks(whole, salt)
    assert cache.segmenting  # every check agreed
    assert len(cache) > 0


def test_a_repeated_prefix_is_not_tokenized_again(info) -> None:  # noqa: ANN001
    cache = PrefixTokenCache(info)
    context = " ".join(f"Section {i}: the committee found item {i} in order." for i in range(300))
    first = cache.plan(context + " Query 1?", True)
    cache.commit(first, cache.tokenize(first), None, None)
    second = cache.plan(context + " Query 2?", True)
    assert second.new_chars < 2 * 512  # only the last segment's text
    assert len(cache.tokenize(second)) <= 2


def test_a_tokenizer_whose_segments_differ_gets_whole_prompts(info) -> None:  # noqa: ANN001
    """One that appends an end token (a template) fails the sample at start; one that
    differs later is caught by a check, and segments stop there."""

    class Appends:
        tokenizer = info.tokenizer

        def encode(self, text: str, add_special: bool = True) -> list[int]:
            return [*info.encode(text, add_special), *([0] if add_special else [])]

    appends = Appends()
    cache = PrefixTokenCache(appends)  # type: ignore[arg-type]
    assert not cache.segmenting
    text = "word " * 600
    plan = cache.plan(text, True)
    assert len(plan.bounds) == 2  # one segment: the whole prompt
    assert cache.commit(plan, cache.tokenize(plan), None, None)[0] == len(appends.encode(text))

    class Drifts:  # agrees on the sample, differs on real prompts
        tokenizer = info.tokenizer
        drift = False

        def encode(self, text: str, add_special: bool = True) -> list[int]:
            return [
                *info.encode(text, add_special),
                *([7] if self.drift and len(text) > 2000 else []),
            ]

    drifts = Drifts()
    cache = PrefixTokenCache(drifts)  # type: ignore[arg-type]
    assert cache.segmenting and cache.fast is not None
    drifts.drift = True
    # The first check that differs turns tiktoken off (segments stay), the next segments.
    for fast_after, segmenting_after in ((False, True), (False, False)):
        plan = cache.plan(text, True)
        while not plan.check:  # (every CHECK_EVERY-th prompt is checked)
            cache.commit(plan, cache.tokenize(plan), None, None)
            plan = cache.plan(text, True)
        n, _ = cache.commit(plan, cache.tokenize(plan), None, None)
        assert n == len(drifts.encode(text)) and len(cache) == 0
        assert (cache.fast is not None, cache.segmenting) == (fast_after, segmenting_after)


# ---- the pool to the replicas


class RawServer:
    """A raw HTTP/1.1 server in a thread: ``answer(request_bytes) -> (reply, keep_open)``;
    counts its connections."""

    def __init__(self, answer: Callable[[bytes], tuple[bytes, bool]]) -> None:
        self.answer, self.connections, self.port = answer, 0, free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        ready = threading.Event()
        self.loop = asyncio.new_event_loop()

        async def serve() -> None:
            self.server = await asyncio.start_server(self.handle, "127.0.0.1", self.port)
            ready.set()

        threading.Thread(target=lambda: (self.loop.run_until_complete(serve()),
                                         self.loop.run_forever()), daemon=True).start()  # fmt: skip
        ready.wait(5)

    async def handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.connections += 1
        try:
            while True:
                head = await reader.readuntil(b"\r\n\r\n")
                length = next((int(line.split(b":")[1]) for line in head.split(b"\r\n")
                               if line.lower().startswith(b"content-length:")), 0)  # fmt: skip
                body = await reader.readexactly(length)
                reply, keep_open = self.answer(head + body)
                writer.write(reply)
                await writer.drain()
                if not keep_open:
                    break
        except (asyncio.IncompleteReadError, ConnectionError):
            pass
        writer.close()

    def stop(self) -> None:
        self.loop.call_soon_threadsafe(self.server.close)


def _ok(body: bytes, extra: bytes = b"") -> bytes:
    return b"HTTP/1.1 200 OK\r\ncontent-length: %d\r\n%s\r\n%s" % (len(body), extra, body)


def _run(scenario: Callable[[], Awaitable[None]]) -> None:
    asyncio.run(scenario())


def test_the_pool_keeps_connections_and_reads_every_framing() -> None:
    chunked = (
        b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n3\r\nabc\r\n2\r\nde\r\n0\r\n\r\n"
    )
    until_close = b"HTTP/1.1 200 OK\r\ncontent-type: text/plain\r\n\r\nto the end"
    replies = {b"/a": (_ok(b"hello"), True), b"/b": (chunked, True), b"/c": (until_close, False)}
    server = RawServer(lambda raw: replies[raw.split(b" ")[1]])

    async def scenario() -> None:
        pool = UpstreamPool(server.url)
        assert await pool.get("/a", 5) == (200, b"hello")
        resp = await pool.request(b"POST", b"/b", b"x-k: v\r\n", b"{}")
        assert resp.status_code == 200 and await resp.aread() == b"abcde"
        assert await pool.get("/a", 5) == (200, b"hello")
        assert server.connections == 1  # one connection, kept between requests
        assert await pool.get("/c", 5) == (200, b"to the end")  # a body up to the close
        assert await pool.get("/a", 5) == (200, b"hello")  # (on a new connection)
        assert server.connections == 2
        await pool.aclose()

    try:
        _run(scenario)
    finally:
        server.stop()


def test_a_connection_the_replica_closed_is_not_a_failure() -> None:
    """A replica closes idle connections (uvicorn after 5 s): the next request goes on a
    new one, whether the close was seen before it or meets it on the way."""
    server = RawServer(lambda raw: (_ok(b"x", b"connection: keep-alive\r\n"), True))

    async def scenario() -> None:
        pool = UpstreamPool(server.url)
        assert await pool.get("/", 5) == (200, b"x")
        conn = pool._idle[0]
        assert conn.transport is not None
        conn.transport.abort()  # as if the replica had closed it
        await asyncio.sleep(0.05)
        assert not pool._idle  # forgotten when it closed
        assert await pool.get("/", 5) == (200, b"x")
        pool._idle[0].transport.close()  # type: ignore[union-attr]  # (not seen yet)
        assert await pool.get("/", 5) == (200, b"x")
        await pool.aclose()

    try:
        _run(scenario)
    finally:
        server.stop()


def test_pool_failures_are_httpx_errors() -> None:
    hang = threading.Event()

    def answer(raw: bytes) -> tuple[bytes, bool]:
        hang.wait(5)
        return _ok(b"late"), True

    server = RawServer(answer)

    async def scenario() -> None:
        with pytest.raises(httpx.ConnectError):
            await UpstreamPool(f"http://127.0.0.1:{free_port()}").get("/", 5)
        pool = UpstreamPool(server.url)
        with pytest.raises(httpx.ReadTimeout):
            await pool.get("/", 0.2)
        waiting = asyncio.ensure_future(pool.request(b"POST", b"/", b"", b"{}"))
        await asyncio.sleep(0.1)
        pool.fail_active("the replica left the rotation")  # (its health check failed)
        with pytest.raises(httpx.ReadError, match="left the rotation"):
            await waiting
        await pool.aclose()

    try:
        _run(scenario)
    finally:
        hang.set()
        server.stop()


# ---- the relay


def test_a_client_that_stops_reading_gets_every_byte_in_order() -> None:
    """~8 MB of events while the client reads nothing for a while: the pushed sends wait
    for its socket, the rest is buffered meanwhile, nothing is lost or reordered."""
    replica = FakeReplica("x" * 4000)
    router = ServerThread(build_app(RouterConfig(backends=[replica.url], policy="round_robin",
                                                 health_check_interval=60.0)))  # fmt: skip
    try:
        body = {"model": "fake", "prompt": "x", "max_tokens": 2000, "stream": True}
        with httpx.stream("POST", router.url + "/v1/completions", json=body, timeout=60) as r:
            lines = r.iter_lines()
            first = next(lines)
            time.sleep(2)
            events = [ln for ln in [first, *lines] if ln.startswith("data:")]
        assert events[-1] == "data: [DONE]"
        texts = [json.loads(e[5:])["choices"][0]["text"] for e in events[:-1]]
        assert texts == [f" {'x' * 4000}{i}" for i in range(2000)]
        listed = httpx.get(router.url + "/health").json()
        assert listed["healthy_replicas"] == 1
    finally:
        router.stop()
        replica.stop()


def test_the_relay_writes_chunks_to_uvicorns_transport_itself() -> None:
    """Under uvicorn (httptools) the relay writes a piece in chunked framing itself
    (``chunk_writer``); a uvicorn that changed its protocol's fields would get ``send``
    again, and this test says so."""
    from services.router.forward import chunk_writer

    writers: list[object] = []

    async def app(scope: dict, receive, send) -> None:  # type: ignore[no-untyped-def]  # noqa: ANN001
        if scope["type"] == "lifespan":
            while (await receive())["type"] != "lifespan.shutdown":
                await send({"type": "lifespan.startup.complete"})
            await send({"type": "lifespan.shutdown.complete"})
            return
        write = chunk_writer(send)
        writers.append(write)
        await send({"type": "http.response.start", "status": 200,
                    "headers": [(b"content-type", b"text/event-stream")]})  # fmt: skip
        wrote = write is not None and write(b"data: 1\n\n") and write(b"data: 2\n\n")
        await send({"type": "http.response.body", "body": b"" if wrote else b"(send)",
                    "more_body": False})  # fmt: skip

    server = ServerThread(app)
    try:
        r = httpx.get(server.url + "/", timeout=10)
        assert r.status_code == 200 and r.text == "data: 1\n\ndata: 2\n\n"
        assert r.headers["transfer-encoding"] == "chunked"
        assert writers and writers[0] is not None
    finally:
        server.stop()
    assert chunk_writer(lambda message: None) is None  # not uvicorn's: send it is
