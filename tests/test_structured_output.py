"""The grammar backend on the default model's tokenizer (services/structured_output).

A stand-in model draws random logits for every step; the backend's bitmask leaves only
the tokens the constraint allows, the "sampler" takes the best one, and the matcher
follows it until the grammar ends. Whatever the random logits, the decoded text must
satisfy the constraint, checked independently: ``jsonschema`` for schemas, ``re`` for
patterns, membership for choices.
"""

from __future__ import annotations

import json
import re

import jsonschema
import numpy as np
import pytest
import torch

from services.structured_output.backend import (
    MAX_CONSTRAINT_BYTES,
    Constraint,
    GrammarError,
    VocabInfo,
    allocate_bitmask,
    check_constraint,
    choose_backend,
    load_backend,
    xgrammar_unsupported,
)
from services.structured_output.bitmask import apply_token_bitmask

SCHEMAS = [
    {"type": "object", "properties": {"name": {"type": "string", "maxLength": 12},
                                      "age": {"type": "integer", "minimum": 0, "maximum": 150}},
     "required": ["name", "age"], "additionalProperties": False},
    {"type": "object", "properties": {"colour": {"enum": ["red", "green", "blue"]},
                                      "sizes": {"type": "array", "items": {"type": "number",
                                                "minimum": -5, "maximum": 5},
                                                "minItems": 1, "maxItems": 3}},
     "required": ["colour", "sizes"], "additionalProperties": False},
    {"type": "object", "properties": {"id": {"type": "string", "pattern": "^[A-Z]{2}-[0-9]{3}$"},
                                      "tags": {"type": "array", "items": {"type": "string",
                                               "maxLength": 6}, "maxItems": 2},
                                      "owner": {"type": "object",
                                                "properties": {"ok": {"type": "boolean"}},
                                                "required": ["ok"], "additionalProperties": False}},
     "required": ["id", "owner"], "additionalProperties": False},
]  # fmt: skip


@pytest.fixture(scope="module")
def tok():
    from services.tokenizer.loader import load_serving_tokenizer

    return load_serving_tokenizer()


@pytest.fixture(scope="module", params=["xgrammar", "guidance"])
def backend(tok, request):
    """Each grammar engine (the tests of what both must do)."""
    vocab = VocabInfo(tok.tokenizer, tok.tokenizer.get_vocab_size(), (tok.eos_token_id,))
    return load_backend(request.param, vocab)


@pytest.fixture(scope="module")
def xgrammar(tok):
    vocab = VocabInfo(tok.tokenizer, tok.tokenizer.get_vocab_size(), (tok.eos_token_id,))
    return load_backend("xgrammar", vocab)


def constrained_decode(backend, tok, constraint: Constraint, seed: int, max_steps: int = 200):
    """Random logits, masked by the constraint, greedy; the text and whether it ended."""
    matcher = backend.matcher(constraint)
    gen = torch.Generator().manual_seed(seed)
    bitmask = allocate_bitmask(1, backend.vocab_size)
    ids: list[int] = []
    for _ in range(max_steps):
        logits = torch.randn(1, backend.vocab_size, generator=gen)
        bitmask[:] = -1
        matcher.fill(bitmask, 0)
        apply_token_bitmask(logits, torch.tensor([0]), torch.from_numpy(bitmask))
        token = int(logits.argmax())
        assert matcher.accept(token)
        if token != tok.eos_token_id:
            ids.append(token)
        if matcher.is_terminated():  # after EOS (xgrammar), or once only EOS may follow
            return tok.decode(ids), True
    return tok.decode(ids), False


@pytest.mark.parametrize("seed", range(3))
@pytest.mark.parametrize("schema", SCHEMAS, ids=["person", "enum_array", "nested_pattern"])
def test_json_schema_outputs_validate(backend, tok, schema, seed):
    # Random logits would wander through whitespace for ever where the schema allows it
    # (it does by default, as in vLLM): compact JSON here, whitespace in the next test.
    constraint = Constraint("json", json.dumps(schema), any_whitespace=False)
    text, ended = constrained_decode(backend, tok, constraint, seed)
    assert ended, text
    jsonschema.validate(json.loads(text), schema)


def test_json_object_and_whitespace(backend, tok):
    # Any object (random logits would write one string for ever: follow a given text).
    matcher = backend.matcher(Constraint("json_object", "", any_whitespace=False))
    assert not matcher.accept(tok.tokenizer.token_to_id("["))
    for token in tok.encode('{"a": [1, {"b": null}], "c": "d"}', add_special_tokens=False):
        assert matcher.accept(token)
    assert not matcher.is_terminated()  # complete, but until a stop token it is not over
    assert matcher.accept(tok.eos_token_id) and matcher.is_terminated()
    # Whitespace: after the "{", a newline may follow unless it is disabled.
    newline = tok.tokenizer.token_to_id("Ċ")  # byte-level BPE's "\n"
    for any_whitespace in (True, False):
        matcher = backend.matcher(Constraint("json", json.dumps(SCHEMAS[0]), any_whitespace))
        assert matcher.accept(tok.tokenizer.token_to_id("{"))
        bitmask = allocate_bitmask(1, backend.vocab_size)
        matcher.fill(bitmask, 0)
        assert bool(bitmask[0, newline // 32] >> (newline % 32) & 1) == any_whitespace


@pytest.mark.parametrize("seed", range(3))
def test_regex_and_choice(backend, tok, seed):
    pattern = r"(yes|no), [0-9]{2,4} (apples|pears)"
    text, ended = constrained_decode(backend, tok, Constraint("regex", pattern), seed)
    assert ended and re.fullmatch(pattern, text), text
    options = ["Paris", "Lyon", "Marseille du Sud"]
    text, ended = constrained_decode(backend, tok, Constraint("choice", json.dumps(options)), seed)
    assert ended and text in options, text


def test_ebnf_grammar(backend, tok):
    grammar = 'root ::= "(" num ("+" num)* ")"\nnum ::= [1-9] [0-9]?'
    text, ended = constrained_decode(backend, tok, Constraint("grammar", grammar), 1)
    assert ended and re.fullmatch(r"\([1-9][0-9]?(\+[1-9][0-9]?)*\)", text), text


def test_a_forbidden_token_is_refused_and_the_matcher_stays(backend, tok):
    matcher = backend.matcher(Constraint("choice", '["yes", "no"]'))
    assert not matcher.accept(tok.tokenizer.token_to_id("{"))
    assert matcher.accept(tok.encode("yes", add_special_tokens=False)[0])


@pytest.mark.parametrize(
    ("constraint", "says"),
    [
        (Constraint("json", "{not json"), "Failed to parse JSON"),
        (Constraint("json", '{"type": "nonsense"}'), 'Unsupported type "nonsense"'),
        (Constraint("regex", "(unclosed"), "parenthesis is not closed"),
        (Constraint("choice", "[]"), "cannot be an empty list"),
        (Constraint("choice", '["a", 1]'), "list of strings"),
        (Constraint("grammar", "root ::= undefined_rule"), "undefined_rule"),
    ],
)
def test_a_bad_constraint_says_what_is_wrong(xgrammar, constraint, says):
    """The same error from the cheap check (the tokenizer's, no vocabulary) and the compile
    (the scheduler's)."""
    for attempt in (lambda: check_constraint("xgrammar", constraint),
                    lambda: xgrammar.matcher(constraint)):  # fmt: skip
        with pytest.raises(GrammarError, match=re.escape(says)) as e:
            attempt()
        assert "/project/cpp" not in str(e.value)  # the library's source location is cut


def test_unknown_kind_and_backend():
    with pytest.raises(GrammarError, match="unknown structured output kind"):
        Constraint("yaml", "")
    with pytest.raises(GrammarError, match="unknown structured outputs backend 'nope'"):
        load_backend("nope", VocabInfo(None, 8, ()))  # type: ignore[arg-type]


def test_bitmask_application_matches_xgrammars(xgrammar):
    """Our torch unpacking (the worker's, no grammar engine there) against xgrammar's own
    ``apply_token_bitmask_inplace``, on rows 1 and 3 of a batch of 4."""
    import xgrammar as xgr

    vocab = xgrammar.vocab_size
    rng = np.random.default_rng(0)
    bitmask = rng.integers(-(2**31), 2**31, size=(4, (vocab + 31) // 32), dtype=np.int64)
    bitmask = torch.from_numpy(bitmask.astype(np.int32))
    logits = torch.randn(4, vocab)
    want = logits.clone()
    xgr.apply_token_bitmask_inplace(want, bitmask, indices=[1, 3])  # its rows: the batch's
    apply_token_bitmask(logits, torch.tensor([1, 3]), bitmask[[1, 3]])  # ours: compact
    assert torch.equal(torch.isinf(logits), torch.isinf(want))
    assert torch.equal(logits[torch.isfinite(logits)], want[torch.isfinite(want)])
    assert torch.isinf(logits[1]).any() and not torch.isinf(logits[[0, 2]]).any()


@pytest.mark.parametrize("form", ["xgrammar", "vllm_structures"])
def test_structural_tag_accepts_its_text_and_refuses_other(xgrammar, tok, form):
    """Both forms of a structural tag: xgrammar's ``format`` and vLLM's older ``structures``
    with ``triggers`` (free text until a trigger, then the tagged JSON)."""
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"],
              "additionalProperties": False}  # fmt: skip
    if form == "xgrammar":
        tag = {"type": "structural_tag", "format": {"type": "tag", "begin": "<x>",
               "content": {"type": "json_schema", "json_schema": schema}, "end": "</x>"}}  # fmt: skip
        good, bad = '<x>{"a": 5}</x>', '<x>{"a": "five"}</x>'
    else:
        tag = {"type": "structural_tag", "triggers": ["<x>"],
               "structures": [{"begin": "<x>", "schema": schema, "end": "</x>"}]}  # fmt: skip
        good, bad = 'Sure. <x>{"a": 5}</x> done', 'Sure. <x>{"b": 5}</x>'

    def accepts(text: str) -> bool:
        matcher = xgrammar.matcher(Constraint("structural_tag", json.dumps(tag)))
        return all(matcher.accept(t) for t in tok.encode(text, add_special_tokens=False))

    assert accepts(good) and not accepts(bad)
    check_constraint("xgrammar", Constraint("structural_tag", json.dumps(tag)))
    with pytest.raises(GrammarError, match="structural_tag"):
        check_constraint("xgrammar", Constraint("structural_tag", '{"structures": [{}]}'))


def test_auto_sends_schemas_xgrammar_would_not_enforce_to_guidance():
    plain = Constraint("json", json.dumps(SCHEMAS[0]))
    unique = Constraint("json", json.dumps({"type": "object", "properties": {"tags": {
        "type": "array", "items": {"type": "string"}, "uniqueItems": True}}}))  # fmt: skip
    assert xgrammar_unsupported(json.loads(unique.spec)) == ["uniqueItems"]
    assert xgrammar_unsupported({"allOf": [{"type": "number", "multipleOf": 3}]}) == [
        "allOf", "multipleOf"]  # fmt: skip
    assert choose_backend("auto", plain) == "xgrammar"
    assert choose_backend("auto", unique) == "guidance"
    assert choose_backend("guidance", plain) == "guidance"
    for configured, fallback in (("xgrammar", True), ("auto", False)):
        with pytest.raises(GrammarError, match="not supported by xgrammar: uniqueItems"):
            choose_backend(configured, unique, fallback)


def test_too_large_or_too_deep_a_constraint_is_refused_before_any_engine_sees_it():
    deep = {"type": "object", "properties": {}}
    node = deep
    for _ in range(40):
        node["properties"]["x"] = {"type": "object", "properties": {}}
        node = node["properties"]["x"]
    for constraint, says in (
        (Constraint("regex", "a" * (MAX_CONSTRAINT_BYTES + 1)), "bytes; this server takes"),
        (Constraint("json", json.dumps(deep)), "nests deeper than 64 levels"),
    ):
        with pytest.raises(GrammarError, match=says):
            check_constraint("xgrammar", constraint)
