"""A simulated device as the roofline sees it: datasheet numbers from a JSON file
(``hardware/*.json``, or any path), with the shares of peak a real kernel achieves."""

from __future__ import annotations

import json
from dataclasses import dataclass, field, fields
from pathlib import Path

from services.flags import ConfigError

HARDWARE_DIR = Path(__file__).parent / "hardware"
_TORCH_DTYPES = {
    "float32": "fp32",
    "float": "fp32",
    "bfloat16": "bf16",
    "float16": "fp16",
    "half": "fp16",
    "auto": "bf16",
}


def sim_dtype(name: str) -> str:
    """``--dtype`` (or a config's ``torch_dtype``) as a key of ``peak_flops``."""
    return _TORCH_DTYPES.get(name, name)


@dataclass(frozen=True)
class SimHardware:
    """A device as the roofline sees it (the shipped ones are datasheet numbers)."""

    name: str
    peak_flops: dict[str, float]  # FLOP/s per dtype (dense)
    memory_bandwidth: float  # bytes/s
    memory_capacity: float  # bytes
    interconnect_bandwidth: float = 0.0  # bytes/s, one direction, between two devices
    interconnect_latency_s: float = 0.0
    compute_efficiency: float = 1.0  # achievable share of peak FLOP/s in a large GEMM
    bandwidth_efficiency: float = 1.0  # achievable share of memory bandwidth
    step_overhead_s: float = 0.0  # per step: launch, sampling, host work the device waits on
    layer_overhead_s: float = 0.0  # per layer and step: launches not hidden by CUDA graphs
    request_overhead_s: float = 0.0  # per request, layer and step: per-sequence attention work
    # Tokens at which a GEMM reaches half its peak FLOP/s: a small GEMM does not fill the
    # machine, peak * T / (T + this). 0: every GEMM runs at the peak.
    gemm_half_tokens: float = 0.0
    attention_efficiency: float = 1.0  # attention kernels' FLOP/s as a share of the GEMMs'
    interconnect: str = ""
    source: str = ""
    extra: dict[str, object] = field(default_factory=dict)  # anything else the file holds

    @classmethod
    def load(cls, name_or_path: str) -> SimHardware:
        """A shipped device (``h200``, ``h100``, ``a100``, ``l40s``) or a JSON file."""
        shipped = HARDWARE_DIR / f"{name_or_path}.json"
        path = shipped if shipped.exists() else Path(name_or_path).expanduser()
        if not path.is_file():
            names = ", ".join(sorted(p.stem for p in HARDWARE_DIR.glob("*.json")))
            raise ConfigError(
                f"--sim-hardware {name_or_path!r} is neither a shipped device ({names}) "
                "nor a JSON file"
            )
        try:
            raw = json.loads(path.read_text())
            known = {f.name for f in fields(cls)} - {"extra"}
            hw = cls(
                **{k: v for k, v in raw.items() if k in known},
                extra={k: v for k, v in raw.items() if k not in known},
            )
        except (ValueError, TypeError) as e:
            raise ConfigError(f"--sim-hardware {path}: {e}") from None
        if hw.memory_bandwidth <= 0 or not hw.peak_flops or min(hw.peak_flops.values()) <= 0:
            raise ConfigError(f"--sim-hardware {path}: needs peak_flops and memory_bandwidth > 0")
        return hw

    def flops(self, dtype: str) -> float:
        try:
            return self.peak_flops[dtype]
        except KeyError:
            raise ConfigError(
                f"the simulated {self.name} has no peak FLOP/s for {dtype}; "
                f"it lists {', '.join(self.peak_flops)}"
            ) from None
