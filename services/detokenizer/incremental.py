"""Incremental detokenization of one request's output, with stop strings.

Decoding one token id alone is wrong for two reasons: a byte-level BPE token
can hold part of a multi-byte UTF-8 character (decoding it alone gives U+FFFD),
and some decoders depend on context (SentencePiece's Metaspace drops the
leading space of the first token it sees). So, as vLLM's
``detokenize_incrementally`` and HF TGI do, we keep two offsets into the token
ids: ``prefix_offset`` .. ``read_offset`` is a short window of tokens already
emitted, decoded again as context; the text that decoding
``ids[prefix_offset:]`` adds beyond the window is the new text, emitted once it
no longer ends in U+FFFD (an incomplete character).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

import tokenizers

# vLLM's INITIAL_INCREMENTAL_DETOKENIZATION_OFFSET: prompt tokens used as context.
_PROMPT_CONTEXT_TOKENS = 5
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
        context = list(prompt_token_ids[-_PROMPT_CONTEXT_TOKENS:])
        self._ids: list[int] = context
        self._prefix_offset = 0
        self._read_offset = len(context)
        self._num_context = len(context)
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

    def _decode_pending(self, *, final: bool) -> str:
        """Text of the tokens past ``read_offset``, or "" while it ends mid-character."""
        prefix_text = self._decode(self._ids[self._prefix_offset : self._read_offset])
        new_text = self._decode(self._ids[self._prefix_offset :])
        if len(new_text) <= len(prefix_text) or (
            new_text.endswith(_REPLACEMENT_CHAR) and not final
        ):
            # Nothing new yet (a skipped special token or an incomplete character).
            if final:
                self._prefix_offset = self._read_offset = len(self._ids)
            return ""
        self._prefix_offset, self._read_offset = self._read_offset, len(self._ids)
        return new_text[len(prefix_text) :]

    def update(self, new_token_ids: Iterable[int], *, stop_terminated: bool = False) -> str:
        if self._finished:
            return ""
        new_ids = list(new_token_ids)
        if stop_terminated and new_ids and not self._include_stop:
            new_ids.pop()
        check_from = len(self.output_text)
        for token_id in new_ids:
            self._ids.append(token_id)
            self.output_text += self._decode_pending(final=False)
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
        self.output_text += self._decode_pending(final=True)
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
