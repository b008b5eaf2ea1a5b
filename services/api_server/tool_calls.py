"""Tool calls in chat completions (issue 17): from generated text to OpenAI's ``tool_calls``.

How a request's tools are called depends on ``tool_choice``:

- a named function: the grammar makes the output that function's arguments (a JSON object
  following its ``parameters`` schema); the whole text is one call's ``arguments``;
- ``"required"``: the grammar makes the output a JSON array of ``{"name": ...,
  "parameters": {...}}`` objects (``required_schema``), one per call, at least one;
- ``"auto"``: the model writes what it likes; a parser registered by name
  (``--tool-call-parser``, vLLM's flag) finds the calls in it: ``hermes``
  (``<tool_call>{"name": ..., "arguments": {...}}</tool_call>``) or ``llama3_json``
  (``{"name": ..., "parameters": {...}}`` objects, optionally after ``<|python_tag|>``,
  separated by ``;``).

Each is a ``CallStream``: fed the text of one choice as it arrives, it returns events:
content to show, the start of a call (its index, id and name), and pieces of a call's
arguments as the model writes them, so streamed and whole responses are built from the
same events and always agree. Arguments are the model's own JSON text, not re-serialised.
It stays whole because the parsers, the schemas that force calls and ``ToolCalling`` (what a
request asked for) share one event model and one JSON scanner.
"""

from __future__ import annotations

import json
import re
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, ClassVar

import msgspec

from services.protocol import SamplingParams
from services.registry import TOOL_CALL_PARSERS, load


def tool_call_id() -> str:
    """vLLM's form of a tool call id."""
    return f"chatcmpl-tool-{uuid.uuid4().hex}"


@dataclass
class Content:
    text: str


@dataclass
class CallStart:
    index: int
    id: str
    name: str


@dataclass
class CallArguments:
    index: int
    text: str


Event = Content | CallStart | CallArguments


@dataclass
class ToolCall:
    id: str
    name: str
    arguments: str = ""

    def to_json(self) -> dict[str, Any]:
        return {
            "id": self.id,
            "type": "function",
            "function": {"name": self.name, "arguments": self.arguments},
        }


@dataclass
class CallStream:
    """The events of one choice's text; ``calls`` and ``content`` accumulate them."""

    # False where the format's tags may be special tokens that must stay in the text
    skip_special_tokens: ClassVar[bool] = True

    calls: list[ToolCall] = field(default_factory=list)
    content: list[str] = field(default_factory=list)

    def feed(self, text: str) -> list[Event]:
        raise NotImplementedError

    def finish(self) -> list[Event]:
        """The end of the text: whatever was held back."""
        return []

    def record(self, events: list[Event]) -> list[Event]:
        for e in events:
            if isinstance(e, Content):
                self.content.append(e.text)
            elif isinstance(e, CallStart):
                self.calls.append(ToolCall(e.id, e.name))
            else:
                self.calls[e.index].arguments += e.text
        return events


# ---------------------------------------------------------------- JSON call objects


class _ObjectScanner:
    """Follows a stream of JSON objects ``{"name": "...", "arguments" | "parameters": {...}}``
    character by character: reports each call's name once its string is complete, and the
    raw text of its arguments value as it streams (the first such value; a call with none
    gets ``{}``). Anything between objects is passed to ``between`` (the caller decides:
    separators, content, or nothing). Text that is not JSON never raises."""

    _ARGUMENT_KEYS = ("arguments", "parameters")

    def __init__(self) -> None:
        self.index = -1  # the last call started
        self._start_object()
        self.depth = 0  # outside any object until a "{"

    def _start_object(self) -> None:
        self.key: str | None = None  # the key whose value is being read, at depth 1
        self.depth, self.expect_key = 1, True
        self.in_string = self.escape = False
        self.token: list[str] = []  # a key or the name being read
        self.in_value = False  # inside the arguments value
        self.arguments_done = False  # an arguments value was read (later ones are ignored)
        self.arguments_started = False
        self.name: str | None = None
        self.pending_arguments: list[str] = []  # read before the name

    def reset(self) -> None:
        """Drop a partly read object (its text ended early); call indexes go on."""
        self.depth, self.in_string, self.escape, self.in_value = 0, False, False, False

    def _string_char(self, ch: str) -> bool:
        """Track strings; True while ``ch`` is inside one (or closes it)."""
        if self.in_string:
            if self.escape:
                self.escape = False
            elif ch == "\\":
                self.escape = True
            elif ch == '"':
                self.in_string = False
            return True
        if ch == '"':
            self.in_string = True
            return True
        return False

    def feed(self, text: str, between: Callable[[str], list[Event]]) -> list[Event]:
        events: list[Event] = []
        for ch in text:
            if self.depth == 0:
                if ch == "{":
                    self._start_object()
                else:
                    events += between(ch)
                continue
            events += self._object_char(ch)
        return events

    def _object_char(self, ch: str) -> list[Event]:
        was_string = self.in_string
        quoted = self._string_char(ch)
        if self.in_value:  # the arguments value: every character of it goes out
            if not quoted and self.depth == 1 and ch in ",}":  # it ended; ch is the object's
                self.in_value, self.arguments_done = False, True
                if ch == "}":
                    return self._end_object()
                self.expect_key = True
                return []
            self._nest(ch, quoted)
            events = self._arguments(ch)
            if self.depth == 1 and not quoted and ch in "}]":  # its object or array closed
                self.in_value, self.arguments_done = False, True
            return events
        if self.depth > 1:  # another key's nested value: skipped
            self._nest(ch, quoted)
            return []
        if quoted:  # depth 1: a key, or the name's value
            if was_string and not self.in_string:  # the string just closed
                word = _json_string("".join(self.token))
                self.token = []
                if self.expect_key:
                    self.key, self.expect_key = word, False
                elif self.key == "name" and self.name is None:
                    self.name = word
                    return self._named()
            elif was_string:
                self.token.append(ch)
            return []
        if ch == ":" and self.key in self._ARGUMENT_KEYS and not self.arguments_done:
            self.in_value = True
        elif ch == ",":
            self.expect_key = True
        elif ch == "}":
            return self._end_object()
        else:
            self._nest(ch, quoted)
        return []

    def _nest(self, ch: str, quoted: bool) -> None:
        if not quoted:
            if ch in "{[":
                self.depth += 1
            elif ch in "}]":
                self.depth -= 1

    def _arguments(self, ch: str) -> list[Event]:
        if not self.arguments_started and ch.isspace():
            return []  # whitespace before the value starts
        self.arguments_started = True
        if self.name is None:
            self.pending_arguments.append(ch)
            return []
        return [CallArguments(self.index, ch)]

    def _named(self) -> list[Event]:
        assert self.name is not None
        self.index += 1
        events: list[Event] = [CallStart(self.index, tool_call_id(), self.name)]
        if self.pending_arguments:
            events.append(CallArguments(self.index, "".join(self.pending_arguments)))
            self.pending_arguments = []
        return events

    def _end_object(self) -> list[Event]:
        self.depth = 0
        if self.name is not None and not self.arguments_started:
            return [CallArguments(self.index, "{}")]  # a call without arguments
        return []


def _json_string(raw: str) -> str:
    """A JSON string's body decoded, as well as it goes (the model may write anything):
    invalid escapes stay as written, lone surrogates become U+FFFD."""
    try:
        text = json.loads('"' + raw + '"', strict=False)
    except ValueError:
        text = raw
    return _SURROGATE.sub("\ufffd", str(text))


_SURROGATE = re.compile("[\ud800-\udfff]")


def _merge(events: list[Event]) -> list[Event]:
    """Adjacent pieces of the same kind as one event (one chunk per feed, not per char)."""
    merged: list[Event] = []
    for e in events:
        last = merged[-1] if merged else None
        if (
            isinstance(e, Content)
            and isinstance(last, Content)
            or isinstance(e, CallArguments)
            and isinstance(last, CallArguments)
            and (last.index == e.index)
        ):
            last.text += e.text
        else:
            merged.append(e)
    return merged


# ---------------------------------------------------------------- tool_choice forms


class NamedCall(CallStream):
    """A named function: the whole output is its arguments."""

    def __init__(self, name: str) -> None:
        super().__init__()
        self.name = name
        self.started = False

    def feed(self, text: str) -> list[Event]:
        events: list[Event] = []
        if not self.started:
            self.started = True
            events.append(CallStart(0, tool_call_id(), self.name))
        if text:
            events.append(CallArguments(0, text))
        return self.record(events)


class RequiredCalls(CallStream):
    """``"required"``: a JSON array of ``{"name", "parameters"}`` objects."""

    def __init__(self) -> None:
        super().__init__()
        self.scanner = _ObjectScanner()

    def feed(self, text: str) -> list[Event]:
        return self.record(_merge(self.scanner.feed(text, lambda ch: [])))


class HermesCalls(CallStream):
    """``<tool_call>{"name": ..., "arguments": {...}}</tool_call>``: content is the text
    before the first call (vLLM's); a tagged region with no call in it is content too,
    shown once the region ends (held back until then)."""

    START, END = "<tool_call>", "</tool_call>"
    skip_special_tokens = False  # vLLM's: some tokenizers make the tags special tokens

    def __init__(self) -> None:
        super().__init__()
        self.scanner = _ObjectScanner()
        self.held = ""  # text that may be the start of a tag
        self.inside = False
        self.region: list[str] = []  # the raw text of the tagged region being read
        self.region_calls = 0  # calls started in it
        self.found = False  # a call started anywhere

    def feed(self, text: str) -> list[Event]:
        events: list[Event] = []
        text = self.held + text
        self.held = ""
        while text:
            tag = self.END if self.inside else self.START
            at = text.find(tag)
            if at < 0:
                keep = _partial_suffix(text, tag)
                body, self.held = text[: len(text) - keep], text[len(text) - keep :]
                events += self._body(body)
                break
            events += self._body(text[:at])
            text = text[at + len(tag) :]
            if self.inside:
                events += self._end_region(closed=True)
            else:
                self.region, self.region_calls = [], 0
            self.inside = not self.inside
        return self.record(_merge(events))

    def _body(self, text: str) -> list[Event]:
        if not self.inside:
            return [Content(text)] if text and not self.found else []
        self.region.append(text)
        events = self.scanner.feed(text, lambda ch: [])
        self.region_calls += sum(isinstance(e, CallStart) for e in events)
        self.found = self.found or self.region_calls > 0
        return events

    def _end_region(self, closed: bool) -> list[Event]:
        """A tagged region ended: with no call in it, its text is content (before any call;
        after one, like any text there, dropped). A call cut short stays as far as it went
        (its deltas are out): its arguments are not valid JSON."""
        self.scanner.reset()
        if self.found:
            return []
        return [Content(self.START + "".join(self.region) + (self.END if closed else ""))]

    def finish(self) -> list[Event]:
        held, self.held = self.held, ""
        if self.inside:
            self.region.append(held)
            return self.record(self._end_region(closed=False))
        return self.record([Content(held)] if held and not self.found else [])


class Llama3JsonCalls(CallStream):
    """Llama 3's JSON tool calls: the output is ``{"name": ..., "parameters": {...}}``
    objects (after an optional ``<|python_tag|>``, separated by ``;``), or plain content.
    Output that looks like calls but has none (a JSON answer) is content, at the end."""

    TAG = "<|python_tag|>"

    def __init__(self) -> None:
        super().__init__()
        self.scanner = _ObjectScanner()
        self.mode: str | None = None  # "calls" or "content", once the output shows which
        self.head = ""  # all the text, while it may still be content

    def feed(self, text: str) -> list[Event]:
        if self.mode == "content":
            return self.record([Content(text)] if text else [])
        self.head += text
        if self.mode is None:
            stripped = self.head.lstrip()
            if not stripped or (self.TAG.startswith(stripped) and stripped != self.TAG):
                return []
            if stripped.startswith(self.TAG):
                self.mode, text = "calls", stripped[len(self.TAG) :]
            elif stripped.startswith("{"):
                self.mode, text = "calls", stripped
            else:
                self.mode = "content"
                return self.record([Content(self.head)])
        return self.record(_merge(self.scanner.feed(text, lambda ch: [])))

    def finish(self) -> list[Event]:
        if self.mode != "content" and self.head and not self.calls:
            return self.record([Content(self.head)])
        return []


def _partial_suffix(text: str, tag: str) -> int:
    """The length of the longest end of ``text`` that begins ``tag``."""
    for n in range(min(len(tag) - 1, len(text)), 0, -1):
        if text.endswith(tag[:n]):
            return n
    return 0


def parser_class(name: str) -> type[CallStream]:
    """The ``--tool-call-parser`` registered as ``name`` (services/registry.py)."""
    cls: type[CallStream] = load("tool call parser", TOOL_CALL_PARSERS, name)
    return cls


# ---------------------------------------------------------------- request side


def function_names(tools: list[dict[str, Any]]) -> list[str]:
    return [t["function"]["name"] for t in tools]


def parameters_schema(tool: dict[str, Any]) -> dict[str, Any]:
    """A function's ``parameters``; none (or ``{}``) is an object with no properties."""
    params = tool["function"].get("parameters")
    return params if params else {"type": "object", "properties": {}}


def named_schema(tools: list[dict[str, Any]], name: str) -> dict[str, Any]:
    return parameters_schema(next(t for t in tools if t["function"]["name"] == name))


def required_schema(tools: list[dict[str, Any]], parallel: bool = True) -> dict[str, Any]:
    """One or more calls of the given functions, each ``{"name", "parameters"}`` with that
    function's parameters (vLLM's schema for ``tool_choice: "required"``); exactly one
    without ``parallel`` (``parallel_tool_calls: false``, which vLLM only applies by
    dropping the calls after the first). The functions' ``$defs`` move to the top, where
    their ``#/$defs/...`` references point; ``ValueError`` if two define one differently."""
    defs: dict[str, Any] = {}
    items = []
    for tool in tools:
        params = dict(parameters_schema(tool))
        for name, definition in (params.pop("$defs", None) or {}).items():
            if defs.setdefault(name, definition) != definition:
                raise ValueError(
                    f"Tool definition '{name}' has multiple schemas, which is not supported."
                )
        items.append({
            "type": "object",
            "properties": {"name": {"type": "string", "enum": [tool["function"]["name"]]},
                           "parameters": params},
            "required": ["name", "parameters"],
        })  # fmt: skip
    schema: dict[str, Any] = {
        "type": "array",
        "minItems": 1,
        **({} if parallel else {"maxItems": 1}),
        "items": {"anyOf": items},
    }
    if defs:
        schema["$defs"] = defs
    return schema


@dataclass(frozen=True)
class ToolCalling:
    """How one chat request's choices turn into tool calls: ``forced`` is ``"required"``,
    a function's name, or None (``"auto"``: ``parser`` finds the calls)."""

    forced: str | None
    parser: str | None
    parallel: bool = True

    def sampling(self, params: SamplingParams) -> SamplingParams:
        """The request's sampling as its parser needs it (special tokens kept for hermes)."""
        parser = parser_class(self.parser) if self.forced is None and self.parser else None
        if parser is not None and not parser.skip_special_tokens:
            return msgspec.structs.replace(params, skip_special_tokens=False)
        return params

    def stream(self) -> CallStream:
        if self.forced == "required":
            return RequiredCalls()
        if self.forced is not None:
            return NamedCall(self.forced)
        assert self.parser is not None
        return parser_class(self.parser)()

    def finish_reason(self, made_calls: bool, engine_reason: str | None) -> str | None:
        """vLLM's: "tool_calls" when calls were made and the output ended by itself, except
        for a named function (the caller asked for that one call: "stop")."""
        named = self.forced not in (None, "required")
        return (
            "tool_calls" if made_calls and not named and engine_reason == "stop" else engine_reason
        )

    def calls(self, stream: CallStream) -> list[ToolCall]:
        return stream.calls if self.parallel else stream.calls[:1]

    def content(self, stream: CallStream) -> str | None:
        """The message's content: "" with a forced call; what the parser left, or None when
        it found calls and nothing else (vLLM's)."""
        text = "".join(stream.content)
        if self.forced is None and stream.calls and not text:
            return None
        return text
