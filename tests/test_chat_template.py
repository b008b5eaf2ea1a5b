"""Chat template rendering against HF transformers' apply_chat_template, plus its limits."""

from __future__ import annotations

import signal
import time

import pytest

from services.tokenizer.chat_template import MAX_ITEMS, ChatTemplateError, _compile, render_chat

CONVERSATIONS = [
    [{"role": "user", "content": "What is the capital of France?"}],
    [
        {"role": "system", "content": "You are terse."},
        {"role": "user", "content": "Hi"},
        {"role": "assistant", "content": "Hello."},
        {"role": "user", "content": "Write code:\n  def f(): pass\n中文 🤗"},
    ],
    [{"role": "user", "content": ""}],
]

# Representative Hub-style templates: Llama-3 (bos_token, raise_exception, loop controls),
# Qwen-style ChatML with tools (tojson), and whitespace control that trim/lstrip_blocks affect.
LLAMA3 = (
    "{{ bos_token }}{% for message in messages %}"
    "{% if message['role'] not in ['system', 'user', 'assistant'] %}"
    "{{ raise_exception('bad role ' + message['role']) }}{% endif %}"
    "{{ '<|start_header_id|>' + message['role'] + '<|end_header_id|>\n\n' + message['content'] | trim + '<|eot_id|>' }}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|start_header_id|>assistant<|end_header_id|>\n\n' }}{% endif %}"
)
CHATML_TOOLS = """{%- if tools %}
    {{- '<|im_start|>system\\n# Tools\\n<tools>' }}
    {%- for tool in tools %}
        {{- '\\n' }}{{- tool | tojson }}
    {%- endfor %}
    {{- '\\n</tools><|im_end|>\\n' }}
{%- endif %}
{%- for message in messages %}
    {%- if loop.index0 > 5 %}{% break %}{% endif %}
    {{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>' + '\\n' }}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|im_start|>assistant\\n' }}
{%- endif %}
"""
BLOCKS = """{% for m in messages %}
  {% if m.role == 'user' %}
    U: {{ m.content }}
  {% else %}
    O: {{ m.content }}
  {% endif %}
{% endfor %}
{% if add_generation_prompt %}A:{% endif %}"""
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "Météo <b>&</b>",
          "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}}]  # fmt: skip


@pytest.fixture(scope="module")
def hf_tokenizer(hf_reference):
    """HF's tokenizer built from the default GGUF (conftest loads it once per session)."""
    return hf_reference.tokenizer


@pytest.mark.parametrize("messages", CONVERSATIONS)
@pytest.mark.parametrize("add_generation_prompt", [True, False])
def test_default_model_template_matches_transformers(hf_tokenizer, messages, add_generation_prompt):
    want = hf_tokenizer.apply_chat_template(
        messages, tokenize=False, add_generation_prompt=add_generation_prompt
    )
    got = render_chat(
        hf_tokenizer.chat_template,
        messages,
        add_generation_prompt=add_generation_prompt,
        bos_token=hf_tokenizer.bos_token,
        eos_token=hf_tokenizer.eos_token,
    )
    assert got == want


@pytest.mark.parametrize(
    "template", [LLAMA3, CHATML_TOOLS, BLOCKS], ids=["llama3", "chatml-tools", "blocks"]
)
@pytest.mark.parametrize("messages", CONVERSATIONS[:2])
def test_hub_style_templates_match_transformers(template, messages):
    from transformers.utils.chat_template_utils import render_jinja_template

    (want,), _ = render_jinja_template(
        conversations=[messages],
        tools=TOOLS,
        chat_template=template,
        add_generation_prompt=True,
        bos_token="<|begin_of_text|>",
        eos_token="<|eot_id|>",
    )
    got = render_chat(
        template, messages, bos_token="<|begin_of_text|>", eos_token="<|eot_id|>", tools=TOOLS
    )
    assert got == want
    if template is CHATML_TOOLS:
        assert "Météo <b>&</b>" in got  # tojson neither escapes HTML nor non-ASCII


def _error(template: str, **kwargs) -> str:
    with pytest.raises(ChatTemplateError) as info:
        render_chat(template, CONVERSATIONS[0], **kwargs)
    msg = str(info.value)
    assert "\n" not in msg
    return msg


def test_errors_are_one_line_chat_template_errors():
    assert "does not compile" in _error("{% for m in messages %}\n{{ m.content ")
    with pytest.raises(
        ChatTemplateError, match="^chat template error: TemplateError: bad role tool$"
    ):
        render_chat(LLAMA3, [{"role": "tool", "content": "42"}])
    assert "undefined" in _error("{{ nothing.at_all }}").lower()
    assert isinstance(ChatTemplateError("x"), ValueError)


def test_sandbox_blocks_mutation_and_internals():
    assert "SecurityError" in _error("{{ messages.append(1) }}")
    assert "SecurityError" in _error("{{ ''.__class__.__mro__[1].__subclasses__() }}")


def test_output_size_is_bounded():
    big = "{% for i in range(100000) %}{{ 'x' * 100 }}{% endfor %}"
    assert "exceeds 5000 characters" in _error(big, max_output_chars=5000)
    assert len(render_chat("{{ 'y' * 5000 }}", [], max_output_chars=5000)) == 5000


def test_render_time_is_bounded():
    slow = "{% for i in range(100000) %}{% for j in range(1000) %}{{ j }}{% endfor %}{% endfor %}"
    start = time.monotonic()
    msg = _error(slow, timeout_s=0.05, max_output_chars=10**12)
    assert "longer than 0.05s" in msg and time.monotonic() - start < 2.0


def test_a_silent_loop_is_stopped_on_time():
    """A loop that emits nothing is stopped by the timer (on the main thread, as in the
    tokenizer process), not only when it next emits."""
    silent = "{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}"
    start = time.monotonic()
    assert "longer than 0.2s" in _error(silent, timeout_s=0.2, timer=True)
    assert time.monotonic() - start < 1.5
    assert signal.getsignal(signal.SIGALRM) is signal.SIG_DFL  # the timer's handler is gone
    assert signal.getitimer(signal.ITIMER_REAL) == (0.0, 0.0)
    assert render_chat("{{ messages | length }}", CONVERSATIONS[0]) == "1"


@pytest.mark.parametrize(
    "template",
    [
        "{{ 'x' * 20000000 }}",
        "{{ [0] * 20000000 }}",
        "{{ 20000000 * 'x' }}",
        "{{ 7 ** 100000 }}",
        "{{ '%20000000d' % 1 }}",
        "{{ '%(a)20000000d' % {'a': 1} }}",
        "{{ '%.20000000f' % 1.0 }}",
        "{{ '%*d' % (20000000, 1) }}",
        "{{ '%20000000d' | format(1) }}",
        "{{ '{:>20000000}'.format(1) }}",
        "{{ '{:>{w}}'.format(1, w=20000000) }}",
        "{{ '{:>{w}}'.format(1, w='20000000') }}",
        "{{ 'x'.ljust(20000000) }}",
        "{{ 'x'.zfill(20000000) }}",
        "{{ 'x' | center(20000000) }}",
        "{{ 'x' | indent(20000000, true) }}",
        # per result, not per width: 100 widths, lines or tabs of a tenth of the bound each
        "{{ ['%*d'] | format(20000000, 1) }}",
        "{{ ('%1000000s' * 100) % ((1,) * 100) }}",
        "{{ ('{:1000000}' * 100).format(*range(100)) }}",
        "{{ ('\t' * 100).expandtabs(1000000) }}",
        "{{ ('\n' * 100) | indent(1000000, true, true) }}",
    ],
)
def test_one_operation_cannot_build_something_huge(template):
    """Each would build 2x MAX_ITEMS (20 MB; scaled up, gigabytes in one C call no timer can
    stop): refused before it runs. Sized so a broken guard fails the test, not the machine."""
    assert MAX_ITEMS == 10_000_000
    start = time.monotonic()
    assert "SecurityError" in _error(template, timeout_s=30, max_output_chars=10**9)
    assert time.monotonic() - start < 1.0


def test_ordinary_numbers_widths_and_powers_still_work():
    """Big numbers as values (timestamps, a tool schema's maxItems) are not sizes."""
    got = render_chat(
        "{{ 'ab' * 3 }}|{{ 2 ** 10 }}|{{ '%5d' % 7 }}|{{ '{:>4}'.format(1) }}|"
        "{{ 1717171717 | string }}|{{ '%d' | format(1717171717) }}|{{ '{}'.format(2**40) }}|"
        "{{ x | default(2147483647) }}|{{ 'a' | center(5) }}|{{ '%(n)s' % {'n': 2**40} }}",
        [],
    )
    assert (
        got
        == "ababab|1024|    7|   1|1717171717|1717171717|1099511627776|2147483647|  a  |1099511627776"
    )


def test_request_variables_cannot_replace_the_messages():
    """As vLLM: a request's variables may set add_generation_prompt (its own wins), not the
    conversation nor the special tokens."""
    with pytest.raises(ChatTemplateError, match="may not set eos_token, messages"):
        render_chat("x", [], variables={"messages": [], "eos_token": "x"})
    template = "{{ tools }}{{ add_generation_prompt }}"
    assert (
        render_chat(template, [], variables={"tools": 3, "add_generation_prompt": False})
        == "3False"
    )


def test_compiled_templates_are_cached():
    template = "{{ messages | length }}-cached"
    assert render_chat(template, CONVERSATIONS[1]) == "4-cached"
    hits = _compile.cache_info().hits
    assert render_chat(template, CONVERSATIONS[0]) == "1-cached"
    assert _compile.cache_info().hits == hits + 1
