"""What tensor and pipeline parallelism cost on this machine: step times and collectives.

Runs the offline engine on the default model with each layout in turn (fresh ranks each
time, same prompts, greedy, EOS ignored) and reports the mean time of a prefill step and
of a decode step, measured on the output rank with ``ACTORSERVE_STEP_TRACE_DIR``. Then
times the collectives one TP decode step makes (60 all-reduces of [batch, hidden] and
one all-gather of the logits, over gloo) in the same number of processes, and counts
the bytes each rank sends per step. Writes JSON and prints a table.

    .venv/bin/python -m bench.parallel --layouts 1x1 3x1 1x2 --batch 16 --out bench/out/parallel.json
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


def _steps(folder: Path, rank: int) -> list[tuple[int, float]]:
    text = (folder / f"rank{rank}.json").read_text().rstrip().rstrip(",")
    return [(e["args"]["tokens"], e["dur"] / 1e3) for e in json.loads(text + "]")]


def run_layout(tp: int, pp: int, prompts: list[list[int]], out_len: int) -> dict:
    from launch.llm import LLM, SamplingParams

    trace = Path(tempfile.mkdtemp(prefix="parallel-trace-"))
    os.environ["ACTORSERVE_STEP_TRACE_DIR"] = str(trace)
    kwargs = dict(max_model_len=1024, num_gpu_blocks_override=512, max_num_batched_tokens=512)
    params = SamplingParams(temperature=0, max_tokens=out_len, ignore_eos=True)
    in_process: list[tuple[int, float]] = []  # one rank runs its steps here, untraced
    start = time.perf_counter()
    with LLM(tensor_parallel_size=tp, pipeline_parallel_size=pp, **kwargs) as llm:
        llm.generate(prompts[:1], SamplingParams(temperature=0, max_tokens=2))  # warm-up
        if tp * pp == 1:
            submit = llm.core.executor.submit

            def timed(plan) -> None:
                t = time.perf_counter()
                submit(plan)
                in_process.append(
                    (plan.total_num_scheduled_tokens, (time.perf_counter() - t) * 1e3)
                )

            llm.core.executor.submit = timed  # type: ignore[method-assign]
        t0 = time.perf_counter()
        outputs = llm.generate(prompts, params)
        elapsed = time.perf_counter() - t0
    del os.environ["ACTORSERVE_STEP_TRACE_DIR"]
    output_rank = tp * (pp - 1)  # TP rank 0 of the last stage
    steps = in_process or _steps(trace, output_rank)
    decode = [ms for tokens, ms in steps if 1 < tokens <= len(prompts)]  # not the warm-up
    prefill = [ms for tokens, ms in steps if tokens > len(prompts)]
    return {
        "tp": tp,
        "pp": pp,
        "ranks": tp * pp,
        "startup_s": round(t0 - start, 2),
        "output_tok_s": round(sum(len(o.outputs[0].token_ids) for o in outputs) / elapsed, 1),
        "decode_step_ms": round(statistics.median(decode), 2) if decode else None,
        "prefill_step_ms": round(statistics.median(prefill), 2) if prefill else None,
        "steps": len(steps),
    }


def _collectives(rank: int, world: int, port: int, batch: int, hidden: int, vocab: int,
                 iters: int, out: dict) -> None:  # fmt: skip
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=world)  # fmt: skip
    x = torch.randn(batch, hidden)
    logits = torch.randn(batch, -(-vocab // world))
    parts = [torch.empty_like(logits) for _ in range(world)]
    for _ in range(3):
        dist.all_reduce(x)
    dist.barrier()
    t0 = time.perf_counter()
    for _ in range(iters):
        for _ in range(60):  # 30 layers x (o_proj, down_proj)
            dist.all_reduce(x)
        dist.all_gather(parts, logits)
    per_step = (time.perf_counter() - t0) / iters
    if rank == 0:
        out["collective_ms_per_decode_step"] = round(per_step * 1e3, 2)
    dist.destroy_process_group()


def time_collectives(world: int, batch: int, hidden: int, vocab: int) -> float:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    out = mp.Manager().dict()
    mp.spawn(_collectives, args=(world, port, batch, hidden, vocab, 20, out), nprocs=world)
    return float(out["collective_ms_per_decode_step"])


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--layouts", nargs="+", default=["1x1", "3x1", "1x2"], help="TPxPP")
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--input-len", type=int, default=256)
    ap.add_argument("--output-len", type=int, default=64)
    ap.add_argument("--out", type=Path, default=Path("bench/out/parallel.json"))
    args = ap.parse_args()
    rng = random.Random(0)
    prompts = [[rng.randint(1000, 40000) for _ in range(args.input_len)] for _ in range(args.batch)]
    hidden, vocab, layers = 576, 49152, 30
    results = []
    for layout in args.layouts:
        tp, pp = (int(x) for x in layout.split("x"))
        print(f"[{len(results) + 1}/{len(args.layouts)}] TP={tp} PP={pp} ...", file=sys.stderr)
        row = run_layout(tp, pp, prompts, args.output_len)
        if tp > 1:
            row["collective_ms_per_decode_step"] = time_collectives(tp, args.batch, hidden, vocab)
            # Ring all-reduce: each rank sends 2 (n-1)/n of the tensor; all-gather (n-1)/n.
            ar = 2 * (tp - 1) / tp * args.batch * hidden * 4 * 2 * layers
            ag = (tp - 1) / tp * args.batch * vocab * 4
            row["tp_bytes_sent_per_rank_per_decode_step"] = int(ar + ag)
        if pp > 1:
            row["pp_bytes_sent_per_stage_per_decode_step"] = 2 * args.batch * hidden * 4 // pp
        results.append(row)
        print(json.dumps(row), file=sys.stderr)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    meta = {"batch": args.batch, "input_len": args.input_len, "output_len": args.output_len,
            "cpu": os.cpu_count(), "torch": torch.__version__}  # fmt: skip
    args.out.write_text(json.dumps({"meta": meta, "results": results}, indent=2))
    print(f"{'TPxPP':>6} {'ranks':>5} {'tok/s':>7} {'decode ms':>10} {'prefill ms':>11} "
          f"{'collectives ms':>15} {'bytes/rank/step':>16}")  # fmt: skip
    for r in results:
        coll = r.get("collective_ms_per_decode_step", "-")
        sent = r.get("tp_bytes_sent_per_rank_per_decode_step",
                     r.get("pp_bytes_sent_per_stage_per_decode_step", "-"))  # fmt: skip
        print(f"{r['tp']}x{r['pp']:<4} {r['ranks']:>5} {r['output_tok_s']:>7} "
              f"{r['decode_step_ms']!s:>10} {r['prefill_step_ms']!s:>11} {coll!s:>15} {sent!s:>16}")  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
