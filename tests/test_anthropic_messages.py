"""Anthropic's Messages API (``/v1/messages``, issue 35) through the official ``anthropic``
client on the default model: whole and streamed answers agree, and agree with the same
conversation through chat completions (the reference: the same engine, OpenAI's shapes);
stop reasons, usage against ``count_tokens``, tool use forced and fed back, and errors in
Anthropic's shape."""

from __future__ import annotations

import json
from collections.abc import Iterator

import httpx
import jsonschema
import openai
import pytest

anthropic = pytest.importorskip("anthropic")

from tests.server_utils import RemoteServer, tool_calling_server  # noqa: E402

MODEL = "SmolLM2-135M-Instruct"
SYSTEM = "You are a terse assistant."
WEATHER = {
    "name": "get_weather",
    "description": "The weather in a city.",
    "input_schema": {"type": "object", "properties": {"city": {"type": "string"}},
                     "required": ["city"]},
}  # fmt: skip


@pytest.fixture(scope="module")
def server() -> Iterator[RemoteServer]:
    yield from tool_calling_server()


@pytest.fixture(scope="module")
def client(server: RemoteServer) -> anthropic.Anthropic:
    return anthropic.Anthropic(base_url=server.url, api_key="x", max_retries=0, timeout=120)


def test_whole_and_streamed_agree_with_chat_completions(server: RemoteServer, client) -> None:  # noqa: ANN001
    kwargs = dict(model=MODEL, max_tokens=24, system=SYSTEM, extra_body={"temperature": 0},
                  messages=[{"role": "user", "content": "Name a color."}])  # fmt: skip
    whole = client.messages.create(**kwargs)
    assert whole.type == "message" and whole.role == "assistant" and whole.model == MODEL
    assert whole.id.startswith("msg_")
    assert [b.type for b in whole.content] == ["text"]
    assert whole.stop_reason in ("end_turn", "max_tokens")
    with client.messages.stream(**kwargs) as stream:
        streamed = "".join(stream.text_stream)
        final = stream.get_final_message()
    assert streamed == whole.content[0].text == final.content[0].text
    assert final.stop_reason == whole.stop_reason
    assert final.usage.output_tokens == whole.usage.output_tokens
    chat = openai.OpenAI(base_url=f"{server.url}/v1", api_key="x").chat.completions.create(
        model=MODEL, max_tokens=24, temperature=0,
        messages=[{"role": "system", "content": SYSTEM}, {"role": "user", "content": "Name a color."}],
    )  # fmt: skip
    assert chat.choices[0].message.content == whole.content[0].text
    assert whole.usage.output_tokens == chat.usage.completion_tokens
    prompt = whole.usage.input_tokens + (whole.usage.cache_read_input_tokens or 0)
    assert prompt == chat.usage.prompt_tokens
    counted = client.messages.count_tokens(
        model=MODEL, system=SYSTEM, messages=[{"role": "user", "content": "Name a color."}]
    )
    assert counted.input_tokens == prompt


def test_stop_reasons(client) -> None:  # noqa: ANN001
    long = client.messages.create(model=MODEL, max_tokens=3, extra_body={"temperature": 0},
                                  messages=[{"role": "user", "content": "Count to twenty."}])  # fmt: skip
    assert long.stop_reason == "max_tokens" and long.usage.output_tokens == 3
    free = client.messages.create(model=MODEL, max_tokens=40, extra_body={"temperature": 0},
                                  messages=[{"role": "user", "content": "Count to twenty."}])  # fmt: skip
    text = free.content[0].text
    word = next(w for w in text.split() if len(w) > 1)  # something it does write
    cut = client.messages.create(model=MODEL, max_tokens=40, extra_body={"temperature": 0}, stop_sequences=[word],
                                 messages=[{"role": "user", "content": "Count to twenty."}])  # fmt: skip
    assert cut.stop_reason == "stop_sequence" and cut.stop_sequence == word
    assert text.startswith(cut.content[0].text if cut.content else "")


def test_a_forced_tool_call_whole_and_streamed_then_its_result_fed_back(client) -> None:  # noqa: ANN001
    messages = [{"role": "user", "content": "What is the weather in Paris?"}]
    kwargs = dict(model=MODEL, max_tokens=60, extra_body={"temperature": 0}, tools=[WEATHER], messages=messages,
                  tool_choice={"type": "tool", "name": "get_weather"})  # fmt: skip
    whole = client.messages.create(**kwargs)
    assert whole.stop_reason == "tool_use"
    (call,) = [b for b in whole.content if b.type == "tool_use"]
    assert call.name == "get_weather"
    jsonschema.validate(call.input, WEATHER["input_schema"])
    with client.messages.stream(**kwargs) as stream:
        final = stream.get_final_message()
    (streamed,) = [b for b in final.content if b.type == "tool_use"]
    assert (streamed.name, streamed.input) == (call.name, call.input)
    assert final.stop_reason == "tool_use"
    history = [
        *messages,
        {"role": "assistant", "content": [{"type": "tool_use", "id": call.id,
                                           "name": call.name, "input": call.input}]},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": call.id,
                                      "content": "Sunny, 21 C."}]},
    ]  # fmt: skip
    answer = client.messages.create(model=MODEL, max_tokens=30, extra_body={"temperature": 0}, tools=[WEATHER],
                                    tool_choice={"type": "none"}, messages=history)  # fmt: skip
    assert answer.stop_reason in ("end_turn", "max_tokens") and answer.content[0].type == "text"
    before = client.messages.count_tokens(model=MODEL, tools=[WEATHER], messages=messages)
    after = client.messages.count_tokens(model=MODEL, tools=[WEATHER], messages=history)
    assert after.input_tokens > before.input_tokens  # the call and its result were rendered


def test_any_tool_makes_a_call(client) -> None:  # noqa: ANN001
    out = client.messages.create(model=MODEL, max_tokens=60, extra_body={"temperature": 0}, tools=[WEATHER],
                                 tool_choice={"type": "any"},
                                 messages=[{"role": "user", "content": "Weather in Oslo?"}])  # fmt: skip
    assert out.stop_reason == "tool_use"
    assert [b.name for b in out.content if b.type == "tool_use"] == ["get_weather"]


def test_errors_in_anthropics_shape(server: RemoteServer, client) -> None:  # noqa: ANN001
    with pytest.raises(anthropic.NotFoundError) as e:
        client.messages.create(model="nope", max_tokens=4,
                               messages=[{"role": "user", "content": "hi"}])  # fmt: skip
    assert e.value.body["error"]["type"] == "not_found_error"
    with pytest.raises(anthropic.BadRequestError, match="not supported"):
        client.messages.create(model=MODEL, max_tokens=4, messages=[{"role": "user", "content": [
            {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": "AA=="}}]}])  # fmt: skip
    for body in ({"model": MODEL, "messages": [{"role": "user", "content": "hi"}]},  # no max_tokens
                 {"model": MODEL, "max_tokens": 4, "messages": []},
                 {"model": MODEL, "max_tokens": 4, "messages": [{"role": "system", "content": "x"}]}):  # fmt: skip
        r = httpx.post(f"{server.url}/v1/messages", json=body, timeout=30)
        assert r.status_code == 400, r.text
        assert r.json()["type"] == "error"
        assert r.json()["error"]["type"] == "invalid_request_error"
    r = httpx.post(f"{server.url}/v1/messages", content=b"{not json", timeout=30)
    assert r.status_code == 400 and r.json()["error"]["type"] == "invalid_request_error"
    # and the server goes on serving
    ok = client.messages.create(model=MODEL, max_tokens=2,
                                messages=[{"role": "user", "content": "hi"}])  # fmt: skip
    assert ok.usage.output_tokens == 2
    assert json.loads(httpx.get(f"{server.url}/v1/models", timeout=30).text)["data"]
