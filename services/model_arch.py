"""The architecture of a Llama-family decoder, read from a Hugging Face ``config.json``."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from services.flags import ConfigError

# Bytes per element of the simulated devices' dtypes (the sim worker, p2p's simulated link).
DTYPE_BYTES = {"fp32": 4, "bf16": 2, "fp16": 2, "fp8": 1}


def kv_row_bytes(kv_cache_dtype: str, head_dim: int, element_bytes: int) -> int:
    """Bytes of one (token, head) K or V row of the cache, as a real rank stores it."""
    if kv_cache_dtype.startswith("fp8"):
        return head_dim
    if kv_cache_dtype == "int8":
        return head_dim + 4
    return head_dim * element_bytes


SUPPORTED_ARCHITECTURES = (
    "LlamaForCausalLM",
    "MistralForCausalLM",
    "Qwen2ForCausalLM",
    "Qwen3ForCausalLM",
)


@dataclass(frozen=True)
class ModelArchConfig:
    """The architecture of a Llama-family decoder, read from an HF ``config.json``."""

    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    max_position_embeddings: int
    tie_word_embeddings: bool = False
    attention_bias: bool = False  # Qwen2: bias on q/k/v projections
    qk_norm: bool = False  # Qwen3: RMSNorm on q and k per head
    rope_scaling: dict[str, Any] | None = None
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()
    # Mistral v0.1's sliding-window attention (None: none, or disabled as in Qwen2's configs).
    # Not implemented: max_model_len is capped to it, as vLLM's --disable-sliding-window does.
    sliding_window: int | None = None

    @property
    def derived_max_model_len(self) -> int:
        """The longest context this model computes correctly here."""
        if self.sliding_window is not None:
            return min(self.max_position_embeddings, self.sliding_window)
        return self.max_position_embeddings

    @classmethod
    def from_hf_config(cls, cfg: dict[str, Any]) -> ModelArchConfig:
        archs = cfg.get("architectures") or []
        arch = archs[0] if archs else ""
        if arch not in SUPPORTED_ARCHITECTURES:
            raise ConfigError(
                f"unsupported model architecture {arch or '(none given)'!r}; "
                f"supported: {', '.join(SUPPORTED_ARCHITECTURES)}"
            )
        try:
            hidden = int(cfg["hidden_size"])
            heads = int(cfg["num_attention_heads"])
            # transformers >= 5 saves rope settings under "rope_parameters".
            rope = cfg.get("rope_parameters") or {}
            rope_scaling = cfg.get("rope_scaling") or (
                rope if rope.get("rope_type", "default") != "default" else None
            )
            eos = cfg.get("eos_token_id")
            eos_ids = tuple(eos) if isinstance(eos, list) else ((eos,) if eos is not None else ())
            window = cfg.get("sliding_window")
            if not cfg.get("use_sliding_window", True) or window is None:
                window = None
            return cls(
                architecture=arch,
                vocab_size=int(cfg["vocab_size"]),
                hidden_size=hidden,
                intermediate_size=int(cfg["intermediate_size"]),
                num_hidden_layers=int(cfg["num_hidden_layers"]),
                num_attention_heads=heads,
                num_key_value_heads=int(cfg.get("num_key_value_heads") or heads),
                head_dim=int(cfg.get("head_dim") or hidden // heads),
                rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
                rope_theta=float(cfg.get("rope_theta", rope.get("rope_theta", 10000.0))),
                max_position_embeddings=int(cfg.get("max_position_embeddings", 2048)),
                tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
                attention_bias=bool(cfg.get("attention_bias", arch == "Qwen2ForCausalLM")),
                qk_norm=arch == "Qwen3ForCausalLM",
                rope_scaling=rope_scaling,
                bos_token_id=cfg.get("bos_token_id"),
                eos_token_ids=eos_ids,
                sliding_window=int(window) if window is not None else None,
            )
        except (KeyError, TypeError, ValueError) as e:
            raise ConfigError(f"config.json is missing or has a bad value for {e}") from None
