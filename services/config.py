"""Engine configuration: one set of dataclasses, built from the CLI and validated at start-up.

Flag names, defaults and meanings follow vLLM's engine arguments, so a vLLM
command line works here unchanged. ``ConfigError`` carries a one-line message
for the user; the CLI prints it and exits with status 2, never a traceback.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import math
from dataclasses import dataclass, field, fields
from typing import Any

from services.flags import (
    ConfigError,
    add_flags,
    check_choice,
    choices,
    coerce,
    flag,
    parse_json_object,
    parse_size,
    parse_token_count,
)
from services.gpu_worker.registry import ATTENTION_BACKENDS, WORKER_BACKENDS
from services.kv_transfer.config import KVTransferConfig
from services.model_arch import ModelArchConfig
from services.parallel_config import ParallelConfig
from services.protocol import DEFAULT_MAX_LOGPROBS
from services.scheduler.block_hash import HASH_FUNCTIONS
from services.scheduler.request_queue import REQUEST_QUEUES

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


@dataclass
class CacheConfig:
    """The paged KV cache and its prefix cache."""

    block_size: int = field(default=16, metadata=flag("tokens per KV cache block"))
    enable_prefix_caching: bool = field(default=True, metadata=flag("reuse cached prompt blocks"))
    prefix_caching_hash_algo: str = field(
        default="sha256", metadata=flag("block hash", choices=choices(HASH_FUNCTIONS))
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
    kv_cache_dtype: str = "auto"
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
        default="fcfs", metadata=flag("admission order", choices=choices(REQUEST_QUEUES))
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
            '"disable_any_whitespace": false, "disable_fallback": false} (default: auto: '
            "xgrammar, guidance for schemas xgrammar does not enforce)"
        ),
    )

    @property
    def structured_outputs(self) -> StructuredOutputsConfig:
        return StructuredOutputsConfig.from_json(self.structured_outputs_config)

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


STRUCTURED_OUTPUT_BACKENDS = ("auto", "xgrammar", "guidance")


@dataclass(frozen=True)
class StructuredOutputsConfig:
    """``--structured-outputs-config``: vLLM's StructuredOutputsConfig, the fields we use.

    ``backend`` is the grammar engine: "auto" (vLLM's default) is xgrammar, or guidance for
    a JSON schema with keywords xgrammar does not enforce (unless ``disable_fallback``);
    ``disable_any_whitespace`` makes JSON outputs compact for every request."""

    backend: str = "auto"
    disable_any_whitespace: bool = False
    disable_fallback: bool = False

    @classmethod
    def from_json(cls, text: str | None) -> StructuredOutputsConfig:
        if not text:
            return cls()
        flag = "--structured-outputs-config"
        raw = parse_json_object(flag, text, {
            "backend", "disable_any_whitespace", "disable_fallback",
            "disable_additional_properties", "reasoning_parser", "reasoning_parser_plugin",
            "enable_in_reasoning",
        })  # fmt: skip
        backend = raw.get("backend", "auto")
        check_choice(f"{flag} backend", backend, STRUCTURED_OUTPUT_BACKENDS)
        for key in ("disable_any_whitespace", "disable_fallback"):
            if not isinstance(raw.get(key, False), bool):
                raise ConfigError(f"{flag}: {key} must be true or false")
        # vLLM's keys for what this engine does not have: accepted when they ask for nothing
        if raw.get("disable_additional_properties"):
            raise ConfigError(f"{flag}: disable_additional_properties is not supported")
        if raw.get("reasoning_parser") or raw.get("reasoning_parser_plugin"):
            raise ConfigError(f"{flag}: there are no reasoning parsers in this engine")
        return cls(
            backend, raw.get("disable_any_whitespace", False), raw.get("disable_fallback", False)
        )


@dataclass
class WorkerConfig:
    """Where and how the model runs."""

    device: str = field(
        default="auto", metadata=flag("auto: CUDA if torch sees a GPU", choices=DEVICES)
    )
    worker_backend: str = field(
        default="torch",
        metadata=flag(
            "what runs each step (services/gpu_worker/registry.py)",
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
    # --worker-backend sim (services/gpu_worker/sim/): the modelled device and model
    sim_hardware: str = field(
        default="h200",
        metadata=flag("simulated device: h200, h100, a100, l40s or a JSON file"),
    )
    sim_model: str | None = field(
        default=None,
        metadata=flag(
            "simulated model: llama-3-8b, llama-3-70b, qwen3-0.6b or an HF config.json "
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
        import torch  # only here: config is imported by processes that never need torch

        return "cuda" if torch.cuda.is_available() else "cpu"


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
        check_choice("--prefix-caching-hash-algo", c.prefix_caching_hash_algo, HASH_FUNCTIONS)
        check_choice("--scheduling-policy", s.scheduling_policy, REQUEST_QUEUES)
        check_choice("--dtype", m.dtype, DTYPES)
        check_choice("--load-format", m.load_format, LOAD_FORMATS)
        check_choice("--device", w.device, DEVICES)
        check_choice("--worker-backend", w.worker_backend, WORKER_BACKENDS)
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
        if w.num_threads is not None and w.num_threads < 1:
            raise ConfigError(f"--num-threads must be at least 1, got {w.num_threads}")
        if w.worker_backend != "sim" and (w.sim_model is not None or w.sim_eos is not None):
            raise ConfigError("--sim-model and --sim-eos are for --worker-backend sim")
        if w.sim_speed <= 0:
            raise ConfigError(f"--sim-speed must be positive, got {w.sim_speed}")
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


def add_engine_args(parser: argparse.ArgumentParser) -> None:
    """vLLM's engine flags, same names and meanings, one group per config section."""
    cfg = EngineConfig()
    for section in _SECTIONS:
        add_flags(parser, section, getattr(cfg, section))


@dataclass
class EngineAddresses:
    """The TCP sockets of an engine core on another machine, which it binds there."""

    engine_core: str
    engine_state: str


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
    kv_events: str | None = None  # scheduler binds (PUB) for routers, when set ("auto": any port)
    kv_events_replay: str | None = None  # scheduler binds (ROUTER): replays of past batches
    kv_events_topic: str = ""
    kv_events_buffer_steps: int = 10_000
    engine_state: str = ""  # scheduler binds (PUB) -> tokenizers: load and cached blocks (DP)
    # Engine cores on other machines (--data-parallel-size-local): their own addresses.
    remote_engines: dict[int, EngineAddresses] = field(default_factory=dict)
    # ``auto`` KV event sockets as first bound, by engine: a restarted engine binds them again
    # (routers subscribed to those addresses).
    kv_events_bound: dict[int, tuple[str, str]] = field(default_factory=dict)

    # Each data-parallel engine core has its own of these; engine 0 keeps the plain names.
    _PER_ENGINE = ("engine_core", "step_plans", "step_results", "engine_state")

    def for_engine(self, dp_rank: int) -> Endpoints:
        """The endpoints as engine ``dp_rank`` sees them: its own input, plan, result and
        state sockets (``name_{dp_rank}``; input and state at its TCP addresses when it runs
        on another machine), and for KV events a TCP port offset by the rank (as vLLM does)."""
        if dp_rank == 0 and not self.remote_engines and not self.kv_events_bound:
            return self
        suffix = f"_{dp_rank}" if dp_rank else ""
        own = {name: getattr(self, name) + suffix for name in self._PER_ENGINE}
        if (remote := self.remote_engines.get(dp_rank)) is not None:
            own.update(engine_core=remote.engine_core, engine_state=remote.engine_state)
        kv, replay = (_offset_endpoint(e, dp_rank) for e in (self.kv_events, self.kv_events_replay))
        if (bound := self.kv_events_bound.get(dp_rank)) is not None:
            kv, replay = bound[0], bound[1] or None
        return dataclasses.replace(self, kv_events=kv, kv_events_replay=replay, **own)

    def engines(self, data_parallel_size: int) -> list[Endpoints]:
        return [self.for_engine(d) for d in range(data_parallel_size)]


def _offset_endpoint(endpoint: str | None, dp_rank: int) -> str | None:
    """Engine ``dp_rank``'s own address for a KV event socket: the TCP port plus the rank
    (as vLLM does), a suffix for ipc; ``auto`` stays ``auto`` (each binds a free port)."""
    if endpoint is None or endpoint == "auto" or dp_rank == 0:
        return endpoint
    head, _, port = endpoint.rpartition(":")
    return f"{head}:{int(port) + dp_rank}" if port.isdigit() else f"{endpoint}_{dp_rank}"


@dataclass
class KVEventPublisherInfo:
    """One engine core's KV event sockets as bound (``GET /kv_events`` reports them)."""

    endpoint: str
    replay_endpoint: str
    topic: str
    data_parallel_rank: int


@dataclass
class RequestLimits:
    """What one request may ask for and hold: past a limit it gets a 400 (413 for the body)."""

    max_request_body_bytes: int = field(
        default=8 << 20,
        metadata=flag("largest request body, in bytes (8MiB, 1G, ...)", type=parse_size),
    )
    max_logprobs: int = field(
        default=DEFAULT_MAX_LOGPROBS,
        metadata=flag(
            "most logprobs (and prompt_logprobs) a request may ask for; -1: up to the "
            "vocabulary size"
        ),
    )
    max_n: int = field(default=128, metadata=flag("most choices (n) one request may ask for"))
    max_sequences_per_request: int = field(
        default=1024,
        metadata=flag("most sequences (prompts x n) one completions request may make"),
    )
    max_stop_strings: int = field(
        default=128,
        metadata=flag("most stop strings, and most bad_words, one request may give (each)"),
    )
    trust_request_chat_template: bool = field(
        default=False,
        metadata=flag(
            "render a chat_template sent with a request (in the sandbox, within the limits "
            "below); without it such a request is refused"
        ),
    )
    chat_template_render_timeout: float = field(
        default=2.0, metadata=flag("seconds a chat template may take to render")
    )
    max_chat_prompt_chars: int = field(
        default=1_000_000, metadata=flag("longest prompt text a chat template may render")
    )
    stream_send_timeout: float = field(
        default=30.0,
        metadata=flag(
            "seconds a streaming client may leave a chunk untaken (its buffers full) before "
            "its stream ends and its request is aborted"
        ),
    )

    @classmethod
    def from_cli(cls, args: argparse.Namespace) -> RequestLimits:
        given = {f.name: getattr(args, f.name, None) for f in fields(cls)}
        limits = cls(**{k: v for k, v in given.items() if v is not None})
        counts = [f.name for f in fields(cls) if f.type == "int" and f.name != "max_logprobs"]
        for name in counts:
            if getattr(limits, name) < 1:
                raise ConfigError(f"--{name.replace('_', '-')} must be at least 1")
        if limits.max_logprobs < -1:
            raise ConfigError("--max-logprobs must be -1 (the vocabulary size) or at least 0")
        for name in ("chat_template_render_timeout", "stream_send_timeout"):
            if not (math.isfinite(getattr(limits, name)) and getattr(limits, name) > 0):
                raise ConfigError(f"--{name.replace('_', '-')} must be a positive number")
        return limits


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
    limits: RequestLimits = field(default_factory=RequestLimits)
    enable_request_id_headers: bool = False
    chat_template: str | None = None  # --chat-template, the text (read from its file)
    # tool calling: tool_choice "auto" and the parser that finds the calls in the output
    enable_auto_tool_choice: bool = False
    tool_call_parser: str | None = None
    exclude_tools_when_tool_choice_none: bool = False
    # --restart-on-failure: a dead engine process restarts the engine group, the port stays
    restart_on_failure: bool = False
    retry_waiting_on_restart: bool = False  # requests with no output yet go to the new engine
    tokenizer_workers: int = 1
    # vLLM's request logging: prompts (and outputs) in the log only when asked for
    enable_log_requests: bool = False
    enable_log_outputs: bool = False
    max_log_len: int | None = None
    num_blocks: int = 0  # measured by the worker, given to the scheduler
    kv_block_bytes: int = 0  # one block's bytes over all ranks of an engine (workers report)
    log_level: str = "info"
    # metrics (services/metrics/): the periodic stats line, and vLLM's switch for engine stats
    log_stats_interval: float = 10.0
    disable_log_stats: bool = False
    kv_event_publishers: list[KVEventPublisherInfo] = field(default_factory=list)
