"""The ``xgrammar`` backend (vLLM's default): compiled grammars cached by constraint, one
``GrammarMatcher`` per request."""

from __future__ import annotations

import functools
import json
import os
import re

import numpy as np
import xgrammar as xgr

from services.structured_output.backend import (
    Constraint,
    GrammarError,
    VocabInfo,
    choices,
)
from services.structured_output.json_bounds import JsonBounds, bound_grammar

# "[12:23:47] /project/cpp/regex_converter.cc:94: " in front of xgrammar's C++ messages
_CPP_PREFIX = re.compile(r"^\[[\d:]+\] \S+:\d+: (Check failed: \(.*?\) is false: )?")


def _message(e: Exception) -> str:
    return _CPP_PREFIX.sub("", str(e).strip()).strip()


def tokenizer_info(vocab: VocabInfo) -> xgr.TokenizerInfo:
    """xgrammar's view of a ``tokenizers.Tokenizer`` (its ``from_huggingface`` wants a
    transformers tokenizer): the vocabulary by id, and the encoding the tokenizer's JSON
    declares (byte-level BPE for the default model; byte fallback for SentencePiece)."""
    tok = vocab.tokenizer
    encoded: list[str] = [""] * tok.get_vocab_size(with_added_tokens=True)
    for token, token_id in tok.get_vocab(with_added_tokens=True).items():
        encoded[token_id] = token
    meta = xgr.TokenizerInfo._detect_metadata_from_hf(tok.to_str())
    return xgr.TokenizerInfo(
        encoded,
        vocab_type=meta["vocab_type"],
        vocab_size=vocab.vocab_size,
        stop_token_ids=list(vocab.stop_token_ids),
        add_prefix_space=meta["add_prefix_space"],
    )


class XgrammarMatcher:
    def __init__(self, compiled: xgr.CompiledGrammar) -> None:
        self._matcher = xgr.GrammarMatcher(compiled)

    def accept(self, token_id: int) -> bool:
        return bool(self._matcher.accept_token(token_id))

    def fill(self, bitmask: np.ndarray, row: int) -> None:
        self._matcher.fill_next_token_bitmask(bitmask, row)

    def rollback(self, num_tokens: int) -> None:
        self._matcher.rollback(num_tokens)

    def is_terminated(self) -> bool:
        return bool(self._matcher.is_terminated())


def _structural_tag(spec: str) -> str | tuple[list[xgr.StructuralTagItem], list[str]]:
    """xgrammar's arguments for a structural tag: its own format (``{"type":
    "structural_tag", "format": ...}``) as text, or vLLM's older one (``structures`` of
    begin / JSON schema / end, and ``triggers``) as tag items and triggers."""
    try:
        tag = json.loads(spec)
    except ValueError:
        return spec  # xgrammar says what is wrong with it
    if isinstance(tag, dict) and "structures" in tag:
        try:
            structures, triggers = tag["structures"], tag["triggers"]
            ok: bool = isinstance(structures, list) and isinstance(triggers, list)
            ok = ok and bool(structures) and all(isinstance(t, str) and t for t in triggers)
            ok = ok and all(
                isinstance(s, dict) and isinstance(s.get("begin"), str)
                and isinstance(s.get("end"), str) and isinstance(s.get("schema"), dict)
                for s in structures
            )  # fmt: skip
            if not ok:
                raise TypeError("types")
            items = [
                xgr.StructuralTagItem(
                    begin=s["begin"], schema=json.dumps(s["schema"]), end=s["end"]
                )
                for s in structures
            ]
            return items, triggers
        except (KeyError, TypeError) as e:
            raise GrammarError(
                "Invalid structural_tag for structured outputs: 'structures' must be a list "
                "of objects with strings 'begin' and 'end' and an object 'schema', and "
                f"'triggers' a list of strings ({e} missing or wrong)"
            ) from None
    return spec


@functools.lru_cache(maxsize=256)
def _bounded_json(schema: str, any_whitespace: bool, bounds: JsonBounds) -> str:
    """The grammar (EBNF) of a JSON schema with ``bounds`` (``json_bounds.py``)."""
    grammar = xgr.Grammar.from_json_schema(
        schema, any_whitespace=any_whitespace, max_whitespace_cnt=bounds.whitespace
    )
    return bound_grammar(str(grammar), bounds)


def _cache_limit_bytes() -> int:
    """The compiled grammars kept for reuse, least recently used first out: 512 MB, or
    ``VLLM_XGRAMMAR_CACHE_MB`` (vLLM's setting); without a limit one client sending new
    schemas would grow the scheduler without end."""
    return int(float(os.environ.get("VLLM_XGRAMMAR_CACHE_MB", "512")) * (1 << 20))


def _invalid(c: Constraint, e: Exception) -> GrammarError:
    return GrammarError(f"Invalid {c.kind} for structured outputs: {_message(e)}")


class XgrammarBackend:
    def __init__(self, vocab: VocabInfo, max_threads: int = 2) -> None:
        self.vocab_size = vocab.vocab_size
        # The compiler keeps every compiled grammar, keyed by its source: one schema used by
        # many requests compiles once.
        self._compiler = xgr.GrammarCompiler(
            tokenizer_info(vocab), max_threads=max_threads, cache_limit_bytes=_cache_limit_bytes()
        )

    @staticmethod
    def check(c: Constraint) -> None:
        try:
            if c.kind == "json":
                xgr.Grammar.from_json_schema(c.spec, any_whitespace=c.any_whitespace)
            elif c.kind == "regex":
                xgr.Grammar.from_regex(c.spec)
            elif c.kind == "choice":
                choices(c.spec)
            elif c.kind == "grammar":
                xgr.Grammar.from_ebnf(c.spec)
            elif c.kind == "structural_tag":
                tag = _structural_tag(c.spec)
                if isinstance(tag, str):
                    xgr.Grammar.from_structural_tag(tag)
                else:
                    xgr.Grammar.from_structural_tag(*tag)
        except GrammarError:
            raise
        except Exception as e:  # xgrammar raises RuntimeError/ValueError/TypeError by kind
            raise _invalid(c, e) from None

    def _compile(self, c: Constraint) -> xgr.CompiledGrammar:
        try:
            if c.kind in ("json", "json_object"):
                schema = c.spec if c.kind == "json" else '{"type": "object"}'
                if c.bounds.any:
                    ebnf = _bounded_json(schema, c.any_whitespace, c.bounds)
                    return self._compiler.compile_grammar(ebnf)
                return self._compiler.compile_json_schema(schema, any_whitespace=c.any_whitespace)
            if c.kind == "regex":
                return self._compiler.compile_regex(c.spec)
            if c.kind == "choice":
                alternatives = " | ".join(json.dumps(v) for v in choices(c.spec))
                return self._compiler.compile_grammar(f"root ::= {alternatives}")
            if c.kind == "grammar":
                return self._compiler.compile_grammar(c.spec)
            tag = _structural_tag(c.spec)
            if isinstance(tag, str):
                return self._compiler.compile_structural_tag(tag)
            return self._compiler.compile_structural_tag(*tag)
        except GrammarError:
            raise
        except Exception as e:
            raise _invalid(c, e) from None

    def matcher(self, constraint: Constraint) -> XgrammarMatcher:
        return XgrammarMatcher(self._compile(constraint))
