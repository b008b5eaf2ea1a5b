"""What the simulated backend reads from a model's ``config.json`` beyond
``ModelArchConfig``: the parts of architectures the engine does not run but the roofline
models (DeepSeek's multi-head latent attention and shared experts, fp8 weights).

A DeepSeek config reaches the engine's processes through its stand-in
(``services/model_loader/sim_model.py:sim_engine_config``); ``load_sim_model`` applies the
same mapping, so a shipped config read directly (a test, a bench) gives what the sim
worker of a server sees.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from services.flags import ConfigError
from services.model_arch import ModelArchConfig
from services.model_loader.sim_model import sim_engine_config


@dataclass(frozen=True)
class MLASpec:
    """DeepSeek's multi-head latent attention (MLA), as the roofline approximates it.

    KV cache: one compressed row per token and layer, ``kv_lora_rank + qk_rope_head_dim``
    values (the latent and the shared rotary key), the same on every TP rank (vLLM
    replicates it: the latent is not split by heads). Attention FLOPs: a GQA equivalent,
    ``4 * heads * d * attended pairs``, with per request the cheaper of vLLM's two kernels:
    absorbed (decode: the query is moved into the latent space, an MQA over the cached rows,
    ``d = (kv_lora_rank + qk_rope_head_dim + kv_lora_rank) / 2``, 544 for DeepSeek-V3) or
    expanded (prefill: the context's latent up-projected to per-head K and V, then an MHA
    with ``d = (qk_nope_head_dim + qk_rope_head_dim + v_head_dim) / 2``, 160, plus the
    up-projection's ``2 * kv_lora_rank * heads * (qk_nope_head_dim + v_head_dim)`` FLOPs
    per context token)."""

    q_lora_rank: int  # 0: the query is projected from the hidden state directly
    kv_lora_rank: int
    qk_nope_head_dim: int
    qk_rope_head_dim: int
    v_head_dim: int

    @property
    def cache_dim(self) -> int:
        """Values per token and layer in the KV cache."""
        return self.kv_lora_rank + self.qk_rope_head_dim

    @property
    def qk_head_dim(self) -> int:
        return self.qk_nope_head_dim + self.qk_rope_head_dim

    def pair_flops(self, absorbed: bool) -> int:
        """FLOPs per (query token, attended token) pair and query head."""
        if absorbed:  # QK over the cached row, PV over the latent
            return 2 * self.cache_dim + 2 * self.kv_lora_rank
        return 2 * self.qk_head_dim + 2 * self.v_head_dim

    def expand_flops(self, heads: int) -> int:
        """FLOPs per context token to up-project its latent into ``heads`` heads' K and V."""
        return 2 * self.kv_lora_rank * heads * (self.qk_nope_head_dim + self.v_head_dim)


@dataclass(frozen=True)
class SimModelExtras:
    """The roofline's terms beyond ``ModelArchConfig`` (none for the Llama family)."""

    mla: MLASpec | None = None
    # Experts every token passes through besides its top-k (DeepSeek: n_shared_experts x
    # moe_intermediate_size; a dense MLP of that width, split by TP like one).
    shared_expert_intermediate_size: int = 0
    # The linear layers' stored dtype where it is not the activations' (DeepSeek-V3 ships
    # block-scaled fp8: one byte a weight, GEMMs at the device's fp8 peak, as DeepGEMM
    # runs them); embeddings, the LM head, the router and attention stay in the dtype.
    weight_dtype: str | None = None

    @classmethod
    def from_hf_config(cls, cfg: dict[str, Any]) -> SimModelExtras:
        try:
            mla = None
            if cfg.get("kv_lora_rank"):
                mla = MLASpec(
                    q_lora_rank=int(cfg.get("q_lora_rank") or 0),
                    kv_lora_rank=int(cfg["kv_lora_rank"]),
                    qk_nope_head_dim=int(cfg["qk_nope_head_dim"]),
                    qk_rope_head_dim=int(cfg["qk_rope_head_dim"]),
                    v_head_dim=int(cfg["v_head_dim"]),
                )
            shared = int(cfg.get("shared_expert_intermediate_size") or 0)
            if cfg.get("n_shared_experts"):
                shared = int(cfg["n_shared_experts"]) * int(cfg["moe_intermediate_size"])
        except (KeyError, TypeError, ValueError) as e:
            raise ConfigError(f"config.json is missing or has a bad value for {e}") from None
        quant = cfg.get("quantization_config") or {}
        weight_dtype = "fp8" if quant.get("quant_method") == "fp8" else None
        return cls(mla, shared, weight_dtype)


def load_sim_model(cfg: dict[str, Any]) -> tuple[ModelArchConfig, SimModelExtras]:
    """An HF config (a shipped sim model's, or a sim folder's) as the sim worker reads it."""
    engine = sim_engine_config(cfg)
    return ModelArchConfig.from_hf_config(engine), SimModelExtras.from_hf_config(engine)
