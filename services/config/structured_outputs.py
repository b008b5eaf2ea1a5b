"""``--structured-outputs-config`` (vLLM's flag, with our JSON bounds) and the bounds a
JSON constraint gets by default; applied to grammars in
``services/structured_output/json_bounds.py``, which says why and how."""

from __future__ import annotations

from dataclasses import dataclass

from services.flags import ConfigError, check_choice, parse_json_object
from services.registry import GRAMMAR_BACKENDS

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


STRUCTURED_OUTPUT_BACKENDS = ("auto", *GRAMMAR_BACKENDS)
_BOUND_KEYS = ("json_max_whitespace", "json_max_digits", "json_max_string_length")


@dataclass(frozen=True)
class StructuredOutputsConfig:
    """``--structured-outputs-config``: vLLM's StructuredOutputsConfig, the fields we use.

    ``backend`` is the grammar engine: "auto" (vLLM's default) is xgrammar, or guidance for
    a JSON schema with keywords xgrammar does not enforce (unless ``disable_fallback``);
    ``disable_any_whitespace`` makes JSON outputs compact for every request.

    Ours: JSON constraints are bounded (``json_bounds.py``): whitespace runs to
    ``json_max_whitespace`` characters, each part of a number to ``json_max_digits``
    digits, and, if set, unbounded strings to ``json_max_string_length`` characters (each
    null: no bound); ``unbounded_json`` turns every bound off (vLLM's behaviour)."""

    backend: str = "auto"
    disable_any_whitespace: bool = False
    disable_fallback: bool = False
    unbounded_json: bool = False
    json_max_whitespace: int | None = DEFAULT_WHITESPACE
    json_max_digits: int | None = DEFAULT_DIGITS
    json_max_string_length: int | None = None

    def json_bounds(self, unbounded: bool = False, string_length: int | None = None) -> JsonBounds:
        """The bounds for a request's JSON constraint (``unbounded``, ``string_length``: the
        request's own ``unbounded_json`` and ``json_max_string_length``)."""
        if unbounded or self.unbounded_json:
            return UNBOUNDED
        return JsonBounds(
            self.json_max_whitespace,
            self.json_max_digits,
            string_length if string_length is not None else self.json_max_string_length,
        )

    @classmethod
    def from_json(cls, text: str | None) -> StructuredOutputsConfig:
        if not text:
            return cls()
        flag = "--structured-outputs-config"
        raw = parse_json_object(flag, text, {
            "backend", "disable_any_whitespace", "disable_fallback",
            "disable_additional_properties", "reasoning_parser", "reasoning_parser_plugin",
            "enable_in_reasoning", "unbounded_json", *_BOUND_KEYS,
        })  # fmt: skip
        backend = raw.get("backend", "auto")
        check_choice(f"{flag} backend", backend, STRUCTURED_OUTPUT_BACKENDS)
        for key in ("disable_any_whitespace", "disable_fallback", "unbounded_json"):
            if not isinstance(raw.get(key, False), bool):
                raise ConfigError(f"{flag}: {key} must be true or false")
        for key in _BOUND_KEYS:
            value = raw.get(key, 1)
            if value is not None and (type(value) is not int or value < 1):
                raise ConfigError(f"{flag}: {key} must be a whole number >= 1, or null")
        # vLLM's keys for what this engine does not have: accepted when they ask for nothing
        if raw.get("disable_additional_properties"):
            raise ConfigError(f"{flag}: disable_additional_properties is not supported")
        if raw.get("reasoning_parser") or raw.get("reasoning_parser_plugin"):
            raise ConfigError(f"{flag}: there are no reasoning parsers in this engine")
        bounds = {key: raw[key] for key in _BOUND_KEYS if key in raw}
        return cls(
            backend,
            raw.get("disable_any_whitespace", False),
            raw.get("disable_fallback", False),
            raw.get("unbounded_json", False),
            **bounds,
        )
