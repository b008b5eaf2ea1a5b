"""Benchmark workloads: lists of ``SampleRequest`` built locally (nothing is downloaded).

Prompts are drawn from the tokenizer's *word tokens* (a leading-space marker followed by ASCII
letters, e.g. ``Ġfox``): a sequence of them decodes to plain words and re-encodes to exactly the
same ids, so a prompt of N such ids is N tokens whether it is sent as token ids
(``/v1/completions``) or as text (``/v1/chat/completions``). vLLM's random dataset sends text
re-tokenized to about the right length; we send the ids themselves to completions, so the
prompt length is exact.

- ``random``: prompt and output lengths uniform in ``[len·(1−r), len·(1+r)]`` (vLLM's
  ``--random-range-ratio``), after an optional prefix of ``--random-prefix-len`` tokens shared
  by every request.
- ``prefix-repetition``: ``num_prefixes`` prefixes, each shared by an equal share of the
  requests, each request a fresh suffix; shuffled (vLLM's ``PrefixRepetitionRandomDataset``).
- ``chat``: multi-turn conversations under one shared system prompt. Turn k's messages are the
  k−1 previous user/assistant pairs plus a new user message, so every turn's prompt starts with
  the previous turn's; the assistant replies in the history are synthetic (fixed length), not
  the server's. Requests are ordered turn by turn across conversations, and each turn waits for
  the previous turn of its conversation to finish (``parent``), as a user would.
- ``jsonl``: one JSON object per line: ``{"prompt": str | [int]}`` or ``{"messages": [...]}``,
  with optional ``"output_len"`` (max_tokens).
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from services.config import ConfigError

DATASETS = ("random", "prefix-repetition", "chat", "jsonl")

Prompt = str | list[int] | list[dict[str, str]]


@dataclass
class SampleRequest:
    """One benchmark request.

    ``prompt`` is text or token ids (a completion) or a list of chat messages. ``prompt_len`` is
    its length in tokens when the client knows it (None: taken from the server's ``usage``).
    ``expected_output_len`` becomes ``max_tokens`` (None: the server's default). ``parent`` is
    the index of a request that must finish before this one is sent (a conversation's previous
    turn).
    """

    prompt: Prompt
    prompt_len: int | None
    expected_output_len: int | None
    parent: int | None = None


class WordTokens:
    """Token ids that are whole words with a leading space, so id sequences round-trip."""

    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer
        vocab: dict[str, int] = tokenizer.tokenizer.get_vocab()
        special = tokenizer.all_special_ids
        ids = [
            i
            for s, i in vocab.items()
            if s[:1] in ("Ġ", "▁") and s[1:].isascii() and s[1:].isalpha() and i not in special
        ]
        if len(ids) < 100:  # not a GPT-2 / SentencePiece style vocabulary: any ordinary token
            ids = [i for i in vocab.values() if i not in special]
        self.ids = np.array(sorted(ids), dtype=np.int64)

    def sample(self, rng: np.random.Generator, n: int) -> list[int]:
        return self.ids[rng.integers(0, len(self.ids), size=n)].tolist()

    def text(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids).strip()


def _len_range(length: int, ratio: float) -> tuple[int, int]:
    return max(1, math.floor(length * (1 - ratio))), math.ceil(length * (1 + ratio))


def random_dataset(
    words: WordTokens,
    num_requests: int,
    input_len: int,
    output_len: int,
    range_ratio: float = 0.0,
    prefix_len: int = 0,
    seed: int = 0,
) -> list[SampleRequest]:
    """vLLM's random dataset, as token ids: a shared prefix, then random words."""
    if not 0.0 <= range_ratio < 1.0:
        raise ConfigError(f"--random-range-ratio must be in [0, 1), got {range_ratio}")
    if input_len < 1 or output_len < 1 or prefix_len < 0:
        raise ConfigError("--random-input-len and --random-output-len must be >= 1")
    rng = np.random.default_rng(seed)
    prefix = words.sample(rng, prefix_len)
    in_lo, in_hi = _len_range(input_len, range_ratio)
    out_lo, out_hi = _len_range(output_len, range_ratio)
    in_lens = rng.integers(in_lo, in_hi + 1, size=num_requests)
    out_lens = rng.integers(out_lo, out_hi + 1, size=num_requests)
    return [
        SampleRequest(prefix + words.sample(rng, int(n_in)), prefix_len + int(n_in), int(n_out))
        for n_in, n_out in zip(in_lens, out_lens, strict=True)
    ]


def prefix_repetition_dataset(
    words: WordTokens,
    num_requests: int,
    num_prefixes: int,
    prefix_len: int,
    suffix_len: int,
    output_len: int,
    seed: int = 0,
) -> list[SampleRequest]:
    """``num_prefixes`` prefixes, each reused by ``num_requests / num_prefixes`` requests."""
    if num_prefixes < 1 or prefix_len < 0 or suffix_len < 1 or output_len < 1:
        raise ConfigError(
            "--prefix-repetition-num-prefixes, -suffix-len and -output-len must be >= 1"
        )
    rng = np.random.default_rng(seed)
    prefixes = [words.sample(rng, prefix_len) for _ in range(num_prefixes)]
    n = prefix_len + suffix_len
    requests = [
        SampleRequest(prefixes[i % num_prefixes] + words.sample(rng, suffix_len), n, output_len)
        for i in range(num_requests)
    ]
    order = rng.permutation(num_requests)
    return [requests[i] for i in order]


def chat_dataset(
    words: WordTokens,
    num_requests: int,
    num_turns: int,
    system_len: int,
    user_len: int,
    assistant_len: int,
    output_len: int,
    seed: int = 0,
) -> list[SampleRequest]:
    """Multi-turn conversations; request k of a conversation carries turns 1..k (see module doc)."""
    if num_turns < 1 or user_len < 1 or output_len < 1 or system_len < 0 or assistant_len < 0:
        raise ConfigError("--chat-num-turns, --chat-user-len, --chat-output-len must be >= 1")
    rng = np.random.default_rng(seed)
    system = [{"role": "system", "content": words.text(words.sample(rng, system_len))}]
    num_convs = math.ceil(num_requests / num_turns)
    histories: list[list[dict[str, str]]] = [
        list(system) if system_len else [] for _ in range(num_convs)
    ]
    last_index: list[int | None] = [None] * num_convs
    requests: list[SampleRequest] = []
    for _turn in range(num_turns):
        for c in range(num_convs):
            if len(requests) == num_requests:
                return requests
            history = histories[c]
            history.append({"role": "user", "content": words.text(words.sample(rng, user_len))})
            requests.append(SampleRequest(list(history), None, output_len, parent=last_index[c]))
            last_index[c] = len(requests) - 1
            reply = words.text(words.sample(rng, assistant_len)) if assistant_len else "ok"
            history.append({"role": "assistant", "content": reply})
    return requests


def jsonl_dataset(path: Path, num_requests: int, output_len: int | None) -> list[SampleRequest]:
    """The first ``num_requests`` lines of a JSONL file (cycled if the file is shorter)."""
    try:
        lines = [ln for ln in Path(path).read_text(encoding="utf-8").splitlines() if ln.strip()]
    except OSError as e:
        raise ConfigError(f"cannot read --dataset-path: {e.strerror}: {path}") from None
    items: list[SampleRequest] = []
    for lineno, line in enumerate(lines, 1):
        try:
            obj = json.loads(line)
        except ValueError as e:
            raise ConfigError(f"{path}:{lineno}: not JSON: {e}") from None
        prompt = obj.get("messages", obj.get("prompt")) if isinstance(obj, dict) else None
        if not isinstance(prompt, str | list) or not prompt:
            raise ConfigError(f"{path}:{lineno}: needs a non-empty 'prompt' or 'messages'")
        n = obj.get("output_len", output_len)
        is_ids = isinstance(prompt, list) and all(isinstance(t, int) for t in prompt)
        items.append(SampleRequest(prompt, len(prompt) if is_ids else None, n))
    if not items:
        raise ConfigError(f"--dataset-path {path} has no prompts")
    return [items[i % len(items)] for i in range(num_requests)]


def arrival_times(
    num_requests: int, request_rate: float, burstiness: float, seed: int = 0
) -> np.ndarray:
    """Send times (s from start), as vLLM's ``get_request`` draws them.

    Gaps ~ Gamma(shape=burstiness, scale=1/(rate·burstiness)): mean 1/rate, coefficient of
    variation 1/sqrt(burstiness); 1 is a Poisson process, lower is burstier, inf is evenly
    spaced. Request i goes after i+1 gaps, and the times are rescaled so the last one is
    exactly num_requests/rate (vLLM does this so that seeds do not move the throughput).
    """
    if burstiness <= 0:
        raise ConfigError(f"--burstiness must be > 0, got {burstiness}")
    if request_rate <= 0:
        raise ConfigError(f"--request-rate must be > 0, got {request_rate}")
    if math.isinf(request_rate) or num_requests == 0:
        return np.zeros(num_requests)
    if math.isinf(burstiness):
        gaps = np.full(num_requests, 1.0 / request_rate)
    else:
        rng = np.random.default_rng(seed)
        gaps = rng.gamma(burstiness, 1.0 / (request_rate * burstiness), size=num_requests)
    times = np.cumsum(gaps)
    return times * (num_requests / request_rate / times[-1])
