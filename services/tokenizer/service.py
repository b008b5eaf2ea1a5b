"""The tokenizer process: api_server requests in, token ids out to the scheduler.

Several tokenizer processes may connect to the api_server's request endpoint;
ZeroMQ hands each message to one of them (round robin). A ``GenerateBatch`` (the
engine requests of one HTTP request) is checked as a whole: if any is rejected,
the first error goes straight back to the api_server and none is sent on;
otherwise each first registers its output spec with the detokenizer, then goes
to a scheduler: with data parallelism, the engine core the balancer chooses
(``balancer.py``) from the engines' published states.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from services import clock
from services.config import ServeConfig
from services.gc_tuning import freeze_gc
from services.ipc import PullSocket, PushSocket, SubSocket, report_ready
from services.kv_transfer.base import params_check
from services.protocol import (
    ApiServerInput,
    DetokenizeRequest,
    EngineCoreInput,
    EngineState,
    GenerateBatch,
    RequestError,
    RequestOutputSpec,
    TokenizedBatch,
    TokenizedRequest,
    TokenizeRequest,
    TokenizerInput,
)
from services.request_log import RequestLog
from services.tokenizer.balancer import DataParallelBalancer
from services.tokenizer.processor import RequestProcessor

logger = logging.getLogger(__name__)

_POLL_MS = 100  # how often an idle loop checks its stop event


@dataclass(frozen=True)
class TokenizerEndpoints:
    """Where the tokenizer connects (every endpoint is bound by its owner)."""

    requests: str  # api_server PUSH -> here (TokenizerInput)
    engine_cores: tuple[str, ...]  # -> each scheduler's PULL (EngineCoreInput)
    detokenizer_specs: str  # -> detokenizer PULL (RequestOutputSpec)
    api_server: str  # -> api_server PULL (ApiServerInput)
    engine_states: tuple[str, ...] = ()  # each scheduler's PUB (EngineState), with DP


def _route(
    batch: GenerateBatch, outs: list, balancer: DataParallelBalancer
) -> list[int] | RequestError:
    """Each request's engine core; a pinned rank out of range fails the whole batch."""
    n = balancer.num_engines
    engines = []
    for req, out in zip(batch.requests, outs, strict=True):
        pinned = req.data_parallel_rank
        if pinned is not None and not 0 <= pinned < n:
            return RequestError(
                req.req_id,
                400,
                f"data_parallel_rank {pinned} is out of range: this server has {n} "
                f"data-parallel engine{'s' if n > 1 else ''} (0 to {n - 1})",
                param="X-data-parallel-rank",
            )
        tokenized = out[0]
        engines.append(balancer.choose(tokenized.prompt_token_ids, tokenized.cache_salt, pinned))
    return engines


def serve_tokenizer(
    processor: RequestProcessor,
    endpoints: TokenizerEndpoints,
    stop_event: threading.Event | None = None,
    tokenize_time: Any | None = None,
    on_connected: Callable[[], None] | None = None,
    balancer: DataParallelBalancer | None = None,
) -> None:
    """Run the tokenizer loop until ``stop_event`` is set (forever without one).

    ``tokenize_time`` (a histogram child) observes each generate request's processing time;
    ``on_connected`` runs once the sockets exist (the process reports READY there).
    """
    stop_event = stop_event or threading.Event()
    requests = PullSocket[TokenizerInput](endpoints.requests, TokenizerInput)
    engines = [PushSocket[EngineCoreInput](e, EngineCoreInput) for e in endpoints.engine_cores]
    states = [SubSocket[EngineState](e, EngineState) for e in endpoints.engine_states]
    balancer = balancer or DataParallelBalancer(len(engines), 16, "builtin")
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
                        start = clock.perf_counter()
                        outs.append(processor.process(req))
                        if tokenize_time is not None:
                            tokenize_time.observe(clock.perf_counter() - start)
                    error = next((o for o in outs if isinstance(o, RequestError)), None)
                    if error is not None:
                        api.send(error)  # the whole group fails with its first error
                        continue
                    for sock in states:  # the engines' latest loads and cached blocks
                        while (state := sock.recv_nowait()) is not None:
                            balancer.on_state(state)
                    routes = _route(msg, outs, balancer)
                    if isinstance(routes, RequestError):
                        api.send(routes)
                        continue
                    # The specs go first so the detokenizer usually knows the requests
                    # before their first tokens (it buffers them otherwise); each engine
                    # gets its share of the group in one message (one step admits it all).
                    groups: dict[int, list[TokenizedRequest]] = {}
                    for out, d in zip(outs, routes, strict=True):
                        assert not isinstance(out, RequestError)
                        specs.send(out[1])
                        groups.setdefault(d, []).append(out[0])
                    for d, group in groups.items():
                        engines[d].send(TokenizedBatch(group))
                elif isinstance(msg, TokenizeRequest):
                    api.send(processor.tokenize(msg))
                elif isinstance(msg, DetokenizeRequest):
                    api.send(processor.detokenize(msg))
            except Exception as e:  # one bad request must not take the process down
                req_id = msg.requests[0].req_id if isinstance(msg, GenerateBatch) else msg.req_id
                logger.exception("tokenizer failed on request %s", req_id)
                api.send(RequestError(req_id, 500, f"tokenizer error: {e}", "InternalServerError"))
    finally:
        closables: list[Any] = [requests, *engines, *states, specs, api]
        for closable in closables:
            closable.close()


# What a tokenizer process may allocate beyond what it holds once loaded: chat templates run
# here, and one that builds gigabytes (``s | replace('x', s)``) gets a MemoryError, a 400,
# instead of the kernel's OOM killer taking the process (and the server) down.
_TEMPLATE_MEMORY_BYTES = 4 << 30


def _limit_memory(headroom: int) -> None:
    """RLIMIT_DATA = this process's data now + ``headroom`` (unless already lower). The data
    limit counts what is writable and private (the heap, anonymous maps), not the address
    space merely reserved (malloc arenas, library mappings), so threads started later by
    zmq or the tokenizers library do not eat into it."""
    import resource

    try:
        with open("/proc/self/status") as f:
            data_kb = next(int(line.split()[1]) for line in f if line.startswith("VmData:"))
    except (OSError, StopIteration):  # not Linux: no limit
        return
    soft, hard = resource.getrlimit(resource.RLIMIT_DATA)
    limit = data_kb * 1024 + headroom
    if hard != resource.RLIM_INFINITY:
        limit = min(limit, hard)
    if soft == resource.RLIM_INFINITY or soft > limit:
        resource.setrlimit(resource.RLIMIT_DATA, (limit, hard))


def run_tokenizer_process(config: ServeConfig, control_endpoint: str) -> None:
    """Child-process entry point: load the tokenizer, report READY, serve."""
    from services.model_loader import load_tokenizer

    ep = config.endpoints
    dp = config.engine.parallel.data_parallel_size
    engines = ep.engines(dp)
    endpoints = TokenizerEndpoints(
        requests=ep.tokenizer_requests,
        engine_cores=tuple(e.engine_core for e in engines),
        detokenizer_specs=ep.detok_specs,
        api_server=ep.api_outputs,
        engine_states=tuple(e.engine_state for e in engines) if dp > 1 else (),
    )
    cache = config.engine.cache
    balancer = DataParallelBalancer(dp, cache.block_size, cache.prefix_caching_hash_algo)
    processor = RequestProcessor(
        load_tokenizer(Path(config.model_folder)),
        config.engine.scheduler.resolved_max_model_len,
        params_check(config.engine),
        config.limits,
        render_timer=True,
        request_log=RequestLog(config.max_log_len) if config.enable_log_requests else None,
        structured_outputs=config.engine.scheduler.structured_outputs,
        chat_template=config.chat_template,
    )
    _limit_memory(_TEMPLATE_MEMORY_BYTES)
    from services.metrics.process_metrics import tokenizer_time

    def connected() -> None:
        freeze_gc()
        report_ready(control_endpoint, "tokenizer")

    serve_tokenizer(
        processor,
        endpoints,
        tokenize_time=tokenizer_time(config),
        on_connected=connected,
        balancer=balancer,
    )
