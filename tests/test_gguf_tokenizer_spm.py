"""SentencePiece (``tokenizer.ggml.model == "llama"``) GGUF tokenizers against independent references.

The fixture is llama.cpp's vocab-only GGUF of Llama-2's tokenizer with its test texts and the
ids HF's Llama-2 tokenizer (LlamaTokenizerFast) gives them (tests/data/README.md). Where the
``sentencepiece`` package happens to be installed, the same vocabulary loaded into SentencePiece
itself is a second reference on random text.
"""

from __future__ import annotations

import json
import random
from pathlib import Path
from typing import Any

import pytest
from tokenizers import Tokenizer

from services.detokenizer.incremental import IncrementalDetokenizer
from services.model_loader.errors import ModelLoadError
from services.model_loader.gguf_convert import open_gguf, read_metadata
from services.model_loader.gguf_tokenizer import build_tokenizer, build_tokenizer_files
from services.model_loader.tokenizer import load_tokenizer

DATA = Path(__file__).parent / "data"
VOCAB = DATA / "ggml-vocab-llama-spm.gguf"
BOS, EOS, UNK = 1, 2, 0


def _cases() -> list[tuple[str, list[int]]]:
    # The format of llama.cpp's tests/test-tokenizer-0.cpp: texts separated by the marker (the
    # file ends with one), and one line of space-separated ids per text.
    texts = (
        VOCAB.with_suffix(".gguf.inp")
        .read_text(encoding="utf-8")
        .split("\n__ggml_vocab_test__\n")[:-1]
    )
    lines = VOCAB.with_suffix(".gguf.out").read_text(encoding="utf-8").split("\n")[:-1]
    assert len(texts) == len(lines) == 46
    return [(text, [int(x) for x in line.split()]) for text, line in zip(texts, lines, strict=True)]


CASES = _cases()


@pytest.fixture(scope="module")
def meta() -> dict[str, Any]:
    return read_metadata(open_gguf(VOCAB))


@pytest.fixture(scope="module")
def tok(meta: dict[str, Any]) -> Tokenizer:
    return build_tokenizer(meta)


def test_inp_texts_match_hf_llama2_ids(tok: Tokenizer) -> None:
    """Whitespace runs, leading spaces, multilingual text, emoji through byte fallback."""
    wrong = [
        (text, want, got)
        for text, want in CASES
        if (got := tok.encode(text, add_special_tokens=False).ids) != want
    ]
    assert wrong == []
    assert {243, 162, 169, 156} <= {i for _, ids in CASES for i in ids}  # 🦙 as <0xF0>.. bytes


def test_bos_like_llama_tokenizer_fast(tok: Tokenizer, meta: dict[str, Any], tmp_path) -> None:
    """BOS (add_bos_token, set in this file and llama.cpp's default) from the tokenizer alone,
    from our converted folder, and from HF reading that folder; never doubled."""
    from transformers import AutoTokenizer

    for name, content in build_tokenizer_files(meta, 4096).items():
        (tmp_path / name).write_text(content, encoding="utf-8")
    config = json.loads((tmp_path / "tokenizer_config.json").read_text(encoding="utf-8"))
    assert (config["bos_token"], config["eos_token"], config["unk_token"]) == (
        "<s>",
        "</s>",
        "<unk>",
    )
    assert config["add_bos_token"] is True and config["add_eos_token"] is False
    info = load_tokenizer(tmp_path)
    hf = AutoTokenizer.from_pretrained(tmp_path)
    for text, want in CASES:
        assert tok.encode(text).ids == [BOS, *want], text
        assert info.encode(text) == [BOS, *want], text
        assert hf(text)["input_ids"] == [BOS, *want], text
        assert info.encode(text, add_special_tokens=False) == want, text
    assert info.eos_token_id == EOS and {BOS, EOS, UNK} <= info.all_special_ids

    older = {k: v for k, v in meta.items() if k != "tokenizer.ggml.add_bos_token"}
    assert build_tokenizer(older).encode("Hello").ids == [BOS, 15043]  # llama.cpp's default
    no_bos = {**meta, "tokenizer.ggml.add_bos_token": False, "tokenizer.ggml.add_eos_token": True}
    assert build_tokenizer(no_bos).encode("Hello").ids == [15043, EOS]
    files = build_tokenizer_files(no_bos, 4096)
    assert json.loads(files["tokenizer_config.json"])["add_bos_token"] is False


def test_decode_round_trips(tok: Tokenizer) -> None:
    for text, ids in CASES:
        assert tok.decode(ids) == text
        assert tok.decode([BOS, *ids, EOS]) == text
        # Only the first piece loses its "▁", so LlamaTokenizerFast also shows "<s> Hello".
        shown = tok.decode([BOS, *ids], skip_special_tokens=False)
        assert shown == ("<s> " + text if text else "<s>")


def _stream(tok: Tokenizer, ids: list[int], chunks: list[int]) -> list[str]:
    detok = IncrementalDetokenizer(tok)
    deltas, pos = [], 0
    for size in chunks:
        deltas.append(detok.update(ids[pos : pos + size]))
        pos += size
    return [*deltas, detok.update(ids[pos:]), detok.flush()]


def test_streaming_detokenization_matches_decode(tok: Tokenizer) -> None:
    """One token at a time, the "▁" prefix and split UTF-8 byte-fallback characters included."""
    for text, ids in CASES:
        deltas = _stream(tok, [BOS, *ids], [1] * (len(ids) + 1))
        assert "".join(deltas) == tok.decode(ids) == text
        assert all("\ufffd" not in d for d in deltas), text
    rng = random.Random(0)
    ids = [i for _, case in CASES for i in case]
    chunks = [rng.randint(1, 4) for _ in range(len(ids) // 2)]
    assert "".join(_stream(tok, ids, chunks)) == tok.decode(ids)


def test_special_and_user_defined_tokens(meta: dict[str, Any], tok: Tokenizer) -> None:
    """Control tokens in text are special (skipped in decode); a USER_DEFINED token stays whole
    and, as in llama.cpp and legacy LlamaTokenizerFast, the text after it gets its "▁"."""
    hello = tok.encode("Hello", add_special_tokens=False).ids
    world = tok.encode("world", add_special_tokens=False).ids
    assert tok.encode("<s>Hello</s>world", add_special_tokens=False).ids == [
        BOS, *hello, EOS, *world
    ]  # fmt: skip
    tokens = [*meta["tokenizer.ggml.tokens"], "<|im_start|>"]
    user = {
        **meta,
        "tokenizer.ggml.tokens": tokens,
        "tokenizer.ggml.scores": [*meta["tokenizer.ggml.scores"], 0.0],
        "tokenizer.ggml.token_type": [*meta["tokenizer.ggml.token_type"], 4],
    }
    ours = build_tokenizer(user)
    ids = ours.encode("Hello<|im_start|>world", add_special_tokens=False).ids
    assert ids == [*hello, len(tokens) - 1, *world]
    assert ours.decode(ids) == "Hello<|im_start|> world"


def test_rejects_bad_vocabularies(meta: dict[str, Any]) -> None:
    with pytest.raises(ModelLoadError, match="scores"):
        build_tokenizer({**meta, "tokenizer.ggml.scores": [0.0]})
    with pytest.raises(ModelLoadError, match="'bert' is not supported"):
        build_tokenizer({**meta, "tokenizer.ggml.model": "bert"})


def _sentencepiece(meta: dict[str, Any], add_dummy_prefix: bool) -> Any:
    import sentencepiece as spm
    from sentencepiece import sentencepiece_model_pb2 as pb

    proto = pb.ModelProto()
    proto.trainer_spec.model_type = pb.TrainerSpec.BPE
    proto.trainer_spec.byte_fallback = True
    proto.trainer_spec.vocab_size = len(meta["tokenizer.ggml.tokens"])
    proto.normalizer_spec.name = "identity"  # Llama's: no NFKC, keep whitespace runs
    proto.normalizer_spec.add_dummy_prefix = add_dummy_prefix
    proto.normalizer_spec.remove_extra_whitespaces = False
    for piece, score, kind in zip(
        meta["tokenizer.ggml.tokens"],
        meta["tokenizer.ggml.scores"],
        meta["tokenizer.ggml.token_type"],
        strict=True,
    ):
        proto.pieces.add(piece=piece, score=score, type=kind)
    return spm.SentencePieceProcessor(model_proto=proto.SerializeToString())


@pytest.mark.parametrize("add_space_prefix", [True, False])
def test_random_text_matches_sentencepiece(meta: dict[str, Any], add_space_prefix: bool) -> None:
    sp = _sentencepiece(meta, add_space_prefix)
    tok = build_tokenizer({**meta, "tokenizer.ggml.add_space_prefix": add_space_prefix})
    rng = random.Random(add_space_prefix)
    chars = list("abcdefghijklmnopqrstuvwxyz ABCXYZ  \n\t0123456789.,!?'\"-")
    chars += list("éüßçñ中文日本語한국어🦙😀Ελληνικάкириллица\u200b\u00a0")
    words = " ".join(text for text, _ in CASES).split()
    texts = [text for text, _ in CASES]
    for _ in range(1000):
        texts.append("".join(rng.choice(chars) for _ in range(rng.randint(0, 40))))
        texts.append((" " * rng.randint(0, 3)).join(rng.sample(words, rng.randint(1, 8))))
    for text in texts:
        ids = tok.encode(text, add_special_tokens=False).ids
        assert ids == sp.encode(text), text
        assert tok.decode(ids) == text
