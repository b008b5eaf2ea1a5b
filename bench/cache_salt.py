"""``cache_salt`` and the prefix-cache timing side channel (issue 16), measured.

A tenant who can time its first token learns whether a prompt was cached: a cache hit
skips the prefill. ``cache_salt`` (vLLM's request field) puts a tenant's blocks under its
own key, so another tenant's identical prompt must neither hit nor come back faster.

On a fresh server, for each of ``--rounds`` new ~1,700-token prompts: the victim sends it
(cold), sends it again (its own salt: a hit), then the attacker sends it with another salt
and with none. Streaming, one output token; the client times the first token (TTFT) and
reads ``usage.prompt_tokens_details.cached_tokens``. Reported per case: TTFT median,
min and max, cached tokens; the attacker's median over the cold median (1.0 = nothing
learned) and the victim's own hit over cold.

    .venv/bin/python -m bench.cache_salt [--rounds 8]

Writes ``bench/out/cache_salt.json`` and a PNG beside it.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import httpx

from bench.plots import write_result
from bench.procs import ServerProcess

OUT = Path(__file__).resolve().parent / "out"
SERVER_ARGS = ("--kv-cache-memory-bytes", "512MiB", "--max-model-len", "2048")
CASES = ("cold", "own salt", "another salt", "no salt")


def prompt(round_: int) -> str:
    """~1,700 tokens of the default tokenizer, new text in every round."""
    return "\n".join(
        f"Entry {round_}.{i}: the ledger of account {round_ * 97 + i} balanced on day {i}."
        for i in range(75)
    )


def first_token(url: str, text: str, salt: str | None) -> tuple[float, int]:
    """(TTFT in seconds, cached prompt tokens) of one streamed request."""
    body: dict[str, Any] = {"prompt": text, "max_tokens": 1, "temperature": 0, "stream": True,
                            "stream_options": {"include_usage": True}}  # fmt: skip
    if salt is not None:
        body["cache_salt"] = salt
    start = time.perf_counter()
    ttft = None
    cached = -1
    with httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=300) as r:
        r.raise_for_status()
        for line in r.iter_lines():
            if not line.startswith("data: {"):
                continue
            chunk = json.loads(line[6:])
            if ttft is None and chunk["choices"]:
                ttft = time.perf_counter() - start
            if chunk.get("usage"):
                details = chunk["usage"].get("prompt_tokens_details") or {}
                cached = int(details.get("cached_tokens") or 0)
    assert ttft is not None, "no token came back"
    return ttft, cached


def measure(rounds: int) -> dict[str, Any]:
    server = ServerProcess(*SERVER_ARGS)
    try:
        server.wait_ready()
        first_token(server.url, "warm up the model", None)
        runs: dict[str, list[tuple[float, int]]] = {case: [] for case in CASES}
        for i in range(rounds):
            text = prompt(i)
            salts = {"cold": f"victim-{i}", "own salt": f"victim-{i}",
                     "another salt": f"attacker-{i}", "no salt": None}  # fmt: skip
            for case in CASES:  # in this order: the victim's two, then the attacker's
                runs[case].append(first_token(server.url, text, salts[case]))
            row = "  ".join(f"{c} {1000 * runs[c][-1][0]:7.1f} ms" for c in CASES)
            print(f"round {i + 1}/{rounds}: {row}", file=sys.stderr, flush=True)
    finally:
        server.close()
    cases = {
        case: {
            "ttft_ms": [round(1000 * t, 2) for t, _ in values],
            "ttft_ms_median": round(1000 * statistics.median(t for t, _ in values), 2),
            "cached_tokens": [c for _, c in values],
        }
        for case, values in runs.items()
    }
    cold = cases["cold"]["ttft_ms_median"]
    return {
        "rounds": rounds,
        "prompt_tokens_approx": 1700,
        "server_args": list(SERVER_ARGS),
        "cases": cases,
        "another_salt_over_cold": round(cases["another salt"]["ttft_ms_median"] / cold, 3),
        "no_salt_over_cold": round(cases["no salt"]["ttft_ms_median"] / cold, 3),
        "own_salt_over_cold": round(cases["own salt"]["ttft_ms_median"] / cold, 3),
    }


def plot(result: dict[str, Any], path: Path) -> None:
    from bench.plots import _pyplot, save_figure

    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(7, 4))
    for x, case in enumerate(CASES):
        values = result["cases"][case]["ttft_ms"]
        ax.scatter([x] * len(values), values, alpha=0.6)
        ax.hlines(result["cases"][case]["ttft_ms_median"], x - 0.3, x + 0.3, color="black")
    ax.set_xticks(range(len(CASES)), [f"{c}\n(cached {result['cases'][c]['cached_tokens'][0]})"
                                      for c in CASES])  # fmt: skip
    ax.set_ylabel("time to first token (ms)")
    ax.set_ylim(bottom=0)
    ax.set_title("cache_salt: the same ~1,700-token prompt, victim then attacker")
    save_figure(fig, path)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--rounds", type=int, default=8)
    p.add_argument("--out", type=Path, default=OUT / "cache_salt.json")
    a = p.parse_args(argv)
    result = measure(a.rounds)
    write_result(result, a.out, plot)
    print(json.dumps({k: v for k, v in result.items() if k != "cases"}
                     | {c: result["cases"][c]["ttft_ms_median"] for c in CASES}, indent=1))  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
