"""The bounds a JSON constraint gets by default (``--structured-outputs-config``'s
``json_max_*`` keys); applied to grammars in ``services/structured_output/json_bounds.py``,
which says why and how."""

from __future__ import annotations

from dataclasses import dataclass

DEFAULT_WHITESPACE = 20  # characters in one run between two JSON tokens
DEFAULT_DIGITS = 20  # digits in each part of a number (integer, fraction, exponent)


@dataclass(frozen=True)
class JsonBounds:
    """At most ``whitespace`` characters in a run of whitespace between two JSON tokens,
    ``digits`` digits in each part of a number, ``string_length`` characters in a string
    the schema leaves unbounded; None: no bound (vLLM's behaviour)."""

    whitespace: int | None = DEFAULT_WHITESPACE
    digits: int | None = DEFAULT_DIGITS
    string_length: int | None = None

    @property
    def any(self) -> bool:
        return (self.whitespace, self.digits, self.string_length) != (None, None, None)


UNBOUNDED = JsonBounds(None, None, None)
