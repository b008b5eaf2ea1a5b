"""The server's configuration: its endpoints, request limits and the engine's config.

The server's flags are fields, as the engine's are: ``flag(...)`` metadata on a field of
``ServeConfig`` or ``RequestLimits`` makes it a flag of ``actorserve serve``
(``add_serve_args``), read back by ``from_cli`` and checked by ``validate``.
"""

from __future__ import annotations

import argparse
import dataclasses
import math
from dataclasses import dataclass, field, fields
from pathlib import Path

from services.config.engine import EngineConfig, add_engine_args
from services.config.kv_transfer import KVTransferConfig
from services.flags import (
    ConfigError,
    add_flags,
    check_choice,
    flag,
    flag_name,
    given_flags,
    parse_size,
)
from services.protocol import DEFAULT_MAX_LOGPROBS
from services.registry import TOOL_CALL_PARSERS


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
        limits = cls(**given_flags(cls, args))
        limits.validate()
        return limits

    def validate(self) -> None:
        for f in fields(self):
            value = getattr(self, f.name)
            if f.type == "int" and f.name != "max_logprobs" and value < 1:
                raise ConfigError(f"{flag_name(f)} must be at least 1")
            if f.type == "float" and not (math.isfinite(value) and value > 0):
                raise ConfigError(f"{flag_name(f)} must be a positive number")
        if self.max_logprobs < -1:
            raise ConfigError("--max-logprobs must be -1 (the vocabulary size) or at least 0")


@dataclass
class ServeConfig:
    """Everything a server's processes need; the launcher hands it to each child as JSON.

    A field with ``flag(...)`` metadata is one of ``actorserve serve``'s own flags (vLLM's
    name): ``add_serve_args`` lists it, ``from_cli`` reads it back and ``validate`` checks it.
    """

    engine: EngineConfig = field(default_factory=EngineConfig)
    endpoints: Endpoints = field(default_factory=Endpoints)
    model_folder: str = ""  # the prepared HF-style folder (GGUF already converted)
    served_model_names: list[str] = field(
        default_factory=list,
        metadata=flag(
            "name(s) clients use in the 'model' field (default: the model argument)",
            name="--served-model-name",
            nargs="+",
            metavar="SERVED_MODEL_NAME",
        ),
    )
    host: str = field(default="127.0.0.1", metadata=flag("address to bind (default: loopback)"))
    port: int = field(default=8000, metadata=flag("port to bind"))
    api_key: str | None = field(default=None, metadata=flag("require 'Authorization: Bearer KEY'"))
    shutdown_timeout: float = field(
        default=30.0, metadata=flag("seconds in-flight requests get to finish after SIGTERM")
    )
    max_num_queued_reqs: int | None = field(
        default=None,
        metadata=flag("answer 429 while more requests than this wait for the engine"),
    )
    limits: RequestLimits = field(default_factory=RequestLimits)
    enable_request_id_headers: bool = field(
        default=False,
        metadata=flag(
            "add an X-Request-Id header to every response (the request's own, or a new one)"
        ),
    )
    # --chat-template names a file or is the template; the field holds the text (from_cli)
    chat_template: str | None = field(
        default=None,
        metadata=flag(
            "the chat template to use instead of the model's: a file, or the template itself "
            "(vLLM's flag); deploy/chat_templates/ has a ChatML one with Hermes-style tool "
            "calls"
        ),
    )
    # tool calling: tool_choice "auto" and the parser that finds the calls in the output
    enable_auto_tool_choice: bool = field(
        default=False,
        metadata=flag(
            'tool_choice "auto": the model decides to call tools, --tool-call-parser finds '
            "the calls in its output"
        ),
    )
    tool_call_parser: str | None = field(
        default=None,
        metadata=flag(
            "how the model writes tool calls: hermes (<tool_call>{...}</tool_call>, Qwen "
            "and many fine-tunes) or llama3_json (JSON objects, Llama 3.x)",
            choices=sorted(TOOL_CALL_PARSERS),
        ),
    )
    exclude_tools_when_tool_choice_none: bool = field(
        default=False,
        metadata=flag('with tool_choice "none", do not show the tools to the chat template'),
    )
    # --restart-on-failure: a dead engine process restarts the engine group, the port stays
    restart_on_failure: bool = field(
        default=False,
        metadata=flag(
            "when an engine process (tokenizer, scheduler, worker, detokenizer) dies, restart "
            "them all while the API server keeps its port and answers 503; without it the "
            "server exits. In-flight requests end with an error."
        ),
    )
    retry_waiting_on_restart: bool = field(
        default=False,
        metadata=flag(
            "with --restart-on-failure: requests that had no output yet when the engine died "
            "wait for the new engine and run there (once), instead of failing"
        ),
    )
    # ... at most --max-restarts times in --restart-window seconds (systemd's StartLimitBurst
    # and StartLimitIntervalSec), the k-th of them after --restart-backoff x 2^(k-1) seconds
    max_restarts: int = field(
        default=5,
        metadata=flag(
            "with --restart-on-failure: restart the engine at most this many times within "
            "--restart-window seconds (a restart that fails to start counts too); one more "
            "failure stops the server (exit 1)"
        ),
    )
    restart_window: float = field(
        default=600.0, metadata=flag("seconds over which --max-restarts counts restarts")
    )
    restart_backoff: float = field(
        default=1.0,
        metadata=flag(
            "seconds before the first restart within --restart-window; each further one "
            "waits twice as long as the one before (at most 60 s)"
        ),
    )
    tokenizer_workers: int = field(
        default=1, metadata=flag("tokenizer processes in front of the engine")
    )
    # vLLM's request logging: prompts (and outputs) in the log only when asked for
    enable_log_requests: bool = field(
        default=False,
        metadata=flag(
            "log each request's prompt, token ids and sampling parameters (vLLM's flag; "
            "off by default: the log holds no user text)"
        ),
    )
    enable_log_outputs: bool = field(
        default=False,
        metadata=flag(
            "with --enable-log-requests: log each request's output text and token ids too"
        ),
    )
    max_log_len: int | None = field(
        default=None,
        metadata=flag("cut logged prompts and outputs to this many characters or token ids"),
    )
    # the access log: a line per request (services/http/middleware.py), on as in vLLM
    disable_uvicorn_access_log: bool = field(
        default=False,
        metadata=flag(
            "no access log line per request (method, path, status, id, tokens, latency; "
            "vLLM's flag)"
        ),
    )
    disable_access_log_for_endpoints: str = field(
        default="/health,/load,/metrics",
        metadata=flag(
            "comma-separated paths without an access line (vLLM's flag; by default the "
            "probes a router or balancer sends every second; '' logs every request)",
            metavar="PATHS",
        ),
    )
    num_blocks: int = 0  # measured by the worker, given to the scheduler
    kv_block_bytes: int = 0  # one block's bytes over all ranks of an engine (workers report)
    log_level: str = field(
        default="warning",
        metadata=flag(
            "the HTTP server's (uvicorn's) log level",
            name="--uvicorn-log-level",
            metavar="UVICORN_LOG_LEVEL",
        ),
    )
    # metrics (services/metrics/): the periodic stats line, and vLLM's switch for engine stats
    log_stats_interval: float = field(
        default=10.0, metadata=flag("seconds between the engine's stats log lines")
    )
    disable_log_stats: bool = field(
        default=False,
        metadata=flag("no stats log line and no engine metrics (vllm:*) per step"),
    )
    kv_event_publishers: list[KVEventPublisherInfo] = field(default_factory=list)
    # which part of a server this machine runs (multi-node)
    headless: bool = field(
        default=False,
        metadata=flag(
            "run no API server, only this machine's worker ranks (with --nnodes, on "
            "--node-rank > 0) or engine cores (with --data-parallel-size-local)"
        ),
    )
    # KV events and KV transfer: the launcher turns them into endpoints, from_cli into
    # engine.kv_transfer
    kv_events_endpoint: str | None = field(
        default=None,
        metadata=flag(
            "publish KV cache events (vLLM's wire format) on this ZMQ endpoint (e.g. "
            "tcp://127.0.0.1:5557), or 'auto': free loopback ports for events and replay, "
            "reported at GET /kv_events"
        ),
    )
    kv_events_config: str | None = field(
        default=None,
        metadata=flag(
            'vLLM\'s JSON form: {"enable_kv_cache_events": true, "publisher": "zmq", '
            '"endpoint": ..., "replay_endpoint": ..., "topic": ..., "buffer_steps": ...}'
        ),
    )
    kv_transfer_config: str | None = field(
        default=None,
        metadata=flag(
            'PD disaggregation, vLLM\'s JSON: {"kv_connector": "p2p", "kv_role": '
            '"kv_producer"|"kv_consumer"|"kv_both", "kv_ip": ..., "kv_port": ..., '
            '"kv_connector_extra_config": {"lease_s": ..., "pull_timeout_s": ...}}'
        ),
    )
    kv_offload_bytes: int | None = field(
        default=None,
        metadata=flag(
            "a host-memory tier of this many bytes (e.g. 4GiB) under the KV cache: evicted "
            "prefix blocks go there and come back instead of being recomputed (the offload "
            "connector; in a --kv-transfer-config, put it under multi)",
            type=parse_size,
        ),
    )
    kv_offloading_size: float | None = field(
        default=None, metadata=flag("vLLM's name for --kv-offload-bytes, in GiB")
    )

    @classmethod
    def from_cli(cls, args: argparse.Namespace) -> ServeConfig:
        """``actorserve serve``'s configuration from its flags: the engine's, the request
        limits and the server's own fields (a flag not given keeps the default), validated.
        The launcher fills in what is measured or bound at start-up (endpoints, model
        folder, blocks) and the served name when none was given."""
        config = cls(
            engine=EngineConfig.from_cli(args),
            limits=RequestLimits.from_cli(args),
            **given_flags(cls, args),
        )
        config.chat_template = load_chat_template(config.chat_template)
        config.validate()
        offload = config.kv_offload_bytes
        if config.kv_offloading_size is not None:
            offload = int(config.kv_offloading_size * (1 << 30))
        config.engine.kv_transfer = KVTransferConfig.from_flags(config.kv_transfer_config, offload)
        return config

    def validate(self) -> None:
        """The server's own flags, each alone and against each other (ConfigError)."""
        if self.tool_call_parser is not None:
            check_choice("--tool-call-parser", self.tool_call_parser, TOOL_CALL_PARSERS)
        if self.tokenizer_workers < 1:
            raise ConfigError("--tokenizer-workers must be at least 1")
        if not 1 <= self.port <= 65535:
            # 0 (any free port) too: the banner, routers and the KV events' topic name it
            raise ConfigError(f"--port must be a port number (1-65535), got {self.port}")
        if self.enable_auto_tool_choice and self.tool_call_parser is None:
            raise ConfigError("--enable-auto-tool-choice requires --tool-call-parser")
        if not self.log_stats_interval > 0:
            raise ConfigError("--log-stats-interval must be positive")
        if self.enable_log_outputs and not self.enable_log_requests:
            raise ConfigError("--enable-log-outputs needs --enable-log-requests")
        if self.max_log_len is not None and self.max_log_len < 0:
            raise ConfigError("--max-log-len must be at least 0")
        if self.kv_offload_bytes is not None and self.kv_offloading_size is not None:
            raise ConfigError("give --kv-offload-bytes or --kv-offloading-size, not both")
        if self.max_restarts < 0:
            raise ConfigError("--max-restarts must be at least 0")
        if not (math.isfinite(self.restart_window) and self.restart_window > 0):
            raise ConfigError("--restart-window must be a positive number of seconds")
        if not (math.isfinite(self.restart_backoff) and self.restart_backoff >= 0):
            raise ConfigError("--restart-backoff must be a number of seconds, 0 or more")


def load_chat_template(value: str | None) -> str | None:
    """``--chat-template``: a file's text, or the value itself when it is no file but looks
    like a template (vLLM's rule)."""
    if value is None:
        return None
    try:
        if Path(value).is_file():
            return Path(value).read_text(encoding="utf-8")
    except OSError:  # a long inline template is no file name
        pass
    if not any(mark in value for mark in ("{{", "{%")):
        raise ConfigError(f"--chat-template: {value!r} is neither a file nor a template")
    return value


def add_serve_args(parser: argparse.ArgumentParser) -> None:
    """``actorserve serve``'s flags from the configuration: the server's own, the request
    limits and the engine's (one group per section)."""
    add_flags(parser, "server", ServeConfig(), "the API server and its processes")
    add_flags(parser, "request limits", RequestLimits())
    add_engine_args(parser)
