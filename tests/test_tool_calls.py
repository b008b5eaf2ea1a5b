"""Tool calls found in generated text (services/api_server/tool_calls.py).

Each form is checked against ``json`` on the whole text: the calls' names and arguments
(parsed) are what the text says, whatever pieces the text arrives in (a stream splits it
anywhere: inside a tag, a string, an escape), and any text at all is handled without an
exception.
"""

from __future__ import annotations

import json

import jsonschema
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from services.api_server.tool_calls import (
    TOOL_CALL_PARSERS,
    CallArguments,
    CallStart,
    Content,
    HermesCalls,
    Llama3JsonCalls,
    NamedCall,
    RequiredCalls,
    ToolCalling,
    parser_class,
    required_schema,
)
from services.config import ConfigError

CALLS = [
    ("get_weather", {"city": 'Paris, "FR"', "days": [1, {"a": "}]"}], "note": "a\\b"}),
    ("add", {"a": 1, "b": -2.5}),
    ("noop", {}),
]


def feed_in_pieces(stream, text: str, cuts: list[int]):
    """Feed ``text`` split at ``cuts``; returns the events, checked to rebuild the calls."""
    events = []
    last = 0
    for cut in sorted(set(c for c in cuts if 0 < c < len(text))):
        events += stream.feed(text[last:cut])
        last = cut
    events += stream.feed(text[last:])
    events += stream.finish()
    # The events alone say the same as the stream's record of them.
    rebuilt: dict[int, list[str]] = {}
    names: dict[int, str] = {}
    for e in events:
        if isinstance(e, CallStart):
            names[e.index] = e.name
            rebuilt[e.index] = []
        elif isinstance(e, CallArguments):
            rebuilt[e.index].append(e.text)
    assert [(names[i], "".join(rebuilt[i])) for i in sorted(names)] == [
        (c.name, c.arguments) for c in stream.calls
    ]
    assert "".join(e.text for e in events if isinstance(e, Content)) == "".join(stream.content)
    return stream


def parsed(stream) -> list[tuple[str, object]]:
    return [(c.name, json.loads(c.arguments)) for c in stream.calls]


cuts = st.lists(st.integers(0, 400), max_size=40)
indents = st.sampled_from([None, 1, 4])


@given(cuts=cuts, indent=indents)
def test_required_calls_any_layout_any_pieces(cuts, indent):
    text = json.dumps([{"name": n, "parameters": p} for n, p in CALLS], indent=indent)
    stream = feed_in_pieces(RequiredCalls(), text, cuts)
    assert parsed(stream) == CALLS and stream.content == []
    for call in stream.calls:  # the model's own text, with no whitespace around it
        assert call.arguments == call.arguments.strip()


@given(cuts=cuts)
def test_hermes_content_then_calls(cuts):
    text = (
        "Let me check.\n"
        + "\n".join(
            f"<tool_call>\n{json.dumps({'name': n, 'arguments': p})}\n</tool_call>"
            for n, p in CALLS
        )
        + "\nanything after the calls is dropped"
    )
    stream = feed_in_pieces(HermesCalls(), text, cuts)
    assert parsed(stream) == CALLS
    assert "".join(stream.content) == "Let me check.\n"


@given(cuts=cuts)
def test_hermes_without_calls_is_all_content(cuts):
    text = "No tools needed: 2 < 3 and <tool_ is not a tag. <tool_call"
    stream = feed_in_pieces(HermesCalls(), text, cuts)
    assert stream.calls == [] and "".join(stream.content) == text


@given(cuts=cuts, tag=st.booleans())
def test_llama3_json_calls(cuts, tag):
    text = ("<|python_tag|>" if tag else " ") + "; ".join(
        json.dumps({"name": n, "parameters": p}) for n, p in CALLS
    )
    stream = feed_in_pieces(Llama3JsonCalls(), text, cuts)
    assert parsed(stream) == CALLS and stream.content == []


@given(cuts=cuts)
def test_llama3_json_plain_answer_is_content(cuts):
    text = "The answer is {42}."
    stream = feed_in_pieces(Llama3JsonCalls(), text, cuts)
    assert stream.calls == [] and "".join(stream.content) == text


@given(cuts=cuts)
def test_named_call_is_the_whole_output(cuts):
    text = json.dumps(CALLS[0][1], indent=2)
    stream = feed_in_pieces(NamedCall("get_weather"), text, cuts)
    assert parsed(stream) == [CALLS[0]]


PIECES = [*'{}[]",:\\ ab<>/_|', "<tool_call>", "</tool_call>", '"name"', '"arguments"',
          '"parameters"', "<|python_tag|>", ": ", '{"name": "f", "arguments": ', "\n", "\\q",
          "\\ud83d", '"na\\qme"']  # fmt: skip


@settings(max_examples=300)
@given(text=st.lists(st.sampled_from(PIECES), max_size=60).map("".join), cuts=cuts)
def test_any_text_is_handled(text, cuts):
    """Broken, truncated or hostile output never raises; calls found have a name."""
    for make in [RequiredCalls, *map(parser_class, TOOL_CALL_PARSERS), lambda: NamedCall("f")]:
        stream = feed_in_pieces(make(), text, cuts)
        assert all(isinstance(c.name, str) for c in stream.calls)


def test_required_schema_accepts_calls_of_the_given_tools_only():
    tools = [
        {"type": "function", "function": {"name": "add", "parameters": {
            "type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}}},
        {"type": "function", "function": {"name": "noop"}},
    ]  # fmt: skip
    schema = required_schema(tools)
    jsonschema.validate(
        [{"name": "add", "parameters": {"a": 1}}, {"name": "noop", "parameters": {}}], schema
    )
    for bad in (
        [],
        [{"name": "add", "parameters": {"a": "x"}}],
        [{"name": "other", "parameters": {}}],
    ):
        try:
            jsonschema.validate(bad, schema)
        except jsonschema.ValidationError:
            continue
        raise AssertionError(f"{bad} was accepted")
    two = [{"name": "noop", "parameters": {}}] * 2
    jsonschema.validate(two, schema)
    with pytest.raises(jsonschema.ValidationError):  # parallel_tool_calls: false -> one call
        jsonschema.validate(two, required_schema(tools, parallel=False))


def test_finish_reason_and_content_rules():
    auto = ToolCalling(None, "hermes")
    assert auto.finish_reason(True, "stop") == "tool_calls"
    assert auto.finish_reason(True, "length") == "length"  # a cut-off call says so
    assert auto.finish_reason(False, "stop") == "stop"
    assert ToolCalling("required", None).finish_reason(True, "stop") == "tool_calls"
    assert ToolCalling("f", None).finish_reason(True, "stop") == "stop"  # named: vLLM's
    stream = auto.stream()
    stream.feed('<tool_call>{"name": "f", "arguments": {}}</tool_call>')
    assert auto.content(stream) is None  # calls and nothing else
    one = ToolCalling("required", None, parallel=False)
    s = one.stream()
    s.feed('[{"name": "a", "parameters": {}}, {"name": "b", "parameters": {}}]')
    assert [c.name for c in one.calls(s)] == ["a"] and one.content(s) == ""


def test_the_hermes_chat_template_renders_tools_calls_and_results():
    """deploy/chat_templates/chatml_hermes_tools.jinja through --chat-template's loader and
    the tokenizer's renderer: the tools, the assistant's call and the tool's answer."""
    from pathlib import Path

    from launch.serve import load_chat_template
    from services.api_server.protocol import ChatMessage
    from services.protocol import TokenizeRequest
    from services.tokenizer.loader import load_serving_tokenizer
    from services.tokenizer.processor import RequestProcessor

    path = (
        Path(__file__).resolve().parent.parent / "deploy/chat_templates/chatml_hermes_tools.jinja"
    )
    processor = RequestProcessor(
        load_serving_tokenizer(), 2048, chat_template=load_chat_template(str(path))
    )
    call = {
        "id": "c1",
        "type": "function",
        "function": {"name": "add", "arguments": '{"a": 1, "b": 2}'},
    }
    messages = [
        ChatMessage(role="user", content="1 + 2?"),
        ChatMessage(role="assistant", content=None, tool_calls=[call]),
        ChatMessage(role="tool", tool_call_id="c1", content="3"),
    ]
    tools = [{"type": "function", "function": {"name": "add", "parameters": {"type": "object"}}}]
    _, text = processor.prompt_ids(TokenizeRequest("t", messages=[m.to_template() for m in messages],
                                                   chat_template_kwargs={"tools": tools}))  # fmt: skip
    assert text is not None
    assert '<tools>\n{"type": "function", "function": {"name": "add"' in text
    assert '<tool_call>\n{"name": "add", "arguments": {"a": 1, "b": 2}}\n</tool_call>' in text
    assert "<tool_response>\n3\n</tool_response>" in text
    assert text.endswith("<|im_start|>assistant\n")
    with pytest.raises(ConfigError, match="neither a file nor a template"):
        load_chat_template("no/such/file.jinja")


def test_strings_the_model_gets_wrong_do_not_raise():
    for text, name in (
        ('[{"name": "bad\\qescape", "parameters": {}}]', "bad\\qescape"),
        ('[{"name": "half\\ud83d", "parameters": {}}]', "half\ufffd"),
        ('[{"note": "raw\nnewline", "name": "f", "parameters": {}}]', "f"),
    ):
        stream = feed_in_pieces(RequiredCalls(), text, [3, 9, 17])
        assert [c.name for c in stream.calls] == [name]
        json.dumps(stream.calls[0].to_json()).encode()  # a response can carry it


def test_duplicate_and_missing_arguments():
    stream = feed_in_pieces(HermesCalls(), '<tool_call>{"name": "f", "arguments": {"x": 1}, '
                            '"arguments": {"y": 2}}</tool_call><tool_call>{"name": "g"}</tool_call>', [])  # fmt: skip
    assert parsed(stream) == [("f", {"x": 1}), ("g", {})]  # the first value; none: {}


def test_what_looks_like_calls_but_is_none_stays_content():
    answer = '{"answer": 42, "unit": "km"}'
    stream = feed_in_pieces(Llama3JsonCalls(), answer, [5, 11])
    assert stream.calls == [] and "".join(stream.content) == answer
    text = "Wrap calls in <tool_call> tags, like <tool_call>this</tool_call>. Done."
    stream = feed_in_pieces(HermesCalls(), text, [20, 40])
    assert stream.calls == [] and "".join(stream.content) == text


def test_required_schema_moves_defs_up_and_fills_empty_parameters():
    from services.structured_output.backend import Constraint, check_constraint

    pydantic_like = {"type": "object", "properties": {"at": {"$ref": "#/$defs/Loc"}},
                     "required": ["at"], "$defs": {"Loc": {"type": "object", "properties": {
                         "city": {"type": "string"}}, "required": ["city"]}}}  # fmt: skip
    tools = [{"type": "function", "function": {"name": "go", "parameters": pydantic_like}},
             {"type": "function", "function": {"name": "ping", "parameters": {}}}]  # fmt: skip
    schema = required_schema(tools)
    check_constraint("xgrammar", Constraint("json", json.dumps(schema)))
    jsonschema.validate([{"name": "go", "parameters": {"at": {"city": "Oslo"}}},
                         {"name": "ping", "parameters": {}}], schema)  # fmt: skip
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate([{"name": "go", "parameters": {"at": {}}}], schema)
    with pytest.raises(jsonschema.ValidationError):  # {} parameters: still an object
        jsonschema.validate([{"name": "ping", "parameters": "not an object"}], schema)
    other = json.loads(json.dumps(tools[0]))
    other["function"]["name"] = "go2"
    other["function"]["parameters"]["$defs"]["Loc"] = {"type": "string"}
    with pytest.raises(ValueError, match="'Loc' has multiple schemas"):
        required_schema([tools[0], other])


def test_a_held_back_chunk_still_carries_its_token_ids():
    import asyncio

    from services.api_server.serving import ResponseContext
    from services.api_server.serving_chat import chat_stream
    from services.protocol import TextDelta

    pieces = ["<tool", '_call>{"name": "f", "arguments": {}}', "</tool_call>"]

    async def deltas():
        for i, text in enumerate(pieces):
            yield 0, TextDelta("r", text, token_ids=[100 + i],
                               finish_reason="stop" if i == len(pieces) - 1 else None,
                               prompt_token_ids=[1, 2] if i == 0 else None)  # fmt: skip

    async def collect():
        ctx = ResponseContext("c", 0, "m", 1, return_token_ids=True)
        tools = ToolCalling(None, "hermes")
        return [c async for c in chat_stream(ctx, deltas(), want_logprobs=False,
                                             include_usage=False, tools=tools)]  # fmt: skip

    chunks = [json.loads(c[6:]) for c in asyncio.run(collect()) if c.startswith(b"data: {")]
    ids = [i for c in chunks for ch in c["choices"] for i in ch.get("token_ids", [])]
    assert ids == [100, 101, 102] and any(c.get("prompt_token_ids") == [1, 2] for c in chunks)
    assert chunks[-1]["choices"][0]["finish_reason"] == "tool_calls"


def test_a_long_inline_chat_template_is_no_file_name():
    from launch.serve import load_chat_template

    template = "{{ messages[0].content }}" + " " * 400
    assert load_chat_template(template) == template


def test_a_models_tool_use_template_is_chosen_when_tools_come(tmp_path):
    """HF's named templates (a list in tokenizer_config.json, or llama.cpp's
    tokenizer.chat_template.NAME in a GGUF): "tool_use" renders conversations with tools."""
    import shutil

    from services.model_loader.gguf_tokenizer import _chat_templates
    from services.model_loader.resolve import prepare_model
    from services.model_loader.tokenizer import load_tokenizer
    from services.tokenizer.processor import RequestProcessor

    folder = prepare_model(None)
    shutil.copy(folder / "tokenizer.json", tmp_path / "tokenizer.json")
    config = json.loads((folder / "tokenizer_config.json").read_text())
    config["chat_template"] = [
        {"name": "default", "template": "plain: {{ messages[0]['content'] }}"},
        {
            "name": "tool_use",
            "template": "tools: {{ tools | length }} {{ messages[0]['content'] }}",
        },
    ]
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(config))
    processor = RequestProcessor(load_tokenizer(tmp_path), 2048)
    messages = [{"role": "user", "content": "hi"}]
    assert processor.render(messages, None, True, {}) == "plain: hi"
    assert processor.render(messages, None, True, {"tools": [{}, {}]}) == "tools: 2 hi"
    assert _chat_templates({"tokenizer.chat_template": "d", "tokenizer.chat_template.tool_use": "t"}) == [
        {"name": "default", "template": "d"}, {"name": "tool_use", "template": "t"}]  # fmt: skip
    assert _chat_templates({"tokenizer.chat_template": "d"}) == "d"


def test_only_a_parser_that_needs_its_tags_keeps_special_tokens():
    from services.protocol import SamplingParams

    params = SamplingParams()
    assert not ToolCalling(None, "hermes").sampling(params).skip_special_tokens
    assert ToolCalling(None, "llama3_json").sampling(params).skip_special_tokens
    assert ToolCalling("required", "hermes").sampling(params).skip_special_tokens  # no parsing
