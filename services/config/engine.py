"""Engine configuration: one set of dataclasses, built from the CLI and validated at start-up.

Flag names, defaults and meanings follow vLLM's engine arguments, so a vLLM
command line works here unchanged. ``ConfigError`` carries a one-line message
for the user; the CLI prints it and exits with status 2, never a traceback.
"""

from __future__ import annotations

import argparse
import json
import logging
from dataclasses import dataclass, field, fields
from typing import Any

from services.config.checks import check_worker_flags
from services.config.kv_transfer import KVTransferConfig
from services.config.pooling import (
    CONVERTS,
    RUNNERS,
    PoolerConfig,
    check_pooling_flags,
    resolve_runner,
)
from services.config.structured_outputs import REASONING_MARKERS, StructuredOutputsConfig
from services.flags import (
    ConfigError,
    add_flags,
    check_choice,
    choices,
    coerce,
    flag,
    parse_size,
    parse_token_count,
)
from services.model_arch import ModelArchConfig
from services.parallel_config import ParallelConfig
from services.registry import (
    ATTENTION_BACKENDS,
    HASH_ALGORITHMS,
    SCHEDULING_POLICIES,
    WORKER_BACKENDS,
)

logger = logging.getLogger(__name__)


# Every allowed value of a choice flag is listed once, here or in the registry it names.
DTYPES = {
    "auto": "auto", "float32": "float32", "float": "float32",
    "float16": "float16", "half": "float16", "fp16": "float16",
    "bfloat16": "bfloat16", "bf16": "bfloat16",
}  # fmt: skip
LOAD_FORMATS = ("auto", "gguf", "safetensors", "dummy")
QUANTIZATIONS = ("auto", "gguf", "none")
CPU_ACTIVATION_QUANTS = ("none", "int8")
DEVICES = ("auto", "cpu", "cuda")
# --kv-cache-dtype (vLLM's names; int8 is ours): how each is stored, actorserve_kernels/kv_quant.py
KV_CACHE_DTYPES = ("auto", "fp8", "fp8_e4m3", "fp8_e5m2", "int8")


@dataclass
class ModelConfig:
    """Which model to serve and how to load it."""

    model: str | None = field(
        default=None,
        metadata=flag("GGUF file or Hugging Face folder (default: SmolLM2-135M-Instruct)"),
    )
    dtype: str = field(
        default="auto",
        metadata=flag(
            "weights and activations (auto: fp32 on CPU, bf16 on GPU)", choices=tuple(DTYPES)
        ),
    )
    load_format: str = field(
        default="auto", metadata=flag("dummy: random weights", choices=LOAD_FORMATS)
    )
    quantization: str = field(
        default="auto",
        metadata=flag(
            "gguf: a GGUF model's Q4_0/Q4_1/Q8_0 matrices stay quantized, read by the CPU "
            "kernels with fp32 math (auto: so when the model is GGUF and runs fp32 on CPU); "
            "none: every weight expanded to --dtype",
            choices=QUANTIZATIONS,
            aliases=("-q",),
        ),
    )
    cpu_activation_quant: str = field(
        default="none",
        metadata=flag(
            "int8: the quantized matrices (Q4_0/Q4_1/Q8_0) multiply activations rounded to "
            "int8 per block of 32, on AVX-512 VNNI (llama.cpp's trade: ~2x faster linears, "
            "not exact; see bench/perplexity.py); none: fp32 activations, exact",
            choices=CPU_ACTIVATION_QUANTS,
        ),
    )
    seed: int = field(default=0, metadata=flag("seed of the sampler's shared generator"))
    # vLLM's pooling flags (services/config/pooling.py): embeddings instead of generation
    runner: str = field(
        default="auto",
        metadata=flag("pooling: /v1/embeddings and /pooling, no generation", choices=RUNNERS),
    )
    convert: str = field(
        default="auto", metadata=flag("--runner pooling: auto = embed", choices=CONVERTS)
    )
    pooler_config: str | None = field(
        default=None,
        metadata=flag('vLLM\'s JSON (default: {"pooling_type": "LAST", "normalize": true})'),
    )

    @property
    def resolved_runner(self) -> str:  # generate or pooling
        return resolve_runner(self.runner, self.convert)

    @property
    def pooler(self) -> PoolerConfig:
        return PoolerConfig.from_json(self.pooler_config)


@dataclass
class CacheConfig:
    """The paged KV cache and its prefix cache."""

    block_size: int = field(default=16, metadata=flag("tokens per KV cache block"))
    enable_prefix_caching: bool = field(default=True, metadata=flag("reuse cached prompt blocks"))
    prefix_caching_hash_algo: str = field(
        default="sha256", metadata=flag("block hash", choices=choices(HASH_ALGORITHMS))
    )
    kv_cache_memory_bytes: int | None = field(
        default=None,
        metadata=flag("KV cache size per worker rank (4GiB, 512M, ...)", type=parse_size),
    )
    gpu_memory_utilization: float = field(
        default=0.92, metadata=flag("share of GPU memory for weights, activations and KV")
    )
    cpu_kv_cache_fraction: float = field(
        default=0.25, metadata=flag("share of free RAM given to the KV cache on CPU")
    )
    num_gpu_blocks_override: int | None = field(
        default=None, metadata=flag("KV cache blocks, instead of measuring the memory")
    )
    kv_cache_dtype: str = field(
        default="auto",
        metadata=flag(
            "KV cache storage: auto (the model's dtype); fp8 (= fp8_e4m3) or fp8_e5m2 with a "
            "scale per layer; int8 with a scale per token and head (CPUs without fast fp8)",
            choices=KV_CACHE_DTYPES,
        ),
    )
    calculate_kv_scales: bool = field(
        default=False,
        metadata=flag(
            "fp8 KV cache: measure each layer's K and V scales on the first prompt "
            "(default: the checkpoint's, else 1.0)"
        ),
    )
    kv_cache_metrics: bool = field(
        default=False, metadata=flag("sample block lifetimes for the kv_block_* metrics")
    )
    kv_cache_metrics_sample: float = field(
        default=0.01, metadata=flag("share of blocks --kv-cache-metrics samples")
    )


@dataclass
class SchedulerConfig:
    """Continuous batching: budgets per step and admission policy."""

    max_num_seqs: int = field(default=256, metadata=flag("most requests running at once"))
    # None: 512 on CPU, 2048 on GPU (see EngineConfig.finalize)
    max_num_batched_tokens: int | None = field(
        default=None,
        metadata=flag(
            "token budget of one step (default: 512 on CPU, 2048 on GPU)", type=parse_token_count
        ),
    )
    enable_chunked_prefill: bool = field(
        default=True, metadata=flag("split long prompts over several steps")
    )
    long_prefill_token_threshold: int = field(
        default=0, metadata=flag("most tokens of one request per step (0: no cap)")
    )
    scheduling_policy: str = field(
        default="fcfs", metadata=flag("admission order", choices=choices(SCHEDULING_POLICIES))
    )
    async_scheduling: bool = field(
        default=False,
        metadata=flag(
            "plan step N+1 while step N runs; the workers feed N's tokens into N+1 "
            "(vLLM's --async-scheduling, SGLang's overlap scheduler)"
        ),
    )
    max_model_len: int | None = field(
        default=None,
        metadata=flag(
            "longest request, prompt + output (default: the model's; resolved at start-up)",
            type=parse_token_count,
        ),
    )
    structured_outputs_config: str | None = field(
        default=None,
        metadata=flag(
            'structured outputs, vLLM\'s JSON: {"backend": "auto"|"xgrammar"|"guidance", '
            '"disable_any_whitespace": false, "disable_fallback": false}, and ours: '
            '"unbounded_json": false, "json_max_whitespace": 20, "json_max_digits": 20, '
            '"json_max_string_length": null (default: auto: xgrammar, guidance for schemas '
            "xgrammar does not enforce; JSON bounded as services/structured_output/"
            "json_bounds.py says)"
        ),
    )
    reasoning_parser: str | None = field(
        default=None,
        metadata=flag(
            "split a chat answer's thinking into reasoning_content; constraints apply after "
            "the thinking (vLLM's flag)",
            choices=tuple(REASONING_MARKERS),
        ),
    )

    @property
    def structured_outputs(self) -> StructuredOutputsConfig:
        return StructuredOutputsConfig.from_json(
            self.structured_outputs_config, self.reasoning_parser
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
        default="auto", metadata=flag("auto: CUDA if torch sees a GPU", choices=DEVICES)
    )
    worker_backend: str = field(
        default="torch",
        metadata=flag(
            "what runs each step (services/registry.py)",
            choices=choices(WORKER_BACKENDS),
        ),
    )
    attention_backend: str | None = field(
        default=None,
        metadata=flag("default: triton on CUDA, torch on CPU", choices=choices(ATTENTION_BACKENDS)),
    )
    num_threads: int | None = field(
        default=None,
        metadata=flag("torch threads per worker rank on CPU (default: cores / ranks)"),
    )
    # CUDA graphs (vLLM's flags): decode-only steps replay a graph captured at start-up for
    # the smallest size that holds the batch (services/gpu_worker/cuda_graphs.py).
    enforce_eager: bool = field(
        default=False,
        metadata=flag("run every step eagerly: no CUDA graphs (a CPU always runs eagerly)"),
    )
    cuda_graph_sizes: list[int] | None = field(
        default=None,
        metadata=flag(
            "batch sizes to capture: one value N means 1, 2, 4, then steps of 8 up to N; "
            "several are the sizes themselves (default: up to 512 or --max-num-seqs)",
            nargs="+",
            type=int,
            metavar="N",
        ),
    )
    max_cudagraph_capture_size: int | None = field(
        default=None,
        metadata=flag(
            "largest batch captured in a CUDA graph; larger decode batches run eagerly "
            "(default: the largest of --cuda-graph-sizes, else min(512, --max-num-seqs))"
        ),
    )
    # --worker-backend sim (services/gpu_worker/sim/): the modelled device and model
    sim_hardware: str = field(
        default="h200",
        metadata=flag("simulated device: h200, h100, a100, l40s or a JSON file"),
    )
    sim_model: str | None = field(
        default=None,
        metadata=flag(
            "simulated model: llama-3-8b, llama-3-70b, qwen3-0.6b, qwen3-30b-a3b, "
            "deepseek-v3 or an HF config.json "
            "(default: --model's); the tokenizer stays --model's"
        ),
    )
    sim_speed: float = field(
        default=1.0,
        metadata=flag("simulated time per real second is 1/this (0.1: ten times faster)"),
    )
    sim_eos: str | None = field(
        default=None,
        metadata=flag(
            "end requests with EOS at a length drawn from fixed:N, uniform:LO,HI, exp:MEAN, "
            "lognormal:MEDIAN,SIGMA or a JSON file of lengths (default: at max_tokens)"
        ),
    )

    def resolved_device(self) -> str:
        """ "cpu" or "cuda": ``device``, with "auto" meaning CUDA when torch sees a GPU."""
        if self.device != "auto":
            return self.device
        # Not ``import torch``: the launcher resolves this and never needs torch.
        from services.config.device import torch_sees_cuda

        return "cuda" if torch_sees_cuda() else "cpu"


_SECTIONS = ("model", "cache", "scheduler", "worker", "parallel")


@dataclass
class EngineConfig:
    model: ModelConfig = field(default_factory=ModelConfig)
    cache: CacheConfig = field(default_factory=CacheConfig)
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)
    worker: WorkerConfig = field(default_factory=WorkerConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    kv_transfer: KVTransferConfig | None = None  # --kv-transfer-config (PD disaggregation)

    @classmethod
    def from_kwargs(cls, **kwargs: Any) -> EngineConfig:
        """Build from vLLM-style keyword names (``max_num_seqs=...``); unknown names are errors."""
        cfg = cls()
        owner = {f.name: (getattr(cfg, s), f) for s in _SECTIONS for f in fields(getattr(cfg, s))}
        for key, value in kwargs.items():
            if key not in owner:
                raise ConfigError(f"unknown engine argument {key!r}")
            section, f = owner[key]
            if key == "structured_outputs_config" and isinstance(value, dict):
                value = json.dumps(value)  # vLLM's offline LLM takes the config as a dict
            setattr(section, key, coerce(f, value))
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
        check_choice("--prefix-caching-hash-algo", c.prefix_caching_hash_algo, HASH_ALGORITHMS)
        check_choice("--scheduling-policy", s.scheduling_policy, SCHEDULING_POLICIES)
        check_choice("--dtype", m.dtype, DTYPES)
        check_choice("--load-format", m.load_format, LOAD_FORMATS)
        check_choice("--device", w.device, DEVICES)
        check_choice("--kv-cache-dtype", c.kv_cache_dtype, KV_CACHE_DTYPES)
        if c.calculate_kv_scales and not c.kv_cache_dtype.startswith("fp8"):
            raise ConfigError(
                "--calculate-kv-scales measures the per-layer scales of an fp8 KV cache; "
                f"--kv-cache-dtype {c.kv_cache_dtype} has none (int8 keeps a scale per token)"
            )
        check_choice("--worker-backend", w.worker_backend, WORKER_BACKENDS)
        check_pooling_flags(m.runner, m.convert, m.pooler_config, w.worker_backend)
        if w.attention_backend is not None:
            check_choice("--attention-backend", w.attention_backend, ATTENTION_BACKENDS)
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
        if w.cuda_graph_sizes is not None and (
            not w.cuda_graph_sizes or min(w.cuda_graph_sizes) < 1
        ):
            raise ConfigError(
                f"--cuda-graph-sizes must be positive batch sizes, got {w.cuda_graph_sizes}"
            )
        if w.max_cudagraph_capture_size is not None and w.max_cudagraph_capture_size < 1:
            raise ConfigError(
                "--max-cudagraph-capture-size must be at least 1, got "
                f"{w.max_cudagraph_capture_size}"
            )
        if w.num_threads is not None and w.num_threads < 1:
            raise ConfigError(f"--num-threads must be at least 1, got {w.num_threads}")
        if w.worker_backend != "sim" and (w.sim_model is not None or w.sim_eos is not None):
            raise ConfigError("--sim-model and --sim-eos are for --worker-backend sim")
        if w.sim_speed <= 0:
            raise ConfigError(f"--sim-speed must be positive, got {w.sim_speed}")
        check_worker_flags(self, None if w.device == "auto" else w.device)
        if w.worker_backend == "sim" and (
            self.parallel.nnodes > 1 or (w.sim_speed != 1.0 and self.parallel.engines_span_nodes)
        ):
            raise ConfigError(
                "--worker-backend sim keeps its device's timeline and simulated time on this "
                "machine's clock: run it on one machine (engine nodes only at --sim-speed 1)"
            )
        self.parallel.validate()
        s.structured_outputs  # noqa: B018 (parsed for its errors)
        if self.scheduler.async_scheduling and self.parallel.pipeline_parallel_size > 1:
            raise ConfigError(
                "--async-scheduling with --pipeline-parallel-size > 1 is not supported: the "
                "pipeline already keeps a plan in flight per stage"
            )
        if self.parallel.data_parallel_size > 1 and c.prefix_caching_hash_algo == "builtin":
            raise ConfigError(
                "--prefix-caching-hash-algo builtin hashes differ from process to process, so "
                "the data-parallel balancer could never match an engine's cached blocks; use "
                "sha256 or sha256_cbor with --data-parallel-size > 1"
            )

    def resolved_dtype(self, device: str | None) -> str:
        """``--dtype``'s canonical name; ``auto`` is float32 on a CPU, bfloat16 on a GPU
        (the model runner's rule), and stays ``auto`` when the device is not known."""
        dtype = DTYPES[self.model.dtype]
        if dtype == "auto" and device in ("cpu", "cuda"):
            return "float32" if device == "cpu" else "bfloat16"
        return dtype

    def finalize(self, arch: ModelArchConfig) -> None:
        """Fill in what depends on the model (max_model_len) and check budgets against it,
        and the flags that depend on the device, before any process starts."""
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
        # The simulated backend models a GPU and needs no device here.
        device = "sim" if self.worker.worker_backend == "sim" else self.worker.resolved_device()
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
        check_worker_flags(self, device, arch)


def add_engine_args(parser: argparse.ArgumentParser) -> None:
    """vLLM's engine flags, same names and meanings, one group per config section."""
    cfg = EngineConfig()
    for section in _SECTIONS:
        add_flags(parser, section, getattr(cfg, section))
