"""Scriptable replicas for the router's tests: small OpenAI-shaped servers in threads.

A ``FakeReplica`` answers ``/health``, ``/metrics`` (with ``vllm:cache_config_info`` and a
load it is told), ``/tokenize`` (one id per word), ``/v1/models`` and streaming or whole
``/v1/completions`` and ``/v1/chat/completions``, records what it received, and can be told
to fail: answer 503 (``fail_status``), break a stream after some chunks (``break_after``),
or stop listening (``stop()``).
"""

from __future__ import annotations

import asyncio
import json
import socket
import threading
import time
from collections.abc import Callable
from typing import Any

import uvicorn
from fastapi import FastAPI, Request, Response
from fastapi.responses import JSONResponse, StreamingResponse


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def word_ids(text: str) -> list[int]:
    return [sum(map(ord, w)) % 50000 for w in text.split()]


class ServerThread:
    """A uvicorn server for ``app`` on a free loopback port, in a thread."""

    def __init__(self, app: Any, port: int | None = None) -> None:
        self.port = port or free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        config = uvicorn.Config(app, host="127.0.0.1", port=self.port, log_level="error",
                                lifespan="on", timeout_graceful_shutdown=1)  # fmt: skip
        self.server = uvicorn.Server(config)
        self.thread = threading.Thread(target=self.server.run, daemon=True)
        self.thread.start()
        deadline = time.monotonic() + 20
        while not self.server.started:
            if time.monotonic() > deadline or not self.thread.is_alive():
                raise RuntimeError("server did not start")
            time.sleep(0.02)

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(10)


class FakeReplica:
    def __init__(self, name: str, block_size: int = 4, hash_algo: str = "sha256") -> None:
        self.name = name
        self.block_size, self.hash_algo = block_size, hash_algo
        self.bodies: list[dict[str, Any]] = []
        self.headers: list[dict[str, str]] = []
        self.healthy = True
        self.fail_status: int | None = None
        self.break_after: int | None = None
        self.chunk_delay = 0.0
        self.running = self.waiting = 0.0
        self.prefill = (0.0, 0.0)  # seconds, tokens (sums)
        self.has_load = False  # answers GET /load as ours does (else 404, as vLLM's mostly)
        self.load_body: Any = None  # what /load answers instead, when set
        self.reply_headers: dict[str, str] = {}  # added to whole answers (latin-1 on the wire)
        self.reads: dict[str, int] = {"/load": 0, "/metrics": 0}
        self.thread = ServerThread(self.app())
        self.url = self.thread.url

    def stop(self) -> None:
        self.thread.stop()

    def app(self) -> FastAPI:
        app = FastAPI()

        @app.get("/health")
        async def health() -> Response:
            return Response(status_code=200 if self.healthy else 503)

        @app.get("/load")
        async def load() -> Response:
            self.reads["/load"] += 1
            if isinstance(self.load_body, str):  # raw text: not JSON, or JSON's NaN
                return Response(self.load_body, media_type="application/json")
            if self.load_body is not None:
                return JSONResponse(self.load_body)
            if not self.has_load:
                return Response(status_code=404)
            return JSONResponse({"server_load": self.running + self.waiting,
                                 "num_requests_waiting": self.waiting,
                                 "num_requests_running": self.running})  # fmt: skip

        @app.get("/metrics")
        async def metrics() -> Response:
            self.reads["/metrics"] += 1
            labels = (f'block_size="{self.block_size}",prefix_caching_hash_algo="{self.hash_algo}",'
                      'num_gpu_blocks="64",enable_prefix_caching="True"')  # fmt: skip
            text = (f"vllm:cache_config_info{{{labels}}} 1.0\n"
                    f'vllm:num_requests_running{{engine="0"}} {self.running}\n'
                    f'vllm:num_requests_waiting{{engine="0"}} {self.waiting}\n'
                    f"vllm:request_prefill_time_seconds_sum {self.prefill[0]}\n"
                    f"vllm:request_prefill_kv_computed_tokens_sum {self.prefill[1]}\n")  # fmt: skip
            return Response(text, media_type="text/plain")

        @app.get("/v1/models")
        async def models() -> dict:
            return {"object": "list", "data": [{"id": "fake", "object": "model",
                                                "owned_by": self.name}]}  # fmt: skip

        @app.post("/tokenize")
        async def tokenize(req: Request) -> dict:
            body = await req.json()
            if "messages" in body:
                text = " ".join(str(m.get("content")) for m in body["messages"])
            else:
                text = body["prompt"]
            ids = word_ids(text)
            return {"count": len(ids), "tokens": ids, "max_model_len": 4096}

        async def generate(req: Request, chat: bool) -> Response:
            body = await req.json()
            self.bodies.append(body)
            self.headers.append(dict(req.headers))
            if self.fail_status is not None:
                return JSONResponse({"error": {"message": "down"}}, status_code=self.fail_status)
            words = [f" {self.name}{i}" for i in range(int(body.get("max_tokens") or 4))]
            prompt_tokens = len(str(body.get("prompt") or body.get("messages")).split())
            usage = {"prompt_tokens": prompt_tokens, "completion_tokens": len(words),
                     "total_tokens": prompt_tokens + len(words)}  # fmt: skip
            if not body.get("stream"):
                text = "".join(words)
                choice = ({"index": 0, "message": {"role": "assistant", "content": text},
                           "finish_reason": "length"} if chat else
                          {"index": 0, "text": text, "finish_reason": "length"})  # fmt: skip
                obj = "chat.completion" if chat else "text_completion"
                return JSONResponse({"id": "x", "object": obj, "created": 0, "model": "fake",
                                     "choices": [choice], "usage": usage},
                                    headers=self.reply_headers)  # fmt: skip

            async def events():  # noqa: ANN202
                for i, w in enumerate(words):
                    if self.break_after is not None and i == self.break_after:
                        raise RuntimeError("replica died mid-stream")
                    await asyncio.sleep(self.chunk_delay)
                    choice = ({"index": 0, "delta": {"content": w}, "finish_reason": None} if chat
                              else {"index": 0, "text": w, "finish_reason": None})  # fmt: skip
                    obj = "chat.completion.chunk" if chat else "text_completion"
                    chunk = {"id": "x", "object": obj, "created": 0, "model": "fake",
                             "choices": [choice]}  # fmt: skip
                    yield f"data: {json.dumps(chunk)}\n\n"
                if (body.get("stream_options") or {}).get("include_usage"):
                    last = {"id": "x", "object": obj, "created": 0, "model": "fake",
                            "choices": [], "usage": usage}  # fmt: skip
                    yield f"data: {json.dumps(last)}\n\n"
                yield "data: [DONE]\n\n"

            return StreamingResponse(events(), media_type="text/event-stream")

        @app.post("/v1/completions")
        async def completions(req: Request) -> Response:
            return await generate(req, chat=False)

        @app.post("/v1/chat/completions")
        async def chat_completions(req: Request) -> Response:
            return await generate(req, chat=True)

        return app


def wait_for(what: str, check: Callable[[], Any], timeout_s: float = 30.0) -> Any:
    """Poll ``check`` until it returns something true; fail with ``what`` at the deadline."""
    deadline = time.monotonic() + timeout_s
    while True:
        value = check()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.05)
