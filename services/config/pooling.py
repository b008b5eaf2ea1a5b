"""vLLM's pooling flags: ``--runner``, ``--convert`` and ``--pooler-config``.

``--runner pooling`` serves embeddings (``/v1/embeddings``, vLLM's ``/pooling``) instead of
generation. Every architecture served here is a ``*ForCausalLM``, so, as in vLLM, ``auto``
means ``generate``, and a pooling runner converts the model for embedding (``--convert
auto`` = ``embed``: the final norm's hidden states pooled, by default LAST token and
L2-normalised, vLLM's defaults for a converted causal LM). ``--pooler-config`` is vLLM's
JSON: ``pooling_type`` (LAST, MEAN, CLS), ``normalize`` (or its new name
``use_activation``), ``dimensions`` (the default cut of every vector). vLLM's keys for
classification, reward and chunked-over-max_model_len processing are accepted only when
they ask for nothing, so a vLLM command line either means the same here or is refused.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from services.flags import ConfigError, check_choice, parse_json_object
from services.protocol import POOLING_TYPES

RUNNERS = ("auto", "generate", "pooling")
CONVERTS = ("auto", "none", "embed", "classify", "reward")
_FLAG = "--pooler-config"
# vLLM's keys for what this engine does not do: only null (or false) is accepted
_UNSUPPORTED_KEYS = {
    "enable_chunked_processing", "max_embed_len", "softmax", "activation", "logit_bias",
    "step_tag_id", "returned_token_ids", "seq_pooling_type", "tok_pooling_type",
}  # fmt: skip


@dataclass(frozen=True)
class PoolerConfig:
    """The server's pooling: the type, whether vectors are normalised, and the default
    ``dimensions`` (None: the hidden size); a request may override the last two."""

    pooling_type: str = "LAST"
    normalize: bool = True
    dimensions: int | None = None

    @classmethod
    def from_json(cls, text: str | None) -> PoolerConfig:
        if not text:
            return cls()
        raw = parse_json_object(
            _FLAG, text, {"pooling_type", "normalize", "use_activation", "dimensions"}
            | _UNSUPPORTED_KEYS
        )  # fmt: skip
        for key in sorted(_UNSUPPORTED_KEYS):
            if raw.get(key) not in (None, False):
                raise ConfigError(f"{_FLAG}: {key} is not supported (embeddings only)")
        kind = raw.get("pooling_type") or "LAST"
        if kind in ("ALL", "STEP"):
            raise ConfigError(f"{_FLAG}: pooling_type {kind} (per token) is not supported")
        check_choice(f"{_FLAG} pooling_type", kind, POOLING_TYPES)
        normalize = _flag_value(raw, "use_activation", _flag_value(raw, "normalize", True))
        dims = raw.get("dimensions")
        if dims is not None and (type(dims) is not int or dims < 1):
            raise ConfigError(f"{_FLAG}: dimensions must be a whole number >= 1, or null")
        return cls(kind, normalize, dims)


def _flag_value(raw: dict[str, Any], key: str, default: bool) -> bool:
    value = raw.get(key)
    if value is None:
        return default
    if not isinstance(value, bool):
        raise ConfigError(f"{_FLAG}: {key} must be true or false")
    return value


def resolve_runner(runner: str, convert: str) -> str:
    """``generate`` or ``pooling``: ``auto`` is pooling when ``--convert`` asks for a
    pooling model, else generate (the causal LMs served here generate)."""
    if runner != "auto":
        return runner
    return "pooling" if convert not in ("auto", "none") else "generate"


def check_pooling_flags(
    runner: str, convert: str, pooler_config: str | None, worker_backend: str
) -> None:
    """ConfigError, naming the flag, for pooling flags that cannot work together."""
    check_choice("--runner", runner, RUNNERS)
    check_choice("--convert", convert, CONVERTS)
    if convert in ("classify", "reward"):
        raise ConfigError(f"--convert {convert} is not supported; --convert embed is")
    resolved = resolve_runner(runner, convert)
    if resolved == "generate":
        if convert not in ("auto", "none"):
            raise ConfigError(f"--convert {convert} makes a pooling model: use --runner pooling")
        if pooler_config:
            raise ConfigError("--pooler-config applies to --runner pooling")
        return
    if convert == "none":
        raise ConfigError(
            "--runner pooling with --convert none: a causal LM has no pooler of its own; "
            "use --convert embed (or auto)"
        )
    if worker_backend == "sim":
        raise ConfigError("--runner pooling needs hidden states: --worker-backend sim has none")
    PoolerConfig.from_json(pooler_config)  # parsed for its errors
