"""The offline engine: scheduler, model runner and detokenizer in one process.

``LLM(model=..., **engine_flags).generate(prompts, SamplingParams(...))`` works as
vLLM's offline API does: every prompt is added to the scheduler at once and the
batch runs with continuous batching (requests join and leave the running batch
step by step), not one prompt after another. Used by ``actorserve generate``,
batch jobs and tests; the server runs the same Scheduler and ModelRunner in
separate processes.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import msgspec

from services.config import EngineConfig, ModelArchConfig
from services.detokenizer.incremental import IncrementalDetokenizer
from services.gpu_worker.model_runner import ModelRunner
from services.logging_utils import init_logger
from services.model_loader import load_hf_config, load_tokenizer, prepare_model
from services.protocol import RequestTokens, SamplingParams, TokenLogprobs
from services.scheduler.capacity import check_kv_capacity
from services.scheduler.request import Request
from services.scheduler.scheduler import Scheduler
from services.tokenizer.chat_template import render_chat

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
        folder = prepare_model(self.config.model.model, self.config.model.load_format)
        arch = ModelArchConfig.from_hf_config(load_hf_config(folder))
        self.config.finalize(arch)
        self.arch = arch
        self.tokenizer = load_tokenizer(folder)
        self._vocab_size = self.tokenizer.tokenizer.get_vocab_size(with_added_tokens=True)
        self.runner = ModelRunner(self.config, folder)
        num_blocks = self.runner.determine_num_blocks()
        check_kv_capacity(
            num_blocks, self.config.cache.block_size, self.config.scheduler.max_model_len, logger
        )
        self.runner.initialize_kv_cache(num_blocks)
        self.scheduler = Scheduler(self.config.scheduler, self.config.cache, num_blocks)
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
        for i, (prompt, sp) in enumerate(zip(prompts, params, strict=True)):
            sp.validate()
            if (bad := sp.out_of_vocab_token(self._vocab_size)) is not None:
                raise ValueError(f"token id {bad[1]} in {bad[0]} is out of vocabulary")
            token_ids = self._encode(prompt)
            result = RequestOutput(
                request_id=str(next(self._ids)),
                prompt=prompt if isinstance(prompt, str) else None,
                prompt_token_ids=token_ids,
                outputs=[],
                prompt_logprobs=None if sp.prompt_logprobs is None else [None],
            )
            results.append(result)
            for index in range(sp.n):
                seq_params = self._child_params(sp, index)
                req_id = f"{result.request_id}-{index}" if sp.n > 1 else result.request_id
                self._add_request(req_id, token_ids, seq_params, priority[i] if priority else 0)
                sequences[req_id] = _Sequence(
                    parent=result,
                    index=index,
                    detokenizer=IncrementalDetokenizer(
                        self.tokenizer.tokenizer,
                        skip_special_tokens=seq_params.skip_special_tokens,
                        stop=list(seq_params.stop),
                        include_stop_str_in_output=seq_params.include_stop_str_in_output,
                        prompt_token_ids=token_ids,
                    ),
                    logprobs=[] if seq_params.logprobs is not None else None,
                )
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
        plan = self.scheduler.schedule()
        if plan.is_empty and not plan.finished_req_ids:
            # Nothing to compute (e.g. only aborts to report): the update still flushes them.
            return self.scheduler.update_from_output(plan, None)
        result = self.runner.execute(plan)
        items = self.scheduler.update_from_output(plan, result)
        if self.step_hook is not None:
            self.step_hook()
        return items

    # ------------------------------------------------------------------ internals

    def _encode(self, prompt: Prompt) -> list[int]:
        if isinstance(prompt, str):
            token_ids = self.tokenizer.encode(prompt)
        else:
            token_ids = list(prompt)
            vocab = self.arch.vocab_size
            if any(not (0 <= t < vocab) for t in token_ids):
                raise ValueError(f"prompt token ids must be in [0, {vocab})")
        if not token_ids:
            raise ValueError("the prompt is empty")
        return token_ids

    def _add_request(
        self, req_id: str, token_ids: list[int], sp: SamplingParams, priority: int
    ) -> None:
        max_len = self.config.scheduler.max_model_len
        if sp.max_tokens is None:
            sp.max_tokens = max(1, max_len - len(token_ids))
        sp.bad_words_token_ids = self.tokenizer.bad_words_token_ids(sp.bad_words)
        if len(token_ids) + sp.max_tokens > max_len:
            raise ValueError(
                f"This model's maximum context length is {max_len} tokens. However, you "
                f"requested {len(token_ids) + sp.max_tokens} tokens ({len(token_ids)} in the "
                f"prompt, {sp.max_tokens} in the completion)."
            )
        self.scheduler.add_request(
            Request(
                req_id=req_id,
                prompt_token_ids=token_ids,
                sampling_params=sp,
                eos_token_id=self.tokenizer.eos_token_id,
                priority=priority,
            )
        )

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
            self.scheduler.finish_requests([item.req_id], "stop")
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

    @staticmethod
    def _child_params(sp: SamplingParams, index: int) -> SamplingParams:
        """A copy per sequence; with n > 1 and a seed, sequence i uses seed + i (as vLLM)."""
        seed = sp.seed + index if (sp.seed is not None and sp.n > 1) else sp.seed
        return msgspec.structs.replace(sp, n=1, seed=seed)
