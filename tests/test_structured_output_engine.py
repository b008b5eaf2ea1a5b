"""Structured outputs on the default model, offline and through the server (issue 17).

Outputs are checked independently of the grammar engine: ``jsonschema`` for schemas,
``re`` for patterns, membership for choices; through the server with the official
``openai`` client.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterator

import httpx
import jsonschema
import openai
import pytest

from launch.llm import LLM, SamplingParams
from services.protocol import StructuredOutputsParams as SO
from tests.server_utils import RemoteServer
from tests.test_structured_output import SCHEMAS

MODEL = "SmolLM2-135M-Instruct"
MORE_SCHEMAS = [
    {"type": "object", "properties": {
        "city": {"type": "string", "enum": ["Paris", "Rome", "Oslo"]},
        "population": {"type": "integer", "minimum": 1000, "maximum": 99999999},
        "coords": {"type": "array", "items": {"type": "number", "minimum": -180, "maximum": 180},
                   "minItems": 2, "maxItems": 2},
        "code": {"type": "string", "pattern": "^[A-Z]{3}$"}},
     "required": ["city", "population", "coords", "code"], "additionalProperties": False},
    {"type": "array", "items": {"type": "object", "properties": {
        "step": {"type": "integer", "minimum": 1, "maximum": 9},
        "done": {"type": "boolean"}}, "required": ["step", "done"],
        "additionalProperties": False}, "minItems": 1, "maxItems": 3},
]  # fmt: skip
ALL_SCHEMAS = SCHEMAS + MORE_SCHEMAS


def chat(llm: LLM, text: str) -> str:
    return llm.apply_chat_template([{"role": "user", "content": text}])


@pytest.fixture(scope="module")
def llm() -> LLM:
    return LLM(max_model_len=1024, num_gpu_blocks_override=256)


def greedy(max_tokens: int = 80, **kw: object) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=max_tokens, **kw)  # type: ignore[arg-type]


def test_schemas_validate_and_free_requests_in_the_batch_are_unchanged(llm: LLM) -> None:
    free_prompt = chat(llm, "Name three colors.")
    (alone,) = llm.generate([free_prompt], greedy(24))
    prompts = [chat(llm, "Describe something as JSON.")] * len(ALL_SCHEMAS) + [free_prompt]
    params = [greedy(120, structured_outputs=SO(json=json.dumps(s))) for s in ALL_SCHEMAS]
    outs = llm.generate(prompts, [*params, greedy(24)])
    for schema, out in zip(ALL_SCHEMAS, outs, strict=False):
        completion = out.outputs[0]
        assert completion.finish_reason == "stop", completion.text  # the grammar ended it
        jsonschema.validate(json.loads(completion.text), schema)
    assert outs[-1].outputs[0].token_ids == alone.outputs[0].token_ids


def test_choice_regex_and_json_object(llm: LLM) -> None:
    outs = llm.generate(
        [chat(llm, "Is the sky blue?"), chat(llm, "When is the meeting?"), chat(llm, "A user.")],
        [
            greedy(structured_outputs=SO(choice=["yes", "no", "it depends"])),
            greedy(structured_outputs=SO(regex=r"[0-2][0-9]:[0-5][0-9] (am|pm)")),
            greedy(120, structured_outputs=SO(json_object=True, disable_any_whitespace=True)),
        ],
    )
    assert outs[0].outputs[0].text in ("yes", "no", "it depends")
    assert re.fullmatch(r"[0-2][0-9]:[0-5][0-9] (am|pm)", outs[1].outputs[0].text)
    compact = outs[2].outputs[0].text
    # no free whitespace: the one layout of Python's json.dumps (", " and ": ")
    assert isinstance(json.loads(compact), dict) and compact == json.dumps(json.loads(compact))


def test_greedy_under_a_constraint_that_admits_the_free_answer_is_the_free_answer(llm) -> None:
    prompt = chat(llm, "What is the capital of France? Answer in one word.")
    (free,) = llm.generate([prompt], greedy(16))
    answer = free.outputs[0]
    assert answer.finish_reason == "stop"  # it ends by itself, so a choice of it can too
    constraints = [
        SO(choice=[answer.text, "Something else entirely"]),
        SO(regex=r"[\s\S]{0,400}"),
        SO(grammar="root ::= [^\\x00]*"),
    ]
    outs = llm.generate(
        [prompt] * len(constraints), [greedy(16, structured_outputs=c) for c in constraints]
    )
    for out in outs:
        assert out.outputs[0].token_ids == answer.token_ids


def test_n_sampled_choices_each_follow_the_schema(llm: LLM) -> None:
    schema = SCHEMAS[0]
    (out,) = llm.generate(
        [chat(llm, "A person as JSON.")],
        SamplingParams(
            n=3,
            temperature=1.0,
            seed=7,
            max_tokens=120,
            structured_outputs=SO(json=json.dumps(schema)),
        ),  # fmt: skip
    )
    assert len(out.outputs) == 3
    for completion in out.outputs:
        jsonschema.validate(json.loads(completion.text), schema)


def test_min_tokens_cannot_make_the_grammar_sample_nothing(llm: LLM) -> None:
    """min_tokens forbids EOS where the grammar wants only EOS: the grammar wins."""
    (out,) = llm.generate(
        [chat(llm, "Is water wet?")],
        greedy(structured_outputs=SO(choice=["yes", "no"]), min_tokens=8),
    )
    assert out.outputs[0].text in ("yes", "no") and out.outputs[0].finish_reason == "stop"


RUNAWAY = [  # the default model under these schemas, greedy, without bounds: endless digits
    ("Give the population of Paris as JSON.",
     {"type": "object", "properties": {"city": {"type": "string"}, "population": {"type": "integer"}},
      "required": ["city", "population"]}, "population"),
    ("What is pi? Answer as JSON.",
     {"type": "object", "properties": {"value": {"type": "number"}}, "required": ["value"]}, "value"),
]  # fmt: skip


def test_bounded_json_ends_where_unbounded_ran_to_the_length_limit(llm: LLM) -> None:
    """Issue 35: by default a number has at most 20 digits in each part, so the answers
    end (``stop``) with valid JSON; ``unbounded_json`` (vLLM's behaviour) runs to
    ``max_tokens`` writing digits."""
    prompts = [chat(llm, text) for text, _, _ in RUNAWAY] * 2
    params = [
        greedy(120, structured_outputs=SO(json=json.dumps(schema), unbounded_json=unbounded))
        for unbounded in (True, False)
        for _, schema, _ in RUNAWAY
    ]
    outs = [o.outputs[0] for o in llm.generate(prompts, params)]
    unbounded, bounded = outs[: len(RUNAWAY)], outs[len(RUNAWAY) :]
    for (_, schema, key), before, after in zip(RUNAWAY, unbounded, bounded, strict=True):
        assert before.finish_reason == "length" and re.search(r"\d{40}", before.text), before.text
        assert after.finish_reason == "stop", after.text
        value = json.loads(after.text)
        jsonschema.validate(value, schema)
        digits = re.findall(r"\d+", json.dumps(value[key]))
        assert digits and all(len(d) <= 20 for d in digits), after.text


def test_a_bad_constraint_is_refused_offline(llm: LLM) -> None:
    with pytest.raises(ValueError, match="only use one kind"):
        llm.generate(["x"], greedy(structured_outputs=SO(regex="a", choice=["a"])))
    with pytest.raises(ValueError, match="only use one kind"):  # vLLM counts a false too
        llm.generate(["x"], greedy(structured_outputs=SO(regex="a", json_object=False)))
    with pytest.raises(ValueError, match="Invalid json"):
        llm.generate(["x"], greedy(structured_outputs=SO(json='{"type": "nonsense"}')))
    # Syntax fine, but nothing can match: found as it compiles, after the first prompt was
    # added; that one must not run on into the next call.
    with pytest.raises(ValueError, match="allows no output at all"):
        llm.generate(
            ["a", "b"], [greedy(4), greedy(structured_outputs=SO(grammar="root ::= root"))]
        )
    (out,) = llm.generate(["c"], greedy(4))
    assert out.outputs[0].token_ids and not llm.scheduler.requests


def test_preemption_prefix_cache_and_async_scheduling_keep_the_outputs(llm: LLM) -> None:
    prompts = [chat(llm, f"Describe item {i} as JSON.") for i in range(4)]
    params = [greedy(100, structured_outputs=SO(json=json.dumps(s))) for s in ALL_SCHEMAS[:4]]
    expected = [o.outputs[0].token_ids for o in llm.generate(prompts, params)]
    again = llm.generate(prompts, params)  # the prompts are cached now
    assert [o.outputs[0].token_ids for o in again] == expected
    assert all(o.num_cached_tokens > 0 for o in again)
    small = LLM(max_model_len=192, num_gpu_blocks_override=16, async_scheduling=True)
    outs = small.generate(prompts, params)
    assert [o.outputs[0].token_ids for o in outs] == expected
    assert small.scheduler.num_preemptions > 0


def test_the_guidance_backend_serves_the_same_constraints() -> None:
    llm = LLM(max_model_len=512, structured_outputs_config={"backend": "guidance"})
    outs = llm.generate(
        [chat(llm, "A city as JSON."), chat(llm, "Is the sky blue?")],
        [
            greedy(120, structured_outputs=SO(json=json.dumps(MORE_SCHEMAS[0]))),
            greedy(structured_outputs=SO(choice=["yes", "no"])),
        ],  # fmt: skip
    )
    jsonschema.validate(json.loads(outs[0].outputs[0].text), MORE_SCHEMAS[0])
    assert outs[1].outputs[0].text in ("yes", "no")
    with pytest.raises(ValueError, match="Invalid regex"):
        llm.generate(["x"], greedy(structured_outputs=SO(regex="(unclosed")))
    with pytest.raises(ValueError, match="structural_tag is not supported"):
        llm.generate(["x"], greedy(structured_outputs=SO(structural_tag="{}")))


def test_simulated_worker_samples_within_the_grammar() -> None:
    sim = LLM(worker_backend="sim", max_model_len=512)
    pattern = r"(red|green|blue)-[0-9]{2,4}"
    outs = sim.generate(
        ["a", "b", "c"],
        [
            SamplingParams(max_tokens=40, structured_outputs=SO(regex=pattern)),
            SamplingParams(max_tokens=40, structured_outputs=SO(choice=["x", "yy"])),
            SamplingParams(max_tokens=5),
        ],  # fmt: skip
    )
    assert re.fullmatch(pattern, outs[0].outputs[0].text)
    assert outs[1].outputs[0].text in ("x", "yy")


# ---------------------------------------------------------------- through the server


@pytest.fixture(scope="module")
def client() -> Iterator[openai.OpenAI]:
    with RemoteServer(
        "--max-model-len", "1024", "--enable-auto-tool-choice", "--tool-call-parser", "hermes"
    ) as server:
        server.wait_ready()
        yield openai.OpenAI(base_url=f"{server.url}/v1", api_key="x", max_retries=0, timeout=120)


def test_served_json_schema_streamed_and_not_agree(client: openai.OpenAI) -> None:
    schema = MORE_SCHEMAS[0]
    kwargs = dict(
        model=MODEL,
        messages=[{"role": "user", "content": "A city as JSON."}],
        temperature=0,
        max_tokens=120,
        response_format={"type": "json_schema", "json_schema": {"name": "city", "schema": schema}},
    )
    full = client.chat.completions.create(**kwargs)  # type: ignore[call-overload]
    text = full.choices[0].message.content
    jsonschema.validate(json.loads(text), schema)
    assert full.choices[0].finish_reason == "stop"
    streamed = "".join(
        chunk.choices[0].delta.content or ""
        for chunk in client.chat.completions.create(stream=True, **kwargs)  # type: ignore[call-overload]
        if chunk.choices
    )
    assert streamed == text


def test_served_json_bounds_per_request(client: openai.OpenAI) -> None:
    """``response_format`` bounded by default; the request's ``structured_outputs`` turns
    the bounds off (``unbounded_json``) or adds one on strings; a bad bound is a 400."""
    text, schema, _ = RUNAWAY[0]
    kwargs = dict(
        model=MODEL, messages=[{"role": "user", "content": text}], temperature=0, max_tokens=80,
        response_format={"type": "json_schema", "json_schema": {"name": "c", "schema": schema}},
    )  # fmt: skip
    bounded = client.chat.completions.create(**kwargs).choices[0]  # type: ignore[call-overload]
    assert bounded.finish_reason == "stop", bounded.message.content
    jsonschema.validate(json.loads(bounded.message.content or ""), schema)
    unbounded = client.chat.completions.create(  # type: ignore[call-overload]
        extra_body={"structured_outputs": {"unbounded_json": True}}, **kwargs
    ).choices[0]
    assert unbounded.finish_reason == "length"
    short = client.chat.completions.create(  # type: ignore[call-overload]
        extra_body={"structured_outputs": {"json_max_string_length": 2}}, **kwargs
    ).choices[0]
    assert len(json.loads(short.message.content or "")["city"]) <= 2
    with pytest.raises(openai.BadRequestError, match="json_max_string_length"):
        client.chat.completions.create(  # type: ignore[call-overload]
            extra_body={"structured_outputs": {"json_max_string_length": 0}}, **kwargs
        )


def test_served_constraints_and_errors(client: openai.OpenAI) -> None:
    messages = [{"role": "user", "content": "Is the sky blue?"}]
    r = client.completions.create(
        model=MODEL, prompt="Is the sky blue? Answer:", temperature=0.7, n=3, max_tokens=8,
        extra_body={"structured_outputs": {"choice": ["yes", "no"]}},
    )  # fmt: skip
    assert len(r.choices) == 3 and all(c.text in ("yes", "no") for c in r.choices)
    bad_bodies = {
        "structured_outputs": [
            {"structured_outputs": {"regex": "a", "choice": ["a"]}},
            {"structured_outputs": {"choice": []}},
            {"structured_outputs": {}},
        ],
        "response_format": [
            {"response_format": {"type": "json_schema"}},
            {"response_format": {"type": "yaml"}},
        ],
        None: [
            {"structured_outputs": {"grammar": "root ::= root"}},  # found by the scheduler
            {"structured_outputs": {"regex": "(unclosed"}},
            {"response_format": {"type": "json_schema",
                                 "json_schema": {"name": "x", "schema": {"type": "nonsense"}}}},
        ],
    }  # fmt: skip
    for param, bodies in bad_bodies.items():
        for body in bodies:
            with pytest.raises(openai.BadRequestError) as e:
                client.chat.completions.create(
                    model=MODEL, messages=messages, max_tokens=4, extra_body=body
                )
            assert e.value.body["param"] == param, (body, e.value.body)  # type: ignore[index]
    # ... and the server keeps serving, constrained and free
    ok = client.chat.completions.create(
        model=MODEL, messages=messages, temperature=0, max_tokens=8,
        response_format={"type": "json_object"},
    )  # fmt: skip
    assert ok.choices[0].finish_reason in ("stop", "length")


# ---------------------------------------------------------------- tool calls, served

WEATHER = {"type": "object", "properties": {
    "city": {"type": "string", "maxLength": 24}, "unit": {"enum": ["celsius", "fahrenheit"]},
    "days": {"type": "integer", "minimum": 1, "maximum": 7}},
    "required": ["city", "unit", "days"], "additionalProperties": False}  # fmt: skip
ADD = {"type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}},
       "required": ["a", "b"], "additionalProperties": False}  # fmt: skip
TOOLS = [
    {"type": "function", "function": {"name": "get_weather", "description": "The forecast",
                                      "parameters": WEATHER}},
    {"type": "function", "function": {"name": "add", "description": "a + b", "parameters": ADD}},
]  # fmt: skip
ASK = [{"role": "user", "content": "What will the weather be in Paris for the next 3 days?"}]


def streamed_calls(client: openai.OpenAI, **kwargs) -> tuple[list[dict], str | None, str]:
    """The tool calls of a streamed answer, put together from the deltas as a client does."""
    calls: dict[int, dict] = {}
    finish, content = None, ""
    for chunk in client.chat.completions.create(model=MODEL, stream=True, **kwargs):
        choice = chunk.choices[0]
        content += choice.delta.content or ""
        for d in choice.delta.tool_calls or []:
            call = calls.setdefault(d.index, {"id": None, "name": "", "arguments": ""})
            call["id"] = d.id or call["id"]
            if d.function is not None:
                call["name"] += d.function.name or ""
                call["arguments"] += d.function.arguments or ""
        finish = choice.finish_reason or finish
    return [calls[i] for i in sorted(calls)], finish, content


def whole_calls(message) -> list[dict]:
    return [{"id": c.id, "name": c.function.name, "arguments": c.function.arguments}
            for c in message.tool_calls or []]  # fmt: skip


def same_calls(a: list[dict], b: list[dict]) -> bool:
    """Equal but for the ids (each response makes its own)."""
    return [(c["name"], c["arguments"]) for c in a] == [(c["name"], c["arguments"]) for c in b]


def test_named_tool_call_follows_its_schema_streamed_or_not(client: openai.OpenAI) -> None:
    kwargs = dict(messages=ASK, tools=TOOLS, temperature=0, max_tokens=80,
                  tool_choice={"type": "function", "function": {"name": "get_weather"}})  # fmt: skip
    r = client.chat.completions.create(model=MODEL, **kwargs)  # type: ignore[call-overload]
    choice = r.choices[0]
    (call,) = whole_calls(choice.message)
    assert call["name"] == "get_weather" and call["id"].startswith("chatcmpl-tool-")
    jsonschema.validate(json.loads(call["arguments"]), WEATHER)
    assert choice.message.content == "" and choice.finish_reason == "stop"  # vLLM's for named
    calls, finish, content = streamed_calls(client, **kwargs)
    assert same_calls(calls, [call]) and finish == "stop" and content == ""


@pytest.mark.parametrize("parallel", [False, True])
def test_required_tool_calls_streamed_and_not_agree(client: openai.OpenAI, parallel) -> None:
    """One call without parallel calls; with them, as many as the model writes (this small
    model may go on until max_tokens cuts the last one: then finish_reason says "length")."""
    kwargs = dict(messages=ASK, tools=TOOLS, tool_choice="required", temperature=0,
                  max_tokens=120, parallel_tool_calls=parallel)  # fmt: skip
    r = client.chat.completions.create(model=MODEL, **kwargs)  # type: ignore[call-overload]
    choice = r.choices[0]
    calls = whole_calls(choice.message)
    complete = calls if choice.finish_reason == "tool_calls" else calls[:-1]
    assert choice.finish_reason == "tool_calls" or (parallel and choice.finish_reason == "length")
    assert complete and (parallel or len(calls) == 1)
    for call in complete:
        schema = {"get_weather": WEATHER, "add": ADD}[call["name"]]
        jsonschema.validate(json.loads(call["arguments"]), schema)
    streamed, finish, _ = streamed_calls(client, **kwargs)
    assert same_calls(streamed, calls) and finish == choice.finish_reason


def test_auto_parses_what_the_model_wrote(client: openai.OpenAI) -> None:
    """``auto`` with the hermes parser: a plain answer stays content; a call written in
    hermes' tags (made certain here by a pattern on the output) becomes ``tool_calls``."""
    plain = client.chat.completions.create(
        model=MODEL, messages=ASK, tools=TOOLS, temperature=0, max_tokens=12
    )
    assert plain.choices[0].message.content and not plain.choices[0].message.tool_calls
    pattern = (
        r'I will add them\. <tool_call>\{"name": "add", "arguments": '
        r'\{"a": [0-9]{1,2}, "b": [0-9]{1,2}\}\}</tool_call>'
    )
    kwargs = dict(messages=[{"role": "user", "content": "What is 12 + 30?"}], tools=TOOLS,
                  temperature=0, max_tokens=200, extra_body={"structured_outputs": {"regex": pattern}})  # fmt: skip
    r = client.chat.completions.create(model=MODEL, **kwargs)  # type: ignore[call-overload]
    choice = r.choices[0]
    (call,) = whole_calls(choice.message)
    assert call["name"] == "add" and set(json.loads(call["arguments"])) == {"a", "b"}
    assert choice.message.content == "I will add them. " and choice.finish_reason == "tool_calls"
    streamed, finish, content = streamed_calls(client, **kwargs)
    assert same_calls(streamed, [call]) and finish == "tool_calls"
    assert content == "I will add them. "


def test_a_tool_result_goes_back_through_the_template(client: openai.OpenAI) -> None:
    r = client.chat.completions.create(
        model=MODEL, messages=ASK, tools=TOOLS, temperature=0, max_tokens=80,
        tool_choice={"type": "function", "function": {"name": "get_weather"}},
    )  # fmt: skip
    call = r.choices[0].message.tool_calls[0]
    conversation = [
        *ASK,
        {"role": "assistant", "content": None, "tool_calls": [call.model_dump()]},
        {"role": "tool", "tool_call_id": call.id, "content": "Sunny, 24 degrees"},
    ]
    answer = client.chat.completions.create(
        model=MODEL, messages=conversation, tools=TOOLS, tool_choice="none", temperature=0,
        max_tokens=16,
    )  # fmt: skip
    assert answer.choices[0].message.content and not answer.choices[0].message.tool_calls
    base = str(client.base_url).removesuffix("/v1/")
    tokens = httpx.post(f"{base}/tokenize", json={"model": MODEL, "messages": conversation}).json()
    prompt = httpx.post(f"{base}/detokenize", json={"model": MODEL, "tokens": tokens["tokens"]})
    assert "<|im_start|>tool\nSunny, 24 degrees<|im_end|>" in prompt.json()["prompt"]
