"""The server's configuration: its endpoints, request limits and the engine's config."""

from __future__ import annotations

import argparse
import dataclasses
import math
from dataclasses import dataclass, field, fields

from services.config.engine import EngineConfig
from services.flags import ConfigError, flag, parse_size
from services.protocol import DEFAULT_MAX_LOGPROBS


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
