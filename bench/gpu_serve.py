"""The whole server on a Llama-3-8B-shaped model: ``actorserve serve --load-format dummy`` and
``actorserve bench`` against it, 1,024 tokens in, 256 out, ignoring EOS, at concurrency 1,
256 and 64 (the two that the issue sets goals for first).

Part of the GPU check (``bench/gpu_check.py``); alone:

    python3 -m bench.gpu_serve [--tiny] [--out FILE] [--decode-json bench/out/decode_graphs.json]

No weights and no network: the model folder (a temporary one) holds the Llama-3-8B
``config.json`` and a synthetic tokenizer, a WordLevel model over all 128,256 ids (words for
ids 0-127,999, Llama-3's 256 special tokens above), so that every id the random weights
sample decodes. The prompts are ``bench.datasets.random_dataset``'s (what ``--dataset-name
random`` draws) over that tokenizer, as token ids in a JSONL file (``--dataset-name jsonl``:
``actorserve bench --tokenizer`` wants weights in the folder it reads); a different seed per
run, so that no prompt is in the prefix cache from an earlier run. A short warm-up run first.

Per run: the bench's metrics (output tok/s, TTFT, TPOT, ITL: mean, median, p90, p99), and
the engine's share of a step from the worker's step timeline (``ACTORSERVE_STEP_TRACE_DIR``:
one event per ``execute()``): the worker's busy share of the run, and over the steady decode
steps (the whole batch decoding, nothing else) the median step and the median gap to the
next step (the device waits there: scheduler, messages, the engine's own work). With the
runner's step times measured alone (``bench/gpu_decode.py``; ``--decode-json``) it also
gives what those allow, ``c / step(c)`` tokens/s and, with each prompt's prefill step, the
throughput the run could have had, beside the measured one. Also from ``/metrics``: the
worker's ``execute()`` time and the scheduler's own time per step; and the CPU share of each
server process and of the bench client (a saturated one shows as ~100 %).

The server's ``--load-format dummy`` draws the weights on the GPU (``dummy_weights`` on the
worker's device): start-up is the capture of the decode graphs, not the weights.

``--tiny`` (a 2-layer model, vocabulary 1,024, on the CPU; 64 in / 16 out; concurrency 1, 4
and 8) is the dry run.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time
import traceback
from pathlib import Path
from typing import Any

from bench.gpu_check import LLAMA3_8B
from bench.gpu_decode import NUM_SPECIAL, TINY
from bench.procs import REPO, ServerProcess

MODEL_NAME = "llama-3-8b-dummy"
# (concurrency, prompts) in the order they run; input and output tokens; the warm-up run
RUNS = {
    "8b": {"runs": ((1, 8), (256, 512), (64, 128)), "input": 1024, "output": 256,
           "warmup": (8, 16), "max_model_len": 2048},
    "tiny": {"runs": ((1, 2), (8, 16), (4, 8)), "input": 64, "output": 16, "warmup": (2, 4),
             "max_model_len": 256},
}  # fmt: skip
# A runner step at batch 1 slower than this (eager, not graphs): half the prompts at c=1
SLOW_STEP_MS = 15.0
# Llama-3's named special tokens, by offset from the first special id (128,000); the rest
# are <|reserved_special_token_N|>
SPECIALS = {0: "<|begin_of_text|>", 1: "<|end_of_text|>", 6: "<|start_header_id|>",
            7: "<|end_header_id|>", 9: "<|eot_id|>"}  # fmt: skip


def _word(i: int) -> str:
    """A distinct lowercase word for each i (bijective base 26: a, b, ..., z, aa, ab, ...)."""
    s = ""
    i += 1
    while i:
        i, r = divmod(i - 1, 26)
        s = chr(97 + r) + s
    return s


def write_model_folder(folder: Path, arch: dict[str, Any]) -> None:
    """``config.json`` of ``arch`` and a synthetic tokenizer over its whole vocabulary."""
    from tokenizers import AddedToken, Tokenizer, models, pre_tokenizers

    vocab_size = arch["vocab_size"]
    first_special = vocab_size - NUM_SPECIAL
    specials = [SPECIALS.get(k, f"<|reserved_special_token_{k}|>") for k in range(NUM_SPECIAL)]
    vocab = {_word(i): i for i in range(first_special)}
    vocab |= {name: first_special + k for k, name in enumerate(specials)}
    tok = Tokenizer(models.WordLevel(vocab, unk_token=specials[2]))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.add_special_tokens([AddedToken(s, special=True, normalized=False) for s in specials])
    folder.mkdir(parents=True, exist_ok=True)
    tok.save(str(folder / "tokenizer.json"))
    (folder / "tokenizer_config.json").write_text(json.dumps({
        "bos_token": specials[0], "eos_token": specials[1], "add_bos_token": True,
        "model_max_length": arch["max_position_embeddings"],
    }))  # fmt: skip
    config = {**arch, "model_type": "llama", "torch_dtype": "bfloat16",
              "bos_token_id": first_special, "eos_token_id": first_special + 1,
              "tie_word_embeddings": False}  # fmt: skip
    (folder / "config.json").write_text(json.dumps(config, indent=1))


def write_prompts(folder: Path, path: Path, num: int, input_len: int, output_len: int,
                  seed: int) -> None:  # fmt: skip
    """``num`` prompts of ``random_dataset`` (as ``--dataset-name random``) as JSONL ids."""
    from bench import datasets as ds
    from services.model_loader import load_tokenizer

    words = ds.WordTokens(load_tokenizer(folder))
    requests = ds.random_dataset(words, num, input_len, output_len, seed=seed)
    with path.open("w") as f:
        for r in requests:
            f.write(json.dumps({"prompt": r.prompt, "output_len": r.expected_output_len}) + "\n")


# ---------------------------------------------------------------- the step timeline


def read_trace(path: Path) -> list[dict[str, Any]]:
    """The events of a ``StepTrace`` file (one JSON object a line, each ending in a comma)."""
    if not path.exists():
        return []
    events = []
    for line in path.read_text().splitlines():
        line = line.strip().rstrip(",")
        if line.startswith("{"):
            with contextlib.suppress(ValueError):
                events.append(json.loads(line))
    return events


def timeline(events: list[dict[str, Any]], batch: int) -> dict[str, Any]:
    """The worker's steps over a run at concurrency ``batch``: its busy share of their span,
    and over the decode steps (one token a request: at most ``batch`` tokens; a step with a
    prompt chunk has more) the median step, the median gap to the next step (the device
    waits there: scheduler, messages, the engine's own work) and the engine's share of a
    step, gap / (step + gap); the full-batch decode steps' median beside them."""
    if len(events) < 2:
        return {"steps": len(events)}
    events = sorted(events, key=lambda e: e["ts"])
    tokens = [e.get("args", {}).get("tokens", 0) for e in events]
    durs = [e["dur"] / 1e3 for e in events]  # ms
    span = (events[-1]["ts"] + events[-1]["dur"] - events[0]["ts"]) / 1e3
    gaps = [(b["ts"] - a["ts"] - a["dur"]) / 1e3 for a, b in zip(events, events[1:], strict=False)]
    out: dict[str, Any] = {
        "steps": len(events),
        "span_s": round(span / 1e3, 3),
        "worker_busy_share": sum(durs) / span,
        "worker_idle_share": 1 - sum(durs) / span,
        "median_step_ms": statistics.median(durs),
        "median_gap_ms": statistics.median(gaps),
    }
    decode = [i for i in range(len(gaps)) if tokens[i] <= batch]
    mixed = [i for i in range(len(durs)) if tokens[i] > batch]
    full = [d for d, n in zip(durs, tokens, strict=True) if n == batch]
    if decode:
        step = statistics.median(durs[i] for i in decode)
        gap = statistics.median(gaps[i] for i in decode)
        out.update(
            decode_steps=len(decode),
            decode_median_tokens=statistics.median(tokens[i] for i in decode),
            decode_step_ms=step,
            decode_gap_ms=gap,
            engine_share=gap / (step + gap),
        )
    if full:
        out.update(full_batch_steps=len(full), full_batch_step_ms=statistics.median(full))
    if mixed:
        out.update(mixed_steps=len(mixed), mixed_step_ms=statistics.median(durs[i] for i in mixed))
    return out


def cpu_seconds(pgid: int) -> dict[str, float]:
    """CPU seconds (user + system) so far of each process of the server (its process group),
    by role: ``launch.child ROLE``'s, else ``launcher``."""
    import psutil

    out: dict[str, float] = {}
    for p in psutil.process_iter():
        with contextlib.suppress(psutil.Error, OSError):
            if os.getpgid(p.pid) != pgid:
                continue
            cmd = p.cmdline()
            role = cmd[cmd.index("launch.child") + 1] if "launch.child" in cmd else "launcher"
            t = p.cpu_times()
            out[role] = out.get(role, 0.0) + t.user + t.system
    return out


def allowed(step_ms: float | None, prefill_ms: float | None, c: int, n: int, in_len: int,
            out_len: int) -> dict[str, Any]:  # fmt: skip
    """What the runner's own step times (measured alone) allow a run of ``n`` requests at
    concurrency ``c``: decode alone, ``c / step``; with every prompt's prefill step too,
    ``n * out / (n / c * out * step + n * prefill)`` (a chunked prefill shares its steps
    with decodes, so this is about what they cost together)."""
    if step_ms is None:
        return {}
    out: dict[str, Any] = {"runner_step_ms": step_ms, "decode_tok_s": c / step_ms * 1e3}
    if prefill_ms is not None:
        scale = in_len / 1024  # prefill_ms is for 1,024 tokens (gpu_decode's prefill)
        total_ms = n / c * out_len * step_ms + n * prefill_ms * scale
        out["with_prefill_tok_s"] = n * out_len / total_ms * 1e3
    return out


def step_times(decode: dict[str, Any] | None) -> tuple[dict[int, float], float | None]:
    """{batch: step ms} and the 1,024-token prefill ms of one ``gpu_decode`` result."""
    if not decode:
        return {}, None
    steps = {r["batch"]: r["step_ms"] for r in decode.get("rows", [])
             if "step_ms" in r and "batch" in r and r.get("sampling") == "greedy"}  # fmt: skip
    prefill = next((r["step_ms"] for r in decode.get("rows", [])
                    if r.get("case", "").startswith("prefill") and "step_ms" in r), None)  # fmt: skip
    return steps, prefill


# ---------------------------------------------------------------- the run


BENCH_KEYS = ("completed", "failed", "duration", "total_input_tokens", "total_output_tokens",
              "request_throughput", "output_throughput", "total_token_throughput",
              "max_concurrent_requests")  # fmt: skip
METRICS = {  # /metrics samples (summed over labels), their deltas over a run
    "worker_forward_s": "actorserve:worker_forward_time_seconds_sum",
    "worker_steps": "actorserve:worker_forward_time_seconds_count",
    "scheduler_step_s": "actorserve:scheduler_step_time_seconds_sum",
    "scheduler_steps": "actorserve:scheduler_step_time_seconds_count",
    "preemptions": "vllm:num_preemptions_total",
}


def bench_cmd(url: str, prompts: Path, n: int, c: int, out_len: int, result: Path) -> list[str]:
    return [sys.executable, "-m", "launch.cli", "bench", "--base-url", url, "--model", MODEL_NAME,
            "--dataset-name", "jsonl", "--dataset-path", str(prompts), "--num-prompts", str(n),
            "--jsonl-output-len", str(out_len), "--max-concurrency", str(c), "--ignore-eos",
            "--temperature", "0", "--percentile-metrics", "ttft,tpot,itl,e2el",
            "--metric-percentiles", "50,90,99", "--no-plots", "--disable-tqdm",
            "--result-dir", str(result.parent), "--result-filename", result.name]  # fmt: skip


def summarize(bench: dict[str, Any]) -> dict[str, Any]:
    keep = {k: bench[k] for k in BENCH_KEYS if k in bench}
    for m in ("ttft", "tpot", "itl", "e2el"):
        for stat in ("mean", "median", "p90", "p99"):
            key = f"{stat}_{m}_ms"
            if key in bench:
                keep[key] = bench[key]
    return keep


class Serve:
    """The server, its trace folder and the bench runs; fills ``out`` as it goes."""

    def __init__(self, args: argparse.Namespace, out: dict[str, Any], tmp: Path,
                 decode: dict[str, Any] | None) -> None:  # fmt: skip
        self.args, self.out, self.tmp = args, out, tmp
        self.shape = RUNS["tiny" if args.tiny else "8b"]
        self.steps, self.prefill_ms = step_times(decode)
        self.folder = tmp / "model"
        self.trace = tmp / "trace" / "rank0.json"

    def start(self, deadline: float) -> ServerProcess:
        a = self.args
        write_model_folder(self.folder, TINY if a.tiny else LLAMA3_8B)
        flags = ["--load-format", "dummy", "--served-model-name", MODEL_NAME,
                 "--max-model-len", str(self.shape["max_model_len"]),
                 "--max-num-seqs", str(max(c for c, _ in self.shape["runs"]))]  # fmt: skip
        if a.tiny:
            flags += ["--device", "cpu", "--kv-cache-memory-bytes", "256MiB"]
        flags += a.serve_args
        self.out["server_args"] = [str(self.folder), *flags]
        (self.tmp / "trace").mkdir()
        env_before = os.environ.get("ACTORSERVE_STEP_TRACE_DIR")
        os.environ["ACTORSERVE_STEP_TRACE_DIR"] = str(self.tmp / "trace")
        start = time.monotonic()
        try:
            proc = ServerProcess(str(self.folder), *flags)
        finally:
            if env_before is None:
                os.environ.pop("ACTORSERVE_STEP_TRACE_DIR", None)
            else:
                os.environ["ACTORSERVE_STEP_TRACE_DIR"] = env_before
        print(f"$ actorserve serve {' '.join(self.out['server_args'])}", flush=True)
        try:
            proc.wait_ready(max(10.0, deadline - time.monotonic()))
        except BaseException:
            self.out["server_log"] = _log_lines(proc)[-60:]
            proc.close()
            raise
        self.out["startup_s"] = round(time.monotonic() - start, 1)
        print(f"server ready in {self.out['startup_s']} s", flush=True)
        return proc

    def run_one(self, proc: ServerProcess, c: int, n: int, out_len: int, seed: int,
                deadline: float, label: str) -> dict[str, Any]:  # fmt: skip
        prompts = self.tmp / f"{label}.jsonl"
        write_prompts(self.folder, prompts, n, self.shape["input"], out_len, seed)
        result = self.tmp / f"{label}.json"
        marks = len(read_trace(self.trace))
        before, cpu_before = _metrics(proc), cpu_seconds(proc.popen.pid)
        client_before = resource.getrusage(resource.RUSAGE_CHILDREN)
        cmd = bench_cmd(proc.url, prompts, n, c, out_len, result)
        timeout = deadline - time.monotonic()
        print(f"[{time.strftime('%H:%M:%S')}] bench {label}: {n} prompts at concurrency {c}, "
              f"{self.shape['input']} in / {out_len} out (at most {timeout:.0f} s)", flush=True)  # fmt: skip
        try:
            run = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=timeout)
        except subprocess.TimeoutExpired:
            return {"concurrency": c, "prompts": n, "note": f"FAILED: not done in {timeout:.0f} s"}
        client = resource.getrusage(resource.RUSAGE_CHILDREN)
        cpu_after = cpu_seconds(proc.popen.pid)
        if run.returncode or not result.exists():
            return {"concurrency": c, "prompts": n,
                    "note": f"FAILED: bench exit {run.returncode}: {run.stderr[-1500:]}"}  # fmt: skip
        print(run.stdout[-3000:], flush=True)
        after = _metrics(proc)
        row: dict[str, Any] = {"concurrency": c, "prompts": n, "input_len": self.shape["input"],
                               "output_len": out_len, **summarize(json.loads(result.read_text()))}  # fmt: skip
        row["timeline"] = timeline(read_trace(self.trace)[marks:], c)
        row["metrics"] = {
            k: after[v] - before.get(v, 0.0) for k, v in METRICS.items() if v in after
        }
        m = row["metrics"]
        if m.get("worker_steps") and row.get("duration"):
            row["metrics"]["worker_busy_share"] = m["worker_forward_s"] / row["duration"]
            row["metrics"]["worker_mean_step_ms"] = m["worker_forward_s"] / m["worker_steps"] * 1e3
        if m.get("scheduler_steps"):
            row["metrics"]["scheduler_mean_step_ms"] = (
                m["scheduler_step_s"] / m["scheduler_steps"] * 1e3
            )
        # Each process's CPU share of the run (1.0: a whole core); the client's counts its
        # start-up too (a second or two of CPU: read it as an upper bound on a short run).
        if row.get("duration"):
            d = row["duration"]
            used = (
                client.ru_utime + client.ru_stime - client_before.ru_utime - client_before.ru_stime
            )
            row["cpu_share"] = {
                role: (t - cpu_before.get(role, 0.0)) / d for role, t in cpu_after.items()
            }
            row["cpu_share"]["bench_client"] = used / d
        row["allowed"] = allowed(self.steps.get(c), self.prefill_ms, c, n, self.shape["input"],
                                 out_len)  # fmt: skip
        if row["allowed"] and row.get("output_throughput"):
            best = row["allowed"].get("with_prefill_tok_s", row["allowed"]["decode_tok_s"])
            row["allowed"]["achieved_frac"] = row["output_throughput"] / best
        return row

    def run(self, deadline: float, save: Any) -> None:
        proc = self.start(deadline)
        try:
            warm_n, warm_out = self.shape["warmup"]
            warm = self.run_one(proc, min(warm_n, 8), warm_n, warm_out, 100, deadline, "warmup")
            self.out["warmup"] = {k: warm.get(k) for k in ("completed", "duration", "note")}
            save()
            for i, (c, n) in enumerate(self.shape["runs"]):
                label = f"c{c}"
                if c == 1 and self.steps.get(1, 0.0) > SLOW_STEP_MS and not self.args.tiny:
                    n = max(2, n // 2)  # eager steps (~30 ms): 8 requests would take ~70 s
                if time.monotonic() > deadline - self.args.min_run_s:
                    self.out["runs"].append({"concurrency": c, "prompts": n,
                                             "note": "skipped: out of time"})  # fmt: skip
                    continue
                row = self.run_one(proc, c, n, self.shape["output"], i + 1, deadline, label)
                self.out["runs"].append(row)
                _print_run(row)
                save()
        finally:
            log = _log_lines(proc)
            self.out["startup_log"] = [ln for ln in log if _notable(ln)][:80]
            print("---- server log (last 120 lines) ----\n" + "\n".join(log[-120:]), flush=True)
            proc.close()


def _metrics(proc: ServerProcess) -> dict[str, float]:
    try:
        return proc.metrics()
    except Exception as e:  # a missing scrape costs the deltas, not the run
        print(f"/metrics: {type(e).__name__}: {e}", flush=True)
        return {}


def _log_lines(proc: ServerProcess) -> list[str]:
    try:
        return Path(proc.log.name).read_text(errors="replace").splitlines()
    except OSError:
        return []


def _notable(line: str) -> bool:
    low = line.lower()
    return any(w in low for w in ("graph", "captur", "kv cache", "blocks", "weights", "load",
                                  "error", "warn", "ready", "memory"))  # fmt: skip


def _print_run(r: dict[str, Any]) -> None:
    if "note" in r:
        print(f"c={r['concurrency']}: {r['note']}", flush=True)
        return
    t, al = r.get("timeline", {}), r.get("allowed", {})
    line = (f"c={r['concurrency']}: {r.get('output_throughput', 0):.0f} out tok/s, TTFT median "
            f"{r.get('median_ttft_ms', 0):.1f} ms, TPOT median {r.get('median_tpot_ms', 0):.2f} ms")  # fmt: skip
    if "decode_step_ms" in t:
        line += (f"; served decode step {t['decode_step_ms']:.2f} ms + gap {t['decode_gap_ms']:.2f}"
                 f" ms (engine {t['engine_share']:.0%})")  # fmt: skip
    if "worker_busy_share" in t:
        line += f", worker busy {t['worker_busy_share']:.0%}"
    if r.get("cpu_share"):
        line += "; CPU " + ", ".join(f"{k} {v:.0%}" for k, v in r["cpu_share"].items())
    if "achieved_frac" in al:
        line += f"; {al['achieved_frac']:.0%} of what the runner's steps allow"
    print(line, flush=True)


def run(args: argparse.Namespace, out: dict[str, Any], save: Any, deadline: float,
        decode: dict[str, Any] | None = None) -> None:  # fmt: skip
    """The server part: fills ``out`` (``save()`` after each run) until ``deadline``."""
    out.setdefault("runs", [])
    out["model"] = "tiny (2 layers)" if args.tiny else "llama-3-8b shape"
    save()
    with tempfile.TemporaryDirectory(prefix="gpu-serve-") as tmp:
        Serve(args, out, Path(tmp), decode).run(deadline, save)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", type=Path, default=Path("bench/out/gpu_serve.json"))
    p.add_argument("--tiny", action="store_true", help="a 2-layer model on the CPU (dry run)")
    p.add_argument("--decode-json", type=Path, default=None,
                   help="a bench.gpu_decode result: the runner's step times")  # fmt: skip
    p.add_argument("--budget-s", type=float, default=330, help="stop starting runs after")
    p.add_argument("--min-run-s", type=float, default=None,
                   help="start a run only with this much time left (default 40; tiny 10)")  # fmt: skip
    p.add_argument("--serve-args", nargs=argparse.REMAINDER, default=[],
                   help="more flags for actorserve serve (last)")  # fmt: skip
    args = p.parse_args(argv)
    if args.min_run_s is None:
        args.min_run_s = 10.0 if args.tiny else 40.0
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    start = time.monotonic()
    out: dict[str, Any] = {"runs": [], "errors": []}
    args.out.parent.mkdir(parents=True, exist_ok=True)

    def save() -> None:
        out["seconds"] = round(time.monotonic() - start, 1)
        args.out.write_text(json.dumps(out, indent=1))

    decode = json.loads(args.decode_json.read_text()) if args.decode_json else None
    try:
        run(args, out, save, start + args.budget_s, decode)
    except Exception as e:
        traceback.print_exc()
        out["errors"].append(f"{type(e).__name__}: {e}"[:1000])
    save()
    failed = out["errors"] or any(r.get("note", "").startswith("FAILED") for r in out["runs"])
    return 1 if failed or not out["runs"] else 0


if __name__ == "__main__":
    sys.exit(main())
