"""``actorserve router``'s settings (built from its command line in launch/cli.py)."""

from __future__ import annotations

from dataclasses import dataclass, field

from services.router.kv_events import Publisher


@dataclass
class RouterConfig:
    """What one router (or one side of the PD proxy) serves and how it routes."""

    backends: list[str]
    policy: str = "cost"
    host: str = "127.0.0.1"
    port: int = 8080
    api_key: str | None = None
    tokenizer: str | None = None  # local tokenization; None: the replicas' /tokenize
    block_size: int | None = None  # None: the replicas' (vllm:cache_config_info)
    prefix_caching_hash_algo: str | None = None
    session_header: str = "x-session-id"
    burst_window_ms: float = 50.0
    health_check_interval: float = 2.0
    load_interval_ms: float = 100.0
    max_body_bytes: int = 64 << 20
    log_level: str = "warning"
    seed: int | None = None
    # Replicas that do not report their KV event sockets (vLLM's): URL -> where they publish.
    kv_events: dict[str, Publisher] = field(default_factory=dict)
