"""Engine configuration: one set of dataclasses, built from the CLI and validated at start-up.

Flag names, defaults and meanings follow vLLM's engine arguments, so a vLLM
command line works here unchanged. ``ConfigError`` carries a one-line message
for the user; the CLI prints it and exits with status 2, never a traceback.
"""

from __future__ import annotations

import argparse
import dataclasses
import re
from dataclasses import dataclass, field
from typing import Any


class ConfigError(ValueError):
    """A configuration mistake the user must fix; its message is one line."""


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


@dataclass
class ModelConfig:
    """Which model to serve and how to load it."""

    model: str | None = None  # path to a GGUF file or HF folder; None = default model
    dtype: str = "auto"  # auto | float32 | float16 | bfloat16
    load_format: str = "auto"  # auto | gguf | safetensors | dummy
    max_model_len: int | None = None  # None: the model's max_position_embeddings
    seed: int = 0


@dataclass
class CacheConfig:
    """The paged KV cache and its prefix cache."""

    block_size: int = 16
    enable_prefix_caching: bool = True
    prefix_caching_hash_algo: str = "sha256"  # sha256 | sha256_cbor | builtin
    kv_cache_memory_bytes: int | None = None
    gpu_memory_utilization: float = 0.92
    cpu_kv_cache_fraction: float = 0.25  # share of free RAM for the KV cache on CPU
    num_gpu_blocks_override: int | None = None
    kv_cache_dtype: str = "auto"
    kv_cache_metrics: bool = False
    kv_cache_metrics_sample: float = 0.01


@dataclass
class SchedulerConfig:
    """Continuous batching: budgets per step and admission policy."""

    max_num_seqs: int = 256
    # None: 512 on CPU, 2048 on GPU (see EngineConfig.finalize)
    max_num_batched_tokens: int | None = None
    enable_chunked_prefill: bool = True
    long_prefill_token_threshold: int = 0  # 0: no cap on one request's chunk
    scheduling_policy: str = "fcfs"  # fcfs | priority
    max_model_len: int = 0  # filled in from the model at start-up

    @property
    def token_budget(self) -> int:
        """``max_num_batched_tokens`` once resolved (``EngineConfig.finalize`` fills the default)."""
        if self.max_num_batched_tokens is None:
            raise ValueError("max_num_batched_tokens is unresolved: call EngineConfig.finalize()")
        return self.max_num_batched_tokens


@dataclass
class WorkerConfig:
    """Where and how the model runs."""

    device: str = "auto"  # auto | cpu | cuda
    worker_backend: str = "torch"  # torch | sim
    attention_backend: str | None = None  # None: triton on CUDA, torch on CPU
    num_threads: int | None = None  # torch intra-op threads on CPU; None = all cores

    def resolved_device(self) -> str:
        """ "cpu" or "cuda": ``device``, with "auto" meaning CUDA when torch sees a GPU."""
        if self.device != "auto":
            return self.device
        import torch  # only here: config is imported by processes that never need torch

        return "cuda" if torch.cuda.is_available() else "cpu"


@dataclass
class EngineConfig:
    model: ModelConfig = field(default_factory=ModelConfig)
    cache: CacheConfig = field(default_factory=CacheConfig)
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)
    worker: WorkerConfig = field(default_factory=WorkerConfig)

    @classmethod
    def from_kwargs(cls, **kwargs: Any) -> EngineConfig:
        """Build from vLLM-style keyword names (``max_num_seqs=...``); unknown names are errors."""
        cfg = cls()
        sections: list[Any] = [cfg.model, cfg.cache, cfg.scheduler, cfg.worker]
        for key, value in kwargs.items():
            for section in sections:
                if key in {f.name for f in dataclasses.fields(section)}:
                    setattr(section, key, value)
                    break
            else:
                raise ConfigError(f"unknown engine argument {key!r}")
        cfg.validate()
        return cfg

    @staticmethod
    def flag_names() -> set[str]:
        """Every engine argument name (the CLI's ``--max-num-seqs`` is ``max_num_seqs``)."""
        sections = (ModelConfig, CacheConfig, SchedulerConfig, WorkerConfig)
        return {f.name for s in sections for f in dataclasses.fields(s)}

    @classmethod
    def from_cli(cls, args: argparse.Namespace) -> EngineConfig:
        names = cls.flag_names()
        return cls.from_kwargs(
            **{k: v for k, v in vars(args).items() if k in names and v is not None}
        )

    def validate(self) -> None:
        c, s, m = self.cache, self.scheduler, self.model
        if c.block_size < 1 or c.block_size & (c.block_size - 1):
            raise ConfigError(f"--block-size must be a power of two, got {c.block_size}")
        if c.prefix_caching_hash_algo not in ("sha256", "sha256_cbor", "builtin"):
            raise ConfigError(
                f"--prefix-caching-hash-algo must be sha256, sha256_cbor or builtin, "
                f"got {c.prefix_caching_hash_algo!r}"
            )
        if not (0.0 < c.gpu_memory_utilization <= 1.0):
            raise ConfigError(
                f"--gpu-memory-utilization must be in (0, 1], got {c.gpu_memory_utilization}"
            )
        if c.kv_cache_memory_bytes is not None and c.kv_cache_memory_bytes <= 0:
            raise ConfigError(
                f"--kv-cache-memory-bytes must be positive, got {c.kv_cache_memory_bytes}"
            )
        if not (0.0 < c.kv_cache_metrics_sample <= 1.0):
            raise ConfigError(
                f"--kv-cache-metrics-sample must be in (0, 1], got {c.kv_cache_metrics_sample}"
            )
        if s.max_num_seqs < 1:
            raise ConfigError(f"--max-num-seqs must be at least 1, got {s.max_num_seqs}")
        if s.max_num_batched_tokens is not None and s.max_num_batched_tokens < 1:
            raise ConfigError(
                f"--max-num-batched-tokens must be at least 1, got {s.max_num_batched_tokens}"
            )
        if s.long_prefill_token_threshold < 0:
            raise ConfigError("--long-prefill-token-threshold must be non-negative")
        if s.scheduling_policy not in ("fcfs", "priority"):
            raise ConfigError(
                f"--scheduling-policy must be fcfs or priority, got {s.scheduling_policy!r}"
            )
        if m.dtype not in (
            "auto",
            "float32",
            "float16",
            "bfloat16",
            "half",
            "float",
            "bf16",
            "fp16",
        ):
            raise ConfigError(
                f"--dtype must be auto, float32, float16 or bfloat16, got {m.dtype!r}"
            )
        if m.load_format not in ("auto", "gguf", "safetensors", "dummy"):
            raise ConfigError(
                f"--load-format must be auto, gguf, safetensors or dummy, got {m.load_format!r}"
            )
        if m.max_model_len is not None and m.max_model_len < 1:
            raise ConfigError(f"--max-model-len must be at least 1, got {m.max_model_len}")

    def finalize(self, arch: ModelArchConfig) -> None:
        """Fill in what depends on the model (max_model_len) and check budgets against it."""
        m, s = self.model, self.scheduler
        derived = arch.derived_max_model_len
        if m.max_model_len is None:
            m.max_model_len = derived
        elif m.max_model_len > derived:
            why = (
                f"the sliding window ({arch.sliding_window}), which this engine does not "
                "implement, so positions past it would be wrong"
                if derived < arch.max_position_embeddings
                else f"the model's max_position_embeddings ({derived})"
            )
            raise ConfigError(
                f"--max-model-len {m.max_model_len} is greater than {why}; "
                f"use --max-model-len {derived} or less"
            )
        s.max_model_len = m.max_model_len
        if s.max_num_batched_tokens is None:
            # The budget is the knob between TTFT and ITL: every running request waits for
            # the whole step. A CPU computes ~1k prompt tokens/s, already at full matmul
            # speed at 512 tokens a step, so a bigger step only makes decodes wait longer
            # (2048 tokens ~3 s here) and admits prompts in bigger, later bursts.
            default = 512 if self.worker.resolved_device() == "cpu" else 2048
            s.max_num_batched_tokens = (
                default if s.enable_chunked_prefill else max(default, m.max_model_len)
            )
        if not s.enable_chunked_prefill and s.max_num_batched_tokens < m.max_model_len:
            raise ConfigError(
                f"--max-num-batched-tokens ({s.max_num_batched_tokens}) is smaller than "
                f"--max-model-len ({m.max_model_len}) with chunked prefill disabled: "
                "a long prompt could never be scheduled; raise it or enable chunked prefill"
            )


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


def add_engine_args(parser: argparse.ArgumentParser) -> None:
    """vLLM's engine flags, same names and meanings. Defaults live in the dataclasses."""
    bool_flag = argparse.BooleanOptionalAction
    g = parser.add_argument_group("model")
    g.add_argument(
        "--model",
        dest="model",
        default=None,
        help="GGUF file or Hugging Face folder (default: SmolLM2-135M-Instruct)",
    )
    g.add_argument(
        "--dtype", default=None, help="auto (fp32 on CPU, bf16 on GPU), float32, float16, bfloat16"
    )
    g.add_argument(
        "--load-format", default=None, help="auto, gguf, safetensors or dummy (random weights)"
    )
    g.add_argument("--max-model-len", type=parse_token_count, default=None)
    g.add_argument("--seed", type=int, default=None)

    g = parser.add_argument_group("cache")
    g.add_argument("--block-size", type=int, default=None)
    g.add_argument("--enable-prefix-caching", action=bool_flag, default=None)
    g.add_argument("--prefix-caching-hash-algo", default=None)
    g.add_argument("--kv-cache-memory-bytes", type=parse_size, default=None)
    g.add_argument("--gpu-memory-utilization", type=float, default=None)
    g.add_argument(
        "--cpu-kv-cache-fraction",
        type=float,
        default=None,
        help="share of free RAM given to the KV cache on CPU (default 0.25)",
    )
    g.add_argument("--num-gpu-blocks-override", type=int, default=None)
    g.add_argument("--kv-cache-metrics", action=bool_flag, default=None)
    g.add_argument("--kv-cache-metrics-sample", type=float, default=None)

    g = parser.add_argument_group("scheduler")
    g.add_argument("--max-num-seqs", type=int, default=None)
    g.add_argument(
        "--max-num-batched-tokens",
        type=parse_token_count,
        default=None,
        help="token budget of one step (default: 512 on CPU, 2048 on GPU)",
    )
    g.add_argument("--enable-chunked-prefill", action=bool_flag, default=None)
    g.add_argument("--long-prefill-token-threshold", type=int, default=None)
    g.add_argument("--scheduling-policy", default=None, choices=["fcfs", "priority"])

    g = parser.add_argument_group("worker")
    g.add_argument("--device", default=None, choices=["auto", "cpu", "cuda"])
    g.add_argument("--worker-backend", default=None)
    g.add_argument(
        "--attention-backend",
        default=None,
        choices=["torch", "triton"],
        help="default: triton on CUDA, torch on CPU",
    )
    g.add_argument(
        "--num-threads", type=int, default=None, help="torch threads in the worker (CPU)"
    )


@dataclass
class Endpoints:
    """The ``ipc://`` (or tcp) addresses of one server's sockets; who binds each is noted."""

    tokenizer_requests: str = ""  # api_server binds (PUSH) -> tokenizers
    api_outputs: str = ""  # api_server binds (PULL) <- tokenizers, detokenizer, launcher
    engine_core: str = ""  # scheduler binds (PULL) <- tokenizers, api_server, detokenizer
    step_plans: str = ""  # scheduler binds (XPUB) -> worker ranks
    step_results: str = ""  # scheduler binds (PULL) <- worker rank 0
    detok_tokens: str = ""  # detokenizer binds (PULL) <- scheduler
    detok_specs: str = ""  # detokenizer binds (PULL) <- tokenizers
    control: str = ""  # launcher binds (PULL) <- every child's Ready
    kv_events: str | None = None  # scheduler binds (PUB) for routers, when set


@dataclass
class ServeConfig:
    """Everything a server's processes need; the launcher hands it to each child as JSON."""

    engine: EngineConfig = field(default_factory=EngineConfig)
    endpoints: Endpoints = field(default_factory=Endpoints)
    model_folder: str = ""  # the prepared HF-style folder (GGUF already converted)
    served_model_names: list[str] = field(default_factory=list)
    host: str = "127.0.0.1"
    port: int = 8000
    api_key: str | None = None
    shutdown_timeout: float = 30.0
    max_num_queued_reqs: int | None = None
    enable_request_id_headers: bool = False
    tokenizer_workers: int = 1
    num_blocks: int = 0  # measured by the worker, given to the scheduler
    log_level: str = "info"
    # metrics (services/metrics/): the periodic stats line, and vLLM's switch for engine stats
    log_stats_interval: float = 10.0
    disable_log_stats: bool = False
