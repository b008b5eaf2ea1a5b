"""``--kv-transfer-config``: vLLM's KVTransferConfig, the fields this engine uses."""

from __future__ import annotations

import uuid
from dataclasses import dataclass, field
from typing import Any

from services.flags import ConfigError, parse_json_object

KV_ROLES = ("kv_producer", "kv_consumer", "kv_both")
_KNOWN_KEYS = {
    "kv_connector", "kv_role", "engine_id", "kv_ip", "kv_port", "kv_connector_extra_config",
    "kv_buffer_device", "kv_buffer_size", "kv_rank", "kv_parallel_size",
}  # fmt: skip


@dataclass
class KVTransferConfig:
    """Which connector, in which role, and where its side channel listens.

    ``kv_producer`` computes prompts for others (prefill instance), ``kv_consumer`` takes
    KV computed elsewhere (decode instance), ``kv_both`` does either per request (what
    ``kv_transfer_params`` asks for). Worker rank r's side channel listens on
    ``kv_ip:kv_port + r`` (p2p).
    """

    kv_connector: str
    kv_role: str = "kv_both"
    engine_id: str = field(default_factory=lambda: uuid.uuid4().hex)
    kv_ip: str = "127.0.0.1"
    kv_port: int = 14579  # vLLM's default
    kv_connector_extra_config: dict[str, Any] = field(default_factory=dict)

    @property
    def is_producer(self) -> bool:
        return self.kv_role in ("kv_producer", "kv_both")

    @property
    def is_consumer(self) -> bool:
        return self.kv_role in ("kv_consumer", "kv_both")

    def extra(self, key: str, default: float) -> float:
        """A number from ``kv_connector_extra_config``; ConfigError if it is not one."""
        value = self.kv_connector_extra_config.get(key, default)
        if isinstance(value, bool) or not isinstance(value, int | float) or value <= 0:
            raise ConfigError(
                f"--kv-transfer-config: kv_connector_extra_config.{key} must be a positive "
                f"number, got {value!r}"
            )
        return float(value)

    @classmethod
    def from_flags(
        cls, config_json: str | None, offload_bytes: int | None
    ) -> KVTransferConfig | None:
        """``--kv-transfer-config`` and ``--kv-offload-bytes`` (alone: the offload
        connector; with a config: refused, the config says it under ``multi``)."""
        cfg = cls.from_json(config_json) if config_json is not None else None
        if offload_bytes is None:
            return cfg
        if cfg is not None:
            raise ConfigError(
                "--kv-offload-bytes with --kv-transfer-config: put the offload connector in "
                'the config, e.g. {"kv_connector": "multi", "kv_connector_extra_config": '
                '{"connectors": [{"kv_connector": "p2p"}, {"kv_connector": "offload", '
                '"kv_connector_extra_config": {"kv_offload_bytes": N}}]}}'
            )
        return cls("offload", kv_connector_extra_config={"kv_offload_bytes": offload_bytes})

    @classmethod
    def from_json(cls, text: str) -> KVTransferConfig:
        from services.registry import KV_CONNECTORS

        raw = parse_json_object("--kv-transfer-config", text, _KNOWN_KEYS)
        name = raw.get("kv_connector")
        if name not in KV_CONNECTORS:
            raise ConfigError(
                f"--kv-transfer-config: kv_connector must be one of {', '.join(KV_CONNECTORS)}, "
                f"got {name!r}"
            )
        role = raw.get("kv_role", "kv_both")
        if role not in KV_ROLES:
            raise ConfigError(
                f"--kv-transfer-config: kv_role must be one of {', '.join(KV_ROLES)}, got {role!r}"
            )
        port = raw.get("kv_port", 14579)
        if isinstance(port, bool) or not isinstance(port, int) or not 0 < port < 65536:
            raise ConfigError(f"--kv-transfer-config: kv_port must be a port number, got {port!r}")
        extra = raw.get("kv_connector_extra_config") or {}
        if not isinstance(extra, dict):
            raise ConfigError("--kv-transfer-config: kv_connector_extra_config must be an object")
        cfg = cls(
            kv_connector=name,
            kv_role=role,
            kv_ip=str(raw.get("kv_ip") or "127.0.0.1"),
            kv_port=port,
            kv_connector_extra_config=extra,
        )
        if raw.get("engine_id"):
            cfg.engine_id = str(raw["engine_id"])
        return cfg
