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
    "Qwen3MoeForCausalLM",
    "MixtralForCausalLM",
)

# Mixture-of-experts architectures: (HF config key of the expert count, the layer's module
# name in HF checkpoints).
_MOE_ARCHITECTURES = {
    "Qwen3MoeForCausalLM": ("num_experts", "mlp"),
    "MixtralForCausalLM": ("num_local_experts", "block_sparse_moe"),
}


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
    # Mixture of experts (Qwen3-MoE, Mixtral); num_experts 0: a dense model.
    num_experts: int = 0
    num_experts_per_tok: int = 0
    moe_intermediate_size: int = 0  # one expert's MLP width
    norm_topk_prob: bool = True  # renormalise the top-k routing weights to sum to 1
    decoder_sparse_step: int = 1  # Qwen3-MoE: every step-th layer is sparse ...
    mlp_only_layers: tuple[int, ...] = ()  # ... except these, which keep a dense MLP

    @property
    def is_moe(self) -> bool:
        return self.num_experts > 0

    def is_moe_layer(self, layer: int) -> bool:
        """Whether decoder layer ``layer`` (global index) has experts instead of a dense MLP."""
        return (
            self.is_moe
            and layer not in self.mlp_only_layers
            and (layer + 1) % self.decoder_sparse_step == 0
        )

    @property
    def moe_checkpoint_module(self) -> str:
        """The MoE block's module name in HF checkpoints (``mlp`` or ``block_sparse_moe``)."""
        return _MOE_ARCHITECTURES[self.architecture][1] if self.is_moe else "mlp"

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
            moe = _moe_fields(arch, cfg)
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
                qk_norm=arch in ("Qwen3ForCausalLM", "Qwen3MoeForCausalLM"),
                rope_scaling=rope_scaling,
                bos_token_id=cfg.get("bos_token_id"),
                eos_token_ids=eos_ids,
                sliding_window=int(window) if window is not None else None,
                **moe,
            )
        except ConfigError:
            raise
        except (KeyError, TypeError, ValueError) as e:
            raise ConfigError(f"config.json is missing or has a bad value for {e}") from None


def _moe_fields(arch: str, cfg: dict[str, Any]) -> dict[str, Any]:
    """The mixture-of-experts fields of an HF config (none for a dense architecture)."""
    if arch not in _MOE_ARCHITECTURES:
        return {}
    experts_key = _MOE_ARCHITECTURES[arch][0]
    if experts_key not in cfg and "num_local_experts" in cfg:
        experts_key = "num_local_experts"  # transformers >= 5 saves Qwen3-MoE's under this name
    num_experts = int(cfg[experts_key])
    top_k = int(cfg["num_experts_per_tok"])
    if arch == "MixtralForCausalLM":  # intermediate_size is the experts' width
        fields: dict[str, Any] = {
            "moe_intermediate_size": int(cfg["intermediate_size"]),
            "norm_topk_prob": True,
        }
    else:
        fields = {
            "moe_intermediate_size": int(cfg["moe_intermediate_size"]),
            "norm_topk_prob": bool(cfg.get("norm_topk_prob", False)),
            "decoder_sparse_step": int(cfg.get("decoder_sparse_step", 1)),
            "mlp_only_layers": tuple(int(i) for i in cfg.get("mlp_only_layers") or ()),
        }
    if num_experts < 1:
        raise ConfigError(f"{experts_key} must be at least 1, got {num_experts}")
    if not 1 <= top_k <= num_experts:
        raise ConfigError(
            f"num_experts_per_tok ({top_k}) must be between 1 and the number "
            f"of experts ({experts_key} = {num_experts})"
        )
    if fields["moe_intermediate_size"] < 1:
        raise ConfigError("the experts' intermediate size must be positive")
    if fields.get("decoder_sparse_step", 1) < 1:
        raise ConfigError("decoder_sparse_step must be at least 1")
    return {"num_experts": num_experts, "num_experts_per_tok": top_k, **fields}
