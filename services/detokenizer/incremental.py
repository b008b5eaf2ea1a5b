"""Incremental detokenization of one request's output, with stop strings.

Decoding one token id alone is wrong for two reasons: a byte-level BPE token
can hold part of a multi-byte UTF-8 character (decoding it alone gives U+FFFD),
and some decoders depend on context (SentencePiece's Metaspace drops the
leading space of the first token it sees). The tokenizers library's
``DecodeStream`` handles both in Rust, one call per token (as vLLM's
``FastIncrementalDetokenizer``): it keeps a short window of ids already shown
as context and returns the text a new id adds once it is complete. Primed with
a few prompt tokens, the first output token decodes as it would after the prompt.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

import tokenizers
from tokenizers.decoders import DecodeStream

# vLLM's INITIAL_INCREMENTAL_DETOKENIZATION_OFFSET: prompt tokens used as context, more
# (up to 24) when a shorter suffix starts inside a multi-byte character.
_PROMPT_CONTEXT_TOKENS = 5
_MAX_PROMPT_CONTEXT_TOKENS = 24
_REPLACEMENT_CHAR = "\ufffd"


class IncrementalDetokenizer:
    """Turns a stream of token ids into a stream of text deltas that are safe to show.

    Contract:
    - ``update(ids)`` appends output token ids and returns the new text delta.
      A delta never ends inside a UTF-8 character, and while stop strings are
      set the last ``len(longest stop) - 1`` characters are held back, so a
      stop string split across tokens never reaches the client.
    - Once a stop string matches, ``stop_matched`` names it, ``output_text`` is
      truncated before it (after it with ``include_stop_str_in_output``), the
      delta returned is everything not yet emitted, and later updates are
      ignored. Stop strings are checked only after ``min_tokens`` outputs.
    - ``flush()`` at finish returns what was held back, including the
      replacement character for a trailing incomplete byte sequence, so the
      concatenated deltas equal ``tokenizer.decode(output_ids)``. One exception,
      as in vLLM: with prompt context, a SentencePiece output keeps the leading
      space of its first token, which decoding the outputs alone would strip.
    - ``update(ids, stop_terminated=True)`` marks the last id as the stop token
      (EOS or a stop_token_id) that finished the request: it is not rendered
      unless ``include_stop_str_in_output``, as in vLLM.
    """

    def __init__(
        self,
        tokenizer: tokenizers.Tokenizer,
        *,
        skip_special_tokens: bool = True,
        stop: Sequence[str] = (),
        include_stop_str_in_output: bool = False,
        prompt_token_ids: Sequence[int] = (),
        min_tokens: int = 0,
    ) -> None:
        self._tokenizer = tokenizer
        self._skip_special_tokens = skip_special_tokens
        self._stop = [s for s in stop if s]
        self._include_stop = include_stop_str_in_output
        self._min_tokens = min_tokens
        # Hold back enough characters that a partial stop string is never streamed.
        self._stop_buffer = (
            max(len(s) for s in self._stop) - 1 if self._stop and not self._include_stop else 0
        )
        context = self._context(prompt_token_ids)
        self._ids: list[int] = context
        self._num_context = len(context)
        self._stream = DecodeStream(skip_special_tokens=skip_special_tokens)
        for token_id in context:
            self._step(token_id)
        self.output_text = ""
        self.stop_matched: str | None = None
        self._emitted = 0  # chars of output_text already returned
        self._finished = False

    @property
    def output_token_ids(self) -> list[int]:
        return self._ids[self._num_context :]

    @property
    def num_output_tokens(self) -> int:
        return len(self._ids) - self._num_context  # without copying the list, once per token

    def _decode(self, ids: list[int]) -> str:
        return self._tokenizer.decode(ids, skip_special_tokens=self._skip_special_tokens)

    def _context(self, prompt: Sequence[int]) -> list[int]:
        """The prompt's last few tokens, taken so that they start on a character boundary."""
        for n in range(_PROMPT_CONTEXT_TOKENS, min(len(prompt), _MAX_PROMPT_CONTEXT_TOKENS) + 1):
            suffix = list(prompt[-n:])
            if _REPLACEMENT_CHAR not in self._decode(suffix):
                return suffix
        return list(prompt[-_PROMPT_CONTEXT_TOKENS:])

    def _step(self, token_id: int) -> str:
        """The text ``token_id`` completes ("" while a character is incomplete)."""
        try:
            return self._stream.step(self._tokenizer, token_id) or ""
        except Exception:  # the library refuses a prefix it decodes inconsistently: restart
            self._stream = DecodeStream(skip_special_tokens=self._skip_special_tokens)
            return self._stream.step(self._tokenizer, token_id) or ""

    def _held_at_finish(self) -> str:
        """At finish: what the stream still holds (the bytes of an incomplete character),
        shown as decoding the whole output shows it (U+FFFD)."""
        if not self.num_output_tokens:
            return ""
        full, text = self._decode(self.output_token_ids), self.output_text
        if full.startswith(text):
            return full[len(text) :]
        if text.startswith(" ") and full.startswith(text[1:]):  # SentencePiece's first space
            return full[len(text) - 1 :]
        return ""

    def update(self, new_token_ids: Iterable[int], *, stop_terminated: bool = False) -> str:
        if self._finished:
            return ""
        new_ids = list(new_token_ids)
        if stop_terminated and new_ids and not self._include_stop:
            new_ids.pop()
        check_from = len(self.output_text)
        for token_id in new_ids:
            self._ids.append(token_id)
            self.output_text += self._step(token_id)
            if self.num_output_tokens <= self._min_tokens:
                check_from = len(self.output_text)
        if self._stop and self._check_stop(check_from):
            return self._take(final=True)
        return self._take(final=False)

    def flush(self) -> str:
        """Finish: return everything not yet emitted (held-back text, incomplete bytes)."""
        if self._finished:
            return ""
        check_from = len(self.output_text)
        self.output_text += self._held_at_finish()
        if self._stop and self.num_output_tokens > self._min_tokens:
            self._check_stop(check_from)
        return self._take(final=True)

    def _check_stop(self, check_from: int) -> bool:
        """Find the earliest stop string that ends in text added since ``check_from``."""
        best: tuple[int, str] | None = None
        for s in self._stop:
            # A match must end after check_from, so start at most len(s) - 1 earlier.
            idx = self.output_text.find(s, max(0, check_from - len(s) + 1))
            if idx != -1 and (best is None or idx < best[0]):
                best = (idx, s)
        if best is None:
            return False
        idx, self.stop_matched = best
        self.output_text = self.output_text[: idx + len(best[1]) if self._include_stop else idx]
        self._finished = True
        return True

    def _take(self, *, final: bool) -> str:
        end = len(self.output_text) - (0 if final else self._stop_buffer)
        if end <= self._emitted:
            return ""
        delta = self.output_text[self._emitted : end]
        self._emitted = end
        if final:
            self._finished = True
        return delta
