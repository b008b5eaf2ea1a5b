"""Render a model's Jinja chat template, as HF's ``apply_chat_template(tokenize=False)`` does.

Templates come with the model file (or, with ``--trust-request-chat-template``, with a
request), so they are untrusted code: they run in Jinja's immutable sandbox, the output size
and render time are bounded (the time by SIGALRM where rendering runs on the main thread, as
in the tokenizer processes), and single operations that would build something huge
(``'x' * 10**10``, ``'%999999999d'``, ``'x'.ljust(10**10)``, ``9**9**9``) are refused before
they allocate. A template can still run out of memory by repeated doubling; a
``MemoryError`` is reported as the template's error. The environment matches transformers'
(trim_blocks, lstrip_blocks, loop controls, ``raise_exception``, a ``tojson`` that does not
HTML-escape, ``strftime_now``) so the same template gives the same prompt.
"""

from __future__ import annotations

import json
import re
import signal
import string
import threading
import time
from collections.abc import Callable
from datetime import datetime
from functools import lru_cache, wraps
from typing import Any

import jinja2
import jinja2.ext
import jinja2.filters
from jinja2.sandbox import ImmutableSandboxedEnvironment, SecurityError

# The most items (characters, list entries, formatting width) one template operation may
# build: repetition, widths and powers past it are refused before they run.
MAX_ITEMS = 10_000_000
_POWER_BITS = 4096  # the largest integer a ``**`` may produce
# A printf-style conversion: %[(name)][flags][width][.precision]type
_PERCENT_SPEC = re.compile(r"%(?:\([^)]*\))?[-#0 +]*(\*|\d+)?(?:\.(\*|\d+))?")
_WIDTH_METHODS = frozenset({"ljust", "rjust", "center", "zfill", "expandtabs"})
_WIDTH_FILTERS = ("center", "indent", "wordwrap")


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


def _check_percent(fmt: str) -> None:
    """``fmt % args``: a '*' width (taken from the arguments), or widths and precisions that
    add up to more than ``MAX_ITEMS``."""
    total = 0
    for spec in _PERCENT_SPEC.finditer(fmt):
        for size in spec.groups():
            if size == "*":
                raise SecurityError("'%' formatting with a '*' width")
            total += int(size or 0)
    if total > MAX_ITEMS:
        raise SecurityError(f"'%' formatting widths add up to {total}, past {MAX_ITEMS}")


def _check_format(fmt: str) -> None:
    """``fmt.format(...)``: a width taken from the arguments (``{:{w}}``), or widths that
    add up to more than ``MAX_ITEMS``."""
    total = 0
    for _, _, spec, _ in string.Formatter().parse(fmt):
        if spec and "{" in spec:
            raise SecurityError("str.format with a nested width")
        total += sum(int(n) for n in re.findall(r"\d+", spec or ""))
    if total > MAX_ITEMS:
        raise SecurityError(f"str.format widths add up to {total}, past {MAX_ITEMS}")


def _check_padding(text: Any, name: str, width: Any) -> None:
    """``text``'s padding ``name`` (``ljust``, ``expandtabs``, ``indent``, ...) to ``width``:
    per line for ``indent``, per tab for ``expandtabs``."""
    if not isinstance(width, int):
        return
    times = 1
    if isinstance(text, str) and name == "indent":
        times = text.count("\n") + 1
    elif isinstance(text, str) and name == "expandtabs":
        times = text.count("\t") + 1
    if width * times > MAX_ITEMS:
        raise SecurityError(f"{name} would pad to {width * times} characters, past {MAX_ITEMS}")


def _width_filter(name: str, function: Callable[..., Any]) -> Callable[..., Any]:
    """``center``/``indent``/``wordwrap`` refusing padding past ``MAX_ITEMS``."""

    @wraps(function)
    def bounded(value: Any, *args: Any, **kwargs: Any) -> Any:
        for arg in (*args, *kwargs.values()):
            _check_padding(value, name, arg)
        return function(value, *args, **kwargs)

    return bounded


def _format_filter(fmt: Any, *args: Any, **kwargs: Any) -> str:
    """Jinja's ``format`` filter (``fmt % args``, any ``fmt`` made a string) with the ``%``
    operator's check."""
    _check_percent(str(fmt))
    return str(jinja2.filters.do_format(fmt, *args, **kwargs))


def _repeated_size(left: Any, right: Any) -> int:
    """The items ``left * right`` builds when it repeats a sequence, else 0."""
    for seq, count in ((left, right), (right, left)):
        if isinstance(seq, str | list | tuple) and isinstance(count, int):
            return len(seq) * count
    return 0


def _power_bits(base: Any, exponent: Any) -> int:
    """About the bits of ``base ** exponent`` for integers, else 0."""
    if isinstance(base, int) and isinstance(exponent, int) and abs(base) > 1:
        return exponent * abs(base).bit_length()
    return 0


class _BoundedSandbox(ImmutableSandboxedEnvironment):
    """Jinja's immutable sandbox, refusing single operations that would build more than
    ``MAX_ITEMS`` items: repetition, powers, padding and formatting widths. (Other ways to
    build much, ``replace`` or ``join`` of big strings, meet the tokenizer process's
    memory limit: a ``MemoryError``, reported as the template's error.)"""

    intercepted_binops = frozenset({"*", "**", "%"})

    def call_binop(self, context: Any, operator: str, left: Any, right: Any) -> Any:
        if operator == "*" and (size := _repeated_size(left, right)) > MAX_ITEMS:
            raise SecurityError(f"'*' would build {size} items")
        if operator == "**" and _power_bits(left, right) > _POWER_BITS:
            raise SecurityError(f"'**' would build an integer of more than {_POWER_BITS} bits")
        if operator == "%" and isinstance(left, str):
            _check_percent(left)
        return super().call_binop(context, operator, left, right)

    def call(__self, __context: Any, __obj: Any, *args: Any, **kwargs: Any) -> Any:  # noqa: N805
        if getattr(__obj, "__name__", None) in _WIDTH_METHODS and isinstance(
            getattr(__obj, "__self__", None), str
        ):
            for arg in (*args, *kwargs.values()):
                _check_padding(__obj.__self__, __obj.__name__, arg)
        return super().call(__context, __obj, *args, **kwargs)

    def wrap_str_format(self, value: Any) -> Callable[..., str] | None:
        if isinstance(getattr(value, "__self__", None), str):
            _check_format(value.__self__)
        return super().wrap_str_format(value)


@lru_cache(maxsize=32)
def _compile(template: str) -> jinja2.Template:
    env = _BoundedSandbox(
        trim_blocks=True, lstrip_blocks=True, extensions=[jinja2.ext.loopcontrols]
    )
    for name in _WIDTH_FILTERS:
        env.filters[name] = _width_filter(name, env.filters[name])
    env.filters["format"] = _format_filter
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    return env.from_string(template)


class _Expired(Exception):
    pass


class _Timer:
    """Raise ``_Expired`` in the main thread ``seconds`` after ``start`` (SIGALRM), so a loop
    that emits nothing is stopped too; ``stop`` puts the previous handler back. Only when
    wanted and on the main thread (elsewhere the checks between output chunks are all there
    is).

    ``start`` goes inside the ``try`` whose ``finally`` sets ``armed = False`` and then calls
    ``stop``: the shot lands in the ``try`` or is ignored, and the handler is always put back
    (a context manager would miss a shot landing in its ``__enter__`` or ``__exit__``)."""

    def __init__(self, wanted: bool) -> None:
        self.on = wanted and threading.current_thread() is threading.main_thread()
        self.armed = False
        self.previous: Any = None

    def _expire(self, *_: object) -> None:
        if self.armed:  # a shot still pending once stopped does nothing
            raise _Expired

    def start(self, seconds: float) -> None:
        if self.on:
            self.previous = signal.signal(signal.SIGALRM, self._expire)
            self.armed = True
            signal.setitimer(signal.ITIMER_REAL, seconds)

    def stop(self) -> None:
        self.armed = False
        if self.on:
            signal.setitimer(signal.ITIMER_REAL, 0)
            # None: a handler set outside Python, which cannot be put back; the default
            # then (the timer is off, so it never fires).
            signal.signal(
                signal.SIGALRM, signal.SIG_DFL if self.previous is None else self.previous
            )


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
    variables: dict[str, Any] | None = None,
    timer: bool = False,
    **extra: Any,
) -> str:
    """The prompt text for ``messages``. ``variables`` and ``extra`` (tools, documents,
    enable_thinking, ...: a request's ``chat_template_kwargs``) are passed to the template,
    as HF passes its keyword arguments (and as vLLM, they may set ``add_generation_prompt``;
    not ``messages`` nor the special tokens). ``timer``: stop a render that outlives
    ``timeout_s`` even while it emits nothing, by SIGALRM (for a process of ours that
    renders on its main thread, as the tokenizer's; it takes the process's one real-time
    timer for the render)."""
    extra = {**(variables or {}), **extra}
    fixed = {"messages": messages, "bos_token": bos_token, "eos_token": eos_token}
    if clash := sorted(fixed.keys() & extra.keys()):
        raise ChatTemplateError(f"chat template variables may not set {', '.join(clash)}")
    context = {"add_generation_prompt": add_generation_prompt, **extra, **fixed}
    try:
        compiled = _compile(template)
    except jinja2.TemplateError as e:
        raise ChatTemplateError(f"chat template does not compile: {_one_line(e)}") from None
    took_too_long = ChatTemplateError(f"chat template took longer than {timeout_s}s to render")
    deadline = time.monotonic() + timeout_s
    parts: list[str] = []
    size = 0
    clock = _Timer(timer)
    try:
        try:
            clock.start(timeout_s)
            for chunk in compiled.generate(**context):
                size += len(chunk)
                if size > max_output_chars:
                    raise ChatTemplateError(
                        f"rendered chat prompt exceeds {max_output_chars} characters"
                    )
                if time.monotonic() > deadline:
                    raise took_too_long
                parts.append(chunk)
        finally:
            # Disarmed first, by a plain store: Python runs a pending handler only at
            # checkpoints such as a call's entry, and ``stop()`` is a call.
            clock.armed = False
            clock.stop()
    except (ChatTemplateError, _Expired) as e:
        raise (took_too_long if isinstance(e, _Expired) else e) from None
    except Exception as e:  # TemplateError, SecurityError, MemoryError, TypeError...
        raise ChatTemplateError(f"chat template error: {_one_line(e)}") from None
    return "".join(parts)
