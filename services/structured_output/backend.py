"""Grammar engines for structured outputs, behind one small interface (issue 17).

A constraint is a kind and its text, vLLM's ``structured_outputs`` fields: ``json`` (a JSON
schema), ``json_object`` (any JSON object), ``regex``, ``choice`` (a JSON list of strings),
``grammar`` (EBNF) and ``structural_tag``. A backend turns one into a ``Matcher`` that
follows a request's tokens and fills the row of a token bitmask for its next one: int32
words, bit ``t % 32`` of word ``t // 32`` set when token ``t`` is allowed (xgrammar's and
llguidance's layout). Backends register by name (``--structured-outputs-config
'{"backend": ...}'``, vLLM's flag); ``xgrammar`` is vLLM's default and ours.

Every backend's errors for a bad constraint are ``GrammarError`` with a message that says
what is wrong (a 400 for the request).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

import tokenizers

from services.config.structured_outputs import UNBOUNDED, JsonBounds
from services.registry import GRAMMAR_BACKENDS, resolve
from services.request import Matcher

if TYPE_CHECKING:
    import numpy as np

KINDS = ("json", "json_object", "regex", "choice", "grammar", "structural_tag")


class GrammarError(ValueError):
    """A constraint the grammar engine cannot use; the message says why."""


@dataclass(frozen=True)
class Constraint:
    kind: str  # one of KINDS
    spec: str  # the schema, pattern, grammar or tag as text; for choice a JSON list
    # JSON only: whitespace the model may put between tokens (vLLM's default), or none at
    # all (vLLM's ``disable_any_whitespace``)
    any_whitespace: bool = True
    # JSON only: bounds on runs of whitespace, number digits and strings where the schema
    # sets none (``json_bounds.py``); vLLM's unbounded by default here, bounded by
    # ``constraint_of`` from the server's settings
    bounds: JsonBounds = UNBOUNDED

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise GrammarError(f"unknown structured output kind {self.kind!r}")


class GrammarBackend(Protocol):
    vocab_size: int

    @staticmethod
    def check(constraint: Constraint) -> None:
        """Raise ``GrammarError`` if ``constraint`` is not a grammar this engine takes: its
        syntax, without the vocabulary (cheap; the tokenizer processes call it)."""
        ...

    def matcher(self, constraint: Constraint) -> Matcher:
        """Compile (or take from the cache) and start a matcher; ``GrammarError`` if bad."""
        ...


@dataclass(frozen=True)
class VocabInfo:
    """What a grammar engine needs of the model's tokenizer."""

    tokenizer: tokenizers.Tokenizer
    vocab_size: int  # the model's (its logits' width), at least the tokenizer's
    stop_token_ids: tuple[int, ...]


def backend_class(name: str) -> type[GrammarBackend]:
    """The grammar backend registered as ``name`` in ``services/registry.py``; its module is
    imported on first use (xgrammar's import brings torch and transformers: ~2 s and
    ~300 MB, paid only by the processes that see a constrained request)."""
    if name not in GRAMMAR_BACKENDS:
        raise GrammarError(
            f"unknown structured outputs backend {name!r}; known: "
            f"{', '.join(sorted(GRAMMAR_BACKENDS))}"
        )
    try:
        cls: type[GrammarBackend] = resolve(GRAMMAR_BACKENDS[name])
    except ImportError as e:
        raise GrammarError(
            f"the {name!r} structured outputs backend needs a package that is not installed: {e}"
        ) from None
    return cls


def load_backend(name: str, vocab: VocabInfo) -> GrammarBackend:
    return backend_class(name)(vocab)  # type: ignore[call-arg]


def check_constraint(name: str, constraint: Constraint) -> None:
    """``GrammarError`` (what is wrong) unless backend ``name`` can compile ``constraint``."""
    check_size(constraint)
    backend_class(name).check(constraint)


# What a constraint may be: its text, and for JSON its nesting. Checking and compiling cost
# grows with both (a schema nested 300 deep takes seconds to check, and compiles in minutes):
# one request must not stall the tokenizer or the compile threads for everyone. OpenAI's
# own limits are of this order (120,000 characters of schema, 10 levels of nesting).
MAX_CONSTRAINT_BYTES = 64 * 1024
MAX_JSON_DEPTH = 64


def check_size(constraint: Constraint) -> None:
    size = len(constraint.spec.encode())
    if size > MAX_CONSTRAINT_BYTES:
        raise GrammarError(
            f"the {constraint.kind} constraint has {size:,} bytes; this server takes at most "
            f"{MAX_CONSTRAINT_BYTES:,}"
        )
    if constraint.kind in ("json", "structural_tag") and _depth(constraint.spec) > MAX_JSON_DEPTH:
        raise GrammarError(
            f"the {constraint.kind} constraint nests deeper than {MAX_JSON_DEPTH} levels"
        )


def _depth(text: str) -> int:
    """How deep JSON text nests (brackets outside strings), without parsing it."""
    depth = deepest = 0
    in_string = escape = False
    for ch in text:
        if in_string:
            if escape:
                escape = False
            elif ch == "\\":
                escape = True
            elif ch == '"':
                in_string = False
        elif ch == '"':
            in_string = True
        elif ch in "{[":
            depth += 1
            deepest = max(deepest, depth)
        elif ch in "}]":
            depth -= 1
    return deepest


# JSON schema keywords xgrammar does not enforce (vLLM's list, and allOf): with backend
# "auto" such a schema goes to guidance; with "xgrammar" it is refused.
_XGRAMMAR_UNSUPPORTED = {
    "integer": ("multipleOf",),
    "number": ("multipleOf",),
    "array": ("uniqueItems", "contains", "minContains", "maxContains"),
    "object": ("minProperties", "maxProperties", "propertyNames", "patternProperties"),
}


def xgrammar_unsupported(schema: object) -> list[str]:
    """The keywords of ``schema`` (anywhere in it) that xgrammar would ignore."""
    found: list[str] = []
    stack = [schema]
    while stack:
        node = stack.pop()
        if isinstance(node, list):
            stack.extend(node)
            continue
        if not isinstance(node, dict):
            continue
        kinds = node.get("type")
        for kind in kinds if isinstance(kinds, list) else [kinds]:
            if isinstance(kind, str):
                found += [k for k in _XGRAMMAR_UNSUPPORTED.get(kind, ()) if k in node]
        if "allOf" in node:
            found.append("allOf")
        stack.extend(node.values())
    return sorted(set(found))


def choose_backend(configured: str, constraint: Constraint, fallback: bool = True) -> str:
    """The engine for one constraint: ``configured``, or with "auto" xgrammar unless the
    schema needs what only guidance enforces (vLLM's rule; ``fallback`` False: refused)."""
    if configured not in ("auto", "xgrammar") or constraint.kind != "json":
        return "xgrammar" if configured == "auto" else configured
    try:
        unsupported = xgrammar_unsupported(json.loads(constraint.spec))
    except ValueError:
        return "xgrammar"  # not JSON: xgrammar says what is wrong with it
    if not unsupported:
        return "xgrammar"
    if configured == "auto" and fallback:
        return "guidance"
    raise GrammarError(
        "The provided JSON schema contains features not supported by xgrammar: "
        f"{', '.join(unsupported)}"
    )


def choices(spec: str) -> list[str]:
    """A ``choice`` constraint's strings, checked."""
    try:
        values = json.loads(spec)
    except ValueError:
        values = None
    if not isinstance(values, list) or not all(isinstance(v, str) for v in values):
        raise GrammarError("choice must be a list of strings")
    if not values:
        raise GrammarError("Choice '[]' cannot be an empty list")
    return values


def allocate_bitmask(rows: int, vocab_size: int) -> np.ndarray:
    """Rows of int32 words with every token allowed (-1: all bits set)."""
    import numpy as np  # here: the tokenizer processes import this module, never numpy

    return np.full((rows, (vocab_size + 31) // 32), -1, dtype=np.int32)
