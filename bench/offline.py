"""Offline throughput: our engine against HF transformers on the same prompts, in one run.

The nano-vllm benchmark shape: N requests with random prompt lengths and random
output lengths, EOS ignored so every request produces exactly its output length.
HF transformers generates the same prompts in static batches (padded left), each
batch running until its longest request is done, which is how a non-serving stack
batches. Prints both throughputs and their ratio; writes JSON.

    .venv/bin/python -m bench.offline --num-requests 64 --hf-batch-size 16
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import time
from pathlib import Path


def make_workload(args: argparse.Namespace, vocab: int) -> list[tuple[list[int], int]]:
    rng = random.Random(args.seed)
    work = []
    for _ in range(args.num_requests):
        n_in = rng.randint(args.min_input, args.max_input)
        n_out = rng.randint(args.min_output, args.max_output)
        # Ordinary ids (skip the low, special-token end of the vocabulary).
        work.append(([rng.randint(1000, vocab - 1) for _ in range(n_in)], n_out))
    return work


def run_engine(args: argparse.Namespace, work: list[tuple[list[int], int]]) -> dict:
    from launch.llm import LLM, SamplingParams

    llm = LLM(
        max_num_seqs=args.max_num_seqs,
        max_num_batched_tokens=args.max_num_batched_tokens,
        max_model_len=args.max_input + args.max_output,
    )
    # Warm-up: one short request so one-time costs are not timed.
    llm.generate([work[0][0][:16]], SamplingParams(temperature=0, max_tokens=2))
    params = [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True) for _, n in work]
    start = time.perf_counter()
    results = llm.generate([p for p, _ in work], params)
    elapsed = time.perf_counter() - start
    n_out = sum(len(r.outputs[0].token_ids) for r in results)
    return {"seconds": elapsed, "output_tokens": n_out, "output_tok_s": n_out / elapsed}


def run_hf(args: argparse.Namespace, work: list[tuple[list[int], int]]) -> dict:
    import torch
    from transformers import AutoModelForCausalLM

    from services.model_loader import prepare_model

    folder = prepare_model(None)
    model = AutoModelForCausalLM.from_pretrained(folder, torch_dtype=torch.float32).eval()
    pad = 0
    start = time.perf_counter()
    n_out = 0
    for i in range(0, len(work), args.hf_batch_size):
        batch = work[i : i + args.hf_batch_size]
        width = max(len(p) for p, _ in batch)
        ids = torch.full((len(batch), width), pad, dtype=torch.long)
        mask = torch.zeros_like(ids)
        for row, (p, _) in enumerate(batch):
            ids[row, width - len(p) :] = torch.tensor(p)
            mask[row, width - len(p) :] = 1
        max_new = max(n for _, n in batch)
        with torch.inference_mode():
            model.generate(
                input_ids=ids,
                attention_mask=mask,
                max_new_tokens=max_new,
                min_new_tokens=max_new,
                do_sample=False,
                pad_token_id=pad,
            )
        # Only the tokens each request asked for count as useful output.
        n_out += sum(n for _, n in batch)
        print(f"  hf batch {i // args.hf_batch_size + 1} done", file=sys.stderr)
    elapsed = time.perf_counter() - start
    return {"seconds": elapsed, "output_tokens": n_out, "output_tok_s": n_out / elapsed}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--num-requests", type=int, default=64)
    p.add_argument("--min-input", type=int, default=100)
    p.add_argument("--max-input", type=int, default=512)
    p.add_argument("--min-output", type=int, default=64)
    p.add_argument("--max-output", type=int, default=256)
    p.add_argument("--max-num-seqs", type=int, default=64)
    p.add_argument("--max-num-batched-tokens", type=int, default=2048)
    p.add_argument("--hf-batch-size", type=int, default=16)
    p.add_argument("--skip-hf", action="store_true")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", type=Path, default=Path("bench/out/offline.json"))
    args = p.parse_args()

    from services.model_loader import load_hf_config, prepare_model

    vocab = int(load_hf_config(prepare_model(None))["vocab_size"])
    work = make_workload(args, vocab)
    print(
        f"{len(work)} requests, {sum(len(w) for w, _ in work)} prompt tokens, "
        f"{sum(n for _, n in work)} output tokens",
        file=sys.stderr,
    )
    report = {"workload": vars(args) | {"out": str(args.out)}}
    report["actorserve"] = run_engine(args, work)
    print(
        f"actorserve: {report['actorserve']['output_tok_s']:.1f} output tok/s "
        f"({report['actorserve']['seconds']:.1f} s)"
    )
    if not args.skip_hf:
        report["hf_transformers"] = run_hf(args, work)
        ratio = report["actorserve"]["output_tok_s"] / report["hf_transformers"]["output_tok_s"]
        report["ratio"] = ratio
        print(
            f"HF transformers (static batches of {args.hf_batch_size}): "
            f"{report['hf_transformers']['output_tok_s']:.1f} output tok/s "
            f"({report['hf_transformers']['seconds']:.1f} s)"
        )
        print(f"ratio: {ratio:.2f}x")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
