"""``--reasoning-parser`` served: a thinking model's thinking in ``reasoning_content`` (chat,
whole and streamed, through the official ``openai`` client) and in reasoning items
(Responses), with structured outputs and forced tool calls applied to the answer after the
thinking -- never switched off.

The default model does not think on its own; a chat template (the shipped
``deploy/chat_templates/chatml_thinking.jinja``) opens ``<think>`` after the assistant's
turn (closed at once with ``enable_thinking: false``, as Qwen3's), and two worked examples
in the conversation show it how to close it. The unsplit text, the
reference, comes from ``/v1/completions`` on the same rendered prompt (no reasoning parser
there). A Qwen3-architecture model with random weights and a tokenizer with ``<think>`` and
``</think>`` tokens (one token each) checks the single-token markers, steered with
``logit_bias``.
"""

from __future__ import annotations

import json

import httpx
import jsonschema
import openai
import pytest

from tests.server_utils import REPO, RemoteServer, sse_chunks

THINKING_TEMPLATE = REPO / "deploy/chat_templates/chatml_thinking.jinja"  # the shipped one
PLAIN_TEMPLATE = (
    "{%- for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
    "{% endfor %}{%- if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
SHOTS = [
    {"role": "system", "content": "You think before answering. Write your thinking inside "
                                  "<think> and </think>, then the answer."},
    {"role": "user", "content": "What is 2+2?"},
    {"role": "assistant", "content": "<think>\nTwo plus two is four.\n</think>\n\nThe answer is 4."},
    {"role": "user", "content": "What is the capital of Italy?"},
    {"role": "assistant", "content": "<think>\nItaly's capital is Rome.\n</think>\n\n"
                                     "The capital of Italy is Rome."},
]  # fmt: skip
QUESTION = [*SHOTS, {"role": "user", "content": "What is the capital of France?"}]
SCHEMA = {"type": "object", "properties": {"capital": {"type": "string", "maxLength": 12}},
          "required": ["capital"], "additionalProperties": False}  # fmt: skip


@pytest.fixture(scope="module")
def server():
    with RemoteServer(
        "--max-model-len", "2048", "--reasoning-parser", "deepseek_r1",
        "--chat-template", str(THINKING_TEMPLATE), "--trust-request-chat-template",
        "--enable-auto-tool-choice", "--tool-call-parser", "hermes",
    ) as s:  # fmt: skip
        yield s.wait_ready()


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key="none", max_retries=0)


MODEL = "SmolLM2-135M-Instruct"


def chat(client, messages=QUESTION, **kwargs):
    kwargs = {"temperature": 0, "max_tokens": 60, **kwargs}
    return client.chat.completions.create(model=MODEL, messages=messages, **kwargs)


def reasoning_of(message) -> str | None:
    return (message.model_extra or {}).get("reasoning_content")


@pytest.fixture(scope="module")
def unsplit(server) -> str:
    """The model's whole text for QUESTION, markers and all: the same prompt rendered by
    ``/tokenize``, completed by ``/v1/completions`` (which splits nothing)."""
    ids = httpx.post(f"{server.url}/tokenize", json={"messages": QUESTION}, timeout=60)
    body = {"prompt": ids.json()["tokens"], "max_tokens": 60, "temperature": 0}
    out = httpx.post(f"{server.url}/v1/completions", json=body, timeout=120).json()
    return out["choices"][0]["text"]


def test_thinking_goes_to_reasoning_content(client, unsplit):
    thinking, marker, answer = unsplit.partition("</think>")
    assert marker and thinking.strip() and answer.strip(), unsplit  # the examples worked
    whole = chat(client)
    message = whole.choices[0].message
    assert reasoning_of(message) == thinking
    # the thinking's tokens, markers included, of the output's
    num_thinking = len(
        httpx.post(
            f"{client.base_url}".removesuffix("/v1/") + "/tokenize",
            json={"prompt": thinking + "</think>"},
        ).json()["tokens"]
    )
    details = whole.usage.completion_tokens_details
    assert abs(details.reasoning_tokens - num_thinking) <= 1  # the closing step's tokens
    assert details.reasoning_tokens < whole.usage.completion_tokens
    assert message.content == answer.lstrip()
    assert "<think>" not in message.content and "</think>" not in message.content

    stream = chat(client, stream=True)
    reasoning, content = [], []
    for chunk in stream:
        delta = chunk.choices[0].delta
        reasoning.append((delta.model_extra or {}).get("reasoning_content") or "")
        content.append(delta.content or "")
    assert "".join(reasoning) == thinking
    assert "".join(content) == answer.lstrip()


def test_the_schema_applies_to_the_answer_after_the_thinking(client, unsplit):
    """The thinking is the unconstrained one (greedy: the same text); the answer, prose
    without a grammar, is the schema's JSON."""
    fmt = {"type": "json_schema", "json_schema": {"name": "capital", "schema": SCHEMA}}
    choice = chat(client, response_format=fmt).choices[0]
    assert reasoning_of(choice.message) == unsplit.partition("</think>")[0]
    assert choice.finish_reason == "stop"
    jsonschema.validate(json.loads(choice.message.content), SCHEMA)


@pytest.mark.parametrize(
    "how",
    [{"chat_template_kwargs": {"enable_thinking": False}},  # the prompt closes the thinking
     {"chat_template": PLAIN_TEMPLATE}],  # the model may open it: this one has no token to
)  # fmt: skip
def test_without_thinking_the_grammar_holds_from_the_first_token(client, how):
    """vLLM has shipped reasoning parsers that left such requests unconstrained."""
    fmt = {"type": "json_schema", "json_schema": {"name": "capital", "schema": SCHEMA}}
    choice = chat(client, response_format=fmt, extra_body=how).choices[0]
    assert reasoning_of(choice.message) is None
    jsonschema.validate(json.loads(choice.message.content), SCHEMA)


def test_a_forced_tool_call_follows_the_thinking(client, unsplit):
    tools = [{"type": "function", "function": {"name": "capital_of", "parameters": {
        "type": "object", "properties": {"country": {"type": "string", "maxLength": 12}},
        "required": ["country"], "additionalProperties": False}}}]  # fmt: skip
    message = chat(client, tools=tools, tool_choice="required", max_tokens=80).choices[0].message
    assert reasoning_of(message) == unsplit.partition("</think>")[0]
    (call,) = message.tool_calls
    assert call.function.name == "capital_of"
    assert isinstance(json.loads(call.function.arguments)["country"], str)


def test_responses_give_a_reasoning_item_then_the_message(client, unsplit):
    thinking, _, answer = unsplit.partition("</think>")
    kwargs = dict(model=MODEL, input=QUESTION, temperature=0, max_output_tokens=60)
    response = client.responses.create(**kwargs)
    assert 0 < response.usage.output_tokens_details.reasoning_tokens < response.usage.output_tokens
    reasoning, message = response.output
    assert reasoning.type == "reasoning" and reasoning.content[0].text == thinking
    assert message.type == "message" and response.output_text == answer.lstrip()

    events = list(client.responses.create(**kwargs, stream=True))
    kinds = [e.type for e in events]
    first_text = kinds.index("response.output_text.delta")
    assert kinds.index("response.reasoning_text.delta") < first_text
    assert kinds.index("response.reasoning_text.done") < first_text
    deltas = "".join(e.delta for e in events if e.type == "response.reasoning_text.delta")
    assert deltas == thinking
    final = events[-1].response
    assert [item.type for item in final.output] == ["reasoning", "message"]


# ---- a Qwen3-architecture model whose tokenizer has <think> and </think> tokens


QWEN3_TEMPLATE = (
    "{%- for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
    "{% endfor %}{%- if add_generation_prompt %}<|im_start|>assistant\n"
    "{% if enable_thinking is defined and not enable_thinking %}<think>\n\n</think>\n\n"
    "{% endif %}{% endif %}"
)  # Qwen3's: the model opens its thinking itself, unless enable_thinking is false


@pytest.fixture(scope="module")
def qwen3(tmp_path_factory):
    """A small random Qwen3 (HF transformers writes it) on the default model's tokenizer
    plus ``<think>`` and ``</think>``, served with ``--reasoning-parser qwen3``."""
    import tokenizers
    import torch
    import transformers

    from services.model_loader import prepare_model

    folder = tmp_path_factory.mktemp("qwen3-thinking")
    source = prepare_model(None, "auto")
    tok = tokenizers.Tokenizer.from_file(str(source / "tokenizer.json"))
    tok.add_tokens([tokenizers.AddedToken(t, special=False) for t in ("<think>", "</think>")])
    tok.save(str(folder / "tokenizer.json"))
    tok_config = json.loads((source / "tokenizer_config.json").read_text())
    tok_config["chat_template"] = QWEN3_TEMPLATE
    tok_config.pop("added_tokens_decoder", None)
    (folder / "tokenizer_config.json").write_text(json.dumps(tok_config))
    config = transformers.Qwen3Config(
        vocab_size=tok.get_vocab_size(), hidden_size=64, intermediate_size=128,
        num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
        max_position_embeddings=2048, tie_word_embeddings=True,
        eos_token_id=tok.token_to_id("<|im_end|>"),
    )  # fmt: skip
    torch.manual_seed(0)
    transformers.Qwen3ForCausalLM(config).save_pretrained(folder, safe_serialization=True)
    with RemoteServer(
        "--model", str(folder), "--max-model-len", "512", "--reasoning-parser", "qwen3",
        "--trust-request-chat-template",
    ) as s:  # fmt: skip
        s.wait_ready()
        yield s, tok.token_to_id("<think>"), tok.token_to_id("</think>")


def qwen3_chat(server, **body):
    body = {"messages": [{"role": "user", "content": "hi"}],
            "temperature": 0, "max_tokens": 30, **body}  # fmt: skip
    r = httpx.post(f"{server.url}/v1/chat/completions", json=body, timeout=120)
    assert r.status_code == 200, r.text
    return r.json()["choices"][0]


COMPACT = {"structured_outputs": {"json": {"type": "object", "properties": {"ok": {
    "type": "boolean"}}, "required": ["ok"]}, "disable_any_whitespace": True}}  # fmt: skip


def test_qwen3_single_token_markers(qwen3):
    server, open_id, close_id = qwen3
    # The prompt opens the thinking (a Qwen3-Thinking style template); </think> pushed to
    # the top closes it at once, and the grammar takes the answer (where </think> is
    # not allowed) however hard it is pushed.
    opened = QWEN3_TEMPLATE.replace("{% endif %}{% endif %}", "{% else %}<think>\n{% endif %}"
                                    "{% endif %}")  # fmt: skip
    choice = qwen3_chat(server, chat_template=opened, logit_bias={str(close_id): 100}, **COMPACT)
    assert choice["message"].get("reasoning_content") is None  # nothing before </think>
    assert json.loads(choice["message"]["content"]) in ({"ok": True}, {"ok": False})

    # No thinking opened by the prompt ("opening"): under a grammar the model may open it
    # with <think> (one token) ...
    choice = qwen3_chat(server, logit_bias={str(open_id): 100}, max_tokens=4, **COMPACT)
    assert choice["finish_reason"] == "length"
    assert choice["message"]["reasoning_content"] == "<think>" * 3  # it keeps "thinking"
    # ... but </think> is no way around the grammar
    choice = qwen3_chat(server, logit_bias={str(close_id): 100}, **COMPACT)
    assert "reasoning_content" not in choice["message"]
    assert json.loads(choice["message"]["content"]) in ({"ok": True}, {"ok": False})

    # enable_thinking: false: the prompt closed it; no split, the grammar from the start
    sse = httpx.post(f"{server.url}/v1/chat/completions", timeout=120, json={
        "messages": [{"role": "user", "content": "hi"}], "stream": True,
        "max_tokens": 30, "temperature": 0, "chat_template_kwargs": {"enable_thinking": False},
        "logit_bias": {str(open_id): 100}, **COMPACT})  # fmt: skip
    deltas = [c["choices"][0]["delta"] for c in sse_chunks(sse.text) if c["choices"]]
    assert not any("reasoning_content" in d for d in deltas)
    assert json.loads("".join(d.get("content") or "" for d in deltas)) in (
        {"ok": True},
        {"ok": False},
    )


def test_anthropic_messages_give_a_thinking_block_then_the_text(server, unsplit):
    import anthropic

    thinking, _, answer = unsplit.partition("</think>")
    client = anthropic.Anthropic(base_url=server.url, api_key="none", max_retries=0)
    system, *messages = QUESTION
    kwargs = dict(model=MODEL, system=system["content"], messages=messages, max_tokens=60,
                  extra_body={"temperature": 0})  # fmt: skip
    message = client.messages.create(**kwargs)
    assert [b.type for b in message.content] == ["thinking", "text"]
    assert message.content[0].thinking == thinking
    assert message.content[1].text == answer.lstrip()

    with client.messages.stream(**kwargs) as stream:
        final = stream.get_final_message()
    assert [b.type for b in final.content] == ["thinking", "text"]
    assert final.content[0].thinking == thinking

    # thinking disabled: the template closes it, all of it is text
    off = client.messages.create(
        **kwargs | {"extra_body": {"temperature": 0, "thinking": {"type": "disabled"}}}
    )
    assert [b.type for b in off.content] == ["text"]
