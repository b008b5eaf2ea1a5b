"""``actorserve router``'s settings (built from its command line in launch/cli.py)."""

from __future__ import annotations

from dataclasses import dataclass, field

from services.router.discovery import DiscoveryConfig
from services.router.kv_events import Publisher

# Paths without an access line by default: the probes balancers and routers send every
# second (as the api_server's --disable-access-log-for-endpoints).
QUIET_ENDPOINTS = "/health,/load,/metrics"


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
    log_level: str = "warning"  # uvicorn's
    shutdown_timeout: float = 30.0  # seconds in-flight requests get after SIGTERM
    # Seconds an idle client connection stays open: longer than clients keep theirs (httpx
    # and the openai client 5, aiohttp 15), or a client reuses one as the router closes it
    # and its request fails (ReadError): the close races the request. nginx's default.
    timeout_keep_alive: int = 75
    access_log: bool = True  # a line per request (services/http/middleware.py)
    access_log_skip: list[str] = field(default_factory=lambda: QUIET_ENDPOINTS.split(","))
    role: str = "backend"  # what the log calls its replicas (the PD proxy: prefill, decode)
    seed: int | None = None
    # Replicas that do not report their KV event sockets (vLLM's): URL -> where they publish.
    kv_events: dict[str, Publisher] = field(default_factory=dict)
    # Replicas found in Kubernetes (--service-discovery; services/router/discovery.py).
    discovery: DiscoveryConfig | None = None
