"""What a grammar costs per decode step (issue 17), on the default model, offline.

For batch 1 and 16: the same chat prompts decode greedily, free and under a JSON schema
(one long string property, so the grammar does not end them early), ``--tokens`` steps
each. Timed per step, medians over the decode steps (prefill steps left out):

- ``step``: the whole engine step (schedule, model, sample, update), free and constrained;
- ``fill``: the scheduler filling the bitmask rows (xgrammar, one row per request);
- ``apply``: the worker masking the logits with them (torch);
- ``accept``: the scheduler advancing the matchers by the sampled tokens.

The grammar's share of a constrained step is (fill + apply + accept) / step; the
constrained step over the free one is the overhead as a user sees it.

    .venv/bin/python -m bench.structured_output [--tokens 48] [--batches 1 16]

Writes ``bench/out/structured_output.json`` and a PNG beside it.
"""

from __future__ import annotations

import argparse
import inspect
import json
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

OUT = Path(__file__).resolve().parent / "out"
SCHEMA = {
    "type": "object",
    "properties": {"id": {"type": "integer"}, "description": {"type": "string"}},
    "required": ["id", "description"],
    "additionalProperties": False,
}


class Timer:
    """Wraps ``owner.name``; collects each call's seconds into ``calls`` (cleared per step)."""

    def __init__(self, owner: Any, name: str) -> None:
        self.calls: list[float] = []
        original = getattr(owner, name)

        def timed(*args: Any, **kwargs: Any) -> Any:
            start = time.perf_counter()
            try:
                return original(*args, **kwargs)
            finally:
                self.calls.append(time.perf_counter() - start)

        static = isinstance(inspect.getattr_static(owner, name), staticmethod)
        setattr(owner, name, staticmethod(timed) if static else timed)

    def take(self) -> float:
        total, self.calls = sum(self.calls), []
        return total


def run(llm: Any, prompts: list[str], params: Any, timers: dict[str, Timer]) -> dict[str, Any]:
    """Generate, timing every step; medians over the steps where every request decodes."""
    steps: list[dict[str, float]] = []
    step: Callable[[], Any] = llm.step

    def timed_step() -> Any:
        for t in timers.values():
            t.take()
        start = time.perf_counter()
        items = step()
        row = {"step": time.perf_counter() - start, "sampled": len(items)}
        row.update({name: t.take() for name, t in timers.items()})
        steps.append(row)
        return items

    llm.step = timed_step
    try:
        outs = llm.generate(prompts, params)
    finally:
        llm.step = step
    decode = [s for s in steps[2:] if s["sampled"] == len(prompts)]  # past the prefill
    result = {k: statistics.median(s[k] for s in decode) * 1e3 for k in ("step", *timers)}
    result["steps"] = len(decode)
    result["tokens"] = [len(o.outputs[0].token_ids) for o in outs]
    return result


def measure(batches: list[int], tokens: int) -> dict[str, Any]:
    from launch.llm import LLM, SamplingParams
    from services.gpu_worker import model_runner
    from services.protocol import StructuredOutputsParams
    from services.structured_output.manager import StructuredOutputManager

    llm = LLM(max_model_len=1024)
    so = StructuredOutputsParams(json=json.dumps(SCHEMA))
    free = SamplingParams(temperature=0, max_tokens=tokens, ignore_eos=True)
    constrained = SamplingParams(temperature=0, max_tokens=tokens, structured_outputs=so)
    warm = [llm.apply_chat_template([{"role": "user", "content": "warm up"}])]
    llm.generate(warm, constrained)  # imports xgrammar and compiles the schema once
    timers = {
        "fill": Timer(StructuredOutputManager, "bitmask"),
        "apply": Timer(model_runner, "_apply_grammar"),
        "accept": Timer(StructuredOutputManager, "accept"),
    }
    rows = []
    for batch in batches:
        prompts = [
            llm.apply_chat_template(
                [{"role": "user", "content": f"Describe item {i} as JSON with a long description."}]
            )
            for i in range(batch)
        ]
        print(f"batch {batch}: free ...", file=sys.stderr)
        f = run(llm, prompts, free, {})
        print(f"batch {batch}: constrained ...", file=sys.stderr)
        c = run(llm, prompts, constrained, timers)
        grammar = c["fill"] + c["apply"] + c["accept"]
        rows.append({
            "batch": batch,
            "free_step_ms": f["step"],
            "constrained_step_ms": c["step"],
            "fill_ms": c["fill"],
            "apply_ms": c["apply"],
            "accept_ms": c["accept"],
            "grammar_share": grammar / c["step"],
            "constrained_over_free": c["step"] / f["step"],
            "decode_steps": [f["steps"], c["steps"]],
            "constrained_tokens": c["tokens"],
        })  # fmt: skip
        r = rows[-1]
        print(
            f"batch {batch}: step free {r['free_step_ms']:.2f} ms, constrained "
            f"{r['constrained_step_ms']:.2f} ms ({r['constrained_over_free']:.2f}x); fill "
            f"{r['fill_ms']:.3f}, apply {r['apply_ms']:.3f}, accept {r['accept_ms']:.3f} ms: "
            f"{100 * r['grammar_share']:.1f} % of the step",
            file=sys.stderr,
        )
    return {"schema": SCHEMA, "tokens": tokens, "rows": rows}


def plot(result: dict[str, Any], path: Path) -> None:
    from bench.plots import _pyplot, save_figure

    plt = _pyplot()
    rows = result["rows"]
    fig, ax = plt.subplots(figsize=(7, 4))
    labels = [f"batch {r['batch']}" for r in rows]
    x = range(len(rows))
    ax.bar([i - 0.2 for i in x], [r["free_step_ms"] for r in rows], 0.4, label="free step")
    bottom = [0.0] * len(rows)
    for key, label in (("fill_ms", "bitmask fill"), ("apply_ms", "mask apply"),
                       ("accept_ms", "matcher accept")):  # fmt: skip
        values = [r[key] for r in rows]
        ax.bar([i + 0.2 for i in x], values, 0.4, bottom=bottom, label=label)
        bottom = [b + v for b, v in zip(bottom, values, strict=True)]
    rest = [r["constrained_step_ms"] - b for r, b in zip(rows, bottom, strict=True)]
    ax.bar([i + 0.2 for i in x], rest, 0.4, bottom=bottom, label="rest of constrained step",
           color="lightgrey")  # fmt: skip
    ax.set_xticks(list(x), labels)
    ax.set_ylabel("ms per decode step (median)")
    ax.set_title("Structured outputs: the grammar's cost per step (default model, CPU)")
    ax.legend(fontsize=8)
    save_figure(fig, path)


def main() -> int:
    from bench.plots import write_result

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--tokens", type=int, default=48)
    p.add_argument("--batches", type=int, nargs="+", default=[1, 16])
    p.add_argument("--out", type=Path, default=OUT / "structured_output.json")
    a = p.parse_args()
    write_result(measure(a.batches, a.tokens), a.out, plot)
    return 0


if __name__ == "__main__":
    sys.exit(main())
