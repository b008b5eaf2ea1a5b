"""Building blocks of Llama-family decoders: linear layers, RMSNorm, SwiGLU activation,
rotary embedding.

Numerics follow HF transformers (norm statistics and rotary angles in fp32) so
fp32 outputs match the HF reference to rounding. Decode on CPU is a few hundred
small ops per step, so each block is written as few ops as possible (see
bench/RESULTS.md, "Forward pass").
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from actorserve_kernels.cpu import INT8_ACTIVATION_TYPES, INT8_ACTIVATIONS, QUANT_TYPES
from services.gpu_worker.distributed import ParallelState
from services.model_loader.gguf_tensors import GGUFBlocks

# oneDNN's fp32 inner-product kernel (what torch.compile emits for CPU linears). It was
# 1.1-1.6x faster than MKL's sgemm behind F.linear at 4-16 tokens on a copy of the
# weight reordered into its blocked layout; that copy doubled the weights' memory, so
# the model keeps one plain copy (bench/RESULTS.md, issue 15). A private op, so resolved
# once and optional; it has no autograd formula (inference only).
_onednn_linear: Any
try:
    _onednn_linear = torch.ops.mkldnn._linear_pointwise.default
except (AttributeError, RuntimeError):
    _onednn_linear = None
_USE_ONEDNN = _onednn_linear is not None and torch.backends.mkldnn.is_available()


# A linear over one or two tokens (decode at batch 1-2) is a stream over its weight; the
# C++ op in actorserve_kernels/cpu reads it at memory bandwidth, where oneDNN's GEMM leaves a share
# unused (batch 1: 35 -> 29 ms per decode step). From 4 tokens on oneDNN is as fast or
# faster (bench/RESULTS.md). Resolved on first use.
_SMALL_M = (1, 2)
_cpu_ops: Any = None


def _cpu_op(name: str) -> Any:
    """The ``actorserve_kernels.cpu`` function ``name``, or None when the C++ ops are unavailable."""
    global _cpu_ops
    if _cpu_ops is None:
        import actorserve_kernels.cpu

        _cpu_ops = actorserve_kernels.cpu if actorserve_kernels.cpu.load_cpu_ops() else False
    return getattr(_cpu_ops, name) if _cpu_ops else None


def _cpu_fp32_inference(x: torch.Tensor) -> bool:
    """Where the CPU fast paths (oneDNN, the C++ ops) apply: fp32 CPU tensors, no autograd."""
    return x.dtype == torch.float32 and x.device.type == "cpu" and not torch.is_grad_enabled()


def _cpu_inference(x: torch.Tensor) -> bool:
    """Where the C++ norm, SwiGLU and rotary ops apply: fp32 or bf16 CPU tensors (bf16: math
    in fp32, each result rounded once), no autograd."""
    return (
        x.dtype in (torch.float32, torch.bfloat16)
        and x.device.type == "cpu"
        and not torch.is_grad_enabled()
    )


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``F.linear``; for fp32 CPU inference through the C++ streaming op at 1 or 2
    tokens, else oneDNN."""
    if not _cpu_fp32_inference(x):
        return F.linear(x, weight, bias)
    if (
        x.dim() == 2
        and x.shape[0] in _SMALL_M
        and x.shape[1] % 16 == 0
        and x.is_contiguous()
        and weight.is_contiguous()
    ):
        op = _cpu_op("small_linear")
        if op is not None:
            out = op(x, weight)
            return out if bias is None else out.add_(bias)
    if _USE_ONEDNN:
        return _onednn_linear(x, weight, bias, "none", [], "")
    return F.linear(x, weight, bias)


@dataclass(frozen=True)
class QuantWeight:
    """A matrix [n, k] kept quantized: GGUF blocks of ``ggml_type`` packed by
    ``actorserve_kernels.cpu.quant_pack`` (1/4 to 1/7 of the fp32 bytes)."""

    packed: torch.Tensor
    ggml_type: int
    n: int
    k: int

    @classmethod
    def pack(cls, blocks: GGUFBlocks, int8_activations: bool = False) -> QuantWeight | None:
        """``blocks`` packed for the CPU kernels; None when they cannot read them (a type
        they lack, a width not a whole number of blocks, no C++ ops). ``int8_activations``:
        Q4_0/Q4_1/Q8_0 multiply activations rounded to int8 (the other types stay exact)."""
        n, k = blocks.shape
        if (
            blocks.ggml_type not in QUANT_TYPES.values()
            or k % blocks.block_size
            or n == 0
            or _cpu_op("quant_pack") is None
        ):
            return None
        kind = blocks.ggml_type
        if int8_activations and kind in INT8_ACTIVATION_TYPES:
            kind |= INT8_ACTIVATIONS
        packed = _cpu_op("quant_pack")(blocks.data, kind, k)
        return cls(packed, kind, n, k)

    @property
    def int8_activations(self) -> bool:
        """Packed for (and computed with) activations rounded to int8."""
        return bool(self.ggml_type & INT8_ACTIVATIONS)

    def linear(self, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        """``x @ W.T (+ bias)`` for x [..., k] in fp32 (exact up to rounding order) or bf16
        (few rows: the fp32 product rounded; many: a bf16 GEMM over W expanded to bf16)."""
        flat = x.reshape(-1, self.k).contiguous()
        out = _cpu_op("quant_linear")(flat, self.packed, self.ggml_type, self.n)
        if bias is not None:
            out.add_(bias)
        return out.view(*x.shape[:-1], self.n)

    def rows(self, ids: torch.Tensor) -> torch.Tensor:
        """Rows ``ids`` of W as fp32 [*ids.shape, k] (an embedding lookup)."""
        flat = _cpu_op("quant_dequant_rows")(
            self.packed, self.ggml_type, self.n, self.k, ids.reshape(-1).long()
        )
        return flat.view(*ids.shape, self.k)


class Linear(nn.Linear):
    """``nn.Linear`` (same parameters and names) computed by ``linear`` above, or by the
    quantized kernels once ``set_quantized`` gave it GGUF blocks.
    """

    quant: QuantWeight | None = None

    def set_quantized(self, quant: QuantWeight) -> None:
        """Compute with ``quant`` from now on; the dense weight is dropped (one copy)."""
        if (quant.n, quant.k) != (self.out_features, self.in_features):
            raise ValueError(
                f"quantized weight {quant.n} x {quant.k} does not fit a Linear "
                f"{self.out_features} x {self.in_features}"
            )
        self.quant = quant
        self.weight = nn.Parameter(self.weight.new_empty(0), requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.quant is not None:
            return self.quant.linear(x, self.bias)
        return linear(x, self.weight, self.bias)


class RMSNorm(nn.Module):
    """RMSNorm over the last dim; with ``residual`` it first adds it (fused add + norm).

    ``forward(x)`` -> normed; ``forward(x, residual)`` -> (normed, x + residual).
    """

    def __init__(self, hidden_size: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size))
        self.eps = eps

    def _norm(self, x: torch.Tensor) -> torch.Tensor:
        if x.dtype == torch.float32:
            # Same math as below when no cast is involved, in one dispatch instead of seven.
            return F.rms_norm(x, self.weight.shape, self.weight, self.eps)
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * xf.to(x.dtype)

    def forward(
        self, x: torch.Tensor, residual: torch.Tensor | None = None
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        if (
            x.is_cuda
            and not torch.is_grad_enabled()
            and x.dtype in (torch.float32, torch.bfloat16, torch.float16)
            and x.dtype == self.weight.dtype
            and x.dim() == 2
            and x.stride(-1) == 1
            and (
                residual is None
                or (
                    residual.shape == x.shape
                    and residual.dtype == x.dtype
                    and residual.stride(-1) == 1
                )
            )
        ):
            from actorserve_kernels.fused import rms_norm  # one Triton launch instead of ~9

            return rms_norm(x, self.weight, self.eps, residual)
        if (
            _cpu_inference(x)
            and x.dtype == self.weight.dtype
            and x.dim() == 2
            and x.stride(-1) == 1
            and (residual is None or (residual.shape == x.shape and residual.stride(-1) == 1))
        ):
            op = _cpu_op("rms_norm")  # add + norm in one pass instead of ~8 ops
            if op is not None:
                out, total = op(x, self.weight, self.eps, residual)
                return out if residual is None else (out, total)
        if residual is None:
            return self._norm(x)
        x = x + residual
        return self._norm(x), x


def vocab_rows(vocab_size: int, tp_size: int) -> int:
    """Vocabulary rows per TP rank: the vocabulary padded to a multiple of the ranks."""
    return -(-vocab_size // tp_size)


class VocabParallelEmbedding(nn.Module):
    """An embedding whose vocabulary rows are split over the TP ranks.

    The vocabulary is padded to ``tp_size * num_rows``; rank r holds rows
    ``[r * num_rows, (r + 1) * num_rows)``. A lookup outside them gives zeros, and the
    all-reduce sums each token's one non-zero row. ``weight`` keeps nn.Embedding's name.
    """

    def __init__(self, vocab_size: int, hidden_size: int, parallel: ParallelState) -> None:
        super().__init__()
        self.parallel = parallel
        self.num_rows = vocab_rows(vocab_size, parallel.tp_size)
        self.start = parallel.tp_rank * self.num_rows
        self.weight = nn.Parameter(torch.empty(self.num_rows, hidden_size))
        self.quant: QuantWeight | None = None

    def set_quantized(self, quant: QuantWeight) -> None:
        """Look rows up in (and, tied, project onto) ``quant``; the dense weight is dropped."""
        if (quant.n, quant.k) != tuple(self.weight.shape):
            raise ValueError(
                f"quantized embedding {quant.n} x {quant.k} does not fit {tuple(self.weight.shape)}"
            )
        self.quant = quant
        self.weight = nn.Parameter(self.weight.new_empty(0), requires_grad=False)

    def _lookup(self, ids: torch.Tensor) -> torch.Tensor:
        if self.quant is None:
            return F.embedding(ids, self.weight)
        return self.quant.rows(ids).to(self.weight.dtype)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        if self.parallel.tp_size == 1:
            return self._lookup(input_ids)
        local = input_ids - self.start
        outside = (local < 0) | (local >= self.num_rows)
        out = self._lookup(local.masked_fill(outside, 0))
        out.masked_fill_(outside.unsqueeze(-1), 0.0)
        return self.parallel.all_reduce(out)


def silu_and_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """SwiGLU: silu(gate) * up for ``gate_up = [gate | up]`` along the last dim."""
    if (
        gate_up.is_cuda
        and not torch.is_grad_enabled()
        and gate_up.dtype in (torch.float32, torch.bfloat16, torch.float16)
        and gate_up.dim() == 2
        and gate_up.stride(-1) == 1
    ):
        from actorserve_kernels.fused import silu_and_mul as triton_silu_and_mul

        return triton_silu_and_mul(gate_up)  # one Triton launch, rounded once
    if _cpu_inference(gate_up) and gate_up.dim() == 2 and gate_up.stride(-1) == 1:
        op = _cpu_op("silu_and_mul")
        if op is not None:
            return op(gate_up)
    gate, up = gate_up.chunk(2, dim=-1)
    return F.silu(gate) * up


def _inv_freq(head_dim: int, theta: float, scaling: dict[str, Any] | None) -> torch.Tensor:
    # on the CPU whatever the default device: under ``torch.device("meta")`` (the model
    # being built) these ops ran through torch's Python reference decompositions, ~2 s
    # of every worker's start-up
    exponents = torch.arange(0, head_dim, 2, dtype=torch.int64, device="cpu").float() / head_dim
    inv_freq = 1.0 / (theta**exponents)
    scaling = scaling or {}
    rope_type = scaling.get("rope_type") or scaling.get("type") or "default"
    if rope_type == "default":
        return inv_freq
    factor = float(scaling["factor"])
    if rope_type == "linear":
        return inv_freq / factor
    if rope_type == "llama3":
        # Llama 3.1: long wavelengths are slowed by `factor`, short ones kept, the
        # band between interpolated smoothly.
        low, high = float(scaling["low_freq_factor"]), float(scaling["high_freq_factor"])
        old_len = float(scaling["original_max_position_embeddings"])
        low_freq_wavelen, high_freq_wavelen = old_len / low, old_len / high
        wavelen = 2 * math.pi / inv_freq
        scaled = torch.where(wavelen > low_freq_wavelen, inv_freq / factor, inv_freq)
        smooth = (old_len / wavelen - low) / (high - low)
        smoothed = (1 - smooth) * scaled / factor + smooth * scaled
        medium = (wavelen >= high_freq_wavelen) & (wavelen <= low_freq_wavelen)
        return torch.where(medium, smoothed, scaled)
    raise ValueError(f"unsupported rope_scaling type {rope_type!r} (supported: linear, llama3)")


class RotaryEmbedding(nn.Module):
    """Neox-style (rotate-half) rotary embedding.

    ``cos_sin(positions, dtype)`` gathers a step's table rows once (the model shares
    them with every layer); ``forward(x, cos, sin)`` rotates ``x`` [T, heads, D], where
    q and k heads may be stacked into one tensor. The table is built lazily on the
    positions' device, so the module can be created on the meta device.
    """

    def __init__(
        self, head_dim: int, max_positions: int, theta: float, scaling: dict[str, Any] | None
    ) -> None:
        super().__init__()
        self.head_dim = head_dim
        self.max_positions = max_positions
        self.theta = theta
        self.scaling = scaling
        _inv_freq(head_dim, theta, scaling)  # reject bad rope_scaling at construction
        # [max_positions, 2, head_dim]: (cos | cos) and (-sin | sin), so that
        # rotate(x) = x * cos + cat(x2, x1) * sin in two fused ops.
        self._table: torch.Tensor | None = None

    def cos_sin(
        self, positions: torch.Tensor, dtype: torch.dtype
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, signed sin: [T, 1, head_dim] in ``dtype`` (angles computed in fp32)."""
        if self._table is None or self._table.device != positions.device:
            inv_freq = _inv_freq(self.head_dim, self.theta, self.scaling)
            positions_cpu = torch.arange(self.max_positions, dtype=torch.float32, device="cpu")
            freqs = torch.outer(positions_cpu, inv_freq)  # (on the CPU, as inv_freq)
            cos, sin = freqs.cos(), freqs.sin()
            table = torch.stack([torch.cat([cos, cos], -1), torch.cat([-sin, sin], -1)], 1)
            self._table = table.to(positions.device)
        rows = self._table[positions].to(dtype)
        return rows[:, 0:1], rows[:, 1:2]

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """x: [T, heads, D] -> rotated, same shape. On CPU in fp32/bf16 ``x`` is rotated in place
        by one C++ op (and returned); elsewhere a rotated copy is returned."""
        if (
            _cpu_inference(x)
            and x.dtype == cos.dtype == sin.dtype
            and x.stride(-1) == 1
            and self.head_dim % 32 == 0
        ):
            op = _cpu_op("rotary_embedding_")
            if op is not None:
                return op(x, cos, sin)
        x1, x2 = x.chunk(2, dim=-1)
        return torch.addcmul(x * cos, torch.cat([x2, x1], dim=-1), sin)
