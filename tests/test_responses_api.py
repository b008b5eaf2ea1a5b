"""OpenAI's Responses API (``/v1/responses``, issue 35) through the official ``openai``
client on the default model: whole, streamed (the event types in order) and parsed answers,
agreeing with chat completions on the same conversation; function tools forced and their
output fed back; ``previous_response_id`` continuing a stored conversation with its prefix
cached; ``GET``/``DELETE``; the store's bounds."""

from __future__ import annotations

import json
from collections.abc import Iterator

import httpx
import jsonschema
import openai
import pydantic
import pytest

from services.api_server.response_store import ResponseStore, Stored
from tests.server_utils import RemoteServer, tool_calling_server

MODEL = "SmolLM2-135M-Instruct"
WEATHER = {
    "type": "function", "name": "get_weather", "description": "The weather in a city.",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                   "required": ["city"], "additionalProperties": False},
}  # fmt: skip


@pytest.fixture(scope="module")
def server() -> Iterator[RemoteServer]:
    yield from tool_calling_server()


@pytest.fixture(scope="module")
def client(server: RemoteServer) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key="x", max_retries=0, timeout=120)


def test_whole_and_streamed_agree_with_chat(client: openai.OpenAI) -> None:
    kwargs = dict(model=MODEL, instructions="Be terse.", input="Name a color.",
                  max_output_tokens=20, temperature=0)  # fmt: skip
    whole = client.responses.create(**kwargs)  # type: ignore[call-overload]
    assert whole.object == "response" and whole.id.startswith("resp_")
    assert whole.status in ("completed", "incomplete") and whole.output_text
    chat = client.chat.completions.create(
        model=MODEL, max_tokens=20, temperature=0,
        messages=[{"role": "system", "content": "Be terse."}, {"role": "user", "content": "Name a color."}],
    )  # fmt: skip
    assert whole.output_text == chat.choices[0].message.content
    assert whole.usage.input_tokens == chat.usage.prompt_tokens
    assert whole.usage.output_tokens == chat.usage.completion_tokens
    with client.responses.stream(**kwargs) as stream:  # type: ignore[arg-type]
        events = list(stream)
        final = stream.get_final_response()
    kinds = [e.type for e in events]
    assert kinds[:2] == ["response.created", "response.in_progress"]
    assert kinds[2:4] == ["response.output_item.added", "response.content_part.added"]
    assert kinds[-4:] == ["response.output_text.done", "response.content_part.done",
                          "response.output_item.done",
                          "response.completed" if whole.status == "completed" else "response.incomplete"]  # fmt: skip
    assert [e.sequence_number for e in events] == list(range(len(events)))
    deltas = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert deltas == final.output_text == whole.output_text


def test_max_output_tokens_makes_it_incomplete(client: openai.OpenAI) -> None:
    out = client.responses.create(model=MODEL, input="Count to fifty.", max_output_tokens=4,
                                  temperature=0)  # fmt: skip
    assert out.status == "incomplete" and out.incomplete_details.reason == "max_output_tokens"
    assert out.usage.output_tokens == 4


class City(pydantic.BaseModel):
    name: str
    country: str


def test_parse_follows_the_schema(client: openai.OpenAI) -> None:
    out = client.responses.parse(  # (strings bounded: this model writes endless ones)
        model=MODEL, input="Paris, as JSON.", text_format=City, max_output_tokens=80,
        temperature=0, extra_body={"structured_outputs": {"json_max_string_length": 24}},
    )  # fmt: skip
    assert isinstance(out.output_parsed, City) and out.status == "completed"
    obj = client.responses.create(model=MODEL, input="Anything as JSON.", temperature=0,
                                  max_output_tokens=60, text={"format": {"type": "json_object"}})  # fmt: skip
    assert isinstance(json.loads(obj.output_text), dict)


def test_a_forced_function_call_and_its_output_continue_the_stored_conversation(
    client: openai.OpenAI,
) -> None:
    first = client.responses.create(
        model=MODEL, input="What is the weather in Paris?", tools=[WEATHER], temperature=0,
        tool_choice={"type": "function", "name": "get_weather"}, max_output_tokens=60,
    )  # fmt: skip
    (call,) = [item for item in first.output if item.type == "function_call"]
    assert call.name == "get_weather" and call.call_id
    jsonschema.validate(json.loads(call.arguments), WEATHER["parameters"])
    with client.responses.stream(
        model=MODEL, input="What is the weather in Paris?", tools=[WEATHER], temperature=0,
        tool_choice={"type": "function", "name": "get_weather"}, max_output_tokens=60,
    ) as stream:  # fmt: skip
        events = list(stream)
    args = "".join(e.delta for e in events if e.type == "response.function_call_arguments.delta")
    assert args == call.arguments
    assert "response.function_call_arguments.done" in [e.type for e in events]
    second = client.responses.create(
        model=MODEL, previous_response_id=first.id, tools=[WEATHER], tool_choice="none",
        input=[{"type": "function_call_output", "call_id": call.call_id, "output": "Sunny."}],
        max_output_tokens=20, temperature=0,
    )  # fmt: skip
    assert second.previous_response_id == first.id and second.output_text
    # turn 2's prompt starts with turn 1's: found in the prefix cache
    assert second.usage.input_tokens > first.usage.input_tokens
    assert second.usage.input_tokens_details.cached_tokens > 0


def test_previous_response_id_without_resending(client: openai.OpenAI) -> None:
    one = client.responses.create(model=MODEL, input="My name is Ada.", max_output_tokens=8,
                                  temperature=0)  # fmt: skip
    two = client.responses.create(model=MODEL, input="What is my name?", max_output_tokens=8,
                                  temperature=0, previous_response_id=one.id)  # fmt: skip
    resent = client.responses.create(model=MODEL, max_output_tokens=8, temperature=0, input=[
        {"role": "user", "content": "My name is Ada."},
        {"role": "assistant", "content": one.output_text},
        {"role": "user", "content": "What is my name?"}])  # fmt: skip
    assert two.output_text == resent.output_text
    assert two.usage.input_tokens == resent.usage.input_tokens
    assert two.usage.input_tokens_details.cached_tokens > 0
    got = client.responses.retrieve(two.id)
    assert got.id == two.id and got.output_text == two.output_text
    client.responses.delete(two.id)
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(two.id)
    with pytest.raises(openai.NotFoundError, match="not found"):
        client.responses.create(model=MODEL, input="x", previous_response_id="resp_nope")


def test_bad_input_is_a_400(server: RemoteServer, client: openai.OpenAI) -> None:
    for body, says in (
        ({"model": MODEL}, "input"),
        ({"model": MODEL, "input": 3}, "input"),
        ({"model": MODEL, "input": [{"role": "robot", "content": "x"}]}, "role"),
        ({"model": MODEL, "input": "x", "tools": [{"type": "web_search"}]}, "not supported"),
        ({"model": MODEL, "input": [{"role": "user", "content": [
            {"type": "input_image", "image_url": "data:"}]}]}, "not supported"),
    ):  # fmt: skip
        r = httpx.post(f"{server.url}/v1/responses", json=body, timeout=30)
        assert r.status_code == 400, r.text
        assert says in r.json()["error"]["message"]
    r = httpx.post(f"{server.url}/v1/responses/resp_nope/cancel", timeout=30)
    assert r.status_code == 404
    done = client.responses.create(model=MODEL, input="hi", max_output_tokens=2)
    r = httpx.post(f"{server.url}/v1/responses/{done.id}/cancel", timeout=30)
    assert r.status_code == 400 and "in progress" in r.json()["error"]["message"]


def test_the_store_is_bounded_in_count_and_age(monkeypatch: pytest.MonkeyPatch) -> None:
    store = ResponseStore(max_entries=2, ttl_s=100.0)
    for i in range(3):
        store.put(f"r{i}", Stored({"id": f"r{i}"}, []))
    assert store.get("r0") is None and store.get("r1") and store.get("r2")
    import services.api_server.response_store as mod

    now = mod.time.monotonic()
    monkeypatch.setattr(mod.time, "monotonic", lambda: now + 101.0)
    assert store.get("r1") is None and store.get("r2") is None


def test_the_openai_agents_sdk_default_model_runs_a_function_tool(server: RemoteServer) -> None:
    """The Agents SDK's default model speaks the Responses API: a forced first call of the
    function tool (the SDK resets ``tool_choice`` after it), its output fed back, a text
    answer."""
    agents = pytest.importorskip("agents")
    seen: list[str] = []

    @agents.function_tool
    def get_weather(city: str) -> str:
        """The weather in a city."""
        seen.append(city)
        return f"Sunny in {city}."

    client = openai.AsyncOpenAI(base_url=f"{server.url}/v1", api_key="x", max_retries=0)
    model = agents.OpenAIResponsesModel(model=MODEL, openai_client=client)
    agent = agents.Agent(
        name="weather", instructions="Answer with the weather.", model=model,
        tools=[get_weather],
        model_settings=agents.ModelSettings(tool_choice="required", temperature=0, max_tokens=40),
    )  # fmt: skip
    agents.set_tracing_disabled(True)
    result = agents.Runner.run_sync(agent, "What is the weather in Paris?", max_turns=3)
    assert len(seen) == 1 and seen[0]
    assert isinstance(result.final_output, str) and result.final_output
    kinds = [item.type for item in result.new_items]
    assert kinds[:2] == ["tool_call_item", "tool_call_output_item"]
    assert kinds[-1] == "message_output_item"


def test_cancel_stops_an_answer_in_progress(server: RemoteServer) -> None:
    """A whole answer in progress is stored as such (GET sees it), /cancel aborts its
    engine request, and the waiting client gets it with status "cancelled". (Its id comes
    from the X-Request-Id header, as every response id here.)"""
    import concurrent.futures
    import time

    rid = f"resp_cancel{time.monotonic_ns()}"
    body = {"model": MODEL, "input": "Count to one thousand.", "max_output_tokens": 900,
            "temperature": 0}  # fmt: skip
    headers = {"X-Request-Id": rid.removeprefix("resp_")}
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        pending = pool.submit(httpx.post, f"{server.url}/v1/responses", json=body,
                              headers=headers, timeout=120)  # fmt: skip
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            got = httpx.get(f"{server.url}/v1/responses/{rid}", timeout=10)
            if got.status_code == 200:
                break
            time.sleep(0.05)
        assert got.status_code == 200 and got.json()["status"] == "in_progress", got.text
        r = httpx.post(f"{server.url}/v1/responses/{rid}/cancel", timeout=30)
        assert r.status_code == 200 and r.json()["status"] == "cancelled", r.text
        answer = pending.result(60)
    assert answer.status_code == 200 and answer.json()["status"] == "cancelled"
    assert answer.json()["usage"] is None or answer.json()["usage"]["output_tokens"] < 900
    assert httpx.get(f"{server.url}/v1/responses/{rid}", timeout=10).json()["status"] == "cancelled"
    ok = httpx.post(f"{server.url}/v1/responses", json={"model": MODEL, "input": "hi",
                                                        "max_output_tokens": 2}, timeout=60)  # fmt: skip
    assert ok.json()["status"] in ("completed", "incomplete")  # and the server goes on
