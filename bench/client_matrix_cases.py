"""The real-client matrix's cases (issue 35), run by ``bench/client_matrix.py`` in a virtual
environment of their own that holds the client libraries (nothing of actorserve is imported
here): ``python client_matrix_cases.py URL MODEL`` prints one JSON line per case,
``{"library", "case", "ok", "seconds", "error"}``.

Each case is a call a user of the library makes, against the server's chat completions,
Responses or Messages API; it passes when the library accepts the answer (its own parsing
and validation) and the answer has the shape asked for (a parsed object, a tool call with
its arguments, streamed text that equals the whole). Greedy where the library lets one say
so, a few dozen tokens, strings bounded where a schema leaves them open (the default model
writes endless ones).
"""

from __future__ import annotations

import json
import sys
import time
import traceback
from collections.abc import Callable
from typing import Any

import pydantic

URL, MODEL = sys.argv[1], sys.argv[2]
V1 = URL + "/v1"
BOUNDED = {"structured_outputs": {"json_max_string_length": 24}}


class City(pydantic.BaseModel):
    name: str
    country: str


WEATHER_SCHEMA = {"type": "object", "properties": {"city": {"type": "string"}},
                  "required": ["city"], "additionalProperties": False}  # fmt: skip
CASES: list[tuple[str, str, Callable[[], Any]]] = []


def case(library: str, name: str) -> Callable[[Callable[[], Any]], Callable[[], Any]]:
    def add(fn: Callable[[], Any]) -> Callable[[], Any]:
        CASES.append((library, name, fn))
        return fn

    return add


def check(condition: bool, what: str) -> None:
    if not condition:
        raise AssertionError(what)


# ---- openai


def _openai() -> Any:
    import openai

    return openai.OpenAI(base_url=V1, api_key="x", max_retries=0, timeout=120)


@case("openai", "chat, whole and streamed")
def case_1() -> None:
    c = _openai()
    kw = dict(model=MODEL, messages=[{"role": "user", "content": "Name a color."}],
              max_tokens=16, temperature=0)  # fmt: skip
    whole = c.chat.completions.create(**kw).choices[0].message.content
    streamed = "".join(ch.choices[0].delta.content or "" for ch in
                       c.chat.completions.create(stream=True, **kw) if ch.choices)  # fmt: skip
    check(bool(whole) and whole == streamed, "streamed != whole")


@case("openai", "chat.completions.parse (json_schema)")
def case_2() -> None:
    out = _openai().chat.completions.parse(
        model=MODEL, messages=[{"role": "user", "content": "Paris, as JSON."}],
        response_format=City, max_tokens=80, temperature=0, extra_body=BOUNDED,
    )  # fmt: skip
    check(isinstance(out.choices[0].message.parsed, City), "not parsed")


@case("openai", "chat, a named tool call")
def case_3() -> None:
    out = _openai().chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "Weather in Paris?"}], temperature=0,
        tools=[{"type": "function", "function": {"name": "get_weather",
                                                 "parameters": WEATHER_SCHEMA}}],
        tool_choice={"type": "function", "function": {"name": "get_weather"}}, max_tokens=60,
    )  # fmt: skip
    (call,) = out.choices[0].message.tool_calls
    check("city" in json.loads(call.function.arguments), "no city")


@case("openai", "responses.create / stream / parse")
def case_4() -> None:
    c = _openai()
    kw = dict(model=MODEL, input="Say hello.", max_output_tokens=60, temperature=0)
    whole = c.responses.create(**kw)
    with c.responses.stream(**kw) as stream:  # (clients want response.completed: no length cut)
        final = stream.get_final_response()
    check(whole.status == "completed", f"status {whole.status}")
    check(whole.output_text == final.output_text != "", "streamed != whole")
    parsed = c.responses.parse(model=MODEL, input="Paris, as JSON.", text_format=City,
                               max_output_tokens=80, temperature=0, extra_body=BOUNDED)  # fmt: skip
    check(isinstance(parsed.output_parsed, City), "not parsed")


# ---- anthropic


@case("anthropic", "messages, whole, streamed, tool_use, count_tokens")
def case_5() -> None:
    import anthropic

    c = anthropic.Anthropic(base_url=URL, api_key="x", max_retries=0, timeout=120)
    kw = dict(model=MODEL, max_tokens=16, messages=[{"role": "user", "content": "Hi!"}],
              extra_body={"temperature": 0})  # fmt: skip
    whole = c.messages.create(**kw)
    with c.messages.stream(**kw) as stream:
        streamed = "".join(stream.text_stream)
    check(whole.content[0].text == streamed != "", "streamed != whole")
    tool = c.messages.create(
        model=MODEL, max_tokens=60, extra_body={"temperature": 0},
        messages=[{"role": "user", "content": "Weather in Paris?"}],
        tools=[{"name": "get_weather", "input_schema": WEATHER_SCHEMA}],
        tool_choice={"type": "tool", "name": "get_weather"},
    )  # fmt: skip
    check(tool.stop_reason == "tool_use" and tool.content[-1].type == "tool_use", "no tool_use")
    check(c.messages.count_tokens(model=MODEL, messages=kw["messages"]).input_tokens > 0, "count")


# ---- instructor


@case("instructor", "response_model (tools mode and JSON mode)")
def case_6() -> None:
    import instructor

    for mode in (instructor.Mode.TOOLS, instructor.Mode.JSON_SCHEMA):
        client = instructor.from_openai(_openai(), mode=mode)
        city = client.chat.completions.create(
            model=MODEL, response_model=City, max_retries=0, max_tokens=80, temperature=0,
            messages=[{"role": "user", "content": "Paris, as JSON."}], extra_body=BOUNDED,
        )  # fmt: skip
        check(isinstance(city, City), f"{mode}: not a City")


# ---- langchain-openai


@case("langchain-openai", "invoke, stream, with_structured_output, bind_tools")
def case_7() -> None:
    from langchain_openai import ChatOpenAI

    llm = ChatOpenAI(model=MODEL, base_url=V1, api_key="x", temperature=0, max_tokens=16,
                     max_retries=0)  # fmt: skip
    whole = llm.invoke("Name a color.").content
    streamed = "".join(chunk.content for chunk in llm.stream("Name a color."))
    check(whole == streamed != "", "streamed != whole")
    structured = ChatOpenAI(model=MODEL, base_url=V1, api_key="x", temperature=0, max_tokens=80,
                            max_retries=0, extra_body=BOUNDED).with_structured_output(City)  # fmt: skip
    check(isinstance(structured.invoke("Paris, as JSON."), City), "not a City")

    def get_weather(city: str) -> str:
        """The weather in a city."""
        return "sunny"

    tooled = ChatOpenAI(model=MODEL, base_url=V1, api_key="x", temperature=0, max_tokens=60,
                        max_retries=0).bind_tools([get_weather], tool_choice="get_weather")  # fmt: skip
    calls = tooled.invoke("Weather in Paris?").tool_calls
    check(len(calls) == 1 and calls[0]["name"] == "get_weather", "no tool call")


# ---- openai-agents


@case("openai-agents", "Responses model and chat model, a function tool")
def case_8() -> None:
    import agents
    import openai

    agents.set_tracing_disabled(True)

    @agents.function_tool
    def get_weather(city: str) -> str:
        """The weather in a city."""
        return f"Sunny in {city}."

    client = openai.AsyncOpenAI(base_url=V1, api_key="x", max_retries=0)
    for model in (agents.OpenAIResponsesModel(model=MODEL, openai_client=client),
                  agents.OpenAIChatCompletionsModel(model=MODEL, openai_client=client)):  # fmt: skip
        agent = agents.Agent(name="w", instructions="Answer with the weather.", model=model,
                             tools=[get_weather],
                             model_settings=agents.ModelSettings(tool_choice="required",
                                                                 temperature=0, max_tokens=40))  # fmt: skip
        result = agents.Runner.run_sync(agent, "Weather in Paris?", max_turns=3)
        kinds = [item.type for item in result.new_items]
        check(kinds[:2] == ["tool_call_item", "tool_call_output_item"], f"{kinds}")
        check(isinstance(result.final_output, str) and result.final_output != "", "no answer")


# ---- pydantic-ai


@case("pydantic-ai", "Agent with output_type")
def case_9() -> None:
    from pydantic_ai import Agent, ModelSettings
    from pydantic_ai.models.openai import OpenAIChatModel
    from pydantic_ai.providers.openai import OpenAIProvider

    model = OpenAIChatModel(MODEL, provider=OpenAIProvider(base_url=V1, api_key="x"))
    settings = ModelSettings(temperature=0, max_tokens=80, extra_body=BOUNDED)
    agent = Agent(model, output_type=City, model_settings=settings, retries=0)
    check(isinstance(agent.run_sync("Paris, as JSON.").output, City), "not a City")


# ---- litellm


@case("litellm", "completion whole, streamed, and response_format")
def case_10() -> None:
    import litellm

    kw = dict(model=f"openai/{MODEL}", api_base=V1, api_key="x", temperature=0, max_tokens=16,
              messages=[{"role": "user", "content": "Name a color."}])  # fmt: skip
    whole = litellm.completion(**kw).choices[0].message.content
    streamed = "".join(ch.choices[0].delta.content or "" for ch in
                       litellm.completion(stream=True, **kw))  # fmt: skip
    check(whole == streamed != "", "streamed != whole")
    kw.update(max_tokens=80, messages=[{"role": "user", "content": "Paris, as JSON."}])
    out = litellm.completion(**kw, response_format=City, extra_body=BOUNDED)
    City.model_validate_json(out.choices[0].message.content)


def main() -> None:
    only = set(sys.argv[3:])
    for library, name, fn in CASES:
        if only and library not in only:
            continue
        started = time.perf_counter()
        row: dict[str, Any] = {"library": library, "case": name, "ok": True, "error": None}
        try:
            fn()
        except Exception as e:  # every failure is a row, never the end of the run
            row["ok"] = False
            row["error"] = f"{type(e).__name__}: {e}"[:300]
            traceback.print_exc(file=sys.stderr)
        row["seconds"] = round(time.perf_counter() - started, 2)
        print(json.dumps(row), flush=True)


if __name__ == "__main__":
    main()
