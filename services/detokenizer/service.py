"""The detokenizer process: TokenBatch in, TextDeltaBatch out, stop strings back to the scheduler.

Each request is registered by the tokenizer (``RequestOutputSpec``) before
the scheduler sees it; tokens that still arrive first (two sockets, no global
order) wait until the spec does. The scheduler ends every request with one
``RequestTokens`` carrying ``finish_reason``; that frees the request's state
here, including requests this process already finished on a stop string.
The per-request logic is ``OutputProcessor`` (``output_processor.py``); this
module is its sockets and loop.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import tokenizers
import zmq

from services import clock
from services.config import ServeConfig
from services.detokenizer.output_processor import OutputProcessor
from services.gc_tuning import freeze_gc
from services.ipc import PullSocket, PushSocket, report_ready
from services.protocol import (
    ApiServerInput,
    EngineCoreInput,
    FinishRequest,
    RequestOutputSpec,
    TextDelta,
    TextDeltaBatch,
    TokenBatch,
)
from services.request_log import RequestLog

_POLL_MS = 100


@dataclass(frozen=True)
class DetokenizerEndpoints:
    token_batches: str  # bound here: scheduler PUSH -> TokenBatch
    specs: str  # bound here: tokenizer PUSH -> RequestOutputSpec
    engine_cores: tuple[str, ...]  # -> each scheduler's PULL (FinishRequest, to all of them)
    api_server: str  # -> api_server PULL (TextDeltaBatch)


def serve_detokenizer(
    tokenizer: tokenizers.Tokenizer,
    endpoints: DetokenizerEndpoints,
    stop_event: threading.Event | None = None,
    ready: threading.Event | None = None,
    batch_time: Any | None = None,
    request_log: RequestLog | None = None,
) -> None:
    """Run the detokenizer loop until ``stop_event`` is set; sets ``ready`` once bound.

    ``batch_time`` (a histogram child) observes the time spent on each batch of inputs.
    """
    stop_event = stop_event or threading.Event()
    processor = OutputProcessor(tokenizer, request_log)
    batches = PullSocket[TokenBatch](endpoints.token_batches, TokenBatch, bind=True)
    specs = PullSocket[RequestOutputSpec](endpoints.specs, RequestOutputSpec, bind=True)
    # It does not know which data-parallel engine holds a request: a finish goes to every
    # engine core, and those that do not hold it ignore it (stop strings only: rare).
    engines = [PushSocket[EngineCoreInput](e, EngineCoreInput) for e in endpoints.engine_cores]
    api = PushSocket[ApiServerInput](endpoints.api_server, ApiServerInput)
    poller = zmq.Poller()
    poller.register(batches.socket, zmq.POLLIN)
    poller.register(specs.socket, zmq.POLLIN)
    if ready is not None:
        ready.set()
    try:
        while not stop_event.is_set():
            if not poller.poll(_POLL_MS):
                continue
            start = clock.perf_counter()
            deltas: list[TextDelta] = []
            finishes: list[FinishRequest] = []
            # Specs first: a request's registration before its tokens where possible.
            while (spec := specs.recv_nowait()) is not None:
                d, f = processor.add_request(spec)
                deltas += d
                finishes += f
            while (batch := batches.recv_nowait()) is not None:
                d, f = processor.process(batch)
                deltas += d
                finishes += f
            for finish in finishes:
                for engine in engines:
                    engine.send(finish)
            if deltas:
                api.send(TextDeltaBatch(deltas))
            if batch_time is not None:
                batch_time.observe(clock.perf_counter() - start)
    finally:
        closables: list[Any] = [batches, specs, *engines, api]
        for closable in closables:
            closable.close()


def run_detokenizer_process(config: ServeConfig, control_endpoint: str) -> None:
    """Child-process entry point: load the tokenizer, bind, report READY, serve."""
    from services.model_loader import load_tokenizer

    ep = config.endpoints
    endpoints = DetokenizerEndpoints(
        token_batches=ep.detok_tokens,
        specs=ep.detok_specs,
        engine_cores=tuple(
            e.engine_core for e in ep.engines(config.engine.parallel.data_parallel_size)
        ),
        api_server=ep.api_outputs,
    )
    # The launcher prepared the folder (a GGUF converted, a dummy's config checked).
    tokenizer = load_tokenizer(Path(config.model_folder)).tokenizer
    bound = threading.Event()

    def report_when_bound() -> None:
        bound.wait()
        freeze_gc()
        report_ready(control_endpoint, "detokenizer")

    from services.metrics.process_metrics import detokenizer_time

    threading.Thread(target=report_when_bound, daemon=True).start()
    serve_detokenizer(
        tokenizer,
        endpoints,
        ready=bound,
        batch_time=detokenizer_time(config),
        request_log=RequestLog(config.max_log_len) if config.enable_log_outputs else None,
    )
