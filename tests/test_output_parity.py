"""Offline ``LLM`` and the server give the same outputs: one table, run both ways.

The two share the output path (``OutputProcessor``, ``fan_out``, ``ChoiceState``) but
not its sockets, processes or HTTP layer; this table pins what each feature of that path
gives, byte for byte: text, token ids, finish and stop reasons, logprob values.

Like is compared with like: the server and the ``LLM`` have one engine configuration,
every row is one request sent on its own (the CPU model's numerics can depend on the
batch's make-up), and both see the rows in the same order (so their prefix caches hold
the same blocks). Greedy and seeded sampling are then deterministic; only the logprobs
of a row with ``n`` > 1 get a looser bound (see ``_check_row``).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import httpx
import pytest

from launch.llm import LLM, CompletionOutput, RequestOutput, SamplingParams
from services.protocol import TokenLogprobs
from tests.server_utils import RemoteServer

MAX_MODEL_LEN = 512
KV_CACHE_BYTES = 256 << 20
CHAT = "<|im_start|>user\nWhat is 2+2?<|im_end|>\n<|im_start|>assistant\n"  # ends on EOS
STORY = "Once upon a time, there"
CODE = "def fibonacci(n):"
FRANCE = "The capital of France is"
_MIN_LOGPROB = -9999.0  # the server clamps -inf (as vLLM does)

# (name, prompt, sampling): every field the server would default is given explicitly.
# fmt: off
ROWS: list[tuple[str, str, dict[str, Any]]] = [
    ("greedy", STORY, {"temperature": 0.0, "max_tokens": 12}),
    ("stop_string", STORY, {"temperature": 0.0, "max_tokens": 16, "stop": ["town"]}),
    (
        "include_stop_str",
        STORY,
        {
            "temperature": 0.0,
            "max_tokens": 16,
            "stop": [" heart", "city"],
            "include_stop_str_in_output": True,
        },
    ),
    ("stop_token_ids", CODE, {"temperature": 0.0, "max_tokens": 16, "stop_token_ids": [1003]}),
    # The first token holds a newline: min_tokens defers the stop string past it.
    ("min_tokens_stop_string", CODE, {"temperature": 0.0, "max_tokens": 16, "stop": ["\n"],
                                      "min_tokens": 3}),
    ("min_tokens_stop_token", CODE, {"temperature": 0.0, "max_tokens": 16,
                                     "stop_token_ids": [216], "min_tokens": 6}),
    # EOS ends it: not rendered, even with skip_special_tokens=False.
    ("eos_keep_special", CHAT, {"temperature": 0.0, "max_tokens": 24,
                                "skip_special_tokens": False}),
    # Past EOS the model writes chat-template tokens: shown, then skipped.
    ("ignore_eos_keep_special", CHAT, {"temperature": 0.0, "max_tokens": 16, "ignore_eos": True,
                                       "skip_special_tokens": False}),
    ("ignore_eos_skip_special", CHAT, {"temperature": 0.0, "max_tokens": 16, "ignore_eos": True,
                                       "skip_special_tokens": True}),
    ("n3_seeded", FRANCE, {"temperature": 0.9, "max_tokens": 8, "n": 3, "seed": 7,
                           "logprobs": 1}),
    ("logprobs_prompt_logprobs", FRANCE, {"temperature": 0.0, "max_tokens": 6, "logprobs": 3,
                                          "prompt_logprobs": 2}),
    ("seeded_top_p", STORY, {"temperature": 1.0, "top_p": 0.9, "max_tokens": 10, "seed": 1234,
                             "logprobs": 0}),
]
# fmt: on

# What each row is there for, checked on the offline outputs: a change of model or of the
# engine's numerics that made a row miss its feature would otherwise compare nothing new.
SHOWS: dict[str, Callable[[LLM, list[CompletionOutput]], bool]] = {
    "stop_string": lambda _, outs: outs[0].stop_reason == "town",
    "include_stop_str": lambda _, outs: outs[0].text.endswith((" heart", "city")),
    "stop_token_ids": lambda _, outs: outs[0].stop_reason == 1003,
    "min_tokens_stop_string": lambda _, outs: (
        outs[0].stop_reason == "\n" and len(outs[0].token_ids) > 3
    ),
    "min_tokens_stop_token": lambda _, outs: (
        216 not in outs[0].token_ids[:6] and outs[0].stop_reason == 216
    ),
    "eos_keep_special": lambda llm, outs: (
        outs[0].token_ids[-1] == llm.tokenizer.eos_token_id and "<|im_end|>" not in outs[0].text
    ),
    "ignore_eos_keep_special": lambda _, outs: "<|im_end|>" in outs[0].text,
    "ignore_eos_skip_special": lambda _, outs: "<|im_end|>" not in outs[0].text,
    "n3_seeded": lambda _, outs: len({tuple(c.token_ids) for c in outs}) > 1,
}


@pytest.fixture(scope="module")
def server() -> Iterator[RemoteServer]:
    args = ("--max-model-len", str(MAX_MODEL_LEN), "--kv-cache-memory-bytes", "256MiB")
    assert KV_CACHE_BYTES == 256 << 20  # the same pool offline
    with RemoteServer(*args) as s:
        s.wait_ready()
        yield s


@pytest.fixture(scope="module")
def llm() -> LLM:
    return LLM(max_model_len=MAX_MODEL_LEN, kv_cache_memory_bytes=KV_CACHE_BYTES)


def _decode(llm: LLM, token_id: int) -> str:
    return llm.tokenizer.tokenizer.decode([token_id], skip_special_tokens=False)


def _lp(x: float) -> float:
    return max(x, _MIN_LOGPROB)


def _expected_logprobs(llm: LLM, lps: list[TokenLogprobs]) -> dict[str, list[Any]]:
    """The completions ``logprobs`` object the server builds from the same values."""
    tops = []
    for lp in lps:
        top = {_decode(llm, lp.token_id): _lp(lp.logprob)}
        top.update(
            {
                _decode(llm, t): _lp(x)
                for t, x in zip(lp.top_token_ids, lp.top_logprobs, strict=True)
            }
        )
        tops.append(top)
    return {
        "tokens": [_decode(llm, lp.token_id) for lp in lps],
        "token_logprobs": [_lp(lp.logprob) for lp in lps],
        "top_logprobs": tops,
    }


def _expected_prompt_logprobs(
    entries: list[TokenLogprobs | None],
) -> list[dict[int, tuple[float, int]] | None]:
    """Per prompt token: token id -> (logprob, rank), the prompt's token first."""
    out: list[dict[int, tuple[float, int]] | None] = []
    for lp in entries:
        if lp is None:
            out.append(None)
            continue
        entry = {lp.token_id: (_lp(lp.logprob), lp.rank)}
        for rank, (t, x) in enumerate(zip(lp.top_token_ids, lp.top_logprobs, strict=True), 1):
            entry.setdefault(t, (_lp(x), rank))
        out.append(entry)
    return out


def _close(got: Any, want: Any, tol: float) -> bool:
    """``==``, floats within ``tol`` (logprobs: the same float32 values, through JSON)."""
    if isinstance(want, float) and isinstance(got, (int, float)):
        return abs(got - want) <= tol
    if isinstance(want, dict) and isinstance(got, dict):
        return got.keys() == want.keys() and all(_close(got[k], want[k], tol) for k in want)
    if isinstance(want, (list, tuple)) and isinstance(got, (list, tuple)):
        return len(got) == len(want) and all(
            _close(g, w, tol) for g, w in zip(got, want, strict=True)
        )
    return bool(got == want)


def _server_completion(server: RemoteServer, prompt: str, sampling: dict[str, Any]) -> dict:
    body = {"prompt": prompt, "return_token_ids": True, **sampling}
    resp = httpx.post(f"{server.url}/v1/completions", json=body, timeout=120)
    assert resp.status_code == 200, resp.text
    return resp.json()


@pytest.mark.parametrize(("name", "prompt", "sampling"), ROWS, ids=[r[0] for r in ROWS])
def test_offline_equals_server(
    server: RemoteServer, llm: LLM, name: str, prompt: str, sampling: dict[str, Any]
) -> None:
    (offline,) = llm.generate(prompt, SamplingParams(**sampling))
    # Ended everywhere, a stop string's finish too: nothing of it left for the next call.
    assert not llm.scheduler.requests and not llm.output_processor.num_requests
    if name in SHOWS:
        assert SHOWS[name](llm, offline.outputs), offline.outputs
    online = _server_completion(server, prompt, sampling)
    _check_row(llm, sampling, offline, online)


def _check_row(
    llm: LLM, sampling: dict[str, Any], offline: RequestOutput, online: dict[str, Any]
) -> None:
    choices = sorted(online["choices"], key=lambda c: c["index"])
    # The server's n choices reach the scheduler in one message (TokenizedBatch) and join
    # one step, as offline: their batches, and so their logprobs, are the same both ways.
    tol = 1e-6
    assert len(choices) == len(offline.outputs) == sampling.get("n", 1)
    for want, got in zip(offline.outputs, choices, strict=True):
        assert got["prompt_token_ids"] == offline.prompt_token_ids
        assert (got["text"], got["token_ids"]) == (want.text, want.token_ids)
        assert (got["finish_reason"], got["stop_reason"]) == (want.finish_reason, want.stop_reason)
        if sampling.get("logprobs") is None:
            assert got["logprobs"] is None and want.logprobs is None
        else:
            assert want.logprobs is not None and len(want.logprobs) == len(want.token_ids)
            expected = _expected_logprobs(llm, want.logprobs)
            assert _close({k: got["logprobs"][k] for k in expected}, expected, tol)
        if sampling.get("prompt_logprobs") is None:
            assert got.get("prompt_logprobs") is None and offline.prompt_logprobs is None
        else:
            assert offline.prompt_logprobs is not None
            assert len(offline.prompt_logprobs) == len(offline.prompt_token_ids)
            served = [
                None
                if entry is None
                else {int(t): (v["logprob"], v["rank"]) for t, v in entry.items()}
                for entry in got["prompt_logprobs"]
            ]
            assert _close(served, _expected_prompt_logprobs(offline.prompt_logprobs), tol)
