"""IncrementalDetokenizer against tokenizer.decode(all ids) on the default model's tokenizer."""

from __future__ import annotations

import random

import pytest
import tokenizers
from tokenizers import decoders, models, pre_tokenizers

from services.detokenizer.incremental import IncrementalDetokenizer
from services.tokenizer.loader import load_serving_tokenizer

TEXTS = [
    "你好，世界！今天天气很好。",
    "Emoji: 🎉👨‍👩‍👧 and flags 🇫🇷🇯🇵, café naïve — done.",
    "混合 text with 数字 123 and ✨sparkles✨ 😀😃😄",
    "def f(x):\n    return x ** 2  # ½ ∑ ∫ ≠",
]


@pytest.fixture(scope="module")
def tok() -> tokenizers.Tokenizer:
    return load_serving_tokenizer().tokenizer


def stream(detok: IncrementalDetokenizer, ids: list[int], chunks: list[int]) -> list[str]:
    """Feed ``ids`` in chunks of the given sizes; return the streamed deltas (flush last)."""
    deltas, pos = [], 0
    for size in chunks:
        deltas.append(detok.update(ids[pos : pos + size]))
        pos += size
    deltas.append(detok.update(ids[pos:]))
    deltas.append(detok.flush())
    return deltas


@pytest.mark.parametrize("text", TEXTS)
def test_one_token_at_a_time_matches_decode(tok, text):
    ids = tok.encode(text, add_special_tokens=False).ids
    assert any(tok.decode([i]).endswith("\ufffd") for i in ids) or text.isascii()
    detok = IncrementalDetokenizer(tok)
    deltas = stream(detok, ids, [1] * len(ids))
    assert "".join(deltas) == tok.decode(ids) == text
    assert all("\ufffd" not in d for d in deltas)
    assert detok.output_text == text


@pytest.mark.parametrize("seed", range(4))
def test_random_chunks_match_decode(tok, seed):
    rng = random.Random(seed)
    text = " ".join(TEXTS)
    ids = tok.encode(text, add_special_tokens=False).ids
    chunks = []
    while sum(chunks) < len(ids):
        chunks.append(rng.randint(1, 4))
    assert "".join(stream(IncrementalDetokenizer(tok), ids, chunks)) == text


def test_prompt_context(tok):
    prompt = tok.encode("用户：你好", add_special_tokens=False).ids
    out = tok.encode("🎉 好的，没问题", add_special_tokens=False).ids
    detok = IncrementalDetokenizer(tok, prompt_token_ids=prompt)
    text = "".join(stream(detok, out, [1] * len(out)))
    full = tok.decode(prompt + out)
    assert text == full[len(tok.decode(prompt)) :]
    assert detok.output_token_ids == out


@pytest.mark.parametrize("skip", [True, False])
def test_special_tokens(tok, skip):
    text = "<|im_start|>assistant\n你好🎉<|im_end|>\n<|im_start|>user\nhi<|im_end|>"
    ids = tok.encode(text, add_special_tokens=False).ids
    assert tok.token_to_id("<|im_end|>") in ids
    detok = IncrementalDetokenizer(tok, skip_special_tokens=skip)
    got = "".join(stream(detok, ids, [1] * len(ids)))
    assert got == tok.decode(ids, skip_special_tokens=skip)
    assert ("<|im_end|>" in got) is not skip


def test_incomplete_bytes_at_finish_match_decode(tok):
    ids = tok.encode("ok 🎉", add_special_tokens=False).ids
    cut = ids[:-1]  # the emoji's last byte token is missing
    assert tok.decode(cut).endswith("\ufffd")
    detok = IncrementalDetokenizer(tok)
    deltas = [detok.update([i]) for i in cut]
    assert "\ufffd" not in "".join(deltas)
    assert "".join(deltas) + detok.flush() == tok.decode(cut)


def _stop_case(tok, text: str, stop: str) -> list[int]:
    ids = tok.encode(text, add_special_tokens=False).ids
    # The stop string must straddle a token boundary for the test to mean anything.
    assert not any(stop in tok.decode([i]) for i in ids)
    return ids


@pytest.mark.parametrize(
    ("text", "stop"),
    [
        ("The answer is 42. Next question please.", "42. Next"),
        ("你好，世界！今天天气很好。再见", "天气很"),
        ("party 🎉🎉 time is over", "🎉 time"),
    ],
)
@pytest.mark.parametrize("include", [False, True])
def test_stop_string_split_across_tokens(tok, text, stop, include):
    ids = _stop_case(tok, text, stop)
    detok = IncrementalDetokenizer(
        tok, stop=[stop, "never-matches"], include_stop_str_in_output=include
    )
    expected = text[: text.index(stop) + (len(stop) if include else 0)]
    streamed = ""
    for i in ids:
        streamed += detok.update([i])
        # Streamed text is always a prefix of the final (truncated) text: no part of the
        # stop string leaks before the match is known.
        assert expected.startswith(streamed)
        if detok.stop_matched:
            break
    assert detok.stop_matched == stop
    streamed += detok.update(ids[-1:]) + detok.flush()  # ignored after the match
    assert streamed == detok.output_text == expected


def test_earliest_stop_string_wins(tok):
    text = "alpha beta gamma delta"
    ids = tok.encode(text, add_special_tokens=False).ids
    detok = IncrementalDetokenizer(tok, stop=["delta", "beta"])
    assert detok.update(ids) == "alpha "
    assert detok.stop_matched == "beta"


def test_stop_terminated_token_not_rendered(tok):
    ids = tok.encode("hello world", add_special_tokens=False).ids
    detok = IncrementalDetokenizer(tok)
    text = detok.update(ids, stop_terminated=True) + detok.flush()
    assert text == tok.decode(ids[:-1])
    detok = IncrementalDetokenizer(tok, include_stop_str_in_output=True)
    assert detok.update(ids, stop_terminated=True) + detok.flush() == "hello world"


def test_min_tokens_delays_stop(tok):
    ids = tok.encode("a b a b a b", add_special_tokens=False).ids
    detok = IncrementalDetokenizer(tok, stop=["b"], min_tokens=3)
    text = "".join(detok.update([i]) for i in ids) + detok.flush()
    # Tokens: "a", " b", " a", " b": the first " b" is within min_tokens and does not stop.
    assert text == "a b a "
    assert detok.stop_matched == "b"


def test_context_dependent_decoder():
    """Metaspace (SentencePiece) drops the leading space of the first token decoded."""
    vocab = {"▁Hello": 0, "▁world": 1, "!": 2, "▁": 3, "<unk>": 4}
    tok = tokenizers.Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Metaspace()
    tok.decoder = decoders.Metaspace()
    assert tok.decode([1]) == "world" and tok.decode([0, 1]) == "Hello world"
    detok = IncrementalDetokenizer(tok, prompt_token_ids=[0])
    assert "".join(stream(detok, [1, 2, 1], [1, 1, 1])) == " world! world"
    assert tok.decode([0, 1, 2, 1]) == "Hello world! world"
    detok = IncrementalDetokenizer(tok)
    assert "".join(stream(detok, [0, 1, 2], [1, 1, 1])) == tok.decode([0, 1, 2])


# ---------------------------------------------------------------- OutputProcessor (process logic)


def _spec(req_id, tok, prompt="hi", **sampling):
    from services.protocol import RequestOutputSpec, SamplingParams

    ids = tok.encode(prompt, add_special_tokens=False).ids
    return RequestOutputSpec(
        req_id, SamplingParams(**sampling), len(ids), ids[-5:], prompt_text=prompt
    )


def test_output_processor_stop_string_finishes_request(tok):
    from services.detokenizer.output_processor import OutputProcessor
    from services.protocol import FinishRequest, RequestTokens, TokenBatch

    out_ids = tok.encode(" one two three four", add_special_tokens=False).ids
    proc = OutputProcessor(tok)
    # Tokens before the spec (two sockets, no global order) wait for it.
    deltas, fins = proc.process(TokenBatch([RequestTokens("a", out_ids[:1], num_cached_tokens=3)]))
    assert deltas == [] and fins == []
    deltas, fins = proc.add_request(_spec("a", tok, stop=["three"]))
    # " one" is held back (it could start "three"), but the step still gets a delta, as in vLLM.
    assert [(d.text, d.token_ids, d.prompt_text) for d in deltas] == [("", out_ids[:1], "hi")]
    deltas, fins = proc.process(TokenBatch([RequestTokens("a", out_ids[1:])]))
    assert [(d.text, d.finish_reason, d.stop_reason) for d in deltas] == [
        (" one two ", "stop", "three")
    ]
    assert deltas[0].prompt_text is None and deltas[0].num_output_tokens == len(out_ids)
    assert deltas[0].num_cached_tokens == 3 and deltas[0].num_prompt_tokens == 1
    assert fins == [FinishRequest("a", "stop", "three")]
    # Late tokens are dropped; the scheduler's final item frees the state.
    assert proc.process(TokenBatch([RequestTokens("a", [1])])) == ([], [])
    assert proc.num_requests == 1
    assert proc.process(TokenBatch([RequestTokens("a", [], finish_reason="abort")])) == ([], [])
    assert proc.num_requests == 0


def test_output_processor_eos_and_logprobs(tok):
    from services.detokenizer.output_processor import OutputProcessor
    from services.protocol import RequestTokens, TokenBatch, TokenLogprobs

    out_ids = tok.encode(" 你好", add_special_tokens=False).ids
    eos = tok.token_to_id("<|im_end|>")
    proc = OutputProcessor(tok)
    proc.add_request(_spec("b", tok, logprobs=1, skip_special_tokens=False))
    lps = [TokenLogprobs(i, -0.5, 1, [i, 7], [-0.5, -2.0]) for i in [*out_ids, eos]]
    deltas, fins = proc.process(
        TokenBatch([RequestTokens("b", [*out_ids, eos], finish_reason="stop", logprobs=lps)])
    )
    (d,) = deltas
    # The stop token is not rendered, even with skip_special_tokens=False (vLLM's rule).
    assert d.text == " 你好" and d.finish_reason == "stop" and fins == []
    assert [lp.token for lp in d.logprobs] == [
        tok.decode([i], skip_special_tokens=False) for i in [*out_ids, eos]
    ]
    assert d.logprobs[0].top_tokens == [
        d.logprobs[0].token,
        tok.decode([7], skip_special_tokens=False),
    ]
    assert proc.num_requests == 0


def test_outputs_are_logged_whole_when_they_finish(tok, caplog):
    """--enable-log-outputs: one line per request at its end, with all of its text and ids."""
    from services.detokenizer.output_processor import OutputProcessor
    from services.protocol import RequestTokens, TokenBatch
    from services.request_log import RequestLog

    caplog.set_level("INFO", logger="services")
    out_ids = tok.encode(" one two three", add_special_tokens=False).ids
    for log in (None, RequestLog()):
        proc = OutputProcessor(tok, log)
        proc.add_request(_spec("c", tok))
        proc.process(TokenBatch([RequestTokens("c", out_ids[:2])]))
        assert "Generated response" not in caplog.text
        proc.process(TokenBatch([RequestTokens("c", out_ids[2:], finish_reason="length")]))
    [line] = [r.getMessage() for r in caplog.records if "Generated response" in r.getMessage()]
    assert line == (
        f"Generated response c: output: ' one two three', output_token_ids: {out_ids}, "
        "finish_reason: length"
    )
