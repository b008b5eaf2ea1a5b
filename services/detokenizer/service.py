"""The detokenizer process: TokenBatch in, TextDeltaBatch out, stop strings back to the scheduler.

Each request is registered by the tokenizer (``RequestOutputSpec``) before
the scheduler sees it; tokens that still arrive first (two sockets, no global
order) wait until the spec does. The scheduler ends every request with one
``RequestTokens`` carrying ``finish_reason``; that frees the request's state
here, including requests this process already finished on a stop string.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import tokenizers
import zmq

from services import clock
from services.config import ServeConfig
from services.detokenizer.incremental import IncrementalDetokenizer
from services.gc_tuning import freeze_gc
from services.ipc import PullSocket, PushSocket, report_ready
from services.protocol import (
    ApiServerInput,
    DecodedLogprob,
    DecodedPromptLogprobs,
    EngineCoreInput,
    FinishRequest,
    RequestOutputSpec,
    RequestTokens,
    TextDelta,
    TextDeltaBatch,
    TokenBatch,
    TokenLogprobs,
)
from services.request_log import RequestLog

_POLL_MS = 100


@dataclass
class _RequestState:
    spec: RequestOutputSpec
    detok: IncrementalDetokenizer
    num_output_tokens: int = 0
    num_cached_tokens: int = 0
    done: bool = False  # final delta sent (stop string); waiting for the scheduler's end
    prompt_text: str | None = None  # handed out once, with the first delta
    prompt_token_ids: list[int] | None = None  # likewise
    # --enable-log-outputs: the whole output, logged when it finishes
    output_text: list[str] = field(default_factory=list)
    output_ids: list[int] = field(default_factory=list)


@dataclass
class OutputProcessor:
    """Per-request incremental detokenization; pure logic, no sockets.

    Contract: ``add_request`` and ``process`` return the deltas to send to the
    api_server and the ``FinishRequest``s to send to the scheduler. Exactly one
    delta per request carries ``finish_reason``; no delta follows it.
    """

    tokenizer: tokenizers.Tokenizer
    request_log: RequestLog | None = None  # --enable-log-outputs
    _states: dict[str, _RequestState] = field(default_factory=dict)
    _early: dict[str, list[RequestTokens]] = field(default_factory=dict)

    @property
    def num_requests(self) -> int:
        return len(self._states)

    def add_request(self, spec: RequestOutputSpec) -> tuple[list[TextDelta], list[FinishRequest]]:
        s = spec.sampling
        detok = IncrementalDetokenizer(
            self.tokenizer,
            skip_special_tokens=s.skip_special_tokens,
            stop=s.stop,
            include_stop_str_in_output=s.include_stop_str_in_output,
            prompt_token_ids=spec.prompt_tail_ids,
            min_tokens=s.min_tokens,
        )
        self._states[spec.req_id] = _RequestState(
            spec, detok, prompt_text=spec.prompt_text, prompt_token_ids=spec.prompt_token_ids
        )
        return self.process(TokenBatch(self._early.pop(spec.req_id, [])))

    def process(self, batch: TokenBatch) -> tuple[list[TextDelta], list[FinishRequest]]:
        deltas: list[TextDelta] = []
        finishes: list[FinishRequest] = []
        for item in batch.items:
            state = self._states.get(item.req_id)
            if state is None:
                self._early.setdefault(item.req_id, []).append(item)
                continue
            if state.done:
                if item.finish_reason is not None:
                    del self._states[item.req_id]
                continue
            delta = self._step(state, item)
            if delta is None:
                continue
            deltas.append(delta)
            if self.request_log is not None:
                state.output_text.append(delta.text)
                state.output_ids += delta.token_ids
                if delta.finish_reason is not None:
                    self.request_log.outputs(
                        item.req_id,
                        "".join(state.output_text),
                        state.output_ids,
                        delta.finish_reason,
                    )
            if delta.finish_reason is not None:
                if item.finish_reason is None:
                    # Finished here on a stop string: the scheduler must free it.
                    state.done = True
                    finishes.append(FinishRequest(item.req_id, "stop", delta.stop_reason))  # type: ignore[arg-type]
                else:
                    del self._states[item.req_id]
        return deltas, finishes

    def _step(self, state: _RequestState, item: RequestTokens) -> TextDelta | None:
        detok = state.detok
        prompt_logprobs = None
        first_id = state.spec.first_prompt_token_id
        if first_id is not None and item.new_token_ids and not state.num_output_tokens:
            prompt_logprobs = DecodedPromptLogprobs(
                first_token_id=first_id,
                first_token=self.tokenizer.decode([first_id], skip_special_tokens=False),
                items=[self._decode_logprobs(lp) for lp in item.prompt_logprobs],
            )
        # The scheduler's "stop" is always a token (EOS or stop_token_ids), never a string.
        text = detok.update(item.new_token_ids, stop_terminated=item.finish_reason == "stop")
        state.num_output_tokens += len(item.new_token_ids)
        state.num_cached_tokens = max(state.num_cached_tokens, item.num_cached_tokens)
        finish_reason, stop_reason = item.finish_reason, item.stop_reason
        if detok.stop_matched is not None:
            finish_reason, stop_reason = "stop", detok.stop_matched
        elif finish_reason is not None:
            text += detok.flush()
        logprobs = (
            [self._decode_logprobs(lp) for lp in item.logprobs]
            if state.spec.sampling.logprobs is not None
            else []
        )
        # A step that produced tokens gets a delta even if they render no text yet (a
        # skipped special token, an incomplete UTF-8 character, a stop string's possible
        # start): vLLM streams one chunk per step, and `vllm bench serve` times each chunk.
        if not text and finish_reason is None and not logprobs and not item.new_token_ids:
            return None
        prompt_text, state.prompt_text = state.prompt_text, None
        prompt_ids, state.prompt_token_ids = state.prompt_token_ids, None
        return TextDelta(
            req_id=item.req_id,
            text=text,
            token_ids=item.new_token_ids,
            finish_reason=finish_reason,
            stop_reason=stop_reason,
            logprobs=logprobs,
            num_prompt_tokens=state.spec.num_prompt_tokens,
            num_cached_tokens=state.num_cached_tokens,
            num_output_tokens=state.num_output_tokens,
            prompt_text=prompt_text,
            prompt_logprobs=prompt_logprobs,
            prompt_token_ids=prompt_ids,
            kv_transfer_params=item.kv_transfer_params,
            error=item.error,
        )

    def _decode_logprobs(self, lp: TokenLogprobs) -> DecodedLogprob:
        decode = self.tokenizer.decode
        return DecodedLogprob(
            token_id=lp.token_id,
            token=decode([lp.token_id], skip_special_tokens=False),
            logprob=lp.logprob,
            rank=lp.rank,
            top_token_ids=lp.top_token_ids,
            top_tokens=[decode([t], skip_special_tokens=False) for t in lp.top_token_ids],
            top_logprobs=lp.top_logprobs,
        )


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
