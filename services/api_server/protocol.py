"""OpenAI request schemas (pydantic), with vLLM's extra sampling fields.

Unknown fields are ignored, as vLLM does. Responses are built as plain dicts
in vLLM's shapes (the ``serving_*.py`` modules); only requests need validation.
It stays whole because it is the API's request schema: every body the api_server accepts,
with the checks that turn one into ``SamplingParams``, in one place (as vLLM's protocol.py).
"""

from __future__ import annotations

import functools
import json
import logging
from typing import Annotated, Any, Literal

import msgspec
from pydantic import BaseModel, ConfigDict, Field, model_validator

from services.api_server.tool_calls import named_schema, required_schema
from services.config import RequestLimits
from services.protocol import SamplingParams, StructuredOutputsParams

log = logging.getLogger(__name__)

_INT64 = 2**63  # integers travel as int64: larger ones are refused here, with a 400
TokenId = Annotated[int, Field(ge=0, lt=_INT64)]
Int64 = Annotated[int, Field(ge=-_INT64, lt=_INT64)]


class ParamError(ValueError):
    """A bad request parameter: a 400 whose error names ``param``."""

    def __init__(self, param: str | None, message: str) -> None:
        super().__init__(message)
        self.param = param


def check_template_trust(
    template: str | None, kwargs: dict[str, Any] | None, limits: RequestLimits
) -> None:
    """vLLM's rule: a request's own chat template (``chat_template``, or one in
    ``chat_template_kwargs``) is code from the client, rendered only if the server trusts it."""
    if limits.trust_request_chat_template:
        return
    if template is not None or (kwargs or {}).get("chat_template") is not None:
        raise ParamError(
            "chat_template",
            "Chat template is passed with request, but --trust-request-chat-template is not "
            "set. Refused request with untrusted chat template.",
        )


_IGNORED_LOGGED: set[str] = set()  # unknown field names already logged
_IGNORED_LOGGED_MAX = 1024  # (a client inventing names cannot grow it without end)


@functools.cache
def _known_fields(model: type[BaseModel]) -> frozenset[str]:
    """A request model's field names and aliases (once per class, not per request)."""
    return frozenset(model.model_fields) | {f.alias for f in model.model_fields.values() if f.alias}


class OpenAIBaseModel(BaseModel):
    """Unknown fields are ignored, as vLLM ignores them (``guided_json``, ``guided_choice``
    ... were removed from vLLM: ``structured_outputs`` took their place), and logged as
    vLLM logs them, once per field name."""

    model_config = ConfigDict(extra="ignore")

    @model_validator(mode="before")
    @classmethod
    def _log_ignored_fields(cls, data: Any) -> Any:
        if isinstance(data, dict) and cls.model_config.get("extra") == "ignore":
            known = _known_fields(cls)
            new = {k for k in data if isinstance(k, str) and k not in known} - _IGNORED_LOGGED
            if new and len(_IGNORED_LOGGED) < _IGNORED_LOGGED_MAX:
                _IGNORED_LOGGED.update(new)
                log.warning(
                    "The following fields were present in the request but ignored: %s",
                    sorted(new),
                )
        return data


class StreamOptions(OpenAIBaseModel):
    include_usage: bool | None = True
    continuous_usage_stats: bool | None = False


class StructuredOutputsRequest(OpenAIBaseModel):
    """vLLM's ``structured_outputs`` request field: one constraint (``json`` a schema, as an
    object or JSON text; ``structural_tag`` likewise)."""

    json_schema: dict[str, Any] | str | None = Field(default=None, alias="json")
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool | None = None
    structural_tag: dict[str, Any] | str | None = None
    disable_any_whitespace: bool = False
    unbounded_json: bool = False  # ours: vLLM's unbounded JSON (no whitespace/digit bounds)
    json_max_string_length: int | None = Field(default=None, ge=1, lt=_INT64)

    def params(self) -> StructuredOutputsParams:
        return StructuredOutputsParams(
            json=_as_text(self.json_schema),
            regex=self.regex,
            choice=self.choice,
            grammar=self.grammar,
            json_object=self.json_object,
            structural_tag=_as_text(self.structural_tag),
            disable_any_whitespace=self.disable_any_whitespace,
            unbounded_json=self.unbounded_json,
            json_max_string_length=self.json_max_string_length,
        )


def _options_only(params: StructuredOutputsParams) -> bool:
    return params.unbounded_json or params.json_max_string_length is not None


def _as_text(value: dict[str, Any] | str | None) -> str | None:
    return json.dumps(value) if isinstance(value, dict) else value


class JsonSchemaFormat(OpenAIBaseModel):
    name: str | None = None
    description: str | None = None
    json_schema: dict[str, Any] | None = Field(default=None, alias="schema")
    strict: bool | None = None


class ResponseFormat(OpenAIBaseModel):
    """OpenAI's ``response_format``, and vLLM's ``structural_tag`` type (``format``, or
    ``structures`` and ``triggers``, kept as given for the grammar engine)."""

    model_config = ConfigDict(extra="allow")
    type: Literal["text", "json_object", "json_schema", "structural_tag"]
    json_schema: JsonSchemaFormat | None = None

    def params(self) -> StructuredOutputsParams | None:
        if self.type == "text":
            return None
        if self.type == "json_object":
            return StructuredOutputsParams(json_object=True)
        if self.type == "json_schema":
            if self.json_schema is None:
                raise ParamError(
                    "response_format",
                    "When response_format type is 'json_schema', the 'json_schema' field must "
                    "be provided.",
                )
            if self.json_schema.json_schema is None:  # no schema: any JSON object (OpenAI's)
                return StructuredOutputsParams(json_object=True)
            return StructuredOutputsParams(json=json.dumps(self.json_schema.json_schema))
        tag = self.model_dump(exclude={"json_schema"}, exclude_none=True)
        return StructuredOutputsParams(structural_tag=json.dumps(tag))


class _SamplingFields(OpenAIBaseModel):
    """Fields shared by completions and chat: OpenAI's, then vLLM's extras."""

    model: str | None = None
    n: Int64 = 1
    seed: Int64 | None = None
    stop: str | list[str] | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    temperature: float | None = None
    top_p: float | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    # vLLM extras
    top_k: Int64 | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    stop_token_ids: list[Int64] | None = None
    ignore_eos: bool = False
    min_tokens: Int64 = 0
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    cache_salt: str | None = None
    priority: Int64 = 0
    prompt_logprobs: Int64 | None = None
    request_id: str | None = None  # the response id's suffix; an X-Request-Id header wins
    logit_bias: dict[str, float] | None = None  # OpenAI's: token id (as a string) -> bias
    return_token_ids: bool = False  # vLLM's: prompt and output token ids in the response
    bad_words: list[str] | None = None  # vLLM's: words never to generate
    kv_transfer_params: dict[str, Any] | None = None  # vLLM's: PD disaggregation (pd-proxy)
    allowed_token_ids: list[TokenId] | None = None
    response_format: ResponseFormat | None = None  # OpenAI's (vLLM takes it on completions too)
    structured_outputs: StructuredOutputsRequest | None = None  # vLLM's

    def structured_outputs_params(self) -> StructuredOutputsParams | None:
        """The request's output constraint: ``structured_outputs``, with ``response_format``
        merged in as vLLM merges it (both set: two kinds, refused by ``validate``)."""
        given = self.structured_outputs.params() if self.structured_outputs else None
        implied = self.response_format.params() if self.response_format else None
        if implied is None:
            if given is not None and not given.kinds() and _options_only(given):
                return None  # our JSON options alone constrain nothing (vLLM's empty field: 400)
            return given
        if given is None:
            return implied
        merged = {f: getattr(given, f) for f in given.__struct_fields__}
        merged.update({k: v for k, v in msgspec.structs.asdict(implied).items() if v})
        return StructuredOutputsParams(**merged)

    def sampling_params(
        self, max_tokens: int | None, logprobs: int | None, prompt_logprobs: int | None = None
    ) -> SamplingParams:
        stop = [self.stop] if isinstance(self.stop, str) else list(self.stop or [])
        return SamplingParams(
            n=self.n,
            temperature=1.0 if self.temperature is None else self.temperature,
            top_p=1.0 if self.top_p is None else self.top_p,
            top_k=0 if self.top_k is None else self.top_k,
            min_p=0.0 if self.min_p is None else self.min_p,
            seed=self.seed,
            presence_penalty=self.presence_penalty,
            frequency_penalty=self.frequency_penalty,
            repetition_penalty=1.0 if self.repetition_penalty is None else self.repetition_penalty,
            max_tokens=max_tokens,
            min_tokens=self.min_tokens,
            stop=stop,
            stop_token_ids=list(self.stop_token_ids or []),
            ignore_eos=self.ignore_eos,
            logprobs=logprobs,
            prompt_logprobs=prompt_logprobs,
            logit_bias=self._logit_bias(),
            allowed_token_ids=self.allowed_token_ids,
            bad_words=list(self.bad_words or []),
            skip_special_tokens=self.skip_special_tokens,
            include_stop_str_in_output=self.include_stop_str_in_output,
            structured_outputs=self.structured_outputs_params(),
        )

    def _logit_bias(self) -> dict[int, float]:
        """Token ids as ints, biases clamped to [-100, 100] (OpenAI's range, as vLLM does)."""
        bias: dict[int, float] = {}
        for key, value in (self.logit_bias or {}).items():
            try:
                token_id = int(key)
                if not 0 <= token_id < _INT64:
                    raise ValueError
            except ValueError:
                raise ParamError(
                    "logit_bias",
                    f"Found token_id `{key}` in logit_bias but token_id must be an integer "
                    "or string representing an integer",
                ) from None
            bias[token_id] = min(100.0, max(-100.0, value))
        return bias

    def check(self, limits: RequestLimits) -> None:
        """Cross-field checks pydantic cannot express, and the server's ``limits``."""
        if self.stream_options is not None and not self.stream:
            raise ParamError(
                "stream_options", "Stream options can only be defined when `stream=True`."
            )
        if not 1 <= self.n <= limits.max_n:
            raise ParamError("n", f"n must be in [1, {limits.max_n}], got {self.n}.")
        stops = [self.stop] if isinstance(self.stop, str) else self.stop or []
        for param, words in (("stop", stops), ("bad_words", self.bad_words or [])):
            if len(words) > limits.max_stop_strings:
                raise ParamError(
                    param,
                    f"{param} has {len(words)} strings; this server takes at most "
                    f"{limits.max_stop_strings} (--max-stop-strings).",
                )
        if self.cache_salt is not None and not self.cache_salt:
            raise ParamError(
                "cache_salt", "Parameter 'cache_salt' must be a non-empty string if provided."
            )
        if self.kv_transfer_params and self.n != 1:
            # One set of params names one prompt's KV: n choices would share it.
            raise ParamError("kv_transfer_params", "kv_transfer_params works with n=1 only.")
        if self.stream and self.prompt_logprobs:
            raise ParamError(
                "prompt_logprobs", "`prompt_logprobs` are not available when `stream=True`."
            )


TokenIds = list[TokenId]


class CompletionRequest(_SamplingFields):
    prompt: str | list[str] | TokenIds | list[TokenIds]
    max_tokens: Int64 | None = 16
    echo: bool = False
    logprobs: Int64 | None = None
    add_special_tokens: bool = True

    @property
    def echo_only(self) -> bool:
        """``echo`` with ``max_tokens`` 0: return the prompt (and its logprobs), generate nothing
        (one token is still sampled and dropped, as vLLM does)."""
        return self.echo and self.max_tokens == 0

    def completion_sampling_params(self) -> SamplingParams:
        # With echo, the prompt's logprobs are part of the logprobs returned (vLLM's rule).
        prompt_logprobs = self.prompt_logprobs
        if prompt_logprobs is None and self.echo:
            prompt_logprobs = self.logprobs
        max_tokens = 1 if self.echo_only else self.max_tokens
        return self.sampling_params(max_tokens, self.logprobs, prompt_logprobs)

    def prompts(self) -> list[str | list[int]]:
        """The batch of prompts: each a string or a list of token ids."""
        p = self.prompt
        if isinstance(p, str):
            return [p]
        if not p:
            raise ParamError("prompt", "prompt must not be empty.")
        if all(isinstance(x, int) for x in p):
            return [list(p)]  # type: ignore[arg-type]
        return list(p)  # type: ignore[arg-type]


class TextContentPart(OpenAIBaseModel):
    type: Literal["text"]
    text: str


class FunctionCallParam(OpenAIBaseModel):
    name: str
    arguments: str | None = None


class ToolCallParam(OpenAIBaseModel):
    """A call in an assistant message the client sends back (OpenAI's shape)."""

    id: str | None = None
    type: Literal["function"] = "function"
    function: FunctionCallParam


class ChatMessage(OpenAIBaseModel):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextContentPart] | None = None
    name: str | None = None
    tool_call_id: str | None = None
    tool_calls: list[ToolCallParam] | None = None

    def to_template(self) -> dict[str, object]:
        """The message as a chat template sees it (vLLM's): text parts joined with newlines,
        no content as "", and each tool call's ``arguments`` parsed from JSON into a dict."""
        content = self.content
        if isinstance(content, list):
            content = "\n".join(part.text for part in content)
        msg: dict[str, object] = {"role": self.role, "content": content or ""}
        if self.name is not None:
            msg["name"] = self.name
        if self.tool_call_id is not None:
            msg["tool_call_id"] = self.tool_call_id
        if self.tool_calls:
            msg["tool_calls"] = [
                {
                    "id": call.id,
                    "type": call.type,
                    "function": {
                        "name": call.function.name,
                        "arguments": _arguments(call.function.arguments),
                    },
                }
                for call in self.tool_calls
            ]
        return msg


def _arguments(text: str | None) -> Any:
    if not text:
        return {}
    try:
        return json.loads(text)
    except ValueError:
        raise ParamError(
            "messages", f"tool call arguments must be JSON, got {text[:100]!r}"
        ) from None


class FunctionDefinition(OpenAIBaseModel):
    name: str
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class ToolParam(OpenAIBaseModel):
    type: Literal["function"] = "function"
    function: FunctionDefinition


_NAMED_USAGE = ' Correct usage: `{"type": "function", "function": {"name": "my_function"}}`'


class ChatCompletionRequest(_SamplingFields):
    messages: list[ChatMessage]
    max_tokens: Int64 | None = None  # deprecated by OpenAI in favour of max_completion_tokens
    max_completion_tokens: Int64 | None = None
    logprobs: bool = False
    top_logprobs: Int64 | None = None
    add_generation_prompt: bool = True
    add_special_tokens: bool = False  # the template already adds BOS
    chat_template: str | None = None
    chat_template_kwargs: dict[str, Any] | None = None
    tools: list[ToolParam] | None = None
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = True

    def check(self, limits: RequestLimits, tool_call_parser: str | None = None) -> None:
        """``tool_call_parser``: the server's ``--tool-call-parser`` when
        ``--enable-auto-tool-choice`` is on, else None."""
        super().check(limits)
        check_template_trust(self.chat_template, self.chat_template_kwargs, limits)
        if not self.messages:
            raise ParamError("messages", "messages must contain at least one message.")
        if self.top_logprobs is not None and self.top_logprobs > 0 and not self.logprobs:
            raise ParamError(
                "top_logprobs", "when using `top_logprobs`, `logprobs` must be set to true."
            )
        self._check_tools(tool_call_parser)

    def _check_tools(self, parser: str | None) -> None:
        """vLLM's rules for ``tools`` and ``tool_choice``, in its order and words."""
        if self.tools is not None and not self.tools:
            raise ParamError(
                "tools",
                "`tools` must not be an empty array. Either provide at least one tool or omit "
                "the field entirely.",
            )
        choice = self.tool_choice
        if choice is None:  # left out: "auto" with tools (vLLM's); an explicit null: "none"
            given = "tool_choice" in self.model_fields_set
            choice = self.tool_choice = "auto" if self.tools and not given else "none"
        if choice == "none":
            return
        if not self.tools:
            raise ParamError("tool_choice", "When using `tool_choice`, `tools` must be set.")
        if isinstance(choice, dict):
            function = choice.get("function")
            if not isinstance(function, dict):
                raise ParamError(
                    "tool_choice",
                    f"Invalid value for `function`: `{function}` in `tool_choice`!" + _NAMED_USAGE,
                )
            if "name" not in function:
                raise ParamError(
                    "tool_choice",
                    "Expected field `name` in `function` in `tool_choice`!" + _NAMED_USAGE,
                )
            name = function["name"]
            if not isinstance(name, str) or not name:
                raise ParamError(
                    "tool_choice",
                    f"Invalid `name` in `function`: `{name}` in `tool_choice`!" + _NAMED_USAGE,
                )
            if name not in [t.function.name for t in self.tools]:
                raise ParamError(
                    "tool_choice",
                    "The tool specified in `tool_choice` does not match any of the specified "
                    "`tools`",
                )
        elif choice not in ("auto", "required"):
            raise ParamError(
                "tool_choice",
                f'Invalid value for `tool_choice`: {choice}! Only named tools, "none", '
                '"auto" or "required" are supported.',
            )
        if choice == "auto" and parser is None:
            raise ParamError(
                "tool_choice",
                '"auto" tool choice requires --enable-auto-tool-choice and --tool-call-parser '
                "to be set",
            )
        constrained = (
            self.structured_outputs is not None and self.structured_outputs.params().kinds()
        )
        if choice != "auto" and constrained:  # (its options alone, json bounds, are no constraint)
            raise ParamError(
                "structured_outputs",
                "You can only either use constraints for structured outputs or tools, not both.",
            )

    @property
    def forced_tool(self) -> str | None:
        """``"required"``, or the named function's name; None when the model chooses (checked
        requests only)."""
        if isinstance(self.tool_choice, dict):
            return str(self.tool_choice["function"]["name"])
        return "required" if self.tool_choice == "required" and self.tools else None

    def tool_dicts(self) -> list[dict[str, Any]]:
        return [t.model_dump(exclude_none=True) for t in self.tools or []]

    def structured_outputs_params(self) -> StructuredOutputsParams | None:
        """A forced tool call is a JSON schema on the output (``response_format`` is then
        dropped, as vLLM drops it)."""
        forced = self.forced_tool
        if forced is None:
            return super().structured_outputs_params()
        tools = self.tool_dicts()
        try:
            if forced == "required":
                schema = required_schema(tools, parallel=self.parallel_tool_calls is not False)
            else:
                schema = named_schema(tools, forced)
        except ValueError as e:
            raise ParamError("tools", str(e)) from None
        tool_json = StructuredOutputsParams(json=json.dumps(schema))
        if self.structured_outputs is not None:  # its options (json bounds) apply to it too
            options = self.structured_outputs.params()
            return msgspec.structs.replace(
                tool_json,
                unbounded_json=options.unbounded_json,
                json_max_string_length=options.json_max_string_length,
            )
        return tool_json

    def template(self) -> str | None:
        """The request's own chat template (vLLM also takes one in ``chat_template_kwargs``);
        rendered only where ``check_template_trust`` let it through."""
        given = (self.chat_template_kwargs or {}).get("chat_template")
        return self.chat_template or (given if isinstance(given, str) else None)

    def template_kwargs(self, exclude_tools_when_none: bool = False) -> dict[str, Any]:
        """Extra chat-template variables: the request's own, and ``tools`` when given (not
        with ``tool_choice: "none"`` under ``--exclude-tools-when-tool-choice-none``)."""
        kwargs = dict(self.chat_template_kwargs or {})
        kwargs.pop("chat_template", None)
        if self.tools and not (exclude_tools_when_none and self.tool_choice == "none"):
            kwargs["tools"] = self.tool_dicts()
        return kwargs

    @property
    def num_logprobs(self) -> int | None:
        return (self.top_logprobs or 0) if self.logprobs else None


class TokenizeCompletionRequest(OpenAIBaseModel):
    model: str | None = None
    prompt: str
    add_special_tokens: bool = True
    return_token_strs: bool = False


class TokenizeChatRequest(OpenAIBaseModel):
    model: str | None = None
    messages: list[ChatMessage]
    add_generation_prompt: bool = True
    add_special_tokens: bool = False
    return_token_strs: bool = False
    chat_template_kwargs: dict[str, Any] | None = None
    tools: list[ToolParam] | None = None  # shown to the chat template, as in a chat request

    def template_kwargs(self) -> dict[str, Any]:
        kwargs = dict(self.chat_template_kwargs or {})
        if self.tools:
            kwargs["tools"] = [t.model_dump(exclude_none=True) for t in self.tools]
        return kwargs


class DetokenizeRequest(OpenAIBaseModel):
    model: str | None = None
    tokens: TokenIds
