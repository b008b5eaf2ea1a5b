"""The tokenizer process: api_server requests in, token ids out to the scheduler.

Several tokenizer processes may connect to the api_server's request endpoint;
ZeroMQ hands each message to one of them (round robin). A ``GenerateBatch`` (the
engine requests of one HTTP request) is checked as a whole: if any is rejected,
the first error goes straight back to the api_server and none is sent on;
otherwise each first registers its output spec with the detokenizer, then goes
to the scheduler.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from services.config import ServeConfig
from services.ipc import PullSocket, PushSocket, report_ready
from services.protocol import (
    ApiServerInput,
    DetokenizeRequest,
    EngineCoreInput,
    GenerateBatch,
    RequestError,
    RequestOutputSpec,
    TokenizeRequest,
    TokenizerInput,
)
from services.tokenizer.processor import RequestProcessor

logger = logging.getLogger(__name__)

_POLL_MS = 100  # how often an idle loop checks its stop event


@dataclass(frozen=True)
class TokenizerEndpoints:
    """Where the tokenizer connects (every endpoint is bound by its owner)."""

    requests: str  # api_server PUSH -> here (TokenizerInput)
    engine_core: str  # -> scheduler PULL (EngineCoreInput)
    detokenizer_specs: str  # -> detokenizer PULL (RequestOutputSpec)
    api_server: str  # -> api_server PULL (ApiServerInput)


def serve_tokenizer(
    processor: RequestProcessor,
    endpoints: TokenizerEndpoints,
    stop_event: threading.Event | None = None,
    tokenize_time: Any | None = None,
    on_connected: Callable[[], None] | None = None,
) -> None:
    """Run the tokenizer loop until ``stop_event`` is set (forever without one).

    ``tokenize_time`` (a histogram child) observes each generate request's processing time;
    ``on_connected`` runs once the sockets exist (the process reports READY there).
    """
    stop_event = stop_event or threading.Event()
    requests = PullSocket[TokenizerInput](endpoints.requests, TokenizerInput)
    engine = PushSocket[EngineCoreInput](endpoints.engine_core, EngineCoreInput)
    specs = PushSocket[RequestOutputSpec](endpoints.detokenizer_specs, RequestOutputSpec)
    api = PushSocket[ApiServerInput](endpoints.api_server, ApiServerInput)
    if on_connected is not None:
        on_connected()
    try:
        while not stop_event.is_set():
            msg = requests.recv(timeout_ms=_POLL_MS)
            if msg is None:
                continue
            try:
                if isinstance(msg, GenerateBatch):
                    outs = []
                    for req in msg.requests:
                        start = time.perf_counter()
                        outs.append(processor.process(req))
                        if tokenize_time is not None:
                            tokenize_time.observe(time.perf_counter() - start)
                    error = next((o for o in outs if isinstance(o, RequestError)), None)
                    if error is not None:
                        api.send(error)  # the whole group fails with its first error
                        continue
                    for out in outs:
                        assert not isinstance(out, RequestError)
                        # The spec goes first so the detokenizer usually knows the
                        # request before its first tokens (it buffers them otherwise).
                        specs.send(out[1])
                        engine.send(out[0])
                elif isinstance(msg, TokenizeRequest):
                    api.send(processor.tokenize(msg))
                elif isinstance(msg, DetokenizeRequest):
                    api.send(processor.detokenize(msg))
            except Exception as e:  # one bad request must not take the process down
                req_id = msg.requests[0].req_id if isinstance(msg, GenerateBatch) else msg.req_id
                logger.exception("tokenizer failed on request %s", req_id)
                api.send(RequestError(req_id, 500, f"tokenizer error: {e}", "InternalServerError"))
    finally:
        for sock in (requests, engine, specs, api):
            sock.close()


def run_tokenizer_process(config: ServeConfig, control_endpoint: str) -> None:
    """Child-process entry point: load the tokenizer, report READY, serve."""
    from services.tokenizer.loader import load_serving_tokenizer

    ep = config.endpoints
    endpoints = TokenizerEndpoints(
        requests=ep.tokenizer_requests,
        engine_core=ep.engine_core,
        detokenizer_specs=ep.detok_specs,
        api_server=ep.api_outputs,
    )
    processor = RequestProcessor(
        load_serving_tokenizer(config.model_folder), config.engine.scheduler.max_model_len
    )
    from services.metrics.process_metrics import tokenizer_time

    serve_tokenizer(
        processor,
        endpoints,
        tokenize_time=tokenizer_time(config),
        on_connected=lambda: report_ready(control_endpoint, "tokenizer"),
    )
