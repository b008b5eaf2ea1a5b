"""A ``tokenizers`` tokenizer rebuilt from a GGUF file's ``tokenizer.ggml.*`` metadata.

A GGUF carries the vocabulary, the merges, a token type per token and a pre-tokenizer name
(``tokenizer.ggml.pre``), but no ``tokenizer.json``. For ``tokenizer.ggml.model == "gpt2"`` we
rebuild the byte-level BPE that the original model shipped: the merges and vocabulary as stored,
CONTROL tokens as special added tokens, USER_DEFINED ones as plain added tokens, and the split
regex llama.cpp uses for that pre-tokenizer name. ``"llama"`` (SentencePiece) vocabularies are
rebuilt in ``gguf_spm``.
"""

from __future__ import annotations

import json
import sys
from functools import cache
from typing import Any

from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers

from services.model_loader.errors import ModelLoadError
from services.model_loader.gguf_spm import build_spm_tokenizer

TOKEN_TYPE_CONTROL = 3
TOKEN_TYPE_USER_DEFINED = 4

_LLAMA3_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_QWEN2_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_LLAMA3_NAMES = {"llama3", "llama-v3", "llama-bpe", "smaug-bpe", "falcon3", "dbrx", "pixtral"}
_QWEN2_NAMES = {"qwen2", "deepseek-r1-qwen", "megrez"}
# llama.cpp splits digits one by one before the GPT-2 regex for these (as the original
# tokenizer.json files do with a ``Digits`` pre-tokenizer).
_DIGITS_THEN_GPT2_NAMES = {"smollm", "starcoder", "refact", "codeshell"}
_GPT2_NAMES = {"gpt2", "default", "gpt-2"}


@cache
def _byte_spelling() -> dict[int, str]:
    """GPT-2's bytes_to_unicode: printable Latin-1 bytes stand for themselves, the rest U+0100+."""
    printable = [
        *range(ord("!"), ord("~") + 1),
        *range(ord("¡"), ord("¬") + 1),
        *range(ord("®"), ord("ÿ") + 1),
    ]
    spelling = {b: chr(b) for b in printable}
    for n, b in enumerate(b for b in range(256) if b not in spelling):
        spelling[b] = chr(256 + n)
    return spelling


@cache
def _byte_alphabet() -> frozenset[str]:
    return frozenset(_byte_spelling().values())


def _pre_tokenizer(pre: str | None) -> pre_tokenizers.PreTokenizer:
    def split_then_bytes(regex: str) -> pre_tokenizers.PreTokenizer:
        return pre_tokenizers.Sequence(
            [
                pre_tokenizers.Split(Regex(regex), behavior="isolated", invert=False),
                pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
            ]
        )

    if pre in _LLAMA3_NAMES:
        return split_then_bytes(_LLAMA3_SPLIT)
    if pre in _QWEN2_NAMES:
        return split_then_bytes(_QWEN2_SPLIT)
    if pre in _DIGITS_THEN_GPT2_NAMES:
        return pre_tokenizers.Sequence(
            [
                pre_tokenizers.Digits(individual_digits=True),
                pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True),
            ]
        )
    if pre not in _GPT2_NAMES and pre is not None:
        print(f"warning: unknown GGUF pre-tokenizer {pre!r}; using GPT-2's split", file=sys.stderr)
    return pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)


def _add_special(meta: dict[str, Any]) -> tuple[bool, bool]:
    """``(add_bos, add_eos)``; llama.cpp adds BOS to a SentencePiece vocabulary by default."""
    default_bos = meta.get("tokenizer.ggml.model") == "llama"
    return (
        bool(meta.get("tokenizer.ggml.add_bos_token", default_bos)),
        bool(meta.get("tokenizer.ggml.add_eos_token", False)),
    )


def build_tokenizer(meta: dict[str, Any]) -> Tokenizer:
    """The tokenizer that ``tokenizer.ggml.*`` metadata describes (byte-level BPE or SentencePiece).

    A SentencePiece tokenizer adds BOS/EOS itself (post-processor) as its ``tokenizer.json``
    would; a byte-level one leaves that to ``add_bos_token`` in ``tokenizer_config.json``.
    """
    model = meta.get("tokenizer.ggml.model")
    if model == "llama":
        add_bos, add_eos = _add_special(meta)
        return build_spm_tokenizer(meta, add_bos=add_bos, add_eos=add_eos)
    if model != "gpt2":
        raise ModelLoadError(
            f"GGUF tokenizer model {model!r} is not supported; supported: 'gpt2' (byte-level BPE), "
            "'llama' (SentencePiece)"
        )
    tokens: list[str] = meta.get("tokenizer.ggml.tokens") or []
    merges: list[str] = meta.get("tokenizer.ggml.merges") or []
    if not tokens or not merges:
        raise ModelLoadError("GGUF file has no tokenizer vocabulary or merges")
    types: list[int] = meta.get("tokenizer.ggml.token_type") or [1] * len(tokens)

    alphabet = _byte_alphabet()
    vocab: dict[str, int] = {}
    for i, tok in enumerate(tokens):
        # A token spelled outside the byte alphabet (rare, added tokens) is stored as raw text.
        key = tok if set(tok) <= alphabet else "".join(_byte_spelling()[b] for b in tok.encode())
        vocab.setdefault(key, i)
    pairs: list[tuple[str, str]] = []
    for merge in merges:
        left, _, right = merge.partition(" ")
        pairs.append((left, right))
    tokenizer = Tokenizer(
        models.BPE(vocab=vocab, merges=pairs, fuse_unk=False, byte_fallback=False)
    )
    if meta.get("tokenizer.ggml.pre") in _QWEN2_NAMES:
        tokenizer.normalizer = normalizers.NFC()
    tokenizer.pre_tokenizer = _pre_tokenizer(meta.get("tokenizer.ggml.pre"))
    tokenizer.decoder = decoders.ByteLevel()

    special = [
        AddedToken(tok, special=True, normalized=False)
        for tok, kind in zip(tokens, types, strict=False)
        if kind == TOKEN_TYPE_CONTROL and set(tok) <= alphabet
    ]
    user = [
        AddedToken(tok, special=False, normalized=False)
        for tok, kind in zip(tokens, types, strict=False)
        if kind == TOKEN_TYPE_USER_DEFINED and tok in vocab
    ]
    tokenizer.add_special_tokens(special)
    tokenizer.add_tokens(user)
    return tokenizer


def build_tokenizer_files(meta: dict[str, Any], model_max_length: int) -> dict[str, str]:
    """``tokenizer.json`` and ``tokenizer_config.json`` contents for a converted GGUF."""
    tokenizer = build_tokenizer(meta)
    tokens: list[str] = meta["tokenizer.ggml.tokens"]

    def token(key: str) -> str | None:
        idx = meta.get(f"tokenizer.ggml.{key}")
        return tokens[int(idx)] if idx is not None and 0 <= int(idx) < len(tokens) else None

    add_bos, add_eos = _add_special(meta)
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": token("bos_token_id"),
        "eos_token": token("eos_token_id"),
        "unk_token": token("unknown_token_id"),
        "pad_token": token("padding_token_id"),
        "add_bos_token": add_bos,
        "add_eos_token": add_eos,
        "model_max_length": model_max_length,
        "chat_template": _chat_templates(meta),
    }
    return {
        "tokenizer.json": tokenizer.to_str(pretty=False),
        "tokenizer_config.json": json.dumps(config, indent=2, ensure_ascii=False),
    }


def _chat_templates(meta: dict[str, Any]) -> str | list[dict[str, str]] | None:
    """The GGUF's chat template; with named ones (llama.cpp's ``tokenizer.chat_template.NAME``,
    e.g. ``tool_use``) HF's list form, the plain one as "default"."""
    default = meta.get("tokenizer.chat_template")
    prefix = "tokenizer.chat_template."
    named = {
        k[len(prefix) :]: v for k, v in meta.items() if k.startswith(prefix) and isinstance(v, str)
    }
    if not named:
        return default
    if isinstance(default, str):
        named = {"default": default, **named}
    return [{"name": name, "template": template} for name, template in named.items()]
