"""A fake engine for HTTP-layer tests: the real tokenizer and detokenizer loops as threads,
a scripted scheduler, and the app on uvicorn over real ipc:// sockets.

The scheduler "generates" a fixed script of tokens (shifted by the seed), one token per 2 ms
step. The ``server``, ``client`` and ``http`` fixtures (tests/conftest.py) start one per module.
"""

from __future__ import annotations

import contextlib
import socket
import threading
import time
from collections.abc import Iterator

import uvicorn

from services.api_server.app import ServerSettings, build_app
from services.api_server.frontend import EngineFrontend, FrontendEndpoints
from services.config import RequestLimits
from services.detokenizer.service import DetokenizerEndpoints, serve_detokenizer
from services.ipc import PullSocket, PushSocket, ipc_dir
from services.protocol import (
    Abort,
    EngineCoreInput,
    RequestTokens,
    TokenBatch,
    TokenizedBatch,
    TokenizedRequest,
    TokenLogprobs,
)
from services.tokenizer.loader import load_serving_tokenizer
from services.tokenizer.processor import RequestProcessor
from services.tokenizer.service import TokenizerEndpoints, serve_tokenizer

MODEL = "smollm2-test"
MAX_LEN = 2048
SCRIPT = "Hello! 你好，世界 🎉 The quick brown fox jumps over the lazy dog. " * 40


class FakeScheduler:
    """Answers TokenizedRequests with SCRIPT's tokens (from offset seed % 5), one per step."""

    def __init__(self, core_ep: str, batches_ep: str, tok) -> None:
        self.script = tok.encode(SCRIPT, add_special_tokens=False).ids
        self.inbox = PullSocket[EngineCoreInput](core_ep, EngineCoreInput, bind=True)
        self.out = PushSocket[TokenBatch](batches_ep, TokenBatch)
        self.received: list[EngineCoreInput] = []
        self.running: dict[str, tuple[TokenizedRequest, int]] = {}
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self.run, daemon=True)

    def run(self) -> None:
        while not self.stop.is_set():
            while (msg := self.inbox.recv(timeout_ms=0 if self.running else 20)) is not None:
                if isinstance(msg, TokenizedBatch):
                    self.received += msg.requests
                    for req in msg.requests:
                        self.running[req.req_id] = (req, 0)
                else:
                    self.received.append(msg)
                    assert not isinstance(msg, TokenizedRequest)  # the tokenizer sends batches
                    ids = msg.req_ids if isinstance(msg, Abort) else [msg.req_id]
                    items = [
                        RequestTokens(i, [], "abort") for i in ids if self.running.pop(i, None)
                    ]
                    self.out.send(TokenBatch(items))
            items = [self.step(req, k) for req, k in list(self.running.values())]
            if items:
                self.out.send(TokenBatch(items))
                time.sleep(0.002)
        self.inbox.close()
        self.out.close()

    def step(self, req: TokenizedRequest, k: int) -> RequestTokens:
        s = req.sampling
        token = self.script[(k + (s.seed or 0) % 5) % len(self.script)]
        finish, stop_reason = None, None
        if token in s.stop_token_ids:
            finish, stop_reason = "stop", token
        elif k + 1 >= s.max_tokens:
            finish = "length"
        if finish:
            del self.running[req.req_id]
        else:
            self.running[req.req_id] = (req, k + 1)
        lps = []
        if s.logprobs is not None:
            top = [token + j for j in range(s.logprobs)]
            lps = [TokenLogprobs(token, -0.25, 1, top, [-0.25 - j for j in range(s.logprobs)])]
        return RequestTokens(
            req.req_id,
            [token],
            finish,
            stop_reason,
            lps,
            num_prompt_tokens=len(req.prompt_token_ids),
            num_cached_tokens=2,
        )

    def ids_of(self, kind: type) -> list:
        return [m for m in self.received if isinstance(m, kind)]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextlib.contextmanager
def serve_fake_engine() -> Iterator[tuple]:
    """Start everything; yield (base url, FakeScheduler, EngineFrontend, ServerSettings,
    tokenizer) and stop it all on exit."""
    info = load_serving_tokenizer()
    d = ipc_dir()
    fe = FrontendEndpoints(d.endpoint("tok_req"), d.endpoint("api_out"), (d.endpoint("core"),))
    te = TokenizerEndpoints(fe.tokenizer_requests, fe.engine_cores, d.endpoint("specs"), fe.outputs)
    de = DetokenizerEndpoints(
        d.endpoint("batches"), te.detokenizer_specs, fe.engine_cores, fe.outputs
    )
    sched = FakeScheduler(fe.engine_cores[0], de.token_batches, info.tokenizer)
    stop = threading.Event()
    threads = [
        sched.thread,
        threading.Thread(target=serve_tokenizer, args=(RequestProcessor(info, MAX_LEN), te, stop)),
        threading.Thread(target=serve_detokenizer, args=(info.tokenizer, de, stop)),
    ]
    frontend = EngineFrontend(fe, max_model_len=MAX_LEN)
    settings = ServerSettings(
        [MODEL],
        limits=RequestLimits(max_request_body_bytes=1 << 20),
        enable_request_id_headers=True,
    )
    port = _free_port()
    uv = uvicorn.Server(
        uvicorn.Config(
            build_app(frontend, settings),
            host="127.0.0.1",
            port=port,
            loop="uvloop",
            log_level="warning",
        )
    )
    threads.append(threading.Thread(target=uv.run))
    for t in threads:
        t.daemon = True
        t.start()
    deadline = time.monotonic() + 20
    while not uv.started and time.monotonic() < deadline:
        time.sleep(0.02)
    base = f"http://127.0.0.1:{port}"
    try:
        yield base, sched, frontend, settings, info.tokenizer
    finally:
        uv.should_exit = True
        sched.stop.set()
        stop.set()
        for t in threads:
            t.join(5)
        d.cleanup()


def script_text(tok, n: int, seed: int = 0) -> str:
    ids = tok.encode(SCRIPT, add_special_tokens=False).ids
    return tok.decode(ids[seed % 5 : seed % 5 + n])
