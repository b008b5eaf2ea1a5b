"""tiktoken's ids for a byte-level BPE vocabulary (``services/tokenizer/fast_bpe.py``) are HF
tokenizers' own: for the default model's tokenizer, and for BPEs trained here with each
pre-tokenizer it takes (GPT-2's regex, with HF's digit split in front, Llama 3's
``Split``), on text made to hit their edges; the ones it cannot take get none."""

from __future__ import annotations

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from tokenizers import Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers

from services.tokenizer.fast_bpe import FastBPE

LLAMA3_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*"
    r"|\s*[\r\n]+|\s+(?!\S)|\s+"
)
SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
CORPUS = [
    "The committee met on 12 March 2024 at 10:30. It reviewed items 1-17 (of 20).",
    "we'll see what they've done, isn't it? x+y=z; a/b\\c <tag attr='1'>  indented",
    "Résumé: naïve café, 日本語, ¿qué? Costs were $1,234.56 or 3.5e-3 per unit.\tNext:\n\n",
    "def f(x):\n    return x ** 2  # squares\r\n\r\nprint(f(3))   \n  \t end",
] * 20

# Pieces that meet at every kind of boundary the pre-tokenizers care about.
_PIECES = ["a", "ab", " ", "  ", "\n", "\r\n", "\t", "1", "12", "1234", " 5", "'s", "'LL", "x,",
           "!!", "é", "日本", "🙂", "<|im_start|>", "<|im_end|>", "-", "$", " the", "The"]  # fmt: skip
texts = st.one_of(
    st.lists(st.sampled_from(_PIECES), max_size=40).map("".join),
    st.text(max_size=60),
)


def _trained(pre: pre_tokenizers.PreTokenizer, *, ignore_merges: bool = False,
             normalizer: normalizers.Normalizer | None = None) -> Tokenizer:  # fmt: skip
    tok = Tokenizer(models.BPE(ignore_merges=ignore_merges))
    tok.pre_tokenizer = pre
    tok.decoder = decoders.ByteLevel()
    if normalizer is not None:
        tok.normalizer = normalizer
    trainer = trainers.BpeTrainer(
        vocab_size=700,
        special_tokens=SPECIALS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tok.train_from_iterator(CORPUS, trainer)
    return tok


def _default() -> Tokenizer:
    from services.tokenizer.loader import load_serving_tokenizer

    return load_serving_tokenizer(None).tokenizer


TOKENIZERS = {
    "default model (Digits, ByteLevel)": _default,
    "GPT-2 (ByteLevel regex)": lambda: _trained(
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    ),
    "digits then ByteLevel": lambda: _trained(pre_tokenizers.Sequence([
        pre_tokenizers.Digits(individual_digits=True),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True),
    ])),
    "Llama 3 (Split, ByteLevel, ignore_merges)": lambda: _trained(pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(LLAMA3_SPLIT), behavior="isolated"),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
    ]), ignore_merges=True),
}  # fmt: skip


@pytest.fixture(scope="module", params=list(TOKENIZERS))
def pair(request: pytest.FixtureRequest) -> tuple[Tokenizer, FastBPE]:
    tok = TOKENIZERS[request.param]()
    fast = FastBPE.build(tok)
    assert fast is not None, request.param
    return tok, fast


def test_the_corpus_and_a_long_prompt_give_hfs_ids(pair: tuple[Tokenizer, FastBPE]) -> None:
    tok, fast = pair
    for text in [*CORPUS[:4], "".join(CORPUS) + " <|im_start|>user\nhi<|im_end|>\n"]:
        assert fast.encode(text) == tok.encode(text, add_special_tokens=False).ids


@settings(
    max_examples=300, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(text=texts)
def test_any_text_gives_hfs_ids_or_none(pair: tuple[Tokenizer, FastBPE], text: str) -> None:
    tok, fast = pair
    ids = fast.encode(text)
    if ids is not None:  # None: a byte the vocabulary lacks (the caller asks HF)
        assert ids == tok.encode(text, add_special_tokens=False).ids


def test_a_byte_missing_from_the_vocabulary_gives_none() -> None:
    tok = _default()  # (its vocabulary lacks a few control bytes)
    fast = FastBPE.build(tok)
    assert fast is not None
    missing = [b for b in range(32) if fast.encode(chr(b)) is None]
    assert missing, "the default vocabulary was expected to lack some control bytes"


def test_tokenizers_it_cannot_read_get_none() -> None:
    metaspace = Tokenizer(models.BPE())
    metaspace.pre_tokenizer = pre_tokenizers.Metaspace()
    metaspace.train_from_iterator(CORPUS, trainers.BpeTrainer(vocab_size=300))
    assert FastBPE.build(metaspace) is None  # (SentencePiece-style: no bytes)
    normalized = _trained(
        pre_tokenizers.ByteLevel(add_prefix_space=False), normalizer=normalizers.NFKC()
    )
    assert FastBPE.build(normalized) is None
    prefix_space = _trained(pre_tokenizers.ByteLevel(add_prefix_space=True))
    assert FastBPE.build(prefix_space) is None
    wordpiece = Tokenizer(models.WordPiece(unk_token="[UNK]"))
    wordpiece.pre_tokenizer = pre_tokenizers.Whitespace()
    wordpiece.train_from_iterator(
        CORPUS, trainers.WordPieceTrainer(vocab_size=300, special_tokens=["[UNK]"])
    )
    assert FastBPE.build(wordpiece) is None
