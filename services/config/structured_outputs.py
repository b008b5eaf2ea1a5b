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
# --reasoning-parser (vLLM's names): the markers around a model's thinking
REASONING_MARKERS = {"deepseek_r1": ("<think>", "</think>"), "qwen3": ("<think>", "</think>")}
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
    null: no bound); ``unbounded_json`` turns every bound off (vLLM's behaviour).

    ``reasoning_parser`` (also ``--reasoning-parser``) splits a chat answer's thinking from
    its answer (``services/structured_output/reasoning.py``); a constraint then applies
    from the end of the thinking on, unless ``enable_in_reasoning``."""

    backend: str = "auto"
    disable_any_whitespace: bool = False
    disable_fallback: bool = False
    unbounded_json: bool = False
    json_max_whitespace: int | None = DEFAULT_WHITESPACE
    json_max_digits: int | None = DEFAULT_DIGITS
    json_max_string_length: int | None = None
    reasoning_parser: str | None = None
    enable_in_reasoning: bool = False

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
    def from_json(
        cls, text: str | None, reasoning_parser: str | None = None
    ) -> StructuredOutputsConfig:
        """The flag's JSON; ``reasoning_parser`` is ``--reasoning-parser`` (it wins over
        the JSON's key, as vLLM's flag does)."""
        if reasoning_parser is not None:
            check_choice("--reasoning-parser", reasoning_parser, tuple(REASONING_MARKERS))
        if not text:
            return cls(reasoning_parser=reasoning_parser)
        flag = "--structured-outputs-config"
        raw = parse_json_object(flag, text, {
            "backend", "disable_any_whitespace", "disable_fallback",
            "disable_additional_properties", "reasoning_parser", "reasoning_parser_plugin",
            "enable_in_reasoning", "unbounded_json", *_BOUND_KEYS,
        })  # fmt: skip
        backend = raw.get("backend", "auto")
        check_choice(f"{flag} backend", backend, STRUCTURED_OUTPUT_BACKENDS)
        bools = (
            "disable_any_whitespace",
            "disable_fallback",
            "unbounded_json",
            "enable_in_reasoning",
        )
        for key in bools:
            if not isinstance(raw.get(key, False), bool):
                raise ConfigError(f"{flag}: {key} must be true or false")
        for key in _BOUND_KEYS:
            value = raw.get(key, 1)
            if value is not None and (type(value) is not int or value < 1):
                raise ConfigError(f"{flag}: {key} must be a whole number >= 1, or null")
        # vLLM's keys for what this engine does not have: accepted when they ask for nothing
        if raw.get("disable_additional_properties"):
            raise ConfigError(f"{flag}: disable_additional_properties is not supported")
        if raw.get("reasoning_parser_plugin"):
            raise ConfigError(f"{flag}: reasoning_parser_plugin is not supported")
        parser = reasoning_parser or raw.get("reasoning_parser") or None
        if parser is not None:
            check_choice(f"{flag} reasoning_parser", parser, tuple(REASONING_MARKERS))
        bounds = {key: raw[key] for key in _BOUND_KEYS if key in raw}
        return cls(
            backend,
            raw.get("disable_any_whitespace", False),
            raw.get("disable_fallback", False),
            raw.get("unbounded_json", False),
            **bounds,
            reasoning_parser=parser,
            enable_in_reasoning=raw.get("enable_in_reasoning", False),
        )
