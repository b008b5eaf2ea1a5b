"""The ``guidance`` backend: llguidance (``--structured-outputs-config '{"backend":
"guidance"}'``, vLLM's name). No compile step ahead of decoding: llguidance computes each
mask lazily from the grammar, which suits schemas seen once; the same bitmask layout as
xgrammar's."""

from __future__ import annotations

import json

import llguidance
import llguidance.numpy
import numpy as np

from services.structured_output.backend import (
    Constraint,
    GrammarError,
    VocabInfo,
    choices,
)


def _grammar(c: Constraint) -> str:
    """llguidance's grammar text for a constraint (errors show up when it is validated)."""
    options: dict[str, object] = {"whitespace_flexible": True}
    if c.bounds.whitespace is not None:  # (llguidance bounds no digits or strings of its own)
        options["whitespace_pattern"] = f"[\\x20\\n\\r\\t]{{0,{c.bounds.whitespace}}}"
    if not c.any_whitespace:  # xgrammar's one layout, so both backends write the same JSON
        options = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}
    if c.kind in ("json", "json_object"):
        schema = c.spec if c.kind == "json" else '{"type": "object"}'
        try:
            json.loads(schema)
            return llguidance.LLMatcher.grammar_from_json_schema(schema, defaults=options)  # type: ignore[arg-type]
        except ValueError as e:  # not JSON, or not a schema llguidance takes (a list, ...)
            raise GrammarError(f"Invalid json for structured outputs: {e}") from None
    if c.kind == "regex":
        return llguidance.LLMatcher.grammar_from_regex(c.spec)
    if c.kind == "choice":
        return llguidance.grammar_from("choice", json.dumps(choices(c.spec)))
    if c.kind == "grammar":
        return llguidance.grammar_from("grammar", c.spec)
    raise GrammarError(
        "structural_tag is not supported by the guidance structured outputs backend (use xgrammar)"
    )


class GuidanceMatcher:
    def __init__(self, matcher: llguidance.LLMatcher, stop_token_ids: tuple[int, ...]) -> None:
        self._matcher = matcher
        self._stop = stop_token_ids
        self._terminated = False

    def accept(self, token_id: int) -> bool:
        if self._matcher.is_stopped():  # complete: only a stop token (which validate refuses)
            if token_id in self._stop and self._matcher.consume_token(token_id):
                self._terminated = True
                return True
            return False
        # Checked first: a refused token would leave llguidance's matcher in its error state.
        if self._matcher.validate_tokens([token_id]) < 1:
            return False
        return self._matcher.consume_token(token_id)

    def fill(self, bitmask: np.ndarray, row: int) -> None:
        llguidance.numpy.fill_next_token_bitmask(self._matcher, bitmask, row)

    def rollback(self, num_tokens: int) -> None:
        self._matcher.rollback(num_tokens)

    def is_terminated(self) -> bool:
        """Complete and a stop token accepted (as xgrammar's: llguidance itself stops one
        token earlier, when only a stop token may follow)."""
        return self._terminated


class GuidanceBackend:
    def __init__(self, vocab: VocabInfo) -> None:
        self.vocab_size = vocab.vocab_size
        self._stop = vocab.stop_token_ids
        self._tokenizer = llguidance.LLTokenizer(
            vocab.tokenizer.to_str(),
            n_vocab=vocab.vocab_size,
            eos_token=list(vocab.stop_token_ids) or None,
        )

    @staticmethod
    def check(c: Constraint) -> None:
        error = llguidance.LLMatcher.validate_grammar(_grammar(c))
        if error:
            raise GrammarError(f"Invalid {c.kind} for structured outputs: {error}")

    def matcher(self, constraint: Constraint) -> GuidanceMatcher:
        matcher = llguidance.LLMatcher(self._tokenizer, _grammar(constraint), log_level=0)
        if matcher.is_error():
            raise GrammarError(
                f"Invalid {constraint.kind} for structured outputs: {matcher.get_error()}"
            )
        return GuidanceMatcher(matcher, self._stop)
