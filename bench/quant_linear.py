"""The quantized linear (``actorserve_kernels.cpu.quant_linear``, issue 15) against fp32 weights.

One decode step's linears of the default model (SmolLM2-135M: 30 layers of q, k, v, o,
gate, up, down, and the 49,152 x 576 LM head), each with its own random weights so that
no weight stays in cache between uses, at 1 to 64 tokens: fp32 weights through the
model's ``linear`` (the streaming C++ op at 1-2 tokens, oneDNN from 4), and the same
weights as GGUF Q8_0, Q4_0 and Q4_1 blocks (gguf's own quantizer), packed by
``quant_pack``, through ``quant_linear``, with fp32 activations and (``+i8``, where the CPU
has AVX-512 VNNI) ``--cpu-activation-quant int8``. Median of 7 after a warm-up.

    .venv/bin/python -m bench.quant_linear

Writes ``bench/out/quant_linear.json`` and prints a table.
"""

from __future__ import annotations

import json
import statistics
import sys
import time
from pathlib import Path

import numpy as np
import torch
from gguf import GGMLQuantizationType, quants

import actorserve_kernels.cpu as kc
from services.gpu_worker.model.layers import linear

OUT = Path(__file__).resolve().parent / "out"
LAYER = [(576, 576), (192, 576), (192, 576), (576, 576), (1536, 576), (1536, 576), (576, 1536)]
SHAPES = LAYER * 30 + [(49152, 576)]
TYPES = ("Q8_0", "Q4_0", "Q4_1")
# The same blocks with --cpu-activation-quant int8 (AVX-512 VNNI only): "<type>+i8".
INT8 = tuple(f"{t}+i8" for t in TYPES) if kc.int8_activations_supported() else ()


def _type_id(kind: str) -> int:
    base = kc.QUANT_TYPES[kind.removesuffix("+i8")]
    return base | kc.INT8_ACTIVATIONS if kind.endswith("+i8") else base


def main() -> int:
    if not kc.load_cpu_ops():
        raise SystemExit("the C++ CPU ops did not build")
    rng = np.random.default_rng(0)
    weights = []
    for n, k in SHAPES:
        w = rng.standard_normal((n, k)).astype(np.float32)
        raw = {t: torch.from_numpy(np.ascontiguousarray(quants.quantize(
            w, GGMLQuantizationType[t.removesuffix("+i8")]))) for t in TYPES}  # fmt: skip
        blocks = {
            t: kc.quant_pack(raw[t.removesuffix("+i8")], _type_id(t), k) for t in TYPES + INT8
        }
        weights.append((torch.from_numpy(w), blocks))
    rows = []
    with torch.inference_mode():
        for m in (1, 2, 4, 8, 16, 64, 256):
            xs = {k: torch.randn(m, k) for k in (576, 1536)}

            def step(kind: str, m: int = m, xs: dict = xs) -> float:
                start = time.perf_counter()
                for w, blocks in weights:
                    x = xs[w.shape[1]]
                    if kind == "fp32":
                        linear(x, w)
                    else:
                        kc.quant_linear(x, blocks[kind], _type_id(kind), w.shape[0])
                return time.perf_counter() - start

            for kind in ("fp32", *TYPES, *INT8):
                step(kind)
                times = [step(kind) for _ in range(7)]
                bytes_read = sum(
                    w.numel() * 4 if kind == "fp32" else b[kind].numel() for w, b in weights
                )
                row = {"tokens": m, "weights": kind, "ms": 1e3 * statistics.median(times),
                       "ms_min": 1e3 * min(times), "weight_mb": bytes_read / 1e6}  # fmt: skip
                rows.append(row)
                print(f"{m} token(s) {kind:>5}: {row['ms']:7.2f} ms (min {row['ms_min']:6.2f}) "
                      f"reading {row['weight_mb']:6.1f} MB of weights", flush=True)  # fmt: skip
    OUT.mkdir(parents=True, exist_ok=True)
    path = OUT / "quant_linear.json"
    path.write_text(json.dumps({"threads": torch.get_num_threads(), "rows": rows}, indent=2) + "\n")
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
