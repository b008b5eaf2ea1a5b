"""Configuration fields as command-line flags, and the checks every flag value gets.

A dataclass field becomes a flag when its metadata carries ``flag(help, ...)``:
``--field-name`` (plus aliases), typed from the annotation or the ``type`` parser given.
``add_flags`` builds the argparse group of a dataclass instance; ``coerce`` gives a
keyword argument (the offline ``LLM``'s) the type the CLI would have given it.
"""

from __future__ import annotations

import argparse
import dataclasses
import re
from typing import Any


class ConfigError(ValueError):
    """A configuration mistake the user must fix; its message is one line."""


def parse_size(text: str) -> int:
    """'4096', '4k', '1.5G', '256MiB' -> integer (k/M/G are powers of 1024 as vLLM's parser)."""
    m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([kKmMgGtT]?)(i?[bB])?\s*", text)
    if not m:
        raise argparse.ArgumentTypeError(f"not a size: {text!r}")
    scale = {"": 1, "k": 1 << 10, "m": 1 << 20, "g": 1 << 30, "t": 1 << 40}[m.group(2).lower()]
    return int(float(m.group(1)) * scale)


def parse_token_count(text: str) -> int:
    """'8192', '32k', '1m' (k = 1000 as vLLM's --max-model-len parser; 'K' = 1024)."""
    m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([kKmMgG]?)\s*", text)
    if not m:
        raise argparse.ArgumentTypeError(f"not a token count: {text!r}")
    scale = {"": 1, "k": 1000, "K": 1024, "m": 10**6, "M": 1 << 20, "g": 10**9, "G": 1 << 30}
    return int(float(m.group(1)) * scale[m.group(2)])


def parse_json_object(flag: str, text: str, known_keys: set[str]) -> dict[str, Any]:
    """A flag's JSON object (vLLM's ``--kv-events-config`` style); ConfigError naming the
    flag when it is not JSON, not an object, or has keys outside ``known_keys``."""
    import json

    try:
        raw = json.loads(text)
    except ValueError as e:
        raise ConfigError(f"{flag} is not valid JSON: {e}") from None
    if not isinstance(raw, dict):
        raise ConfigError(f"{flag} must be a JSON object")
    if unknown := set(raw) - known_keys:
        raise ConfigError(f"{flag}: unknown keys {sorted(unknown)}")
    return raw


def flag(help: str, **argparse_kwargs: Any) -> dict[str, Any]:
    """Field metadata that makes a dataclass field a CLI flag: ``--field-name`` (or ``name``
    when the flag's vLLM name is not the field's), plus ``aliases``, a ``type`` parser,
    ``choices``, ``nargs`` and ``metavar`` when given."""
    return {"flag": {"help": help, **argparse_kwargs}}


def flag_name(f: dataclasses.Field[Any]) -> str:
    """The flag of field ``f`` as the user types it (``--max-num-seqs``), for messages."""
    return str(f.metadata.get("flag", {}).get("name") or f"--{f.name.replace('_', '-')}")


def flag_fields(cls: Any) -> list[dataclasses.Field[Any]]:
    """The fields of dataclass ``cls`` that are flags."""
    return [f for f in dataclasses.fields(cls) if "flag" in f.metadata]


def given_flags(cls: Any, args: argparse.Namespace) -> dict[str, Any]:
    """The flags of dataclass ``cls`` the user gave, by field name (an unset flag is None
    and left out, so the dataclass default holds)."""
    given = {f.name: getattr(args, f.name, None) for f in flag_fields(cls)}
    return {name: value for name, value in given.items() if value is not None}


def choices(registry: Any) -> tuple[str, ...]:
    return tuple(registry)


def coerce(f: dataclasses.Field[Any], value: Any) -> Any:
    """``value`` as field ``f``'s type: a string goes through the flag's parser (so
    ``max_model_len="2k"`` works offline as on the CLI); anything else of the wrong type
    is a ConfigError, not a TypeError deep in start-up."""
    kinds = str(f.type).replace(" ", "").split("|")
    base = kinds[0]
    if value is None:
        if "None" in kinds:
            return None
        raise ConfigError(f"{f.name} must not be None")
    if isinstance(value, str) and base in ("int", "float"):
        parse = f.metadata.get("flag", {}).get("type") or {"int": int, "float": float}[base]
        try:
            value = parse(value)
        except (ValueError, argparse.ArgumentTypeError):
            raise ConfigError(f"{f.name} must be {base}, got {value!r}") from None
    if base == "list[int]":
        if isinstance(value, str):  # "1 2 4" or "1,2,4", as the CLI would take them
            try:
                value = [int(v) for v in value.replace(",", " ").split()]
            except ValueError:
                raise ConfigError(f"{f.name} must be a list of int, got {value!r}") from None
        if not isinstance(value, list | tuple) or not all(
            isinstance(v, int) and not isinstance(v, bool) for v in value
        ):
            raise ConfigError(f"{f.name} must be a list of int, got {value!r}")
        return list(value)
    numeric = isinstance(value, int | float) and not isinstance(value, bool)
    ok = {
        "int": numeric and isinstance(value, int),
        "float": numeric,
        "bool": isinstance(value, bool),
        "str": isinstance(value, str),
    }[base]
    if not ok:
        raise ConfigError(f"{f.name} must be {base}, got {value!r}")
    return float(value) if base == "float" else value


def check_choice(flag: str, value: object, choices: Any) -> None:
    if value not in choices:
        raise ConfigError(f"{flag} must be one of {', '.join(choices)}, got {value!r}")


def add_flags(
    parser: argparse.ArgumentParser, title: str, obj: Any, description: str | None = None
) -> None:
    """One argument group with a flag per field of dataclass ``obj`` that carries ``flag``
    metadata (described by ``description``, else the first line of the class's docstring).
    Every default is None ("not given"): the dataclass holds the real default, shown in
    the help."""
    if description is None:
        description = (type(obj).__doc__ or "").splitlines()[0]
    group = parser.add_argument_group(title, description)
    for f in flag_fields(obj):
        spec = dict(f.metadata["flag"])
        spec.pop("name", None)
        names = [flag_name(f), *spec.pop("aliases", ())]
        default = getattr(obj, f.name)
        if default is not None and "default" not in spec["help"]:
            spec["help"] += f" (default: {default})"
        if str(f.type).startswith("bool"):
            spec["action"] = argparse.BooleanOptionalAction
        elif "type" not in spec and "choices" not in spec:
            spec["type"] = {"int": int, "float": float}.get(str(f.type).split(" ")[0], str)
        group.add_argument(*names, dest=f.name, default=None, **spec)
