"""Render a model's Jinja chat template, as HF's ``apply_chat_template(tokenize=False)`` does.

Templates come with the model file, so they are untrusted code: they run in Jinja's
immutable sandbox, and the output size and render time are bounded. The environment matches
transformers' (trim_blocks, lstrip_blocks, loop controls, ``raise_exception``, a ``tojson``
that does not HTML-escape, ``strftime_now``) so the same template gives the same prompt.
"""

from __future__ import annotations

import json
import time
from datetime import datetime
from functools import lru_cache
from typing import Any

import jinja2
import jinja2.ext
from jinja2.sandbox import ImmutableSandboxedEnvironment


class ChatTemplateError(ValueError):
    """The template failed, produced too much text or took too long; the message is one line."""


def _raise_exception(message: str) -> None:
    raise jinja2.exceptions.TemplateError(message)


def _tojson(
    x: Any,
    ensure_ascii: bool = False,
    indent: int | None = None,
    separators: Any = None,
    sort_keys: bool = False,
) -> str:
    return json.dumps(
        x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys
    )


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


@lru_cache(maxsize=32)
def _compile(template: str) -> jinja2.Template:
    env = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[jinja2.ext.loopcontrols]
    )
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    return env.from_string(template)


def _one_line(e: BaseException) -> str:
    text = " ".join(str(e).split())
    return f"{type(e).__name__}: {text}" if text else type(e).__name__


def render_chat(
    template: str,
    messages: list[dict[str, Any]],
    *,
    add_generation_prompt: bool = True,
    bos_token: str | None = None,
    eos_token: str | None = None,
    max_output_chars: int = 1_000_000,
    timeout_s: float = 2.0,
    **extra: Any,
) -> str:
    """The prompt text for ``messages``. ``extra`` (tools, documents, enable_thinking, ...)
    is passed to the template as variables, as HF passes its keyword arguments.

    The time limit is checked between output chunks, so a template that loops for a long time
    without emitting anything is only stopped when it next emits (Jinja's sandbox already caps
    ``range`` at 100,000 items).
    """
    try:
        compiled = _compile(template)
    except jinja2.TemplateError as e:
        raise ChatTemplateError(f"chat template does not compile: {_one_line(e)}") from None
    context = {
        "messages": messages,
        "add_generation_prompt": add_generation_prompt,
        "bos_token": bos_token,
        "eos_token": eos_token,
        **extra,
    }
    deadline = time.monotonic() + timeout_s
    parts: list[str] = []
    size = 0
    try:
        for chunk in compiled.generate(**context):
            size += len(chunk)
            if size > max_output_chars:
                raise ChatTemplateError(
                    f"rendered chat prompt exceeds {max_output_chars} characters"
                )
            if time.monotonic() > deadline:
                raise ChatTemplateError(f"chat template took longer than {timeout_s}s to render")
            parts.append(chunk)
    except ChatTemplateError:
        raise
    except Exception as e:  # TemplateError, SecurityError, TypeError from template code...
        raise ChatTemplateError(f"chat template error: {_one_line(e)}") from None
    return "".join(parts)
