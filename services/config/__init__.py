"""Configuration, at the bottom of the layers: imports no service.

``engine`` holds vLLM's engine flags (one dataclass per section, built from field
metadata), ``serve`` the server's endpoints and request limits, ``kv_transfer``
``--kv-transfer-config``. Backend names come from ``services.registry``.
"""

from services.config.engine import (
    DTYPES,
    LOAD_FORMATS,
    CacheConfig,
    EngineConfig,
    SchedulerConfig,
    StructuredOutputsConfig,
    add_engine_args,
)
from services.config.kv_transfer import KVTransferConfig
from services.config.serve import (
    Endpoints,
    EngineAddresses,
    KVEventPublisherInfo,
    RequestLimits,
    ServeConfig,
    add_serve_args,
)
from services.flags import ConfigError
from services.model_arch import ModelArchConfig
from services.parallel_config import ParallelConfig

__all__ = [
    "DTYPES",
    "LOAD_FORMATS",
    "CacheConfig",
    "ConfigError",
    "Endpoints",
    "EngineAddresses",
    "EngineConfig",
    "KVEventPublisherInfo",
    "KVTransferConfig",
    "ModelArchConfig",
    "ParallelConfig",
    "RequestLimits",
    "SchedulerConfig",
    "ServeConfig",
    "StructuredOutputsConfig",
    "add_engine_args",
    "add_serve_args",
]
