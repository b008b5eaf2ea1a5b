"""Engine configuration: one set of dataclasses, built from the CLI and validated at start-up.

Flag names, defaults and meanings follow vLLM's engine arguments, so a vLLM
command line works here unchanged. ``ConfigError`` carries a one-line message
for the user; the CLI prints it and exits with status 2, never a traceback.
"""

from __future__ import annotations

import argparse
import dataclasses
import logging
import os
import re
from dataclasses import dataclass, field, fields
from typing import Any

from services.gpu_worker.registry import ATTENTION_BACKENDS, WORKER_BACKENDS
from services.scheduler.block_hash import HASH_FUNCTIONS
from services.scheduler.request_queue import REQUEST_QUEUES

logger = logging.getLogger(__name__)


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


# Every allowed value of a choice flag is listed once, here or in the registry it names.
DTYPES = {
    "auto": "auto", "float32": "float32", "float": "float32",
    "float16": "float16", "half": "float16", "fp16": "float16",
    "bfloat16": "bfloat16", "bf16": "bfloat16",
}  # fmt: skip
LOAD_FORMATS = ("auto", "gguf", "safetensors", "dummy")
DEVICES = ("auto", "cpu", "cuda")


def _flag(help: str, **argparse_kwargs: Any) -> dict[str, Any]:
    """Field metadata that makes a dataclass field a CLI flag (``add_engine_args``):
    ``--field-name``, plus ``aliases``, a ``type`` parser and ``choices`` when given."""
    return {"flag": {"help": help, **argparse_kwargs}}


def _choices(registry: Any) -> tuple[str, ...]:
    return tuple(registry)


@dataclass
class ModelConfig:
    """Which model to serve and how to load it."""

    model: str | None = field(
        default=None,
        metadata=_flag("GGUF file or Hugging Face folder (default: SmolLM2-135M-Instruct)"),
    )
    dtype: str = field(
        default="auto",
        metadata=_flag(
            "weights and activations (auto: fp32 on CPU, bf16 on GPU)", choices=tuple(DTYPES)
        ),
    )
    load_format: str = field(
        default="auto", metadata=_flag("dummy: random weights", choices=LOAD_FORMATS)
    )
    seed: int = field(default=0, metadata=_flag("seed of the sampler's shared generator"))


@dataclass
class CacheConfig:
    """The paged KV cache and its prefix cache."""

    block_size: int = field(default=16, metadata=_flag("tokens per KV cache block"))
    enable_prefix_caching: bool = field(default=True, metadata=_flag("reuse cached prompt blocks"))
    prefix_caching_hash_algo: str = field(
        default="sha256", metadata=_flag("block hash", choices=_choices(HASH_FUNCTIONS))
    )
    kv_cache_memory_bytes: int | None = field(
        default=None,
        metadata=_flag("KV cache size per worker rank (4GiB, 512M, ...)", type=parse_size),
    )
    gpu_memory_utilization: float = field(
        default=0.92, metadata=_flag("share of GPU memory for weights, activations and KV")
    )
    cpu_kv_cache_fraction: float = field(
        default=0.25, metadata=_flag("share of free RAM given to the KV cache on CPU")
    )
    num_gpu_blocks_override: int | None = field(
        default=None, metadata=_flag("KV cache blocks, instead of measuring the memory")
    )
    kv_cache_dtype: str = "auto"
    kv_cache_metrics: bool = field(
        default=False, metadata=_flag("sample block lifetimes for the kv_block_* metrics")
    )
    kv_cache_metrics_sample: float = field(
        default=0.01, metadata=_flag("share of blocks --kv-cache-metrics samples")
    )


@dataclass
class SchedulerConfig:
    """Continuous batching: budgets per step and admission policy."""

    max_num_seqs: int = field(default=256, metadata=_flag("most requests running at once"))
    # None: 512 on CPU, 2048 on GPU (see EngineConfig.finalize)
    max_num_batched_tokens: int | None = field(
        default=None,
        metadata=_flag(
            "token budget of one step (default: 512 on CPU, 2048 on GPU)", type=parse_token_count
        ),
    )
    enable_chunked_prefill: bool = field(
        default=True, metadata=_flag("split long prompts over several steps")
    )
    long_prefill_token_threshold: int = field(
        default=0, metadata=_flag("most tokens of one request per step (0: no cap)")
    )
    scheduling_policy: str = field(
        default="fcfs", metadata=_flag("admission order", choices=_choices(REQUEST_QUEUES))
    )
    max_model_len: int | None = field(
        default=None,
        metadata=_flag(
            "longest request, prompt + output (default: the model's; resolved at start-up)",
            type=parse_token_count,
        ),
    )

    @property
    def resolved_max_model_len(self) -> int:
        """``max_model_len`` once resolved (``EngineConfig.finalize`` fills it from the model)."""
        if self.max_model_len is None:
            raise ValueError("max_model_len is unresolved: call EngineConfig.finalize()")
        return self.max_model_len

    @property
    def token_budget(self) -> int:
        """``max_num_batched_tokens`` once resolved (``EngineConfig.finalize`` fills the default)."""
        if self.max_num_batched_tokens is None:
            raise ValueError("max_num_batched_tokens is unresolved: call EngineConfig.finalize()")
        return self.max_num_batched_tokens


@dataclass
class WorkerConfig:
    """Where and how the model runs."""

    device: str = field(
        default="auto", metadata=_flag("auto: CUDA if torch sees a GPU", choices=DEVICES)
    )
    worker_backend: str = field(
        default="torch",
        metadata=_flag(
            "what runs each step (services/gpu_worker/registry.py)",
            choices=_choices(WORKER_BACKENDS),
        ),
    )
    attention_backend: str | None = field(
        default=None,
        metadata=_flag(
            "default: triton on CUDA, torch on CPU", choices=_choices(ATTENTION_BACKENDS)
        ),
    )
    num_threads: int | None = field(
        default=None,
        metadata=_flag("torch threads per worker rank on CPU (default: cores / ranks)"),
    )

    def resolved_device(self) -> str:
        """ "cpu" or "cuda": ``device``, with "auto" meaning CUDA when torch sees a GPU."""
        if self.device != "auto":
            return self.device
        import torch  # only here: config is imported by processes that never need torch

        return "cuda" if torch.cuda.is_available() else "cpu"


@dataclass
class ParallelConfig:
    """How the model is split over worker ranks (torch.distributed: NCCL on CUDA, gloo on CPU).

    ``world_size = tensor_parallel_size * pipeline_parallel_size`` workers; rank r is
    TP rank ``r % tp`` of pipeline stage ``r // tp``. The engine core broadcasts each
    StepPlan to every rank and takes the StepResult of TP rank 0 of the last stage
    (vLLM's output rank).
    """

    tensor_parallel_size: int = field(
        default=1,
        metadata=_flag("worker ranks that split every layer (Megatron-style)", aliases=("-tp",)),
    )
    pipeline_parallel_size: int = field(
        default=1,
        metadata=_flag("pipeline stages, each a consecutive run of layers", aliases=("-pp",)),
    )
    pp_layer_partition: str | None = field(
        default=None,
        metadata=_flag("layers per stage, e.g. 16,14 (default: as even as possible)"),
    )
    data_parallel_size: int = field(
        default=1,
        metadata=_flag(
            "engine cores (scheduler, KV cache, worker ranks each) behind one API server",
            aliases=("-dp",),
        ),
    )
    nnodes: int = field(
        default=1, metadata=_flag("machines the worker ranks of one engine core span")
    )
    node_rank: int = field(
        default=0, metadata=_flag("this machine's place among --nnodes (0 runs the server)")
    )
    master_addr: str = field(
        default="127.0.0.1",
        metadata=_flag(
            "node 0's address: the torch.distributed store and, across nodes, the plans"
        ),
    )
    master_port: int | None = field(
        default=None, metadata=_flag("port of that store (default: a free one)")
    )
    distributed_timeout: float = field(
        default=120.0,
        metadata=_flag(
            "seconds the ranks wait for each other, to form the group or in a collective"
        ),
    )

    @property
    def world_size(self) -> int:
        return self.tensor_parallel_size * self.pipeline_parallel_size

    @property
    def local_ranks(self) -> range:
        """The worker ranks this node runs: node k holds the k-th equal share."""
        per_node = self.world_size // self.nnodes
        return range(self.node_rank * per_node, (self.node_rank + 1) * per_node)

    def stage_layers(self, num_layers: int) -> list[tuple[int, int]]:
        """Each pipeline stage's layers ``[start, end)``: ``--pp-layer-partition``, else an
        even split whose remainder goes to the first stages (the last one also samples)."""
        pp = self.pipeline_parallel_size
        if self.pp_layer_partition is not None:
            sizes = [int(x) for x in self.pp_layer_partition.split(",")]
        else:
            sizes = [num_layers // pp + (i < num_layers % pp) for i in range(pp)]
        if len(sizes) != pp or sum(sizes) != num_layers or min(sizes) < 1:
            raise ConfigError(
                f"--pp-layer-partition {self.pp_layer_partition} must give each of the {pp} "
                f"stages at least one layer, {num_layers} in all"
            )
        starts = [sum(sizes[:i]) for i in range(pp)]
        return [(a, a + n) for a, n in zip(starts, sizes, strict=True)]

    def validate(self) -> None:
        if self.tensor_parallel_size < 1:
            raise ConfigError(
                f"--tensor-parallel-size must be at least 1, got {self.tensor_parallel_size}"
            )
        if self.data_parallel_size < 1:
            raise ConfigError(
                f"--data-parallel-size must be at least 1, got {self.data_parallel_size}"
            )
        if self.pipeline_parallel_size < 1:
            raise ConfigError(
                f"--pipeline-parallel-size must be at least 1, got {self.pipeline_parallel_size}"
            )
        if self.pp_layer_partition is not None and not re.fullmatch(
            r"\d+(,\d+)*", self.pp_layer_partition
        ):
            raise ConfigError(
                f"--pp-layer-partition must be comma-separated layer counts, got "
                f"{self.pp_layer_partition!r}"
            )
        if self.nnodes < 1 or not 0 <= self.node_rank < self.nnodes:
            raise ConfigError(
                f"--node-rank must be in [0, --nnodes), got {self.node_rank} of {self.nnodes}"
            )
        if self.nnodes > 1:
            if self.world_size % self.nnodes:
                raise ConfigError(
                    f"the {self.world_size} worker ranks (tensor x pipeline parallel size) must "
                    f"divide evenly over --nnodes {self.nnodes}"
                )
            if self.master_port is None:
                raise ConfigError("--nnodes > 1 needs --master-port: every node must give the same")
            if self.data_parallel_size > 1:
                raise ConfigError(
                    "--nnodes > 1 spreads one engine core's ranks over machines; data "
                    "parallelism across machines (--data-parallel-address) is not supported yet"
                )
        if self.distributed_timeout <= 0:
            raise ConfigError("--distributed-timeout must be positive")

    def check_fits(self, arch: ModelArchConfig, device: str) -> None:
        """The split must divide the model's heads and MLP, and the ranks must find devices."""
        tp = self.tensor_parallel_size
        heads, kv_heads = arch.num_attention_heads, arch.num_key_value_heads
        if heads % tp:
            raise ConfigError(
                f"Total number of attention heads ({heads}) must be divisible by tensor "
                f"parallel size ({tp})."
            )
        # vLLM's rule: KV heads are split when there are at least as many as ranks,
        # else each is replicated on tp / num_kv_heads ranks.
        if (kv_heads >= tp and kv_heads % tp) or (kv_heads < tp and tp % kv_heads):
            raise ConfigError(
                f"the model's {kv_heads} KV heads can be neither split over nor replicated "
                f"on {tp} tensor-parallel ranks; use a size that divides {kv_heads} or that "
                f"{kv_heads} divides"
            )
        if arch.intermediate_size % tp:
            raise ConfigError(
                f"the MLP width ({arch.intermediate_size}) must be divisible by tensor "
                f"parallel size ({tp})"
            )
        self.stage_layers(arch.num_hidden_layers)  # raises when the partition does not fit
        ranks = len(self.local_ranks) * self.data_parallel_size  # on this machine
        if ranks == 1:
            return
        if device == "cuda":
            import torch

            if ranks > torch.cuda.device_count():
                raise ConfigError(
                    f"{ranks} worker ranks need {ranks} GPUs; torch sees "
                    f"{torch.cuda.device_count()}"
                )
        elif ranks > (os.cpu_count() or 1):
            logger.warning(
                "%d worker ranks on %d CPU cores: each rank gets one thread and they share "
                "cores, so this is a test of the code path, not a speed-up",
                ranks,
                os.cpu_count(),
            )


_SECTIONS = ("model", "cache", "scheduler", "worker", "parallel")


@dataclass
class EngineConfig:
    model: ModelConfig = field(default_factory=ModelConfig)
    cache: CacheConfig = field(default_factory=CacheConfig)
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)
    worker: WorkerConfig = field(default_factory=WorkerConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)

    @classmethod
    def from_kwargs(cls, **kwargs: Any) -> EngineConfig:
        """Build from vLLM-style keyword names (``max_num_seqs=...``); unknown names are errors."""
        cfg = cls()
        owner = {f.name: (getattr(cfg, s), f) for s in _SECTIONS for f in fields(getattr(cfg, s))}
        for key, value in kwargs.items():
            if key not in owner:
                raise ConfigError(f"unknown engine argument {key!r}")
            section, f = owner[key]
            setattr(section, key, _coerce(f, value))
        cfg.validate()
        return cfg

    @classmethod
    def flag_names(cls) -> set[str]:
        """Every engine argument name (the CLI's ``--max-num-seqs`` is ``max_num_seqs``)."""
        cfg = cls()
        return {f.name for s in _SECTIONS for f in fields(getattr(cfg, s))}

    @classmethod
    def cli_kwargs(cls, args: argparse.Namespace) -> dict[str, Any]:
        """The engine flags the user gave (unset flags are None and left out)."""
        names = cls.flag_names()
        return {k: v for k, v in vars(args).items() if k in names and v is not None}

    @classmethod
    def from_cli(cls, args: argparse.Namespace) -> EngineConfig:
        return cls.from_kwargs(**cls.cli_kwargs(args))

    def validate(self) -> None:
        c, s, m, w = self.cache, self.scheduler, self.model, self.worker
        if c.block_size < 1 or c.block_size & (c.block_size - 1):
            raise ConfigError(f"--block-size must be a power of two, got {c.block_size}")
        _check_choice("--prefix-caching-hash-algo", c.prefix_caching_hash_algo, HASH_FUNCTIONS)
        _check_choice("--scheduling-policy", s.scheduling_policy, REQUEST_QUEUES)
        _check_choice("--dtype", m.dtype, DTYPES)
        _check_choice("--load-format", m.load_format, LOAD_FORMATS)
        _check_choice("--device", w.device, DEVICES)
        _check_choice("--worker-backend", w.worker_backend, WORKER_BACKENDS)
        if w.attention_backend is not None:
            _check_choice("--attention-backend", w.attention_backend, ATTENTION_BACKENDS)
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
        if s.max_model_len is not None and s.max_model_len < 1:
            raise ConfigError(f"--max-model-len must be at least 1, got {s.max_model_len}")
        if w.num_threads is not None and w.num_threads < 1:
            raise ConfigError(f"--num-threads must be at least 1, got {w.num_threads}")
        self.parallel.validate()
        if self.parallel.data_parallel_size > 1 and c.prefix_caching_hash_algo == "builtin":
            raise ConfigError(
                "--prefix-caching-hash-algo builtin hashes differ from process to process, so "
                "the data-parallel balancer could never match an engine's cached blocks; use "
                "sha256 or sha256_cbor with --data-parallel-size > 1"
            )

    def finalize(self, arch: ModelArchConfig) -> None:
        """Fill in what depends on the model (max_model_len) and check budgets against it."""
        s = self.scheduler
        derived = arch.derived_max_model_len
        if s.max_model_len is None:
            s.max_model_len = derived
        elif s.max_model_len > derived:
            why = (
                f"the sliding window ({arch.sliding_window}), which this engine does not "
                "implement, so positions past it would be wrong"
                if derived < arch.max_position_embeddings
                else f"the model's max_position_embeddings ({derived})"
            )
            raise ConfigError(
                f"--max-model-len {s.max_model_len} is greater than {why}; "
                f"use --max-model-len {derived} or less"
            )
        device = self.worker.resolved_device()
        if s.max_num_batched_tokens is None:
            # The budget is the knob between TTFT and ITL: every running request waits for
            # the whole step. A CPU computes ~1k prompt tokens/s, already at full matmul
            # speed at 512 tokens a step, so a bigger step only makes decodes wait longer
            # (2048 tokens ~3 s here) and admits prompts in bigger, later bursts.
            default = 512 if device == "cpu" else 2048
            s.max_num_batched_tokens = (
                default if s.enable_chunked_prefill else max(default, s.max_model_len)
            )
        if not s.enable_chunked_prefill and s.max_num_batched_tokens < s.max_model_len:
            raise ConfigError(
                f"--max-num-batched-tokens ({s.max_num_batched_tokens}) is smaller than "
                f"--max-model-len ({s.max_model_len}) with chunked prefill disabled: "
                "a long prompt could never be scheduled; raise it or enable chunked prefill"
            )
        self.parallel.check_fits(arch, device)


def _coerce(f: dataclasses.Field[Any], value: Any) -> Any:
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


def _check_choice(flag: str, value: object, choices: Any) -> None:
    if value not in choices:
        raise ConfigError(f"{flag} must be one of {', '.join(choices)}, got {value!r}")


def add_engine_args(parser: argparse.ArgumentParser) -> None:
    """vLLM's engine flags, same names and meanings, made from the dataclass fields that
    carry ``_flag`` metadata. Every default is None ("not given"): the dataclasses hold
    the real defaults, shown in the help."""
    cfg = EngineConfig()
    for section in _SECTIONS:
        obj = getattr(cfg, section)
        group = parser.add_argument_group(section, (type(obj).__doc__ or "").splitlines()[0])
        for f in fields(obj):
            spec = f.metadata.get("flag")
            if spec is None:
                continue
            spec = dict(spec)
            names = [f"--{f.name.replace('_', '-')}", *spec.pop("aliases", ())]
            default = getattr(obj, f.name)
            if default is not None and "default" not in spec["help"]:
                spec["help"] += f" (default: {default})"
            if str(f.type).startswith("bool"):
                spec["action"] = argparse.BooleanOptionalAction
            elif "type" not in spec and "choices" not in spec:
                spec["type"] = {"int": int, "float": float}.get(str(f.type).split(" ")[0], str)
            group.add_argument(*names, dest=f.name, default=None, **spec)


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
    engine_state: str = ""  # scheduler binds (PUB) -> tokenizers: load and cached blocks (DP)

    # Each data-parallel engine core has its own of these; engine 0 keeps the plain names.
    _PER_ENGINE = ("engine_core", "step_plans", "step_results", "engine_state")

    def for_engine(self, dp_rank: int) -> Endpoints:
        """The endpoints as engine ``dp_rank`` sees them: its own input, plan, result and
        state sockets (``name_{dp_rank}``), and for KV events a TCP port offset by the rank
        (as vLLM does)."""
        if dp_rank == 0:
            return self
        own = {name: f"{getattr(self, name)}_{dp_rank}" for name in self._PER_ENGINE}
        kv = self.kv_events
        if kv is not None:
            head, _, port = kv.rpartition(":")
            kv = f"{head}:{int(port) + dp_rank}" if port.isdigit() else f"{kv}_{dp_rank}"
        return dataclasses.replace(self, kv_events=kv, **own)

    def engines(self, data_parallel_size: int) -> list[Endpoints]:
        return [self.for_engine(d) for d in range(data_parallel_size)]


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
