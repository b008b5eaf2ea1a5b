"""JSON constraints bounded by default (issue 35): whitespace runs and number digits where
the schema sets no bound, strings when asked; the schema's own bounds and patterns kept;
checked on xgrammar's own matcher (byte strings accepted or refused), and the settings'
path from the flag and the request to the constraint."""

from __future__ import annotations

import json

import pytest

xgr = pytest.importorskip("xgrammar")

from services.config import ConfigError  # noqa: E402
from services.config.engine import StructuredOutputsConfig  # noqa: E402
from services.config.structured_outputs import UNBOUNDED, JsonBounds  # noqa: E402
from services.protocol import StructuredOutputsParams  # noqa: E402
from services.structured_output.json_bounds import bound_grammar  # noqa: E402
from services.structured_output.manager import constraint_of  # noqa: E402

SCHEMA = {
    "type": "object",
    "properties": {
        "n": {"type": "number"},
        "i": {"type": "integer"},
        "low": {"type": "integer", "minimum": 0},
        "s": {"type": "string"},
        "short": {"type": "string", "maxLength": 3},
        "long": {"type": "string", "minLength": 2},
        "code": {"type": "string", "pattern": "[0-9]*x"},
        "xs": {"type": "array", "items": {"type": "integer"}},
    },
    "required": ["n", "i", "low", "s", "short", "long", "code", "xs"],
}


def _accepts(bounds: JsonBounds, text: str, schema: dict = SCHEMA) -> bool:  # type: ignore[type-arg]
    grammar = xgr.Grammar.from_json_schema(
        json.dumps(schema), any_whitespace=True, max_whitespace_cnt=bounds.whitespace
    )
    ebnf = bound_grammar(str(grammar), bounds)
    return bool(xgr.testing._is_grammar_accept_string(xgr.Grammar.from_ebnf(ebnf), text))


def _doc(**over: object) -> str:
    doc: dict[str, object] = {"n": 1.5, "i": -3, "low": 7, "s": "hi", "short": "abc",
                              "long": "xyz", "code": "12x", "xs": [1, 2]}  # fmt: skip
    doc.update(over)
    return json.dumps(doc)


def test_a_plain_document_passes_bounded_and_unbounded() -> None:
    for bounds in (JsonBounds(), UNBOUNDED, JsonBounds(string_length=8)):
        assert _accepts(bounds, _doc())


def test_number_digits_are_bounded_unless_unbounded() -> None:
    bounds = JsonBounds(digits=20)
    for field, ok, runaway in (
        ("i", "1" * 20, "1" * 21),
        ("low", "9" * 20, "9" * 21),  # the schema's own rule (minimum only) bounded too
        ("n", "1." + "5" * 20, "1." + "5" * 21),
        ("n", "1" * 20 + ".5", "1" * 21 + ".5"),
        ("n", "1e" + "7" * 20, "1e" + "7" * 21),
    ):
        doc_ok = _doc(**{field: 0}).replace(f'"{field}": 0', f'"{field}": {ok}')
        doc_runaway = _doc(**{field: 0}).replace(f'"{field}": 0', f'"{field}": {runaway}')
        assert _accepts(bounds, doc_ok), (field, ok)
        assert not _accepts(bounds, doc_runaway), (field, runaway)
        assert _accepts(UNBOUNDED, doc_runaway), (field, runaway)


def test_array_items_are_numbers_bounded_too() -> None:
    assert not _accepts(JsonBounds(digits=5), _doc(xs=[123456]))
    assert _accepts(JsonBounds(digits=5), _doc(xs=[12345, 1]))


def test_whitespace_runs_are_bounded() -> None:
    doc = _doc()
    assert _accepts(JsonBounds(whitespace=20), doc.replace(", ", ",\n" + " " * 19, 1))
    assert not _accepts(JsonBounds(whitespace=20), doc.replace(", ", ",\n" + " " * 20, 1))
    assert _accepts(UNBOUNDED, doc.replace(", ", "," + "\n" * 170, 1))


def test_string_length_only_when_asked_and_the_schemas_own_kept() -> None:
    assert _accepts(JsonBounds(), _doc(s="a" * 500))
    assert _accepts(JsonBounds(string_length=8), _doc(s="a" * 8, long="b" * 8))
    assert not _accepts(JsonBounds(string_length=8), _doc(s="a" * 9))
    assert not _accepts(JsonBounds(string_length=8), _doc(long="b" * 9))  # minLength only
    assert not _accepts(JsonBounds(string_length=8), _doc(short="abcd"))  # its maxLength 3
    # escapes count as one character each and still pass
    assert '\\"' in _doc(s='a"b\u00e9') and "\\u00e9" in _doc(s='a"b\u00e9')
    assert _accepts(JsonBounds(string_length=4), _doc(s='a"b\u00e9'))
    assert not _accepts(JsonBounds(string_length=3), _doc(s='a"b\u00e9', long="ab"))
    # a pattern is the schema's: neither bound applies inside it
    assert _accepts(JsonBounds(digits=2, string_length=3), _doc(code="1234567x", i=1, low=1,
                                                                n=1, xs=[], s="", long="ab"))  # fmt: skip


def test_literals_that_look_like_repeats_are_left_alone() -> None:
    schema = {"type": "object", "properties": {"[0-9]*": {"enum": ["[0-9]*", "a{1, -1}"]}},
              "required": ["[0-9]*"]}  # fmt: skip
    assert _accepts(JsonBounds(), '{"[0-9]*": "a{1, -1}"}', schema)
    assert not _accepts(JsonBounds(), '{"[0-9]*": "a{1, 2}"}', schema)


def test_the_flag_and_the_request_reach_the_constraint() -> None:
    params = StructuredOutputsParams(json=json.dumps(SCHEMA))
    default = StructuredOutputsConfig()
    assert constraint_of(params, default).bounds == JsonBounds(20, 20, None)
    config = StructuredOutputsConfig.from_json(
        '{"json_max_whitespace": 4, "json_max_digits": null, "json_max_string_length": 64}'
    )
    assert constraint_of(params, config).bounds == JsonBounds(4, None, 64)
    off = StructuredOutputsConfig.from_json('{"unbounded_json": true}')
    assert constraint_of(params, off).bounds == UNBOUNDED
    mine = StructuredOutputsParams(json="{}", unbounded_json=True)
    assert constraint_of(mine, default).bounds == UNBOUNDED
    longer = StructuredOutputsParams(json="{}", json_max_string_length=5)
    assert constraint_of(longer, config).bounds == JsonBounds(4, None, 5)
    regex = StructuredOutputsParams(regex="[0-9]*")  # not JSON: no bounds
    assert constraint_of(regex, default).bounds == UNBOUNDED
    for bad in ('{"json_max_digits": 0}', '{"json_max_whitespace": "4"}',
                '{"unbounded_json": 1}', '{"json_max_string_length": 2.5}'):  # fmt: skip
        with pytest.raises(ConfigError, match="json|unbounded"):
            StructuredOutputsConfig.from_json(bad)


def test_removed_vllm_fields_are_ignored_and_logged_once_per_name(
    caplog: pytest.LogCaptureFixture,
) -> None:
    from services.api_server import protocol

    protocol._IGNORED_LOGGED.discard("guided_json")
    protocol._IGNORED_LOGGED.discard("guided_choice")
    body = {"model": "m", "prompt": "hi", "guided_json": {"type": "object"}}
    with caplog.at_level("WARNING", logger=protocol.__name__):
        first = protocol.CompletionRequest.model_validate(body)
        protocol.CompletionRequest.model_validate(body)
        protocol.ChatCompletionRequest.model_validate(
            {"model": "m", "messages": [], "guided_json": {}, "guided_choice": ["a"]}
        )
    assert first.structured_outputs_params() is None  # ignored: no constraint
    lines = [r.getMessage() for r in caplog.records]
    assert lines == [
        "The following fields were present in the request but ignored: ['guided_json']",
        "The following fields were present in the request but ignored: ['guided_choice']",
    ]
    # known fields, aliases included, are never reported
    caplog.clear()
    protocol.CompletionRequest.model_validate(
        {"model": "m", "prompt": "x", "structured_outputs": {"json": {}, "unbounded_json": True}}
    )
    assert not caplog.records


def test_options_alone_are_no_constraint_and_reach_a_tool_calls_grammar() -> None:
    """instructor sends a forced tool with ``structured_outputs`` options (found by
    bench/client_matrix.py): not vLLM's "constraints or tools, not both"."""
    from services.api_server.protocol import ChatCompletionRequest
    from services.config import RequestLimits

    base = {"messages": [{"role": "user", "content": "x"}]}
    tool = {"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}
    options = {"structured_outputs": {"json_max_string_length": 5}}
    alone = ChatCompletionRequest.model_validate({**base, **options})
    assert alone.structured_outputs_params() is None
    forced = ChatCompletionRequest.model_validate(
        {**base, **options, "tools": [tool], "tool_choice": "required"}
    )
    forced.check(RequestLimits(), None)
    params = forced.structured_outputs_params()
    assert params is not None and params.json is not None and params.json_max_string_length == 5
    empty = ChatCompletionRequest.model_validate({**base, "structured_outputs": {}})
    with pytest.raises(ValueError, match="must use one kind"):
        empty.structured_outputs_params().validate()  # type: ignore[union-attr]
    both = ChatCompletionRequest.model_validate(
        {**base, "structured_outputs": {"regex": "a"}, "tools": [tool], "tool_choice": "required"}
    )
    with pytest.raises(ValueError, match="not both"):
        both.check(RequestLimits(), None)
