"""Turn validated API requests into token ids, or into a user-facing error.

Pure logic, no sockets, so it is tested directly; ``service.py`` runs it in a loop.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable
from typing import Any, cast

import msgspec

from services.config import RequestLimits, StructuredOutputsConfig
from services.model_loader import TokenizerInfo
from services.protocol import (
    DetokenizeRequest,
    DetokenizeResult,
    GenerateRequest,
    PoolingParams,
    RequestError,
    RequestOutputSpec,
    StructuredOutputsParams,
    TokenizedRequest,
    TokenizeRequest,
    TokenizeResult,
)
from services.request_log import RequestLog
from services.structured_output.backend import GrammarError, check_constraint, choose_backend
from services.structured_output.manager import constraint_of
from services.structured_output.reasoning import prompt_reasoning
from services.tokenizer.chat_template import ChatTemplateError, render_chat

_CHECKED_KEPT = 256  # constraints whose check is remembered

# vLLM's INITIAL_INCREMENTAL_DETOKENIZATION_OFFSET: decoding context for the first output token.
_PROMPT_TAIL = 5


class PromptError(ValueError):
    """A request the tokenizer rejects; ``param`` names the offending request field."""

    def __init__(self, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.param = param


class RequestProcessor:
    """Chat template, tokenization and length checks for one model.

    Contract: ``process`` returns either the scheduler's ``TokenizedRequest``
    plus the detokenizer's ``RequestOutputSpec`` for it (with
    ``sampling.max_tokens`` filled in), or a ``RequestError`` (status 400) with
    vLLM's wording. It never raises for user input.
    """

    def __init__(
        self,
        tokenizer: TokenizerInfo,
        max_model_len: int,
        check_kv_transfer: Callable[[dict[str, Any]], None] | None = None,
        limits: RequestLimits | None = None,
        render_timer: bool = False,
        request_log: RequestLog | None = None,
        structured_outputs: StructuredOutputsConfig | None = None,
        chat_template: str | None = None,
    ) -> None:
        self.tokenizer = tokenizer
        self.chat_template = chat_template  # --chat-template: instead of the model's
        self.structured_outputs = structured_outputs or StructuredOutputsConfig()
        # Recent constraints and what their check said (an error, or None): a request's n
        # choices, and clients that send one schema again and again, are checked once.
        self._checked: OrderedDict[tuple[str, str, bool], str | None] = OrderedDict()
        self.request_log = request_log  # --enable-log-requests
        self.max_model_len = max_model_len
        self.limits = limits or RequestLimits()  # the chat template's time and size
        self.render_timer = render_timer  # SIGALRM-bounded renders (the tokenizer process)
        # The KV connector's check of kv_transfer_params (--kv-transfer-config), if any.
        self.check_kv_transfer = check_kv_transfer
        self._vocab_size = tokenizer.tokenizer.get_vocab_size(with_added_tokens=True)

    def render(
        self,
        messages: list[dict[str, object]],
        template: str | None,
        add_generation_prompt: bool,
        kwargs: dict[str, object],
    ) -> str:
        if template is None:  # --chat-template, else the model's (its tool_use one with tools)
            template = self.chat_template or self.tokenizer.chat_template_for(
                bool(kwargs.get("tools"))
            )
        if not template:
            raise PromptError(
                "As of transformers v4.44, default chat template is no longer allowed, so you "
                "must provide a chat template if the tokenizer does not define one.",
                "chat_template",
            )
        try:
            return render_chat(
                template,
                messages,  # type: ignore[arg-type]
                add_generation_prompt=add_generation_prompt,
                bos_token=self.tokenizer.bos_token,
                eos_token=self.tokenizer.eos_token,
                variables=cast(dict[str, Any], kwargs),
                max_output_chars=self.limits.max_chat_prompt_chars,
                timeout_s=self.limits.chat_template_render_timeout,
                timer=self.render_timer,
            )
        except ChatTemplateError as e:
            raise PromptError(str(e), "messages") from None

    def prompt_ids(self, req: GenerateRequest | TokenizeRequest) -> tuple[list[int], str | None]:
        """Token ids of the request's prompt, and its text where there is one."""
        if req.messages is not None:
            template = req.chat_template if isinstance(req, GenerateRequest) else None
            text = self.render(
                req.messages, template, req.add_generation_prompt, req.chat_template_kwargs
            )
            return self.tokenizer.encode(text, add_special_tokens=req.add_special_tokens), text
        if req.prompt is not None:
            return self.tokenizer.encode(
                req.prompt, add_special_tokens=req.add_special_tokens
            ), req.prompt
        ids = list(req.prompt_token_ids or []) if isinstance(req, GenerateRequest) else []
        bad = next((i for i in ids if not 0 <= i < self._vocab_size), None)
        if bad is not None:
            raise PromptError(f"Token id {bad} is out of vocabulary", "prompt")
        return ids, None

    def check_length(self, num_prompt_tokens: int, max_tokens: int | None) -> int:
        """The effective max_tokens, or PromptError with vLLM's message."""
        n, limit = num_prompt_tokens, self.max_model_len
        if n == 0:
            raise PromptError("The decoder prompt cannot be empty", "prompt")
        if max_tokens is None:
            if n >= limit:
                raise PromptError(
                    f"This model's maximum context length is {limit} tokens. However, your "
                    f"request has {n} input tokens. Please reduce the length of the input messages.",
                    "messages",
                )
            return limit - n
        if n + max_tokens > limit:
            raise PromptError(
                f"This model's maximum context length is {limit} tokens. However, you requested "
                f"{n + max_tokens} tokens ({n} in the messages, {max_tokens} in the completion). "
                "Please reduce the length of the messages or completion.",
                "max_tokens",
            )
        return max_tokens

    def pooling_prompt(self, ids: list[int], pooling: PoolingParams) -> list[int]:
        """An embedding's prompt: its last ``truncate_prompt_tokens`` tokens (-1: the last
        max_model_len), within max_model_len whole (no output follows); vLLM's messages."""
        limit, keep = self.max_model_len, pooling.truncate_prompt_tokens
        if keep is not None:
            if keep > limit:
                raise PromptError(
                    f"truncate_prompt_tokens value ({keep}) is greater than max_model_len "
                    f"({limit}). Please, select a smaller truncation size.",
                    "truncate_prompt_tokens",
                )
            ids = ids[-(limit if keep == -1 else keep) :]
        if not ids:
            raise PromptError("The decoder prompt cannot be empty", "input")
        if len(ids) > limit:
            raise PromptError(
                f"This model's maximum context length is {limit} tokens. However, you "
                f"requested {len(ids)} tokens in the input for embedding generation. Please "
                "reduce the length of the input.",
                "input",
            )
        return ids

    def check_structured_outputs(self, params: StructuredOutputsParams) -> None:
        """PromptError saying what is wrong unless the grammar engine takes the constraint
        (its syntax only: the scheduler compiles it against the vocabulary). The engine is
        imported on the first constrained request."""
        try:
            params.validate()
        except ValueError as e:
            raise PromptError(str(e)) from None
        constraint = constraint_of(params, self.structured_outputs)
        key = (constraint.kind, constraint.spec, constraint.any_whitespace)
        if key in self._checked:
            self._checked.move_to_end(key)
            error = self._checked[key]
        else:
            try:
                config = self.structured_outputs
                name = choose_backend(config.backend, constraint, not config.disable_fallback)
                check_constraint(name, constraint)
                error = None
            except GrammarError as e:
                error = str(e)
            self._checked[key] = error
            if len(self._checked) > _CHECKED_KEPT:
                self._checked.popitem(last=False)
        if error is not None:
            raise PromptError(error)

    def process(
        self, req: GenerateRequest
    ) -> tuple[TokenizedRequest, RequestOutputSpec] | RequestError:
        try:
            ids, text = self.prompt_ids(req)
            if req.pooling is not None:
                ids = self.pooling_prompt(ids, req.pooling)
                max_tokens = 1  # never sampled: the request ends with its prompt
            else:
                max_tokens = self.check_length(len(ids), req.sampling.max_tokens)
            for param in ("logprobs", "prompt_logprobs"):  # --max-logprobs -1: the vocabulary
                if (num := getattr(req.sampling, param) or 0) > self._vocab_size:
                    raise PromptError(
                        f"{param} must be at most the vocabulary size ({self._vocab_size}), "
                        f"got {num}.",
                        param,
                    )
            if (bad := req.sampling.out_of_vocab_token(self._vocab_size)) is not None:
                param, token_id = bad
                raise PromptError(
                    f"token id {token_id} in {param} is out of vocabulary "
                    f"(vocabulary size: {self._vocab_size})",
                    param,
                )
            if req.sampling.structured_outputs is not None:
                self.check_structured_outputs(req.sampling.structured_outputs)
            if req.kv_transfer_params and self.check_kv_transfer is not None:
                try:
                    self.check_kv_transfer(req.kv_transfer_params)
                except ValueError as e:
                    raise PromptError(str(e), "kv_transfer_params") from None
        except PromptError as e:
            return RequestError(req.req_id, 400, str(e), param=e.param)
        parser = self.structured_outputs.reasoning_parser
        sampling = msgspec.structs.replace(
            req.sampling,
            max_tokens=max_tokens,
            bad_words_token_ids=self.tokenizer.bad_words_token_ids(req.sampling.bad_words),
            # a chat answer's thinking, told from where the rendered prompt leaves it
            reasoning=prompt_reasoning(parser, text or "")
            if parser is not None and req.messages is not None
            else None,
        )
        if req.echo and text is None:
            text = self.tokenizer.decode(ids, skip_special_tokens=False)
        tokenized = TokenizedRequest(
            req_id=req.req_id,
            prompt_token_ids=ids,
            sampling=sampling,
            arrival_time=req.arrival_time,
            priority=req.priority,
            cache_salt=req.cache_salt,
            eos_token_id=self.tokenizer.eos_token_id,
            kv_transfer_params=req.kv_transfer_params,
            pooling=req.pooling,
        )
        if self.request_log is not None:
            self.request_log.inputs(req.req_id, text, ids, sampling)
        spec = RequestOutputSpec(
            req_id=req.req_id,
            sampling=sampling,
            num_prompt_tokens=len(ids),
            prompt_tail_ids=ids[-_PROMPT_TAIL:],
            prompt_text=text if req.echo else None,
            first_prompt_token_id=ids[0] if sampling.prompt_logprobs is not None else None,
            prompt_token_ids=list(ids) if req.return_token_ids else None,
        )
        return tokenized, spec

    def tokenize(self, req: TokenizeRequest) -> TokenizeResult | RequestError:
        try:
            ids, _ = self.prompt_ids(req)
        except PromptError as e:
            return RequestError(req.req_id, 400, str(e), param=e.param)
        strs = None
        if req.return_token_strs:
            strs = [self.tokenizer.tokenizer.id_to_token(i) or "" for i in ids]
        return TokenizeResult(req.req_id, ids, self.max_model_len, strs)

    def detokenize(self, req: DetokenizeRequest) -> DetokenizeResult | RequestError:
        bad = next((i for i in req.token_ids if not 0 <= i < self._vocab_size), None)
        if bad is not None:
            return RequestError(
                req.req_id, 400, f"Token id {bad} is out of vocabulary", param="tokens"
            )
        return DetokenizeResult(
            req.req_id, self.tokenizer.decode(req.token_ids, skip_special_tokens=False)
        )
