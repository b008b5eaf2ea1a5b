"""The offline engine: scheduler, model runner and detokenizer in one process.

``LLM(model=..., **engine_flags).generate(prompts, SamplingParams(...))`` works as
vLLM's offline API does: every prompt is added to the scheduler at once and the
batch runs with continuous batching (requests join and leave the running batch
step by step), not one prompt after another. Used by ``actorserve generate``,
batch jobs and tests.

It drives the same ``EngineCore`` as the server's scheduler process and checks
requests with the same ``RequestProcessor`` as the server's tokenizers, so a rule
holds in both. One rank runs in this process (``UniprocExecutor``); with
``tensor_parallel_size`` > 1 the ranks are child processes (``close()`` ends them).
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from services import clock
from services.config import ConfigError, EngineConfig, ModelArchConfig
from services.detokenizer.incremental import IncrementalDetokenizer
from services.logging_utils import init_logger
from services.model_loader import load_hf_config, load_tokenizer, prepare_engine_model
from services.protocol import (
    GenerateRequest,
    RequestError,
    RequestTokens,
    SamplingParams,
    TokenLogprobs,
    choice_params,
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
class _Sequence:
    """Engine-side state of one running sequence (one of a prompt's ``n``)."""

    parent: RequestOutput
    index: int
    detokenizer: IncrementalDetokenizer
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[TokenLogprobs] | None = None


class LLM:
    """An offline engine over one model. Keyword arguments are vLLM's engine flags."""

    def __init__(self, model: str | None = None, **engine_kwargs: object) -> None:
        self.config = EngineConfig.from_kwargs(model=model, **engine_kwargs)
        m, w = self.config.model, self.config.worker
        clock.set_sim_speed(w.sim_speed if w.worker_backend == "sim" else 1.0)
        folder = prepare_engine_model(m.model, m.load_format, self.config.worker.sim_model)
        arch = ModelArchConfig.from_hf_config(load_hf_config(folder))
        self.config.finalize(arch)
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
        priority: Sequence[int] | None = None,
    ) -> list[RequestOutput]:
        """Complete every prompt (text or token ids); one RequestOutput per prompt, in order."""
        if isinstance(prompts, str) or (
            isinstance(prompts, list) and prompts and isinstance(prompts[0], int)
        ):
            prompts = [prompts]  # type: ignore[list-item]
        prompts = list(prompts)  # type: ignore[arg-type]
        params = self._per_prompt(sampling_params, len(prompts))
        results: list[RequestOutput] = []
        sequences: dict[str, _Sequence] = {}
        try:
            for i, (prompt, sp) in enumerate(zip(prompts, params, strict=True)):
                sp.validate()
                request_id = str(next(self._ids))
                text, token_ids = (
                    (prompt, None) if isinstance(prompt, str) else (None, list(prompt))
                )
                for index in range(sp.n):
                    req_id = f"{request_id}-{index}" if sp.n > 1 else request_id
                    checked = self.processor.process(
                        GenerateRequest(
                            req_id,
                            choice_params(sp, index),
                            prompt=text,
                            prompt_token_ids=token_ids,
                            priority=priority[i] if priority else 0,
                        )
                    )
                    if isinstance(checked, RequestError):
                        raise ValueError(checked.message)
                    tokenized, spec = checked
                    if index == 0:
                        result = RequestOutput(
                            request_id=request_id,
                            prompt=text,
                            prompt_token_ids=tokenized.prompt_token_ids,
                            outputs=[],
                            prompt_logprobs=None if sp.prompt_logprobs is None else [None],
                        )
                        results.append(result)
                    self.core.add_request(tokenized)
                    sequences[req_id] = _Sequence(
                        parent=result,
                        index=index,
                        detokenizer=IncrementalDetokenizer(
                            self.tokenizer.tokenizer,
                            skip_special_tokens=spec.sampling.skip_special_tokens,
                            stop=list(spec.sampling.stop),
                            include_stop_str_in_output=spec.sampling.include_stop_str_in_output,
                            prompt_token_ids=tokenized.prompt_token_ids,
                        ),
                        logprobs=[] if spec.sampling.logprobs is not None else None,
                    )
        except Exception:
            # A prompt refused part-way (its grammar, offline, fails as it compiles): the
            # requests already added must not run on into the next call.
            self.core.abort_requests(list(sequences))
            raise
        while sequences:
            for item in self.step():
                self._collect(item, sequences)
        for result in results:
            result.outputs.sort(key=lambda c: c.index)
        return results

    def chat(
        self,
        messages: list[dict[str, str]] | list[list[dict[str, str]]],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
    ) -> list[RequestOutput]:
        """Apply the model's chat template to each conversation, then generate."""
        conversations = [messages] if messages and isinstance(messages[0], dict) else messages
        prompts = [self.apply_chat_template(conv) for conv in conversations]  # type: ignore[arg-type]
        return self.generate(prompts, sampling_params)

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

    def _collect(self, item: RequestTokens, sequences: dict[str, _Sequence]) -> None:
        seq = sequences.get(item.req_id)
        if seq is None:
            return
        seq.token_ids.extend(item.new_token_ids)
        if seq.logprobs is not None:
            seq.logprobs.extend(item.logprobs)
        prompt_lps = seq.parent.prompt_logprobs
        if item.prompt_logprobs and prompt_lps is not None and len(prompt_lps) == 1:
            prompt_lps.extend(item.prompt_logprobs)  # the n sequences' copies are the same
        seq.detokenizer.update(item.new_token_ids)
        finish_reason, stop_reason = item.finish_reason, item.stop_reason
        if finish_reason is None and seq.detokenizer.stop_matched is not None:
            # A stop string ends the request: free its blocks now.
            self.core.finish_requests([item.req_id], "stop", None)
            finish_reason, stop_reason = "stop", seq.detokenizer.stop_matched
        if finish_reason is None:
            return
        seq.detokenizer.flush()
        del sequences[item.req_id]
        seq.parent.num_cached_tokens = max(seq.parent.num_cached_tokens, item.num_cached_tokens)
        seq.parent.outputs.append(
            CompletionOutput(
                index=seq.index,
                text=seq.detokenizer.output_text,
                token_ids=seq.token_ids,
                finish_reason=finish_reason,
                stop_reason=stop_reason,
                logprobs=seq.logprobs,
            )
        )

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
