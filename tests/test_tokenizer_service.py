"""The tokenizer process: chat template, tokenization, length checks, and its socket loop."""

from __future__ import annotations

import threading

import pytest

from services.ipc import PullSocket, PushSocket, ipc_dir
from services.protocol import (
    ApiServerInput,
    DetokenizeRequest,
    DetokenizeResult,
    EngineCoreInput,
    GenerateBatch,
    GenerateRequest,
    RequestError,
    RequestOutputSpec,
    SamplingParams,
    TokenizedBatch,
    TokenizedRequest,
    TokenizeRequest,
    TokenizeResult,
    TokenizerInput,
)
from services.tokenizer.loader import load_serving_tokenizer
from services.tokenizer.processor import RequestProcessor
from services.tokenizer.service import TokenizerEndpoints, serve_tokenizer

MAX_LEN = 64
# SmolLM2-Instruct's template output, written out by hand as the reference.
SMOL_PROMPT = (
    "<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face"
    "<|im_end|>\n<|im_start|>user\n你好 🎉<|im_end|>\n<|im_start|>assistant\n"
)


@pytest.fixture(scope="module")
def info():
    return load_serving_tokenizer()


@pytest.fixture(scope="module")
def proc(info):
    return RequestProcessor(info, MAX_LEN)


def gen(**kw) -> GenerateRequest:
    kw.setdefault("sampling", SamplingParams(max_tokens=None))
    return GenerateRequest("r1", **kw)


def test_text_prompt_fills_max_tokens(proc, info):
    tokenized, spec = proc.process(gen(prompt="Hello 世界", echo=True))
    ids = info.tokenizer.encode("Hello 世界").ids
    assert tokenized.prompt_token_ids == ids
    assert tokenized.sampling.max_tokens == MAX_LEN - len(ids)
    assert tokenized.eos_token_id == info.tokenizer.token_to_id("<|im_end|>")
    assert spec.num_prompt_tokens == len(ids) and spec.prompt_tail_ids == ids[-5:]
    assert spec.prompt_text == "Hello 世界"
    assert spec.sampling == tokenized.sampling


def test_chat_prompt_matches_template(proc, info):
    msgs = [{"role": "user", "content": "你好 🎉"}]
    tokenized, spec = proc.process(gen(messages=msgs, add_special_tokens=False))
    assert (
        tokenized.prompt_token_ids
        == info.tokenizer.encode(SMOL_PROMPT, add_special_tokens=False).ids
    )
    assert spec.prompt_text is None  # no echo asked


def test_token_prompt_echo_decodes(proc, info):
    ids = info.tokenizer.encode("a b c").ids
    _, spec = proc.process(gen(prompt_token_ids=ids, echo=True))
    assert spec.prompt_text == "a b c"


def test_too_long_with_max_tokens_uses_vllms_message(proc, info):
    prompt = "word " * 40
    n = len(info.tokenizer.encode(prompt).ids)
    err = proc.process(gen(prompt=prompt, sampling=SamplingParams(max_tokens=50)))
    assert isinstance(err, RequestError) and err.status == 400
    assert err.message == (
        f"This model's maximum context length is {MAX_LEN} tokens. However, you requested "
        f"{n + 50} tokens ({n} in the messages, 50 in the completion). Please reduce the length "
        "of the messages or completion."
    )
    ok = proc.process(gen(prompt=prompt, sampling=SamplingParams(max_tokens=MAX_LEN - n)))
    assert not isinstance(ok, RequestError)


def test_prompt_filling_the_context_is_rejected(proc):
    err = proc.process(gen(prompt_token_ids=[100] * MAX_LEN))
    assert isinstance(err, RequestError) and err.status == 400
    assert f"maximum context length is {MAX_LEN} tokens" in err.message
    assert f"{MAX_LEN} input tokens" in err.message
    tokenized, _ = proc.process(gen(prompt_token_ids=[100] * (MAX_LEN - 1)))
    assert tokenized.sampling.max_tokens == 1


@pytest.mark.parametrize(
    "kw",
    [
        {"prompt": ""},
        {"prompt_token_ids": []},
        {"prompt_token_ids": [1, 10**9]},
        {"prompt_token_ids": [-1]},
        {
            "messages": [{"role": "user", "content": "x"}],
            "chat_template": "{{ raise_exception('no') }}",
        },
        {"messages": [{"role": "user", "content": "x"}], "chat_template": "{% for %}"},
    ],
)
def test_bad_prompts_are_400(proc, kw):
    err = proc.process(gen(**kw))
    assert isinstance(err, RequestError) and err.status == 400 and err.message


def test_tokenize_and_detokenize(proc, info):
    res = proc.tokenize(TokenizeRequest("t", prompt="Hi 你好", return_token_strs=True))
    assert isinstance(res, TokenizeResult)
    assert res.token_ids == info.tokenizer.encode("Hi 你好").ids and res.max_model_len == MAX_LEN
    assert len(res.token_strs) == len(res.token_ids)
    res = proc.tokenize(
        TokenizeRequest(
            "t", messages=[{"role": "user", "content": "你好 🎉"}], add_special_tokens=False
        )
    )
    assert res.token_ids == info.tokenizer.encode(SMOL_PROMPT, add_special_tokens=False).ids
    out = proc.detokenize(DetokenizeRequest("d", res.token_ids))
    assert isinstance(out, DetokenizeResult) and out.text == SMOL_PROMPT
    assert isinstance(proc.detokenize(DetokenizeRequest("d", [10**9])), RequestError)


def test_service_loop_routes_messages(proc):
    with ipc_dir() as d:
        ep = TokenizerEndpoints(
            d.endpoint("req"), (d.endpoint("core"),), d.endpoint("spec"), d.endpoint("api")
        )
        requests = PushSocket[TokenizerInput](ep.requests, TokenizerInput, bind=True)
        core = PullSocket[EngineCoreInput](ep.engine_cores[0], EngineCoreInput, bind=True)
        specs = PullSocket[RequestOutputSpec](ep.detokenizer_specs, RequestOutputSpec, bind=True)
        api = PullSocket[ApiServerInput](ep.api_server, ApiServerInput, bind=True)
        stop = threading.Event()
        t = threading.Thread(target=serve_tokenizer, args=(proc, ep, stop), daemon=True)
        t.start()
        try:
            ok = GenerateRequest("ok", SamplingParams(max_tokens=4), prompt="hi")
            requests.send(GenerateBatch([ok]))
            bad = GenerateRequest("bad", SamplingParams(max_tokens=4), prompt="")
            requests.send(GenerateBatch([bad]))
            requests.send(TokenizeRequest("tok", prompt="hi"))
            spec = specs.recv(timeout_ms=5000)
            batch = core.recv(timeout_ms=5000)
            assert isinstance(spec, RequestOutputSpec) and spec.req_id == "ok"
            assert isinstance(batch, TokenizedBatch) and len(batch.requests) == 1
            (tokenized,) = batch.requests
            assert isinstance(tokenized, TokenizedRequest) and tokenized.req_id == "ok"
            replies = {m.req_id: m for m in (api.recv(timeout_ms=5000), api.recv(timeout_ms=5000))}
            assert isinstance(replies["bad"], RequestError) and replies["bad"].status == 400
            assert isinstance(replies["tok"], TokenizeResult)
        finally:
            stop.set()
            t.join(5)
            for s in (requests, core, specs, api):
                s.close()


def test_prompts_are_logged_only_when_asked(info, caplog):
    """--enable-log-requests: the rendered prompt, sampling parameters and token ids, cut to
    --max-log-len; without it the prompt never reaches the log."""
    from services.request_log import RequestLog

    caplog.set_level("INFO", logger="services")
    RequestProcessor(info, MAX_LEN).process(gen(prompt="a secret prompt"))
    assert "secret" not in caplog.text
    logged = RequestProcessor(info, MAX_LEN, request_log=RequestLog(max_log_len=8))
    tokenized, _ = logged.process(gen(prompt="a secret prompt"))
    [record] = [r for r in caplog.records if "Received request" in r.getMessage()]
    line = record.getMessage()
    assert line.startswith("Received request r1: prompt: 'a secret', params: SamplingParams(")
    assert f"prompt_token_ids: {tokenized.prompt_token_ids[:8]}" in line
    assert "prompt'" not in line  # cut at 8 characters
