"""Reasoning parsers (services/structured_output/reasoning.py): the split of a thinking
model's text into reasoning and answer, and the grammar held back while it thinks.

The split is checked as a property: cut into pieces anywhere, the text splits as it does
whole. The held-back grammar runs xgrammar on the default model's tokenizer, whose
vocabulary has no ``</think>`` token (the marker comes in pieces: ``</``, ``think``,
``>``); its bitmask rows are compared with the same grammar's own rows.
"""

from __future__ import annotations

import json
import random

import numpy as np
import pytest

from services.config import StructuredOutputsConfig
from services.detokenizer.output_processor import OutputProcessor
from services.flags import ConfigError
from services.protocol import (
    ReasoningParams,
    RequestOutputSpec,
    RequestTokens,
    SamplingParams,
    StructuredOutputsParams,
    TokenBatch,
)
from services.request import Request
from services.structured_output.backend import VocabInfo, allocate_bitmask
from services.structured_output.manager import StructuredOutputManager
from services.structured_output.reasoning import (
    ReasoningSplitter,
    ThinkingMatcher,
    prompt_reasoning,
)

THINKING = ReasoningParams("<think>", "</think>", "thinking")
OPENING = ReasoningParams("<think>", "</think>", "opening")

# (phase, output, (reasoning, answer))
CASES = [
    (THINKING, "Paris is the capital.</think>\n\nThe capital is Paris.",
     ("Paris is the capital.", "The capital is Paris.")),
    (THINKING, "<think>\nhmm</think>ok", ("\nhmm", "ok")),  # a leading opener is dropped
    (THINKING, "still thinking </thi", ("still thinking </thi", "")),  # never closed
    (THINKING, "a < b </ c</think> x</think>", ("a < b </ c", "x</think>")),
    (THINKING, "</think>", ("", "")),
    (THINKING, "  \n", ("  \n", "")),
    (OPENING, '<think>x</think>{"a": 1}', ("x", '{"a": 1}')),
    (OPENING, '  {"a": 1}', ("", '  {"a": 1}')),  # answers at once
    (OPENING, "<thought>", ("", "<thought>")),
    (OPENING, "\n<think>\nwhy</think>\n\nbecause", ("\nwhy", "because")),
    (OPENING, "<thi", ("", "<thi")),
    (OPENING, "", ("", "")),
]  # fmt: skip


def split(params: ReasoningParams, pieces: list[str]) -> tuple[str, str]:
    splitter = ReasoningSplitter(params)
    reasoning, answer = [], []
    for piece in pieces:
        r, a = splitter.feed(piece)
        reasoning.append(r)
        answer.append(a)
    r, a = splitter.finish()
    return "".join(reasoning) + r, "".join(answer) + a


@pytest.mark.parametrize(("params", "text", "expected"), CASES)
def test_split_is_the_same_however_the_text_is_cut(params, text, expected):
    assert split(params, [text]) == expected
    assert split(params, list(text)) == expected  # one character at a time
    rng = random.Random(text)
    for _ in range(30):
        cuts = sorted(rng.sample(range(len(text) + 1), min(len(text), rng.randint(0, 5))))
        pieces = [text[i:j] for i, j in zip([0, *cuts], [*cuts, len(text)], strict=True)]
        assert split(params, pieces) == expected, pieces


def test_the_prompt_says_where_the_thinking_stands():
    assert prompt_reasoning("deepseek_r1", "<|im_start|>assistant\n<think>\n") == THINKING
    assert prompt_reasoning("qwen3", "<|im_start|>assistant\n") == OPENING
    # enable_thinking: false closes it in the prompt: all of the output is answer
    assert prompt_reasoning("qwen3", "assistant\n<think>\n\n</think>\n\n") is None


def test_config_takes_the_parser_from_the_flag_or_the_json():
    assert StructuredOutputsConfig.from_json(None, "qwen3").reasoning_parser == "qwen3"
    config = StructuredOutputsConfig.from_json(
        '{"reasoning_parser": "deepseek_r1", "enable_in_reasoning": true}'
    )
    assert (config.reasoning_parser, config.enable_in_reasoning) == ("deepseek_r1", True)
    with pytest.raises(ConfigError, match="--reasoning-parser must be one of"):
        StructuredOutputsConfig.from_json(None, "granite")


# ---- the grammar, held back while the model thinks


SCHEMA = {"type": "object", "properties": {"capital": {"type": "string", "maxLength": 10}},
          "required": ["capital"], "additionalProperties": False}  # fmt: skip


@pytest.fixture(scope="module")
def tok():
    from services.tokenizer.loader import load_serving_tokenizer

    return load_serving_tokenizer()


def manager(tok, **config) -> StructuredOutputManager:
    vocab = VocabInfo(tok.tokenizer, tok.tokenizer.get_vocab_size(), (tok.eos_token_id,))
    return StructuredOutputManager(
        StructuredOutputsConfig(backend="xgrammar", **config), lambda: vocab, synchronous=True
    )


def constrained(tok, mgr, reasoning: ReasoningParams | None, schema=SCHEMA) -> Request:
    params = SamplingParams(
        structured_outputs=StructuredOutputsParams(json=json.dumps(schema)), reasoning=reasoning
    )
    request = Request("r", [1, 2, 3], params, eos_token_id=tok.eos_token_id)
    assert mgr.add(request)
    return request


def row(mgr, request) -> np.ndarray:
    mask = allocate_bitmask(1, mgr.vocab_size)
    request.grammar.fill(mask, 0)
    return mask[0].copy()


def allowed(mask_row: np.ndarray, token_id: int) -> bool:
    return bool((int(mask_row[token_id // 32]) >> (token_id % 32)) & 1)


def test_thinking_is_free_and_the_answer_follows_the_grammar(tok):
    mgr = manager(tok)
    request = constrained(tok, mgr, THINKING)
    plain = constrained(tok, mgr, None)  # the same grammar, never held back
    assert isinstance(request.grammar, ThinkingMatcher)
    encode = tok.tokenizer.encode
    thinking = encode("I know this one: Paris", add_special_tokens=False).ids
    for token_id in thinking:
        assert (row(mgr, request) == -1).all()  # every token allowed while thinking
        assert mgr.accept(request, token_id)
        assert not request.grammar.is_terminated()
    assert not allowed(row(mgr, plain), thinking[0])  # which the grammar would not allow
    for piece in ["</", "think"]:
        (token_id,) = encode(piece, add_special_tokens=False).ids
        assert mgr.accept(request, token_id)
    # "</think" held: ">" may close it, but not a token with text after the marker
    closing = row(mgr, request)
    assert allowed(closing, tok.tokenizer.token_to_id(">"))
    assert not allowed(closing, tok.tokenizer.token_to_id('>"'))
    assert allowed(closing, tok.tokenizer.token_to_id("Ġthe"))
    assert mgr.accept(request, tok.tokenizer.token_to_id(">"))
    assert request.grammar.phase == "answer"
    answer = encode('{"capital": "Paris"}', add_special_tokens=False).ids + [tok.eos_token_id]
    for token_id in answer:
        assert (row(mgr, request) == row(mgr, plain)).all()  # the grammar's own rows
        assert mgr.accept(request, token_id) and mgr.accept(plain, token_id)
    assert request.grammar.is_terminated()


def test_text_after_the_marker_in_its_token_goes_to_the_grammar(tok):
    """``</think`` then the token ``>"``: the marker closes and ``"`` is the answer's first
    character, fed to the grammar. A JSON string takes it (the next rows are the grammar's
    after ``"``); a JSON object refuses it, which is why, while thinking, such a token is
    not allowed after a held ``</think``."""
    closing_quote = tok.tokenizer.token_to_id('>"')
    thinking = tok.tokenizer.encode("ok</think", add_special_tokens=False).ids
    (quote,) = tok.tokenizer.encode('"', add_special_tokens=False).ids
    string = {"type": "string", "maxLength": 5}
    mgr = manager(tok)
    held = constrained(tok, mgr, THINKING, string)
    plain = constrained(tok, mgr, None, string)
    for token_id in thinking:
        assert mgr.accept(held, token_id)
    assert not allowed(row(mgr, held), closing_quote)  # the mask keeps it out
    assert mgr.accept(held, closing_quote)  # (were it sampled) the grammar takes the '"'
    assert held.grammar.phase == "answer"
    assert mgr.accept(plain, quote)
    assert (row(mgr, held) == row(mgr, plain)).all()

    refused = constrained(tok, mgr, THINKING)  # an object: '"' cannot start it
    for token_id in thinking:
        assert mgr.accept(refused, token_id)
    assert not mgr.accept(refused, closing_quote)


def test_a_model_that_does_not_open_its_thinking_answers_under_the_grammar(tok):
    """ "opening": the grammar's tokens, or one that opens the thinking whole; the default
    model's vocabulary has no such token, so its rows are the grammar's from the first."""
    mgr = manager(tok)
    request = constrained(tok, mgr, OPENING)
    plain = constrained(tok, mgr, None)
    assert (row(mgr, request) == row(mgr, plain)).all()
    (brace,) = tok.tokenizer.encode("{", add_special_tokens=False).ids
    assert mgr.accept(request, brace)
    assert request.grammar.phase == "answer"


def test_enable_in_reasoning_constrains_the_thinking_too(tok):
    mgr = manager(tok, enable_in_reasoning=True)
    request = constrained(tok, mgr, THINKING)
    assert not isinstance(request.grammar, ThinkingMatcher)


def test_the_detokenizer_splits_each_delta(tok):
    out = OutputProcessor(tok.tokenizer)
    params = SamplingParams(max_tokens=100, reasoning=THINKING)
    out.add_request(RequestOutputSpec("r", params, num_prompt_tokens=3))
    text = "Two and two.</think>\n\nThe answer is 4."
    ids = tok.tokenizer.encode(text, add_special_tokens=False).ids
    deltas = []
    for i, token_id in enumerate(ids):
        finish = "length" if i == len(ids) - 1 else None
        batch = TokenBatch([RequestTokens("r", [token_id], finish_reason=finish)])
        deltas += out.process(batch)[0]
    assert "".join(d.reasoning for d in deltas) == "Two and two."
    assert "".join(d.text for d in deltas) == "The answer is 4."
    assert deltas[-1].finish_reason == "length"
