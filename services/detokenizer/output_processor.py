"""The detokenizer's output path: token ids in, text deltas and stop-string finishes out.

Pure logic, no sockets: the detokenizer process (``service.py``) runs it between its
sockets, and the offline ``LLM`` (``launch/llm.py``) calls it after each engine step, so
stop strings, ``min_tokens``, stop tokens and logprobs come out the same in both.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import tokenizers

from services.detokenizer.incremental import IncrementalDetokenizer
from services.protocol import (
    DecodedLogprob,
    DecodedPromptLogprobs,
    FinishRequest,
    RequestOutputSpec,
    RequestTokens,
    TextDelta,
    TokenBatch,
    TokenLogprobs,
)
from services.request_log import RequestLog
from services.structured_output.reasoning import ReasoningSplitter


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
    reasoning: ReasoningSplitter | None = None  # a chat answer's thinking (--reasoning-parser)
    num_reasoning_tokens: int = 0  # the tokens of steps that thought


@dataclass
class OutputProcessor:
    """Per-request incremental detokenization; pure logic, no sockets.

    Contract: ``add_request`` and ``process`` return the deltas to send to the
    api_server and the ``FinishRequest``s to send to the scheduler. Exactly one
    delta per request carries ``finish_reason``; no delta follows it.
    """

    tokenizer: tokenizers.Tokenizer
    request_log: RequestLog | None = None  # --enable-log-outputs
    # A thinking model's text split into TextDelta.reasoning and .text (the server); the
    # offline LLM keeps it whole, as vLLM's does
    split_reasoning: bool = True
    _states: dict[str, _RequestState] = field(default_factory=dict)
    _early: dict[str, list[RequestTokens]] = field(default_factory=dict)

    @property
    def num_requests(self) -> int:
        return len(self._states)

    def __contains__(self, req_id: str) -> bool:
        """Whether the request is still tracked: registered, and not yet ended by the
        scheduler (a request finished here on a stop string stays until then)."""
        return req_id in self._states

    def abort_requests(self, req_ids: list[str]) -> None:
        """Forget requests now, without waiting for the scheduler's end of them: for a
        caller that will not read their tokens any more (the offline ``LLM`` on an error).
        That caller also drops the scheduler's later report of them."""
        for req_id in req_ids:
            self._states.pop(req_id, None)
            self._early.pop(req_id, None)

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
        splitter = None
        if s.reasoning is not None and self.split_reasoning:
            splitter = ReasoningSplitter(s.reasoning)
        self._states[spec.req_id] = _RequestState(
            spec,
            detok,
            prompt_text=spec.prompt_text,
            prompt_token_ids=spec.prompt_token_ids,
            reasoning=splitter,
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
                state.output_text.append(delta.reasoning + delta.text)
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
        reasoning = ""
        if state.reasoning is not None:
            thinking = state.reasoning.phase == "thinking"
            reasoning, answer = state.reasoning.feed(text)
            if thinking or reasoning or state.reasoning.phase == "thinking":
                state.num_reasoning_tokens += len(item.new_token_ids)
            if finish_reason is not None:
                more_reasoning, more_answer = state.reasoning.finish()
                reasoning, answer = reasoning + more_reasoning, answer + more_answer
        else:
            answer = text
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
            text=answer,
            reasoning=reasoning,
            num_reasoning_tokens=state.num_reasoning_tokens,
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
            pooled=item.pooled,  # an embedding: passed on as the bytes it came in
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
