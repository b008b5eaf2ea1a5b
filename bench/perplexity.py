"""Accuracy of the ways to run one model: perplexity on a local text and greedy agreement.

Issue 15 asks that every fast path state what it costs in accuracy. For each way of running
the default model (or ``--model``) this runs the offline engine and measures:

- **perplexity** over a local English text (default: the GPL-3 text Debian ships in
  /usr/share/common-licenses, else this repository's README), cut into windows of
  ``--window`` tokens, each scored from its own start (``prompt_logprobs=0``: the log-
  probability of every token given the ones before it, as vLLM users compute it);
- **greedy agreement** with the first configuration (the fp32 reference): ``--prompts``
  prompts (the text's lines), ``--max-tokens`` greedy tokens each, the share generated
  identically and the mean length of the common prefix.

Configurations (``--configs``): ``fp32`` (every weight expanded to fp32: the reference the
tests hold HF transformers to), ``gguf`` (fp32 activations over the GGUF's quantized blocks:
the default on CPU), ``bf16`` (``--dtype bfloat16``: bf16 activations and KV cache over the
same quantized blocks; few-row products exact then rounded, prefill GEMMs over W rounded to
bf16), ``bf16-dense`` (``--dtype bfloat16 --quantization none``: every weight rounded to
bf16, as vLLM runs a bf16 model), ``int8`` (``--cpu-activation-quant int8``: activations
rounded to int8 per block of 32, AVX-512 VNNI). bf16 runs on any CPU, fast only where it has
AVX512_BF16 (the measurement is about accuracy here, not speed).

``--kv-cache-dtype`` (with ``--calculate-kv-scales``) runs every configuration over a quantized KV
cache. A window scored in one step attends over its own fresh K/V and never reads the cache;
``--max-num-batched-tokens`` below ``--window`` (e.g. 64) splits each window into chunks, and
every chunk after the first then reads the earlier ones (and itself) from the cache
(``bench/kv_dtype.py accuracy`` does this for each KV dtype).

    .venv/bin/python -m bench.perplexity [--configs fp32 gguf bf16 bf16-dense int8] [--window 512]
        [--kv-cache-dtype auto|fp8|fp8_e5m2|int8] [--calculate-kv-scales] [--max-num-batched-tokens N]

Writes ``bench/results/perplexity.json`` and prints a table.
"""

from __future__ import annotations

import argparse
import json
import math
import platform
import sys
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
RESULTS = REPO / "bench" / "results"
DEFAULT_TEXT = Path("/usr/share/common-licenses/GPL-3")
CONFIGS: dict[str, dict[str, Any]] = {
    "fp32": {"quantization": "none"},
    "gguf": {"quantization": "gguf"},
    "bf16": {"dtype": "bfloat16"},
    "bf16-dense": {"dtype": "bfloat16", "quantization": "none"},
    "int8": {"quantization": "gguf", "cpu_activation_quant": "int8"},
}


def windows(ids: list[int], size: int, limit: int) -> list[list[int]]:
    """Consecutive windows of ``size`` tokens (the last partial one dropped), at most ``limit``."""
    return [ids[i : i + size] for i in range(0, len(ids) - size + 1, size)][:limit]


def run_config(
    name: str, args: argparse.Namespace, text: str, extra: dict[str, Any] | None = None
) -> dict[str, Any]:
    """Score ``text`` and run the greedy prompts with configuration ``name`` (its engine
    flags, then ``extra``'s: e.g. a KV cache dtype and a step token budget)."""
    from launch.llm import LLM, SamplingParams

    engine_kwargs = {**CONFIGS[name], **(extra or {})}
    llm = LLM(
        args.model,
        max_model_len=max(args.window, 256) + args.max_tokens,
        enable_prefix_caching=False,
        **engine_kwargs,
    )
    ids = llm.tokenizer.encode(text)
    chunks = windows(ids, args.window, args.max_windows)
    print(f"[{name}] scoring {len(chunks)} windows of {args.window} tokens ...", flush=True)
    start = time.perf_counter()
    scored = llm.generate(chunks, SamplingParams(max_tokens=1, prompt_logprobs=0))
    seconds = time.perf_counter() - start
    total, count = 0.0, 0
    for out in scored:
        for lp in (out.prompt_logprobs or [])[1:]:  # the first token has no context
            assert lp is not None
            total += lp.logprob
            count += 1
    prompts = [line.strip() for line in text.splitlines() if len(line.split()) >= 6]
    prompts = prompts[: args.prompts]
    print(f"[{name}] {len(prompts)} greedy completions of {args.max_tokens} tokens ...", flush=True)
    greedy = llm.generate(
        prompts, SamplingParams(temperature=0, max_tokens=args.max_tokens, ignore_eos=True)
    )
    llm.close()
    return {
        "config": name,
        "engine_kwargs": engine_kwargs,
        "scored_tokens": count,
        "perplexity": math.exp(-total / count),
        "mean_nll": -total / count,
        "scoring_tok_s": sum(len(c) for c in chunks) / seconds,
        "greedy": [list(g.outputs[0].token_ids) for g in greedy],
    }


def agreement(ref: list[list[int]], other: list[list[int]]) -> dict[str, float]:
    """Share of sequences generated identically and the mean common prefix, in tokens."""
    same = sum(a == b for a, b in zip(ref, other, strict=True))
    prefix = []
    for a, b in zip(ref, other, strict=True):
        n = next(
            (i for i, (x, y) in enumerate(zip(a, b, strict=False)) if x != y), min(len(a), len(b))
        )
        prefix.append(n)
    return {"identical": same / len(ref), "mean_common_prefix": sum(prefix) / len(prefix)}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default=None, help="default: the default model")
    parser.add_argument("--configs", nargs="+", default=list(CONFIGS), choices=list(CONFIGS))
    parser.add_argument("--text", type=Path, default=None)
    parser.add_argument("--window", type=int, default=512)
    parser.add_argument("--max-windows", type=int, default=24)
    parser.add_argument("--prompts", type=int, default=16)
    parser.add_argument("--max-tokens", type=int, default=48)
    parser.add_argument("--name", default="perplexity", help="result file name (no suffix)")
    parser.add_argument("--kv-cache-dtype", default="auto", help="every configuration's KV cache")
    parser.add_argument("--calculate-kv-scales", action="store_true")
    parser.add_argument("--max-num-batched-tokens", type=int, default=None,
                        help="below --window: later chunks of a window read the KV cache")  # fmt: skip
    args = parser.parse_args()
    path = args.text or (DEFAULT_TEXT if DEFAULT_TEXT.exists() else REPO / "README.md")
    text = path.read_text(encoding="utf-8")
    extra: dict[str, Any] = {}
    if args.kv_cache_dtype != "auto":
        extra["kv_cache_dtype"] = args.kv_cache_dtype
    if args.calculate_kv_scales:
        extra["calculate_kv_scales"] = True
    if args.max_num_batched_tokens is not None:
        extra["max_num_batched_tokens"] = args.max_num_batched_tokens
    rows = [run_config(name, args, text, extra) for name in args.configs]
    ref = rows[0]["greedy"]
    print(f"\ntext: {path} ({len(text)} characters); reference: {rows[0]['config']}")
    print("| config | perplexity | mean NLL | greedy identical | mean common prefix |")
    print("|---|---|---|---|---|")
    for row in rows:
        row.update(agreement(ref, row["greedy"]))
        print(f"| {row['config']} | {row['perplexity']:.4f} | {row['mean_nll']:.5f} | "
              f"{row['identical']:.0%} | {row['mean_common_prefix']:.1f} / {args.max_tokens} |")  # fmt: skip
    RESULTS.mkdir(parents=True, exist_ok=True)
    out = RESULTS / f"{args.name}.json"
    meta = {"text": str(path), "window": args.window, "max_tokens": args.max_tokens,
            "cpu": platform.processor() or platform.machine(), "rows": rows}  # fmt: skip
    out.write_text(json.dumps(meta, indent=1) + "\n")
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
