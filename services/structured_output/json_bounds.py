"""Bounds on what a JSON schema leaves open, so constrained output cannot run away.

A schema that sets no bound lets a model write a number of 180 digits or 170 newlines
between two keys: every prefix valid, the answer useless, the request ended by
``max_tokens`` (vLLM behaves so; its users report endless digits under an empty schema).
By default (``JsonBounds()``, ``services/config/structured_outputs.py``) the xgrammar backend
bounds

- the whitespace between two JSON tokens: at most ``whitespace`` characters in one run
  (xgrammar's ``max_whitespace_cnt``; enough for an indented document nested 9 deep);
- the digits of each part of a number (integer, fraction, exponent) where the schema sets
  no bound: at most ``digits`` (no useful JSON number has more: a double has 17
  significant digits, an int64 19);
- and, only when asked, the characters of a string the schema leaves unbounded
  (``string_length``; a schema's own ``maxLength``/``minLength``/``pattern`` are kept).

``UNBOUNDED`` is vLLM's behaviour: the server's ``--structured-outputs-config
'{"unbounded_json": true}'``, or a request's ``structured_outputs.unbounded_json``.

The bounds are applied to the grammar xgrammar makes of the schema (``bound_grammar``):
its rules are read as text, and each unbounded repetition of a digit, of a string's
characters or of whitespace (``[0-9]*``, ``rule{m, -1}`` where ``rule`` is one character
class) gets the bound as its maximum. String literals and a ``pattern``'s regex are left as
they are. ``tests/test_json_bounds.py`` checks the result on xgrammar's own matcher, so a
new xgrammar that prints its grammars otherwise fails there, not in production.
"""

from __future__ import annotations

import re

from services.config.structured_outputs import UNBOUNDED, JsonBounds

__all__ = ["UNBOUNDED", "JsonBounds", "bound_grammar"]


# One token of a rule's body: a string literal, a character class, an unbounded repeat
# ``{m, -1}``, ``*`` / ``+``, a name, or any other character.
_TOKEN = re.compile(
    r'"(?:[^"\\]|\\.)*"|\[(?:[^\]\\]|\\.)*\]|\{\s*\d+\s*,\s*-1\s*\}|[*+]|[A-Za-z_]\w*|\s+|.',
    re.S,
)
_RULE = re.compile(r"^([A-Za-z_]\w*) ::= (.*)$")
_ONE_CLASS = re.compile(r"^\(\((\[(?:[^\]\\]|\\.)*\])\)\)$")
_DIGIT = "[0-9]"
_SPACE = "[ \\n\\r\\t]"
_STRING_CHAR = (
    '[^\\0-\\x1f\\"\\\\\\r\\n]'  # JSON's unescaped string character, as xgrammar prints it
)


def _bound_for(char_class: str, bounds: JsonBounds) -> int | None:
    if char_class == _DIGIT:
        return bounds.digits
    if char_class == _SPACE:
        return bounds.whitespace
    return bounds.string_length


def bound_grammar(ebnf: str, bounds: JsonBounds) -> str:
    """``ebnf`` (xgrammar's grammar of a JSON schema, as ``str(Grammar)`` prints it) with
    ``bounds`` on its unbounded repetitions."""
    rules: list[tuple[str, str]] = []
    for line in ebnf.splitlines():
        found = _RULE.match(line)
        if found is None:
            raise ValueError(f"not a grammar rule: {line!r}")
        rules.append((found.group(1), found.group(2)))
    classes = {name: m.group(1) for name, body in rules if (m := _ONE_CLASS.match(body))}
    out = []
    for name, body in rules:
        if name == "basic_string" and bounds.string_length is not None:
            body = f'(("\\"" basic_string_char{{0, {bounds.string_length}}} "\\""))'
        out.append(f"{name} ::= {_bound_body(body, classes, bounds)}")
    if bounds.string_length is not None and any(n == "basic_string" for n, _ in rules):
        out.append(f'basic_string_char ::= (({_STRING_CHAR}) | ("\\\\" basic_escape))')
    return "\n".join(out) + "\n"


def _bound_body(body: str, classes: dict[str, str], bounds: JsonBounds) -> str:
    tokens = _TOKEN.findall(body)
    for i in range(1, len(tokens)):
        tok, prev = tokens[i], tokens[i - 1]
        if tok in ("*", "+") and prev.startswith("["):
            limit = _bound_for(prev, bounds)
            if limit is not None:  # (after a digit class: one digit came before, [1-9])
                most = max(limit - (prev == _DIGIT), 1)
                tokens[i] = f"{{{0 if tok == '*' else 1}, {most}}}"
        elif tok.startswith("{") and tok.endswith("-1}") and prev in classes:
            limit = _bound_for(classes[prev], bounds)
            if limit is not None:
                least = int(tok[1:].split(",")[0])
                tokens[i] = f"{{{least}, {max(limit, least, 1)}}}"
    return "".join(tokens)
