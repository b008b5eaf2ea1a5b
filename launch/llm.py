"""The offline engine: scheduler, model runner and detokenizer in one process.

``LLM(model=..., **engine_flags).generate(prompts, SamplingParams(...))`` works as
vLLM's offline API does: every prompt is added to the scheduler at once and the
batch runs with continuous batching (requests join and leave the running batch
step by step), not one prompt after another. Used by ``actorserve generate``,
batch jobs and tests.

It is the server's serve path without the sockets: the same ``RequestProcessor`` as
the tokenizers checks each request, the same ``EngineCore`` as the scheduler process
runs it, the same ``OutputProcessor`` as the detokenizer process turns its tokens into
text (stop strings, ``min_tokens``, stop tokens, logprobs), and the api_server's
``fan_out`` and ``ChoiceState`` make and gather the ``n`` choices, so a rule holds in
both (``tests/test_output_parity.py``). One rank runs in this process
(``UniprocExecutor``); with ``tensor_parallel_size`` > 1 the ranks are child processes
(``close()`` ends them).
"""

from __future__ import annotations

import itertools
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import numpy as np

from launch.serve import check_model_files
from services import clock
from services.api_server.choices import ChoiceState, fan_out
from services.config import ConfigError, EngineConfig, ModelArchConfig
from services.detokenizer.output_processor import OutputProcessor
from services.logging_utils import init_logger
from services.model_loader import load_hf_config, load_tokenizer, prepare_engine_model
from services.protocol import (
    DecodedLogprob,
    FinishRequest,
    GenerateRequest,
    PoolingParams,
    RequestError,
    RequestTokens,
    SamplingParams,
    TextDelta,
    TokenBatch,
    TokenLogprobs,
)
from services.scheduler.engine_core import EngineCore
from services.scheduler.executor import Executor, UniprocExecutor
from services.structured_output.manager import StructuredOutputManager, vocab_info
from services.tokenizer.chat_template import render_chat
from services.tokenizer.processor import RequestProcessor

if TYPE_CHECKING:
    from launch.workers import LocalWorkerRanks

__all__ = ["LLM", "SamplingParams", "RequestOutput", "CompletionOutput"]

logger = init_logger(__name__)

Prompt = str | list[int]


@dataclass
class CompletionOutput:
    """One sampled continuation of a prompt."""

    index: int
    text: str
    token_ids: list[int]
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    logprobs: list[TokenLogprobs] | None = None


@dataclass
class EmbeddingOutput:
    embedding: list[float] = field(default_factory=list)


@dataclass
class EmbeddingRequestOutput:
    """One prompt's vector, as vLLM's: ``result.outputs.embedding``."""

    request_id: str
    prompt_token_ids: list[int]
    outputs: EmbeddingOutput = field(default_factory=EmbeddingOutput)


@dataclass
class RequestOutput:
    """The result for one prompt: its ``n`` completions, in order."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    num_cached_tokens: int = 0
    finished: bool = True
    # With SamplingParams.prompt_logprobs: one entry per prompt token, None for the first.
    prompt_logprobs: list[TokenLogprobs | None] | None = None


@dataclass
class _Choice:
    """One engine request of a ``generate`` call: the result it belongs to, its index
    there, and its deltas gathered as the api_server gathers a choice's."""

    result: RequestOutput
    index: int
    sampling: SamplingParams
    state: ChoiceState = field(default_factory=ChoiceState)


class LLM:
    """An offline engine over one model. Keyword arguments are vLLM's engine flags."""

    def __init__(self, model: str | None = None, **engine_kwargs: object) -> None:
        self.config = EngineConfig.from_kwargs(model=model, **engine_kwargs)
        m, w = self.config.model, self.config.worker
        clock.set_sim_speed(w.sim_speed if w.worker_backend == "sim" else 1.0)
        folder = prepare_engine_model(m.model, m.load_format, self.config.worker.sim_model)
        arch = ModelArchConfig.from_hf_config(load_hf_config(folder))
        self.config.finalize(arch)
        check_model_files(self.config, folder)
        if self.config.parallel.data_parallel_size > 1:
            raise ConfigError(
                "data_parallel_size is for the server (actorserve serve -dp N); offline, "
                "run one LLM per data-parallel rank"
            )
        self.arch = arch
        self.tokenizer = load_tokenizer(folder)
        max_len = self.config.scheduler.resolved_max_model_len
        self.processor = RequestProcessor(
            self.tokenizer,
            max_len,
            structured_outputs=self.config.scheduler.structured_outputs,
        )
        self._ranks: LocalWorkerRanks | None = None
        executor: Executor
        if self.config.parallel.world_size == 1:
            executor = UniprocExecutor(self.config, folder)
        else:
            from launch.workers import LocalWorkerRanks

            self._ranks = LocalWorkerRanks(self.config, folder)
            executor = self._ranks.executor
        # The detokenizer process's logic: text, stop strings and logprobs of every request.
        self.output_processor = OutputProcessor(self.tokenizer.tokenizer, split_reasoning=False)
        self.core = EngineCore(
            self.config,
            executor,
            structured_output=StructuredOutputManager(  # compiles in add_request: errors raise
                self.config.scheduler.structured_outputs,
                lambda: vocab_info(self.tokenizer, arch.vocab_size),
                synchronous=True,
            ),
        )
        self.scheduler = self.core.scheduler
        self._ids = itertools.count()
        # Called after every step; tests use it to check the block pool's integrity.
        self.step_hook: Callable[[], None] | None = None

    # ------------------------------------------------------------------ public API

    def generate(
        self,
        prompts: Prompt | Sequence[Prompt],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        *,
        use_tqdm: bool | Callable[..., Any] = True,
        priority: Sequence[int] | None = None,
    ) -> list[RequestOutput]:
        """Complete every prompt (text or token ids); one RequestOutput per prompt, in order.

        ``use_tqdm`` (vLLM's): a "Processed prompts" progress bar on stderr, with the
        input and output tokens per second so far; False hides it, a callable replaces
        ``tqdm.tqdm``."""
        if isinstance(prompts, str) or (
            isinstance(prompts, list) and prompts and isinstance(prompts[0], int)
        ):
            prompts = [prompts]  # type: ignore[list-item]
        prompts = list(prompts)  # type: ignore[arg-type]
        params = self._per_prompt(sampling_params, len(prompts))
        results: list[RequestOutput] = []
        choices: dict[str, _Choice] = {}  # engine request id -> its choice
        progress = _Progress(len(prompts), use_tqdm)
        try:
            for i, (prompt, sp) in enumerate(zip(prompts, params, strict=True)):
                sp.validate()
                results.append(self._add(prompt, sp, priority[i] if priority else 0, choices))
            # Until the scheduler has ended every request (a stop string's finish too), so
            # the output processor holds nothing of this call afterwards.
            live = set(choices)
            left: dict[int, int] = {}  # a prompt's choices not yet ended, by its result
            for choice in choices.values():
                left[id(choice.result)] = left.get(id(choice.result), 0) + 1
            while live:
                items = [item for item in self.step() if item.req_id in live]
                self._take(*self.output_processor.process(TokenBatch(items)), choices)
                ended = {req_id for req_id in live if req_id not in self.output_processor}
                live -= ended
                for req_id in ended:
                    choice = choices[req_id]
                    left[id(choice.result)] -= 1
                    progress.choice_done(choice, left[id(choice.result)] == 0)
        except BaseException:
            # A prompt refused part-way (its grammar, offline, fails as it compiles), or an
            # interrupted run: its requests must not run on into the next call. The
            # scheduler's reports of them are dropped there (not of that call).
            self.core.abort_requests(list(choices))
            self.output_processor.abort_requests(list(choices))
            raise
        finally:
            progress.close()
        for choice in choices.values():  # in choice order: fan_out's
            result = choice.result
            result.outputs.append(_completion_output(choice))
            result.num_cached_tokens = max(result.num_cached_tokens, choice.state.num_cached_tokens)
            if choice.index == 0 and choice.sampling.prompt_logprobs is not None:
                result.prompt_logprobs = _prompt_logprobs(choice.state)
        return results

    def embed(
        self,
        prompts: Prompt | Sequence[Prompt],
        pooling_params: PoolingParams | None = None,
        *,
        use_tqdm: bool | Callable[..., Any] = True,
    ) -> list[EmbeddingRequestOutput]:
        """One vector per prompt (text or token ids), in order (vLLM's ``LLM.embed``): each
        a prefill-only request through the same engine steps as ``generate``'s, pooled as
        ``--pooler-config`` (``pooler_config=``) says, or as ``pooling_params`` override it.
        Needs ``runner="pooling"``, as vLLM's does."""
        if self.config.model.resolved_runner != "pooling":
            raise ValueError(
                "LLM.embed() is only supported for pooling models. Try passing "
                "`runner='pooling'` (`--runner pooling`) to use the model as a pooling model."
            )
        batch: list[Prompt] = (
            [prompts]  # type: ignore[list-item]
            if isinstance(prompts, str) or (prompts and isinstance(prompts[0], int))
            else list(prompts)  # type: ignore[arg-type]
        )
        if pooling_params is None:
            pooler = self.config.model.pooler
            pooling_params = PoolingParams(pooler.pooling_type, pooler.normalize, pooler.dimensions)
        if (
            dims := pooling_params.dimensions
        ) is not None and not 0 < dims <= self.arch.hidden_size:
            raise ValueError(f"dimensions must be in [1, {self.arch.hidden_size}], got {dims}")
        results: dict[str, EmbeddingRequestOutput] = {}
        progress = _Progress(len(batch), use_tqdm)
        try:
            for prompt in batch:
                req_id = f"embed-{next(self._ids)}"
                text, ids = (prompt, None) if isinstance(prompt, str) else (None, list(prompt))
                out = self.processor.process(GenerateRequest(
                    req_id, SamplingParams(max_tokens=1), prompt=text, prompt_token_ids=ids,
                    pooling=pooling_params))  # fmt: skip
                if isinstance(out, RequestError):
                    raise ValueError(out.message)
                self.core.add_request(out[0])
                results[req_id] = EmbeddingRequestOutput(req_id, out[0].prompt_token_ids)
            live = set(results)
            while live:
                for item in self.step():
                    if item.req_id in live and item.finish_reason is not None:
                        if item.finish_reason != "stop":
                            raise RuntimeError(f"embedding {item.req_id} failed: {item.error}")
                        vector = np.frombuffer(item.pooled, dtype="<f4").tolist()
                        results[item.req_id].outputs.embedding = vector
                        live.discard(item.req_id)
                        progress.prompt_done(len(results[item.req_id].prompt_token_ids), 0)
        except BaseException:
            self.core.abort_requests(list(results))
            raise
        finally:
            progress.close()
        return list(results.values())

    def chat(
        self,
        messages: list[dict[str, str]] | list[list[dict[str, str]]],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        *,
        use_tqdm: bool | Callable[..., Any] = True,
    ) -> list[RequestOutput]:
        """Apply the model's chat template to each conversation, then generate."""
        conversations = [messages] if messages and isinstance(messages[0], dict) else messages
        prompts = [self.apply_chat_template(conv) for conv in conversations]  # type: ignore[arg-type]
        return self.generate(prompts, sampling_params, use_tqdm=use_tqdm)

    def apply_chat_template(self, messages: list[dict[str, str]]) -> str:
        tok = self.tokenizer
        if not tok.chat_template:
            raise ValueError("this model has no chat template; send a plain prompt instead")
        return render_chat(
            tok.chat_template, messages, bos_token=tok.bos_token, eos_token=tok.eos_token
        )

    def step(self) -> list[RequestTokens]:
        """Run one engine step: schedule, execute, update. Returns each request's new tokens."""
        _, items = self.core.step()
        if self.step_hook is not None:
            self.step_hook()
        return items

    def close(self) -> None:
        """End the worker ranks' processes, if any (a single rank needs nothing)."""
        ranks = getattr(self, "_ranks", None)  # None too when __init__ failed early
        if ranks is not None:
            ranks.close()
            self._ranks = None

    def __enter__(self) -> LLM:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __del__(self) -> None:
        self.close()

    # ------------------------------------------------------------------ internals

    def _add(
        self, prompt: Prompt, sp: SamplingParams, priority: int, choices: dict[str, _Choice]
    ) -> RequestOutput:
        """Check and add one prompt's ``n`` choices, as the api_server fans them out and the
        tokenizer checks them; each is recorded in ``choices`` before the engine sees it."""
        request_id = str(next(self._ids))
        text, token_ids = (prompt, None) if isinstance(prompt, str) else (None, list(prompt))
        result: RequestOutput | None = None
        for index, (req_id, _, params) in enumerate(fan_out(request_id, 1, sp)):
            checked = self.processor.process(
                GenerateRequest(
                    req_id, params, prompt=text, prompt_token_ids=token_ids, priority=priority
                )
            )
            if isinstance(checked, RequestError):
                raise ValueError(checked.message)
            tokenized, spec = checked
            if result is None:
                result = RequestOutput(
                    request_id=request_id,
                    prompt=text,
                    prompt_token_ids=tokenized.prompt_token_ids,
                    outputs=[],
                )
            choices[req_id] = _Choice(result, index, spec.sampling)
            self._take(*self.output_processor.add_request(spec), choices)
            self.core.add_request(tokenized)
        assert result is not None  # n >= 1: checked by SamplingParams.validate
        return result

    def _take(
        self, deltas: list[TextDelta], finishes: list[FinishRequest], choices: dict[str, _Choice]
    ) -> None:
        """The output processor's answer, handled as the server's processes handle it."""
        for finish in finishes:  # a stop string matched: the scheduler process's handling
            self.core.finish_requests([finish.req_id], finish.finish_reason, finish.stop_reason)
        for delta in deltas:
            choices[delta.req_id].state.update(delta, delta.text)

    @staticmethod
    def _per_prompt(
        sampling_params: SamplingParams | Sequence[SamplingParams] | None, count: int
    ) -> list[SamplingParams]:
        if sampling_params is None:
            return [SamplingParams() for _ in range(count)]
        if isinstance(sampling_params, SamplingParams):
            return [sampling_params] * count
        if len(sampling_params) != count:
            raise ValueError(
                f"got {len(sampling_params)} sampling params for {count} prompts; "
                "pass one, or one per prompt"
            )
        return list(sampling_params)


def _tqdm() -> Callable[..., Any]:
    from tqdm import tqdm

    return tqdm


class _Progress:
    """vLLM's "Processed prompts" bar over one ``generate`` call: a prompt counts once all
    its choices have ended; the postfix estimates input and output tokens per second."""

    def __init__(self, total: int, use_tqdm: bool | Callable[..., Any]) -> None:
        self.bar: Any = None
        self.input_tokens = self.output_tokens = 0
        if not use_tqdm:
            return
        make: Callable[..., Any] = use_tqdm if callable(use_tqdm) else _tqdm()
        self.bar = make(
            total=total,
            desc="Processed prompts",
            dynamic_ncols=True,
            file=sys.stderr,
            postfix="est. speed input: 0.00 toks/s, output: 0.00 toks/s",
        )

    def choice_done(self, choice: _Choice, prompt_done: bool) -> None:
        self.prompt_done(len(choice.result.prompt_token_ids), len(choice.state.token_ids),
                         counted=prompt_done)  # fmt: skip

    def prompt_done(self, input_tokens: int, output_tokens: int, counted: bool = True) -> None:
        """A request's tokens in the estimate; the bar moves on when ``counted`` (its
        prompt's last choice)."""
        if self.bar is None:
            return
        self.input_tokens += input_tokens
        self.output_tokens += output_tokens
        if not counted:
            return
        elapsed = max(self.bar.format_dict.get("elapsed", 0.0), 1e-9)
        self.bar.postfix = (
            f"est. speed input: {self.input_tokens / elapsed:.2f} toks/s, "
            f"output: {self.output_tokens / elapsed:.2f} toks/s"
        )
        self.bar.update(1)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()


def _token_logprobs(lp: DecodedLogprob) -> TokenLogprobs:
    return TokenLogprobs(lp.token_id, lp.logprob, lp.rank, lp.top_token_ids, lp.top_logprobs)


def _completion_output(choice: _Choice) -> CompletionOutput:
    s = choice.state
    return CompletionOutput(
        index=choice.index,
        text="".join(s.text),
        token_ids=s.token_ids,
        finish_reason=s.finish_reason,
        stop_reason=s.stop_reason,
        logprobs=(
            [_token_logprobs(lp) for lp in s.logprobs]
            if choice.sampling.logprobs is not None
            else None
        ),
    )


def _prompt_logprobs(state: ChoiceState) -> list[TokenLogprobs | None]:
    """One entry per prompt token, None for the first (the n choices' copies are the same)."""
    items = state.prompt_logprobs.items if state.prompt_logprobs is not None else []
    return [None, *(_token_logprobs(lp) for lp in items)]
