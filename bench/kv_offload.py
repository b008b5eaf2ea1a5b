"""The KV offload tier (issue 14): what it saves, and what int8 costs in accuracy.

A device KV pool too small for the working set (``--num-gpu-blocks-override``, default 200
blocks: 3,200 tokens) and ``--docs`` long documents (~1,500 tokens each) asked about in
turn, ``--rounds`` times: from the second round on, every document's prefix has been
evicted from the device pool by the others. The same requests (greedy, ``--max-tokens``
each, one at a time, streamed) go to fresh servers of the default model:

- ``recompute``: no offload tier: every revisit computes its prompt again;
- ``offload``: ``--kv-offload-bytes`` (default 1 GiB) of host tier in the cache's dtype;
- ``offload-int8``: the same bytes, blocks kept as int8 with per-(layer, K/V, head) scales;
- ``device``: a pool large enough for all documents (the upper bound).

Per setup: TTFT P50 of the first round (cold) and of the revisits, the prefix tokens the
device cache and the tier supplied, and against ``recompute``'s outputs (the reference:
computed from the prompt) how many revisits produced the same greedy text, and the
common prefix of those that did not, in characters.

    .venv/bin/python -m bench.kv_offload [--docs 6] [--rounds 3] [--max-tokens 32]

Writes ``bench/out/kv_offload.json`` and a PNG beside it, and prints a table.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import httpx

from bench.procs import ServerProcess
from services.flags import parse_size

OUT = Path(__file__).resolve().parent / "out"
_WORDS = ("river", "stone", "lamp", "orchard", "signal", "harbor", "meadow", "copper", "lantern", "violet", "engine", "thunder", "garden", "winter", "marble", "silver")  # fmt: skip


def documents(n: int, words: int = 1000) -> list[str]:
    """``n`` distinct texts of ~1,500 tokens (no shared prefix beyond the first words)."""
    docs = []
    for d in range(n):
        body = " ".join(_WORDS[(d * 7 + i * (d + 3)) % len(_WORDS)] for i in range(words))
        docs.append(f"Document {d} ({d * 37 % 101} pages). {body}\n")
    return docs


def ask(url: str, prompt: str, max_tokens: int) -> tuple[float, str]:
    """(TTFT s, the greedy text) of one streamed completion."""
    body = {"prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "stream": True,
            "ignore_eos": True}  # fmt: skip
    start = time.perf_counter()
    ttft, text = None, []
    with httpx.stream("POST", url + "/v1/completions", json=body, timeout=600) as r:
        r.raise_for_status()
        for line in r.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            piece = json.loads(line[6:])["choices"][0]["text"]
            if ttft is None and piece:
                ttft = time.perf_counter() - start
            text.append(piece)
    return ttft or time.perf_counter() - start, "".join(text)


def run_setup(name: str, args: list[str], docs: list[str], rounds: int,
              max_tokens: int) -> dict[str, Any]:  # fmt: skip
    server = ServerProcess("--max-model-len", "1600", *args)
    try:
        server.wait_ready()
        ask(server.url, "Warm up.", 2)
        before = server.metrics()
        rows = []
        for r in range(rounds):
            for d, doc in enumerate(docs):
                ttft, text = ask(server.url, f"{doc}Question {r}: what is document {d} about?",
                                 max_tokens)  # fmt: skip
                rows.append({"round": r, "doc": d, "ttft_s": ttft, "text": text})
                print(f"  {name:>13} round {r} doc {d}: TTFT {ttft * 1e3:7.0f} ms", flush=True)
        after = server.metrics()
    finally:
        server.close()

    def delta(metric: str) -> float:
        return after.get(metric, 0.0) - before.get(metric, 0.0)

    return {
        "args": args,
        "rows": rows,
        "prompt_tokens": delta("vllm:prompt_tokens_total"),
        "device_hit_tokens": delta("vllm:prefix_cache_hits_total"),
        "tier_hit_tokens": delta("vllm:external_prefix_cache_hits_total"),
    }


def summarize(setups: dict[str, Any]) -> None:
    ref = {(x["round"], x["doc"]): x["text"] for x in setups["recompute"]["rows"]}
    for s in setups.values():
        cold = [x["ttft_s"] for x in s["rows"] if x["round"] == 0]
        warm = [x for x in s["rows"] if x["round"] > 0]
        s["ttft_cold_p50_ms"] = 1e3 * statistics.median(cold)
        s["ttft_revisit_p50_ms"] = 1e3 * statistics.median(x["ttft_s"] for x in warm)
        same = [x["text"] == ref[x["round"], x["doc"]] for x in warm]
        s["revisits_same_text"] = f"{sum(same)}/{len(same)}"
        s["differing_common_prefix_chars"] = [
            len(os.path.commonprefix([x["text"], ref[x["round"], x["doc"]]]))
            for x in warm
            if x["text"] != ref[x["round"], x["doc"]]
        ]


def plot(setups: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = list(setups)
    fig, ax = plt.subplots(figsize=(7, 4))
    xs = range(len(names))
    ax.bar([x - 0.2 for x in xs], [setups[n]["ttft_cold_p50_ms"] for n in names], 0.4,
           label="first visit (cold)")  # fmt: skip
    ax.bar([x + 0.2 for x in xs], [setups[n]["ttft_revisit_p50_ms"] for n in names], 0.4,
           label="revisit (prefix evicted from the device pool)")  # fmt: skip
    ax.set_xticks(list(xs), names)
    ax.set_ylabel("TTFT P50 (ms)")
    ax.set_title("A ~1,500-token prefix coming back: recomputed, or from the host tier")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.kv_offload", description=__doc__.splitlines()[0])  # fmt: skip
    p.add_argument("--docs", type=int, default=6)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--max-tokens", type=int, default=32)
    p.add_argument("--device-blocks", type=int, default=200)
    p.add_argument("--offload-bytes", default="1GiB")
    args = p.parse_args(argv)
    docs = documents(args.docs)
    small = ["--num-gpu-blocks-override", str(args.device_blocks)]
    int8 = {"kv_connector": "offload", "kv_connector_extra_config": {
        "kv_offload_bytes": parse_size(args.offload_bytes), "kv_offload_dtype": "int8"}}  # fmt: skip
    configs = {
        "recompute": small,
        "offload": [*small, "--kv-offload-bytes", args.offload_bytes],
        "offload-int8": [*small, "--kv-transfer-config", json.dumps(int8)],
        "device": ["--num-gpu-blocks-override", str(120 * args.docs + 100)],
    }
    setups = {}
    for name, server_args in configs.items():
        print(f"{name}: {' '.join(server_args)}", flush=True)
        setups[name] = run_setup(name, server_args, docs, args.rounds, args.max_tokens)
    summarize(setups)
    print(f"{'setup':>13} {'cold TTFT':>10} {'revisit TTFT':>13} {'device hits':>12} "
          f"{'tier hits':>10} {'same text':>10}")  # fmt: skip
    for name, s in setups.items():
        print(f"{name:>13} {s['ttft_cold_p50_ms']:8.0f}ms {s['ttft_revisit_p50_ms']:11.0f}ms "
              f"{s['device_hit_tokens']:12.0f} {s['tier_hit_tokens']:10.0f} "
              f"{s['revisits_same_text']:>10}")  # fmt: skip
    OUT.mkdir(parents=True, exist_ok=True)
    path = OUT / "kv_offload.json"
    result = {"docs": args.docs, "rounds": args.rounds, "max_tokens": args.max_tokens,
              "device_blocks": args.device_blocks, "offload_bytes": args.offload_bytes,
              "setups": setups}  # fmt: skip
    path.write_text(json.dumps(result, indent=2) + "\n")
    plot(setups, path.with_suffix(".png"))
    print(f"wrote {path} and .png")
    return 0


if __name__ == "__main__":
    sys.exit(main())
