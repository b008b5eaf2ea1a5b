"""Reasoning parsers (vLLM's ``--reasoning-parser deepseek_r1|qwen3``): a chat answer's
thinking, between ``<think>`` and ``</think>``, told apart from its answer.

Three processes see one output and must agree on where its thinking ends:

- the tokenizer reads where the rendered prompt leaves the model (``prompt_reasoning``): in
  its thinking (the template opened it: DeepSeek-R1's, Qwen3-Thinking's), past it (the
  template closed it: Qwen3's ``enable_thinking: false``; no splitting then), or neither
  ("opening": the model opens its thinking with ``<think>``, or answers at once). It puts
  that in ``SamplingParams.reasoning``;
- the detokenizer splits each request's text into reasoning and answer with a
  ``ReasoningSplitter`` (``TextDelta.reasoning``; the APIs show it as ``reasoning_content``,
  reasoning items, thinking blocks);
- the scheduler holds a request's grammar back while the model thinks
  (``ThinkingMatcher``, which the ``StructuredOutputManager`` wraps around the grammar's
  matcher): structured outputs and forced tool calls constrain the answer, never the
  thinking, and they always do constrain it. While the model is "opening" under a grammar,
  it may pick the grammar's tokens or a token that opens the thinking whole (Qwen3's
  ``<think>``); a tokenizer with no such token (the default model's) answers under the
  grammar from the first token -- a reasoning parser never turns a grammar off.

The markers are found in the decoded text, not as token ids: a model whose tokenizer has
no ``</think>`` token writes it in pieces (``</``, ``think``, ``>``), and text after the
marker in the same token is the answer's (fed to the grammar). Whitespace right after
``</think>`` is dropped from the answer (the model's usual blank line).
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import TYPE_CHECKING

from services.config.structured_outputs import REASONING_MARKERS
from services.protocol import ReasoningParams

if TYPE_CHECKING:
    import numpy as np
    import tokenizers

    from services.request import Matcher


def prompt_reasoning(parser: str, prompt: str) -> ReasoningParams | None:
    """Where the rendered chat ``prompt`` leaves the model's thinking, for ``parser``;
    None when the prompt closed it (the whole output is the answer)."""
    start, end = REASONING_MARKERS[parser]
    tail = prompt.rstrip()
    if tail.endswith(end):
        return None
    return ReasoningParams(start, end, "thinking" if tail.endswith(start) else "opening")


def _partial_suffix(text: str, marker: str) -> int:
    """Length of the longest end of ``text`` that begins ``marker`` (held back: the next
    piece may finish the marker)."""
    for k in range(min(len(text), len(marker) - 1), 0, -1):
        if text.endswith(marker[:k]):
            return k
    return 0


class ReasoningSplitter:
    """One output's text, piece by piece, into (reasoning, answer): the same split however
    the text is cut into pieces. ``phase`` is "opening", "thinking" or "answer"."""

    def __init__(self, params: ReasoningParams) -> None:
        self.start, self.end = params.start, params.end
        self.phase = params.phase
        self._held = ""  # text not given out yet: whitespace, or a marker's possible start
        self._fresh = True  # no thinking given out yet: a leading start marker is dropped
        self._after_end = False  # whitespace right after the end marker is dropped

    def feed(self, text: str) -> tuple[str, str]:
        reasoning: list[str] = []
        answer: list[str] = []
        text, self._held = self._held + text, ""
        while text:
            if self.phase == "answer":
                if self._after_end:
                    text = text.lstrip()
                    if not text:
                        break
                    self._after_end = False
                answer.append(text)
                break
            stripped = text.lstrip()
            if self.phase == "opening" or self._fresh:
                if stripped.startswith(self.start):
                    self.phase, self._fresh = "thinking", False
                    text = stripped[len(self.start) :]
                    continue
                if self.start.startswith(stripped):  # whitespace, or the marker's start
                    self._held = text
                    break
                if self.phase == "opening":
                    self.phase = "answer"
                    continue
                self._fresh = False
            i = text.find(self.end)
            if i >= 0:
                reasoning.append(text[:i])
                text = text[i + len(self.end) :]
                self.phase, self._after_end = "answer", True
                continue
            keep = _partial_suffix(text, self.end)
            reasoning.append(text[: len(text) - keep])
            self._held = text[len(text) - keep :]
            break
        return "".join(reasoning), "".join(answer)

    @property
    def pending_end(self) -> str:
        """The held text that may begin the end marker ("" when none)."""
        held = self._held
        return held if held and self.end.startswith(held) else ""

    def finish(self) -> tuple[str, str]:
        """What was held back, at the output's end: thinking that was never closed stays
        reasoning; an output that never opened its thinking is all answer."""
        held, self._held = self._held, ""
        if self.phase == "thinking":
            return held, ""
        return "", held.lstrip() if self._after_end else held


class TokenTexts:
    """Each token's text (decoded alone, cached) and the tokens that open a thinking
    whole, for the ``ThinkingMatcher``s of one scheduler."""

    def __init__(self, tokenizer: tokenizers.Tokenizer, vocab_size: int) -> None:
        self._tokenizer = tokenizer
        self._vocab_size = vocab_size
        self._texts: dict[int, str] = {}
        self._rows: dict[tuple[str, str], np.ndarray] = {}
        self._vocab_texts: list[str] | None = None  # every token's text, for the rows
        self._lock = threading.Lock()  # rows are computed on a compile thread

    def text(self, token_id: int) -> str:
        text = self._texts.get(token_id)
        if text is None:
            text = self._texts[token_id] = self._tokenizer.decode(
                [token_id], skip_special_tokens=False
            )
        return text

    def encode(self, text: str) -> list[int]:
        return list(self._tokenizer.encode(text, add_special_tokens=False).ids)

    def opens(self, token_id: int, start: str) -> bool:
        return self.text(token_id).lstrip().startswith(start)

    def _row(self, key: tuple[str, str], wanted: Callable[[str], bool]) -> np.ndarray:
        """A bitmask row (int32 words) of the tokens whose text is ``wanted``; computed
        once per key (a pass over the vocabulary: ~0.2 s for 50k tokens)."""
        with self._lock:
            row = self._rows.get(key)
            if row is None:
                import numpy as np

                if self._vocab_texts is None:
                    n = self._tokenizer.get_vocab_size(with_added_tokens=True)
                    self._vocab_texts = self._tokenizer.decode_batch(
                        [[i] for i in range(n)], skip_special_tokens=False
                    )
                texts = self._vocab_texts
                bits = np.zeros((self._vocab_size + 31) // 32 * 32, dtype=bool)
                bits[: len(texts)] = [wanted(text) for text in texts]
                # bit j of word i is token 32 i + j, as the grammar engines' bitmasks
                row = np.packbits(bits, bitorder="little").view("<u4").view(np.int32)
                self._rows[key] = row
            return row

    def opener_row(self, start: str) -> np.ndarray:
        """The tokens that open a thinking whole."""
        return self._row(("open", start), lambda text: text.lstrip().startswith(start))

    def closer_row(self, end: str, pending: str) -> np.ndarray:
        """The tokens that, after ``pending`` (a start of the end marker, or ""), complete
        the marker with more than whitespace after it in the same token: while thinking
        these are not allowed, so the answer's first token is the grammar's own."""

        def closes_with_text(text: str) -> bool:
            joined = pending + text
            i = joined.find(end)
            return i >= 0 and bool(joined[i + len(end) :].strip())

        return self._row(("close", end + "\0" + pending), closes_with_text)


class ThinkingMatcher:
    """A request's grammar, held back while its model thinks (``Matcher``): every token is
    allowed then; the answer after ``</think>`` goes to the grammar, text of the closing
    token included. See the module's docstring for "opening"."""

    def __init__(self, inner: Matcher, params: ReasoningParams, texts: TokenTexts) -> None:
        self.inner = inner
        self.splitter = ReasoningSplitter(params)
        self.texts = texts
        if params.phase == "opening":  # the rows computed here, on the compile thread
            texts.opener_row(params.start)
        for k in range(len(params.end)):
            texts.closer_row(params.end, params.end[:k])

    @property
    def phase(self) -> str:
        return self.splitter.phase

    def fill(self, bitmask: np.ndarray, row: int) -> None:
        if self.phase == "thinking":
            closer = self.texts.closer_row(self.splitter.end, self.splitter.pending_end)
            bitmask[row, :] = ~closer
            return
        self.inner.fill(bitmask, row)
        if self.phase == "opening":
            bitmask[row, :] |= self.texts.opener_row(self.splitter.start)

    def accept(self, token_id: int) -> bool:
        if self.phase == "answer":
            return self.inner.accept(token_id)
        if self.phase == "opening" and not self.texts.opens(token_id, self.splitter.start):
            self.splitter.phase = "answer"  # the model answers at once: the grammar's token
            return self.inner.accept(token_id)
        _, answer = self.splitter.feed(self.texts.text(token_id))
        return all(self.inner.accept(t) for t in self.texts.encode(answer)) if answer else True

    def rollback(self, num_tokens: int) -> None:
        if self.phase != "answer":
            raise NotImplementedError("rolling back a thinking model's tokens")
        self.inner.rollback(num_tokens)

    def is_terminated(self) -> bool:
        return self.phase == "answer" and self.inner.is_terminated()
