"""A byte-level BPE tokenizer's ids through tiktoken: ~4x HF ``tokenizers``' speed.

The router tokenizes every prompt new to it (``services/router/prompt_cache.py``): a
6,000-token context costs ~5-7 ms of CPU in HF ``tokenizers`` (``encode_batch_fast``) and
~1.4 ms in tiktoken, which reads the same vocabulary. Only tokenizers whose every step
tiktoken does the same way get one (``FastBPE.build``; None otherwise):

- the model is BPE over ``ByteLevel`` bytes (GPT-2, SmolLM, Llama 3, Qwen 2/3, DeepSeek
  V3): no normalizer, no ``byte_fallback``, no dropout, no word prefix or suffix;
- the pre-tokenizer is one regex: ``ByteLevel``'s own (``use_regex``, GPT-2's), optionally
  after ``Digits`` (one piece per digit: folded into the regex), or a ``Split`` (isolated
  matches) before a ``ByteLevel`` without one (Llama 3's, Qwen's);
- added tokens match their text exactly (none strips spaces or matches whole words only).

BPE's merge order becomes tiktoken's ranks (a merge's result ranks by its first merge),
the ranks map back to the vocabulary's ids. ``ignore_merges`` (a piece in the vocabulary
is one token) is what tiktoken always does: a tokenizer without it gets one only if the
sample (``check``) agrees, as it must with any merge list whose results differ from a
shortcut's only in contrived pieces. The caller still compares what it depends on against
HF's (the prompt cache: every 64th prompt whole), and uses HF's where they differ.
"""

from __future__ import annotations

import json
import logging
from typing import Any

log = logging.getLogger(__name__)

# GPT-2's pre-tokenizer regex (``ByteLevel(use_regex=True)``), and with HF's ``Digits(
# individual_digits=True)`` in front of it: a digit is a piece of its own, and spaces
# before a digit end their piece where the digit starts (the digit split cut them off).
GPT2_PATTERN = r"""'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"""
GPT2_DIGITS_PATTERN = (
    r"""'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+|\s+(?=\p{N})|\s+(?!\S)|\s+"""
)


def _byte_decoder() -> dict[str, int]:
    """``ByteLevel``'s printable stand-in for each byte, back to the byte (GPT-2's)."""
    bs = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), 256)]
    cs = list(bs)
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return {chr(c): b for b, c in zip(bs, cs, strict=True)}


def _pattern(pre: dict[str, Any] | None) -> str | None:
    """The one regex that splits text as the pre-tokenizer does; None if there is none."""
    if pre is None:
        return None
    kind = pre.get("type")
    steps = pre.get("pretokenizers", []) if kind == "Sequence" else [pre]
    kinds = [s.get("type") for s in steps]
    if any(s.get("type") == "ByteLevel" and s.get("add_prefix_space") for s in steps):
        return None
    if kinds == ["ByteLevel"] and steps[0].get("use_regex", True):
        return GPT2_PATTERN
    if kinds == ["Digits", "ByteLevel"] and steps[1].get("use_regex", True):
        return GPT2_DIGITS_PATTERN if steps[0].get("individual_digits") else None
    if kinds == ["Split", "ByteLevel"] and not steps[1].get("use_regex", True):
        split = steps[0]
        regex = (split.get("pattern") or {}).get("Regex")
        if regex and split.get("behavior") == "Isolated" and not split.get("invert"):
            return str(regex)
    return None


class FastBPE:
    """``encode(text)``: the ids HF's tokenizer gives ``text`` without its post-processor
    (``add_special_tokens=False``), added tokens in the text included."""

    def __init__(self, encoding: Any, table: list[int], special: bool) -> None:
        self._encoding = encoding
        self._table = table  # tiktoken's rank -> the vocabulary's id (-1: none)
        self._special = special

    @classmethod
    def build(cls, tokenizer: Any) -> FastBPE | None:
        """From an HF ``tokenizers.Tokenizer``; None when tiktoken would not do what it
        does (see the module's docstring) or is not installed."""
        try:
            import tiktoken
        except ImportError:
            return None
        spec = json.loads(tokenizer.to_str())
        model = spec.get("model") or {}
        if (model.get("type") != "BPE" or spec.get("normalizer") is not None
                or model.get("byte_fallback") or model.get("dropout")
                or model.get("continuing_subword_prefix") or model.get("end_of_word_suffix")
                or (spec.get("decoder") or {}).get("type") != "ByteLevel"):  # fmt: skip
            return None
        pattern = _pattern(spec.get("pre_tokenizer"))
        added = spec.get("added_tokens") or []
        if pattern is None or any(
            t.get("lstrip") or t.get("rstrip") or t.get("single_word") for t in added
        ):
            return None
        to_byte = _byte_decoder()

        def raw(piece: str) -> bytes | None:
            try:
                return bytes(to_byte[c] for c in piece)
            except KeyError:  # not a byte-level token
                return None

        vocab: dict[bytes, int] = {}
        for piece, i in model.get("vocab", {}).items():
            if (b := raw(piece)) is not None:
                vocab[b] = i
        ranks = {bytes([b]): b for b in range(256)}
        for m in model.get("merges", []):
            left, right = m.split(" ", 1) if isinstance(m, str) else m
            a, b = raw(left), raw(right)
            if a is None or b is None:
                return None
            ranks.setdefault(a + b, len(ranks))
        table = [vocab.get(b, -1) for b, _ in sorted(ranks.items(), key=lambda kv: kv[1])]
        if any(table[r] < 0 for r in range(256, len(table))):
            return None  # a merge whose result is not in the vocabulary
        specials = {}
        for t in added:
            specials[t["content"]] = len(table)
            table.append(int(t["id"]))
        try:
            encoding = tiktoken.Encoding(
                "actorserve-fast-bpe", pat_str=pattern, mergeable_ranks=ranks,
                special_tokens=specials,
            )  # fmt: skip
        except (ValueError, TypeError) as e:  # a pattern tiktoken's regex engine refuses
            log.info("fast BPE: tiktoken refused this tokenizer: %s", e)
            return None
        return cls(encoding, table, bool(specials))

    def encode(self, text: str) -> list[int] | None:
        """The ids; None when the text needs a byte the vocabulary lacks (HF's then)."""
        if self._special:
            ranks = self._encoding.encode(text, allowed_special="all", disallowed_special=())
        else:
            ranks = self._encoding.encode_ordinary(text)
        table = self._table
        ids = [table[r] for r in ranks]
        return None if -1 in ids else ids
