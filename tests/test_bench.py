"""``actorserve bench``: metric definitions on synthetic timings, workload shapes, and one short
run against a fake OpenAI SSE server (timings it controls, so TTFT/ITL can be checked)."""

from __future__ import annotations

import asyncio
import json
import math
import threading
import time
from pathlib import Path

import numpy as np
import pytest
import torch
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse

from bench import datasets as ds
from bench.client import RequestOutput
from bench.metrics import (
    calculate_metrics,
    parse_goodput,
    parse_prometheus,
    server_deltas,
)
from services.config import ConfigError
from tests.server_utils import free_port


def _out(ttft: float, latency: float, n: int, itl: list[float] | None = None) -> RequestOutput:
    return RequestOutput(
        success=True, prompt_len=10, output_tokens=n, ttft=ttft, latency=latency, itl=itl or []
    )


# --- metrics ------------------------------------------------------------------------------


def test_tpot_formula_and_single_token_requests() -> None:
    outs = [_out(0.1, 1.1, 11), _out(0.2, 0.2, 1), _out(0.5, 2.5, 5)]
    r = calculate_metrics(outs, duration_s=2.0, percentiles=[50])
    # (1.1-0.1)/10 = 100 ms and (2.5-0.5)/4 = 500 ms; the 1-token request has no TPOT.
    assert r["mean_tpot_ms"] == pytest.approx(300.0)
    assert r["median_ttft_ms"] == pytest.approx(200.0)
    assert r["total_output_tokens"] == 17 and r["total_input_tokens"] == 30
    assert r["output_throughput"] == pytest.approx(8.5)
    assert r["total_token_throughput"] == pytest.approx(23.5)
    assert r["request_throughput"] == pytest.approx(1.5)


def test_percentiles_match_numpy_linear_interpolation() -> None:
    rng = np.random.default_rng(1)
    ttfts = rng.uniform(0.01, 2.0, size=37)
    outs = [_out(t, t + 1.0, 3, itl=[0.01 * (i + 1)]) for i, t in enumerate(ttfts)]
    r = calculate_metrics(outs, 10.0, percentiles=[90, 99, 99.9])
    ms = np.sort(ttfts) * 1000
    # Independent: the order statistic with linear interpolation, written out.
    for p, key in ((90, "p90_ttft_ms"), (99, "p99_ttft_ms"), (99.9, "p99.9_ttft_ms")):
        pos = p / 100 * (len(ms) - 1)
        lo = int(math.floor(pos))
        want = ms[lo] + (ms[min(lo + 1, len(ms) - 1)] - ms[lo]) * (pos - lo)
        assert r[key] == pytest.approx(want)
    assert r["median_itl_ms"] == pytest.approx(190.0)  # ITLs 10..370 ms pooled
    assert r["mean_e2el_ms"] == pytest.approx((ttfts.mean() + 1.0) * 1000)


def test_peak_concurrency_and_tokens_per_second() -> None:
    a, b, c = _out(0.5, 1.0, 2, itl=[0.5]), _out(0.5, 1.0, 4, itl=[0.5]), _out(0.2, 1.5, 3)
    a.start_time, b.start_time, c.start_time = 0.0, 1.0, 0.5  # a ends exactly when b starts
    r = calculate_metrics([a, b, c], 3.0)
    assert r["max_concurrent_requests"] == 2
    # Tokens at 0.5, 1.0 (a: 1 each), 1.5, 2.0 (b: 2 each), 0.7 (c: 3 in one chunk):
    # second [0, 1) holds 1 + 3, [1, 2) holds 1 + 2.
    assert r["max_output_tokens_per_s"] == pytest.approx(4.0)
    assert calculate_metrics([a], 1.0)["max_concurrent_requests"] == 1


def test_failed_requests_are_counted_not_measured() -> None:
    outs = [_out(0.1, 1.0, 10), RequestOutput(success=False, error="HTTP 500: boom")]
    r = calculate_metrics(outs, 1.0)
    assert (r["completed"], r["failed"]) == (1, 1)
    assert r["mean_ttft_ms"] == pytest.approx(100.0)


def test_goodput_counts_requests_meeting_every_slo() -> None:
    outs = [
        _out(0.1, 1.0, 10),  # ttft 100, tpot 100, e2el 1000: good
        _out(0.6, 1.5, 10),  # ttft 600: bad
        _out(0.1, 2.0, 10),  # tpot 211: bad
        _out(0.1, 0.1, 1),  # one token: tpot counts as 0: good
    ]
    slo = parse_goodput(["ttft:500", "tpot:150"])
    assert calculate_metrics(outs, 2.0, goodput=slo)["request_goodput"] == pytest.approx(1.0)
    assert calculate_metrics(outs, 2.0, goodput={"e2el": 1200})["request_goodput"] == 1.0
    assert "request_goodput" not in calculate_metrics(outs, 2.0)
    with pytest.raises(ConfigError):
        parse_goodput(["itl:5"])
    with pytest.raises(ConfigError):
        parse_goodput(["ttft:fast"])


def test_prometheus_deltas() -> None:
    def text(hits: int, queries: int, computed: float, preempt: int) -> str:
        return (
            "# TYPE vllm:prefix_cache_hits counter\n"
            f'vllm:prefix_cache_hits_total{{engine="0",model_name="m"}} {hits}\n'
            "# TYPE vllm:prefix_cache_queries counter\n"
            f'vllm:prefix_cache_queries_total{{engine="0",model_name="m"}} {queries}\n'
            "# TYPE vllm:request_prefill_kv_computed_tokens histogram\n"
            f'vllm:request_prefill_kv_computed_tokens_bucket{{le="+Inf",model_name="m"}} 3\n'
            f'vllm:request_prefill_kv_computed_tokens_count{{model_name="m"}} 3\n'
            f'vllm:request_prefill_kv_computed_tokens_sum{{model_name="m"}} {computed}\n'
            "# TYPE vllm:num_preemptions counter\n"
            f'vllm:num_preemptions_total{{engine="0",model_name="m"}} {preempt}\n'
        )

    d = server_deltas(
        parse_prometheus(text(10, 100, 50, 1)), parse_prometheus(text(70, 180, 70, 4))
    )
    assert d["prefix_cache_hit_rate"] == pytest.approx(60 / 80)
    assert d["prefill_kv_computed_tokens"] == 20 and d["num_preemptions"] == 3
    assert server_deltas({}, {})["prefix_cache_hit_rate"] is None


# --- datasets -----------------------------------------------------------------------------


class _FakeTokenizer:
    """A GPT-2 style vocabulary: 'Ġword' tokens plus specials; decode joins with spaces."""

    all_special_ids = {0, 1}

    def __init__(self) -> None:
        words = [f"Ġw{chr(97 + i % 26)}{chr(97 + i // 26 % 26)}" for i in range(300)]
        self.vocab = {"<s>": 0, "</s>": 1, "Ġ12": 2, **{w: i + 3 for i, w in enumerate(words)}}
        self.inv = {i: s for s, i in self.vocab.items()}
        self.tokenizer = self

    def get_vocab(self) -> dict[str, int]:
        return self.vocab

    def decode(self, ids: list[int]) -> str:
        return "".join(self.inv[i].replace("Ġ", " ") for i in ids)


@pytest.fixture(scope="module")
def words() -> ds.WordTokens:
    return ds.WordTokens(_FakeTokenizer())


def test_word_tokens_exclude_specials_and_non_words(words: ds.WordTokens) -> None:
    assert len(words.ids) == 300 and not {0, 1, 2} & set(words.ids.tolist())


def test_random_dataset_lengths_and_shared_prefix(words: ds.WordTokens) -> None:
    reqs = ds.random_dataset(
        words, 200, input_len=100, output_len=20, range_ratio=0.5, prefix_len=16, seed=3
    )
    in_lens = [len(r.prompt) for r in reqs]
    assert all(r.prompt_len == len(r.prompt) for r in reqs)
    assert min(in_lens) >= 16 + 50 and max(in_lens) <= 16 + 150
    assert max(in_lens) - min(in_lens) > 50  # the range is really used
    assert all(10 <= r.expected_output_len <= 30 for r in reqs)
    assert len({tuple(r.prompt[:16]) for r in reqs}) == 1
    assert len({tuple(r.prompt[16:32]) for r in reqs}) == 200  # the rest is not shared
    exact = ds.random_dataset(words, 5, 64, 8, seed=0)
    assert {len(r.prompt) for r in exact} == {64} and {r.expected_output_len for r in exact} == {8}
    with pytest.raises(ConfigError):
        ds.random_dataset(words, 5, 64, 8, range_ratio=1.0)


def test_prefix_repetition_dataset(words: ds.WordTokens) -> None:
    reqs = ds.prefix_repetition_dataset(
        words, 40, num_prefixes=4, prefix_len=32, suffix_len=8, output_len=5, seed=0
    )
    assert all(len(r.prompt) == 40 == r.prompt_len for r in reqs)
    groups: dict[tuple[int, ...], int] = {}
    for r in reqs:
        groups[tuple(r.prompt[:32])] = groups.get(tuple(r.prompt[:32]), 0) + 1
    assert sorted(groups.values()) == [10, 10, 10, 10]
    assert [tuple(r.prompt[:32]) for r in reqs[:4]] != [tuple(reqs[0].prompt[:32])] * 4  # shuffled


def test_chat_turns_reuse_their_history(words: ds.WordTokens) -> None:
    reqs = ds.chat_dataset(
        words, 10, num_turns=3, system_len=20, user_len=6, assistant_len=4, output_len=7, seed=0
    )
    assert len(reqs) == 10
    system = reqs[0].prompt[0]
    for i, r in enumerate(reqs):
        msgs = r.prompt
        assert msgs[0] == system and msgs[-1]["role"] == "user"  # shared system prompt
        assert [m["role"] for m in msgs[1:]] == ["user", "assistant"] * (len(msgs) // 2 - 1) + [
            "user"
        ]
        if r.parent is None:
            assert len(msgs) == 2
        else:
            parent = reqs[r.parent]
            assert r.parent < i
            assert msgs[: len(parent.prompt)] == parent.prompt  # previous turn is the prefix
            assert len(msgs) == len(parent.prompt) + 2 and msgs[-2]["role"] == "assistant"
    assert sum(r.parent is None for r in reqs) == 4  # ceil(10 / 3) conversations


def test_jsonl_dataset(tmp_path: Path) -> None:
    f = tmp_path / "p.jsonl"
    f.write_text(
        '{"prompt": "hi there", "output_len": 3}\n\n{"prompt": [5, 6, 7]}\n'
        '{"messages": [{"role": "user", "content": "yo"}]}\n'
    )
    reqs = ds.jsonl_dataset(f, 5, output_len=9)
    assert [r.expected_output_len for r in reqs] == [3, 9, 9, 3, 9]
    assert reqs[1].prompt_len == 3 and reqs[0].prompt_len is None
    f.write_text('{"text": "x"}\n')
    with pytest.raises(ConfigError, match="p.jsonl:1"):
        ds.jsonl_dataset(f, 1, None)


@pytest.mark.parametrize("burstiness", [0.5, 1.0, 4.0])
def test_gamma_arrivals(burstiness: float) -> None:
    t = ds.arrival_times(4000, request_rate=20.0, burstiness=burstiness, seed=1)
    gaps = np.diff(np.concatenate([[0.0], t]))
    assert (gaps >= 0).all() and t[-1] == pytest.approx(4000 / 20)  # mean gap 1/rate
    # Gamma(k, θ): coefficient of variation 1/sqrt(k): burstiness really shapes the gaps.
    assert gaps.std() / gaps.mean() == pytest.approx(1 / math.sqrt(burstiness), rel=0.1)
    # Exponential gaps (k=1) are memoryless: P(gap > mean) = 1/e.
    if burstiness == 1.0:
        assert (gaps > gaps.mean()).mean() == pytest.approx(math.exp(-1), abs=0.03)


def test_arrivals_edge_cases() -> None:
    assert (ds.arrival_times(5, math.inf, 1.0) == 0).all()
    assert np.allclose(ds.arrival_times(4, 2.0, math.inf), [0.5, 1.0, 1.5, 2.0])
    with pytest.raises(ConfigError):
        ds.arrival_times(4, 2.0, 0.0)


# --- end to end against a fake server -----------------------------------------------------

FIRST_DELAY, GAP = 0.05, 0.01


def _fake_app(counters: dict[str, int]):  # noqa: ANN202
    app = FastAPI()

    @app.get("/v1/models")
    async def models() -> dict:
        return {"data": [{"id": "fake"}]}

    @app.get("/metrics")
    async def metrics() -> PlainTextResponse:
        return PlainTextResponse(
            "# TYPE vllm:prefix_cache_queries counter\n"
            f"vllm:prefix_cache_queries_total {counters['queries']}\n"
            "# TYPE vllm:prefix_cache_hits counter\n"
            f"vllm:prefix_cache_hits_total {counters['queries'] // 2}\n"
            "# TYPE vllm:num_requests_running gauge\n"
            f"vllm:num_requests_running {counters['running']}\n"
        )

    async def stream(body: dict, chat: bool):  # noqa: ANN202
        counters["running"] += 1
        n = body["max_tokens"]
        prompt = body.get("prompt")
        n_in = len(prompt) + 1 if isinstance(prompt, list) else 7

        def chunk(text: str | None, finish: str | None = None) -> str:
            choice = (
                {"delta": {"content": text} if text is not None else {"role": "assistant"}}
                if chat
                else {"text": text or ""}
            )
            return (
                "data: "
                + json.dumps({"choices": [{"index": 0, **choice, "finish_reason": finish}]})
                + "\n\n"
            )

        yield chunk(None if chat else "")  # empty first chunk: must not count as the first token
        await asyncio.sleep(FIRST_DELAY)
        for i in range(n):
            if i:
                await asyncio.sleep(GAP)
            yield chunk(f" t{i}")
        yield chunk("" if not chat else None, "length")
        counters["queries"] += 10
        counters["running"] -= 1
        yield (
            "data: "
            + json.dumps({"choices": [], "usage": {"prompt_tokens": n_in, "completion_tokens": n}})
            + "\n\n"
        )
        yield "data: [DONE]\n\n"

    @app.post("/v1/completions")
    async def completions(req: Request) -> Response:
        body = await req.json()
        if body.get("max_tokens") == 13:
            return JSONResponse({"error": {"message": "unlucky"}}, status_code=400)
        assert body["stream"] and body["stream_options"]["include_usage"]
        return StreamingResponse(stream(body, chat=False), media_type="text/event-stream")

    @app.post("/v1/chat/completions")
    async def chat(req: Request) -> StreamingResponse:
        return StreamingResponse(
            stream(await req.json(), chat=True), media_type="text/event-stream"
        )

    return app


@pytest.fixture(scope="module")
def fake_server():  # noqa: ANN201
    import uvicorn

    counters = {"queries": 0, "running": 0}
    port = free_port()
    server = uvicorn.Server(uvicorn.Config(_fake_app(counters), port=port, log_level="error"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 20
    while not server.started and time.monotonic() < deadline:
        time.sleep(0.02)
    yield f"http://127.0.0.1:{port}"
    server.should_exit = True
    thread.join(5)


def _bench_args(tmp_path: Path, url: str, *extra: str):  # noqa: ANN202
    import argparse

    from bench.serve import add_cli_args

    p = argparse.ArgumentParser()
    add_cli_args(p)
    return p.parse_args(
        ["--base-url", url, "--result-dir", str(tmp_path), "--disable-tqdm", *extra]
    )


def test_end_to_end_against_fake_server(tmp_path: Path, fake_server: str, capsys) -> None:  # noqa: ANN001
    from bench.serve import main

    f = tmp_path / "p.jsonl"
    f.write_text('{"prompt": [1, 2, 3]}\n{"prompt": "hello"}\n')
    args = _bench_args(
        tmp_path,
        fake_server,
        "--dataset-name",
        "jsonl",
        "--dataset-path",
        str(f),
        "--jsonl-output-len",
        "6",
        "--num-prompts",
        "8",
        "--max-concurrency",
        "4",
        "--num-warmups",
        "1",
        "--scrape-metrics",
        "--goodput",
        "ttft:10000",
        "--result-filename",
        "run.json",
    )
    assert main(args) == 0
    assert "Serving Benchmark Result" in capsys.readouterr().out
    r = json.loads((tmp_path / "run.json").read_text())
    assert r["completed"] == 8 and r["failed"] == 0 and r["model_id"] == "fake"
    assert r["total_output_tokens"] == 48 and r["request_goodput"] > 0
    assert r["input_lens"] == [4, 7] * 4  # the server's usage count, not the client's
    # TTFT skips the empty first chunk: it includes the fake server's FIRST_DELAY.
    assert min(r["ttfts"]) >= FIRST_DELAY
    assert all(len(itl) == 5 for itl in r["itls"]) and r["median_itl_ms"] >= GAP * 1000 * 0.9
    assert r["server_metrics"]["prefix_cache_queries"] == 80  # warm-up excluded
    assert r["server_metrics"]["prefix_cache_hit_rate"] == pytest.approx(0.5)
    assert r["server_timeline"]
    for name in ("ttft_cdf", "tpot_cdf", "throughput", "running_waiting"):
        png = tmp_path / f"run_{name}.png"
        assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_chat_endpoint_waits_for_previous_turn(tmp_path: Path, fake_server: str) -> None:
    from bench.client import CHAT
    from bench.serve import benchmark

    reqs = ds.chat_dataset(
        ds.WordTokens(_FakeTokenizer()),
        6,
        num_turns=3,
        system_len=4,
        user_len=3,
        assistant_len=2,
        output_len=4,
    )
    args = _bench_args(tmp_path, fake_server, "--dataset-name", "chat", "--no-plots")
    r = asyncio.run(benchmark(args, reqs, fake_server))
    assert r["endpoint"] == CHAT and r["completed"] == 6
    assert min(r["ttfts"]) >= FIRST_DELAY  # the role-only first delta is not the first token
    for i, req in enumerate(reqs):
        if req.parent is not None:  # sent only after the previous turn's last chunk
            assert r["start_times"][i] >= r["start_times"][req.parent] + r["e2els"][req.parent]


def test_sim_speed_reports_simulated_seconds(tmp_path: Path, fake_server: str) -> None:
    """Against a server at --sim-speed S, every time is real / S and arrivals are S times
    denser in real time: here S = 0.25, so the fake server's real 50 ms is 200 ms."""
    from bench.serve import benchmark
    from services import clock

    reqs = [ds.SampleRequest("hi there", 2, 4) for _ in range(4)]
    args = _bench_args(tmp_path, fake_server, "--no-plots", "--sim-speed", "0.25",
                       "--request-rate", "2", "--seed", "3")  # fmt: skip
    try:
        real = clock.time.perf_counter()
        r = asyncio.run(benchmark(args, reqs, fake_server))
        real = clock.time.perf_counter() - real
    finally:
        clock.set_sim_speed(1.0)
    assert r["completed"] == 4 and r["sim_speed"] == 0.25
    assert min(r["ttfts"]) >= 4 * FIRST_DELAY
    assert r["duration"] > 2.5 * real  # measured in simulated seconds
    arrivals = ds.arrival_times(4, 2.0, 1.0, 3)
    assert max(r["start_times"]) >= arrivals[-1] - 1e-6  # sent on the simulated schedule


def test_compare_ratio_table() -> None:
    from bench.compare import parse_servers, ratio_table

    a = {"output_throughput": 50.0, "median_ttft_ms": 200.0, "server_metrics": None}
    b = {"output_throughput": 100.0, "median_ttft_ms": 100.0}
    lines = ratio_table({"ours": a, "vllm": b}).splitlines()
    row = {ln.split("  ")[0]: ln.split() for ln in lines[2:]}
    assert row["Output token throughput (tok/s) ↑"][-1] == "x2.00"
    assert row["Median TTFT (ms) ↓"][-1] == "x0.50"
    assert not any("hit rate" in ln for ln in lines)  # absent everywhere: no row
    assert parse_servers(["a=http://h:1/v1/", "b=https://x"]) == {
        "a": "http://h:1",
        "b": "https://x",
    }
    for bad in (["nourl"], ["a=ftp://x"], ["a=http://x", "a=http://y"], []):
        with pytest.raises(ConfigError):
            parse_servers(bad)


def test_compare_runs_each_server(tmp_path: Path, fake_server: str, capsys) -> None:  # noqa: ANN001
    from bench.compare import build_parser, main

    f = tmp_path / "p.jsonl"
    f.write_text('{"prompt": "hello", "output_len": 3}\n')
    args = build_parser().parse_args([
        "--server", f"one={fake_server}", "--server", f"two={fake_server}/v1",
        "--dataset-name", "jsonl", "--dataset-path", str(f), "--num-prompts", "3",
        "--result-dir", str(tmp_path), "--disable-tqdm",
    ])  # fmt: skip
    assert main(args) == 0
    out = capsys.readouterr().out
    assert out.count("Serving Benchmark Result") == 2 and "two/one" in out
    summary = json.loads(next(tmp_path.glob("compare-*.json")).read_text())["summary"]
    assert summary["one"]["output_throughput"] > 0 and summary["two"]["output_throughput"] > 0
    assert len(list(tmp_path.glob("bench-jsonl-*-one.json"))) == 1
    assert next(tmp_path.glob("compare-*_cdf.png")).read_bytes()[:4] == b"\x89PNG"


def test_payloads_and_endpoint_checks(fake_server: str) -> None:
    from bench.client import RequestSettings, build_payload, make_client, send_request
    from bench.serve import CHAT, COMPLETIONS, check_prompts

    s = RequestSettings(fake_server, COMPLETIONS, "m", ignore_eos=True)
    body = build_payload(ds.SampleRequest([5, 6], 2, 4), s)
    assert body["prompt"] == [5, 6] and body["max_tokens"] == 4 and body["ignore_eos"] is True
    assert body["stream_options"] == {"include_usage": True} and body["temperature"] == 0.0
    chat = build_payload(ds.SampleRequest("hi", None, None), RequestSettings("", CHAT, "m"))
    assert chat["messages"] == [{"role": "user", "content": "hi"}] and "max_tokens" not in chat
    with pytest.raises(ConfigError, match="token ids"):
        check_prompts([ds.SampleRequest([1], 1, 1)], CHAT)
    with pytest.raises(ConfigError, match="chat messages"):
        check_prompts([ds.SampleRequest([{"role": "user", "content": "x"}], None, 1)], COMPLETIONS)

    async def failing() -> RequestOutput:
        async with make_client(1, 10.0) as client:
            return await send_request(client, ds.SampleRequest("x", 1, 13), s, 0.0)

    out = asyncio.run(failing())
    assert not out.success and out.error.startswith("HTTP 400") and "unlucky" in out.error


# --- the GPU check's dry run (bench/gpu_check.py --dry-run: its parts on the CPU) ---------


def test_gpu_decode_tiny_dry_run(tmp_path: Path) -> None:
    """bench/gpu_decode.py, tiny, in both modes (on a CPU with the torch backend
    capture_cuda_graphs does nothing): the synthetic plans drive ModelRunner.execute through
    decode (new blocks as requests cross block boundaries), the sampled row and a prefill;
    every row timed, floors set; the K/V cache random, the same in both; both modes sample
    the same tokens at every step (same weights, prompts and K/V)."""
    from bench import gpu_check, gpu_decode

    results = {}
    for mode in ("eager", "graphs"):
        out = tmp_path / f"{mode}.json"
        argv = ["--mode", mode, "--tiny", "--device", "cpu", "--out", str(out), "--steps", "4",
                "--warmup", "1", "--context", "40", "--bandwidth-gbps", "10"]  # fmt: skip
        assert gpu_decode.main(argv) == 0
        r = results[mode] = json.loads(out.read_text())
        assert not r["errors"] and r["capture"]["called"] and r["enforce_eager_field"]
        decode = [row for row in r["rows"] if row["case"].startswith("decode")]
        assert [row["batch"] for row in decode] == [1, 4, 8, 4]  # the last one sampled
        assert decode[-1]["sampling"] == gpu_decode.SAMPLED
        for row in decode:
            assert row["step_ms"] > 0 and row["steps"] == 4 and row["floor_ms"] > 0
            # 40 tokens, 1 + 1 warm-up steps, then 4 timed: contexts 42..45 (a block
            # boundary at 48 is not crossed; 16-token blocks: the third block since 33)
            assert row["mean_context"] == pytest.approx(43.5)
        assert {k: len(v) for k, v in r["first_tokens"].items()} == {"1": 1, "4": 4, "8": 8}
        # step 0, 1 warm-up, 4 timed, 2 check steps: 8 steps of each greedy batch
        assert {k: [len(s) for s in v] for k, v in r["step_tokens"].items()} == {
            "1": [1] * 8, "4": [4] * 8, "8": [8] * 8,
        }  # fmt: skip
        assert r["kv_fill"]["how"].startswith("normal(0, 1)") and r["kv_fill"]["num_blocks"] > 0
        prefill = r["rows"][-1]
        assert prefill["case"] == "prefill 32 tokens" and prefill["step_ms"] > 0
    # graphs mode on a CPU with the torch backend: no graphs, so nothing replayed to compare
    gve = results["graphs"]["graph_vs_eager"]
    assert (
        gve["checks"] == [] and gve["verdict"] is None and "graph_vs_eager" not in results["eager"]
    )
    agree = gpu_check.agreement(results["eager"], results["graphs"])
    assert agree == {
        "decode_tokens_equal": "104/104", "first_step_tokens_equal": "13/13",
        "requests_all_steps_equal": "13/13", "first_divergence": None, "comparable": True,
        "prefill_token_equal": True,
        "graph_vs_eager": {"steps_checked": 0, "replayed": "0/0", "verdict": None},
    }  # fmt: skip


def test_gpu_decode_kv_fill_only_in_the_models_float_dtype() -> None:
    """Random K/V where the cache holds the model's dtype; a quantized cache is zeroed."""
    from types import SimpleNamespace

    from bench.gpu_decode import fill_kv_cache

    caches = [(torch.full((3, 16, 2, 8), 7.0), torch.full((3, 16, 2, 8), 7.0)) for _ in range(2)]
    fill = fill_kv_cache(SimpleNamespace(kv_caches=caches, dtype=torch.float32))
    assert fill == {"num_blocks": 3, "cache_dtype": "float32", "how": "normal(0, 1), seed 1234"}
    k0, v0 = caches[0]
    assert abs(float(k0.std()) - 1) < 0.1 and not torch.equal(k0, v0)
    assert not torch.equal(k0, caches[1][0])
    again = [(torch.empty(3, 16, 2, 8), torch.empty(3, 16, 2, 8)) for _ in range(2)]
    fill_kv_cache(SimpleNamespace(kv_caches=again, dtype=torch.float32))
    assert all(
        torch.equal(a, b)
        for x, y in zip(caches, again, strict=True)
        for a, b in zip(x, y, strict=True)
    )
    quantized = [(torch.full((3, 16, 2, 9), 5, dtype=torch.uint8),) * 2]
    fill = fill_kv_cache(
        SimpleNamespace(kv_caches=quantized, dtype=torch.bfloat16, kv_cache_dtype="fp8_e4m3")
    )
    assert fill["how"].startswith("zeros: the cache stores fp8_e4m3 (uint8)")
    assert not quantized[0][0].any()
    bf16_cache = [(torch.ones(2, 16, 2, 8, dtype=torch.bfloat16),) * 2]
    assert fill_kv_cache(SimpleNamespace(kv_caches=bf16_cache, dtype=torch.float32))[
        "how"
    ].startswith("zeros")


def _tiny_graph_bench(tmp_path: Path):
    """A tiny runner whose decode steps pad to graph sizes and run eagerly (the Triton
    backend in the interpreter, ``capture_cuda_graphs(record=False)``), in a Bench that
    checks its last step of each batch against the eager forward."""
    from bench import gpu_decode

    runner, _, _ = gpu_decode.build_runner(
        gpu_decode.TINY, "cpu", eager=False, max_batch=4, max_model_len=64, token_budget=64,
        attention_backend="triton",
    )  # fmt: skip
    runner.initialize_kv_cache(8)
    gpu_decode.fill_kv_cache(runner)
    capture = gpu_decode.capture_graphs(runner, "cpu", "graphs")
    assert capture["runner_graphs"] and not capture["recorded"]
    out = {"rows": [], "first_tokens": {}, "step_tokens": {}, "errors": []}
    return runner, gpu_decode.Bench(runner, "cpu", 1e10, out, check_steps=1), out


def test_gpu_decode_graph_vs_eager_on_the_cpu(tmp_path: Path) -> None:
    """graph_vs_eager's code on a CPU: the padded steps "replay" (eagerly) and equal the
    eager forward over the same inputs bit for bit; the greedy tokens too. A replay that
    read another context (a stale sequence length, as a graph that baked one in would)
    shows up as DIFFERENT over the random K/V, even one token of 20 left out (the last
    step's lengths)."""
    from bench import gpu_decode
    from bench.gpu_decode import summarize_checks

    runner, bench, out = _tiny_graph_bench(tmp_path)
    row = bench.decode(3, 20, warmup=1, steps=1, per_seq=2)
    assert row["steps"] == 1 and [len(s) for s in out["step_tokens"]["3"]] == [3] * 4
    (check,) = bench.checks
    assert check["graph_size"] == 4 and check["max_abs_diff"] == 0 and check["tokens"] == 3
    assert check["tokens_equal"] == 3 and check["finite"]
    assert summarize_checks(bench.checks)["verdict"] == "identical"

    # A "graph" that attends over one token fewer for the first request.
    graphs, seq_lens = runner.graphs, runner.buffers.seq_lens
    replay = graphs.replay

    def stale(size: int) -> torch.Tensor:
        seq_lens.np[0] -= 1
        try:
            return replay(size)
        finally:
            seq_lens.np[0] += 1

    graphs.replay = stale
    bench.decode(2, 20, warmup=0, steps=1, per_seq=2)
    assert graphs.replay == replay  # compare_step put the instance's method back
    bad = bench.checks[-1]
    assert bad["graph_size"] == 2 and bad["max_row_rel_err"] > gpu_decode.ROW_REL_ERROR
    summary = summarize_checks(bench.checks)
    assert summary["verdict"] == "DIFFERENT" and summary["replayed"] == "2/2"
    assert summarize_checks([{"note": "not replayed"}]) == {
        "steps_checked": 1, "replayed": "0/1", "verdict": None,
    }  # fmt: skip


def test_gpu_check_agreement_over_every_step() -> None:
    """Two processes' greedy tokens step by step: where a request first differs."""
    from bench.gpu_check import agreement

    eager = {"step_tokens": {"2": [[1, 2], [3, 4], [5, 6]], "1": [[9], [9]]},
             "kv_fill": {"how": "x"}, "prefill_first_token": 7}  # fmt: skip
    graphs = {"step_tokens": {"2": [[1, 2], [3, 4], [5, 0]], "1": [[9], [9]]},
              "kv_fill": {"how": "x"}, "prefill_first_token": 7,
              "graph_vs_eager": {"method": "m", "checks": [{}], "verdict": "identical"}}  # fmt: skip
    assert agreement(eager, graphs) == {
        "decode_tokens_equal": "7/8", "first_step_tokens_equal": "3/3",
        "requests_all_steps_equal": "2/3", "first_divergence": {"2": 2}, "comparable": True,
        "prefill_token_equal": True, "graph_vs_eager": {"verdict": "identical"},
    }  # fmt: skip


def test_gpu_check_kernel_tests_report_failures_and_time_out(tmp_path: Path) -> None:
    """Part 1: the kernel test files, in order (the longest last); a failing test is reported (the check
    goes on); past the limit pytest is interrupted and says what ran."""
    import sys

    from bench import gpu_check

    cmd = gpu_check.tests_command(workers=1)
    assert [c for c in cmd if c.startswith("tests/")] == list(gpu_check.TEST_FILES)
    assert "-n" not in cmd and gpu_check.TEST_FILES[-1] == "tests/test_kernels.py"
    test = tmp_path / "test_x.py"
    test.write_text("import time\n\ndef test_ok():\n    pass\n\n"
                    "def test_bad():\n    assert 1 == 2\n\n"
                    "def test_slow():\n    time.sleep(float(__import__('os').environ.get('SLOW', 0)))\n")  # fmt: skip
    base = [sys.executable, "-m", "pytest", "-q", "-rfE", "-p", "no:cacheprovider",
            "--rootdir", str(tmp_path), "-c", "/dev/null", str(test)]  # fmt: skip
    r = gpu_check.run_tests(60, base)
    assert not r["passed"] and r["returncode"] == 1 and not r["timed_out"]
    assert len(r["failed"]) == 1 and r["failed"][0].startswith("FAILED ")
    assert "test_x.py::test_bad" in r["failed"][0]
    assert r["summary"].startswith("1 failed, 2 passed")
    import os

    # The limit: past the time the quick run took, three times over (a loaded machine starts
    # pytest slowly, and a limit that ends it before test_bad ran leaves no summary).
    limit = max(4.0, 3 * r["seconds"])
    os.environ["SLOW"] = "120"
    try:
        r = gpu_check.run_tests(limit, base)
    finally:
        del os.environ["SLOW"]
    assert r["timed_out"] and not r["passed"] and r["seconds"] < limit + 20
    assert r["summary"] is not None and "1 failed" in r["summary"]


def test_gpu_check_device_run_stops_at_once_without_wheels(tmp_path: Path) -> None:
    """`run` with no wheels in WHEEL_DIR and a module it cannot import: exit status 3 in
    the first seconds, saying to carry .whl/."""
    import os
    import subprocess

    repo = Path(__file__).parent.parent
    if not (repo / ".venv" / "bin" / "python").exists():
        pytest.skip("run picks .venv's python (make install)")
    env = {**os.environ, "WHEEL_DIR": str(tmp_path / "none"), "OUT": str(tmp_path),
           "GPU_CHECK_WHEEL_MODULES": "json no_such_module_here"}  # fmt: skip
    run = subprocess.run(["bash", "bench/gpu_check_device.sh", "run"], cwd=repo, env=env,
                         capture_output=True, text=True, timeout=120)  # fmt: skip
    assert run.returncode == 3, run.stdout + run.stderr
    assert "no_such_module_here" in run.stderr and "carry [" in run.stderr
    assert not (tmp_path / "gpu_check.json").exists()


def test_gpu_decode_plans_add_blocks_at_boundaries() -> None:
    from bench.gpu_decode import Plans
    from services.protocol import SamplingParams

    plans = Plans("t", 2, 31, 1024, 4, SamplingParams(), np.random.default_rng(0))
    assert [len(n.block_ids) for n in plans.new] == [2, 2] and plans.new[1].block_ids == [4, 5]
    assert plans.new[0].num_computed_tokens == 30 and len(plans.new[0].token_ids) == 31
    first = plans.next(1)  # computes position 31: still in block 1
    assert [d.new_block_ids for d in first.running] == [[], []]
    second = plans.next(2)  # position 32: the third block
    assert [d.new_block_ids for d in second.running] == [[2], [6]]
    assert [d.num_computed_tokens for d in second.running] == [32, 32]
    assert second.num_scheduled_tokens == [1, 1]


def test_gpu_serve_model_folder_and_prompts(tmp_path: Path) -> None:
    """The synthetic tokenizer decodes every id of the vocabulary (what random weights
    sample), Llama-3's specials on top; the prompts are random_dataset's, as ids."""
    from bench.gpu_decode import TINY
    from bench.gpu_serve import write_model_folder, write_prompts
    from services.model_loader import load_tokenizer, prepare_model

    folder = tmp_path / "model"
    write_model_folder(folder, TINY)
    assert prepare_model(str(folder), "dummy") == folder
    tok = load_tokenizer(folder)
    assert tok.tokenizer.get_vocab_size() == 1024
    assert (tok.bos_token_id, tok.eos_token_id) == (768, 769) and 777 in tok.all_special_ids
    words = list(range(768))
    assert tok.encode(tok.decode(words), add_special_tokens=False) == words
    assert tok.decode([1023], skip_special_tokens=False) == "<|reserved_special_token_255|>"
    write_prompts(folder, tmp_path / "p.jsonl", 3, 20, 5, seed=1)
    lines = [json.loads(line) for line in (tmp_path / "p.jsonl").read_text().splitlines()]
    assert [len(x["prompt"]) for x in lines] == [20] * 3 and lines[0]["output_len"] == 5
    assert all(0 <= t < 768 for x in lines for t in x["prompt"])


def test_gpu_serve_timeline_and_what_steps_allow() -> None:
    from bench.gpu_check import goals
    from bench.gpu_serve import allowed, timeline

    # Three decode steps of 4 tokens (10 ms, then 2 ms gaps), one with a prompt chunk (30 ms).
    events, t = [], 0.0
    for tokens, dur in ((4, 10), (4, 10), (1028, 30), (4, 10)):
        events.append({"ts": t * 1e3, "dur": dur * 1e3, "args": {"tokens": tokens}})
        t += dur + 2
    tl = timeline(events, 4)
    assert tl["steps"] == 4 and tl["span_s"] == pytest.approx(0.066)
    assert tl["worker_idle_share"] == pytest.approx(6 / 66)
    assert tl["decode_steps"] == 2 and tl["decode_step_ms"] == 10 and tl["decode_gap_ms"] == 2
    assert tl["engine_share"] == pytest.approx(2 / 12) and tl["mixed_step_ms"] == 30
    assert tl["full_batch_steps"] == 3 and timeline(events[:1], 4) == {"steps": 1}
    # 8 requests at concurrency 4, 1,024 in / 256 out: 2 x 256 steps of 10 ms + 8 prefills
    a = allowed(10.0, 50.0, 4, 8, 1024, 256)
    assert a["decode_tok_s"] == pytest.approx(400)
    assert a["with_prefill_tok_s"] == pytest.approx(8 * 256 / (2 * 256 * 10 + 8 * 50) * 1e3)
    assert allowed(None, 50.0, 4, 8, 1024, 256) == {}
    results = {
        "decode": {"graphs": {"rows": [{"batch": 1, "step_ms": 4.0, "floor_ms": 3.5,
                                        "sampling": "greedy"}]}},
        "serve": {"runs": [{"concurrency": 1, "output_throughput": 200.0,
                            "median_tpot_ms": 5.0, "median_ttft_ms": 70.0}]},
    }  # fmt: skip
    g = goals(results)
    assert g["decode B=1 <= 1.3x floor"] == {"value": pytest.approx(4 / 3.5), "met": True}
    assert g["decode B=64 <= 1.3x floor"]["met"] is None
    assert g["TPOT c=1 <= 5.5 ms"]["met"] and not g["TTFT c=1 <= 60 ms"]["met"]


def test_gpu_wheels_are_the_installed_versions() -> None:
    """The wheels the GPU machine gets (bench/gpu_check_device.sh) are what this venv runs."""
    import importlib.metadata
    import re

    script = (Path(__file__).parent.parent / "bench" / "gpu_check_device.sh").read_text()
    wheels = re.search(r"^WHEELS=\(([^)]*)\)", script, re.M)
    assert wheels is not None
    pins = dict(spec.split("==") for spec in wheels.group(1).split())
    assert {"msgspec", "pyzmq", "fastapi", "uvicorn", "pydantic-core"} <= set(pins)
    stale = {n: (v, importlib.metadata.version(n)) for n, v in pins.items()
             if importlib.metadata.version(n) != v}  # fmt: skip
    assert not stale, f"update WHEELS in bench/gpu_check_device.sh, then make gpu-wheels: {stale}"


@pytest.mark.slow
def test_gpu_check_dry_run(tmp_path: Path) -> None:
    """``bash bench/gpu_check_device.sh dry-run`` (~1-2 minutes): bench.gpu_check --dry-run
    in an interpreter that sees only the GPU machine's packages and the carried wheels: the
    runner's steps in both modes, the server on the tiny model with its synthetic tokenizer,
    the bench client at three concurrencies, the JSON."""
    import os
    import subprocess

    repo = Path(__file__).parent.parent
    if not (repo / ".venv" / "bin" / "python").exists():
        pytest.skip("the dry run builds on .venv (make install)")
    env = {**os.environ, "OUT": str(tmp_path)}
    env.pop("PYTHONPATH", None)
    run = subprocess.run(["bash", "bench/gpu_check_device.sh", "dry-run"], cwd=repo, env=env,
                         capture_output=True, text=True, timeout=600)  # fmt: skip
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    r = json.loads((tmp_path / "gpu_check.json").read_text())
    assert not r["errors"] and all(v == "ok" for v in r["imports"].values())
    assert set(r["decode"]) == {"eager", "graphs"} and not r["decode"]["graphs"]["errors"]
    runs = r["serve"]["runs"]
    assert [x["concurrency"] for x in runs] == [1, 8, 4] and not r["serve"]["errors"]
    for x in runs:
        assert x["completed"] == x["prompts"] and x["failed"] == 0 and x["output_throughput"] > 0
        assert x["timeline"]["decode_steps"] > 0 and "worker" in x["cpu_share"]
        assert x["allowed"]["achieved_frac"] > 0
    assert (tmp_path / "gpu_check.log").read_text().count("Serving Benchmark Result") == 4


# --- bench/kv_dtype.py (issue 32's measurements), tiny ----------------------------------------


def test_kv_dtype_tiny_parts_run(tmp_path: Path, small_model: Path) -> None:
    """``bench.kv_dtype accuracy|capacity|decode --tiny`` on the 2-layer dummy model: KV
    variants scored in chunks against auto, the whole-window control equal to auto (nothing
    reads the cache there), capacity from the start-up lines, decode steps timed."""
    from bench import kv_dtype

    common = ["--tiny", "--model", str(small_model), "--load-format", "dummy",
              "--out-dir", str(tmp_path)]  # fmt: skip
    kvs = ["auto", "fp8+scales", "int8"]  # (each variant costs an engine or two: a few here)
    assert kv_dtype.main(["accuracy", "--dtypes", "float32", "--kv", *kvs, *common]) == 0
    acc = json.loads((tmp_path / "kv_dtype_accuracy.json").read_text())
    by = {r["kv"]: r for r in acc["rows"]}
    assert list(by) == [*kvs, "auto (whole windows)", "fp8 (whole windows)"]
    assert by["auto"]["ppl_ratio"] == 1.0 and by["auto"]["long_agreement"]["identical"] == 1.0
    assert by["fp8 (whole windows)"]["perplexity"] == by["auto (whole windows)"]["perplexity"]
    assert all(math.isfinite(r["perplexity"]) for r in acc["rows"])
    assert len(by["int8"]["long_greedy"]) == 2 and by["int8"]["long_prompt_lens"] == [96, 96]

    assert kv_dtype.main(["capacity", "--dtypes", "float32", *common]) == 0
    cap_rows = json.loads((tmp_path / "kv_dtype_capacity.json").read_text())["rows"]
    cap = {r["kv"]: r for r in cap_rows}
    assert list(cap) == list(kv_dtype.CAPACITY_DTYPES)
    # head_dim 32: fp32 rows of 128 bytes, fp8 rows of 32, int8 rows of 32 + a 4-byte scale
    assert cap["auto"]["bytes_per_block"] == 4 * cap["fp8"]["bytes_per_block"]
    assert cap["int8"]["bytes_per_block"] * 32 == cap["fp8"]["bytes_per_block"] * 36
    assert cap["fp8"]["max_concurrency"] > 3.9 * cap["auto"]["max_concurrency"]
    assert cap["auto"]["max_concurrency_line"].startswith("Maximum concurrency for 256 tokens")

    assert kv_dtype.main(["decode", "--dtypes", "float32", *common]) == 0
    dec = json.loads((tmp_path / "kv_dtype_decode.json").read_text())
    assert {(r["kv"], r["batch"], r["context"]) for r in dec["rows"]} == {
        (kv, b, 48) for kv in ("auto", "fp8", "fp8_e5m2", "int8") for b in (1, 2)
    }
    assert all(r["step_ms"] > 0 and r["steps"] == 2 for r in dec["rows"])
    assert (tmp_path / "kv_dtype_decode.png").exists()


def test_kv_dtype_divergence() -> None:
    from bench.kv_dtype import divergence

    ref = [[1, 2, 3, 4], [5, 6, 7, 8]]
    d = divergence(ref, [[1, 2, 3, 4], [5, 9, 7, 8]])
    assert d == {"identical": 0.5, "tokens_before_divergence": 5 / 8, "first_divergence": [None, 1]}
    assert divergence(ref, [[1, 2, 3], [5, 6, 7, 8]])["first_divergence"] == [3, None]


def test_startup_summary_and_cpu_of_a_tree(tmp_path: Path) -> None:
    """bench.startup: medians per revision and configuration, HEAD's ratio to BASE; the CPU
    of a process tree counts its children."""
    import subprocess
    import sys

    from bench import startup

    runs = [{"rev": rev, "config": "default", "ready_s": s, "cpu_s": 2 * s}
            for rev, s in (("a", 6.0), ("a", 7.0), ("a", 9.0), ("b", 4.0), ("b", 3.0))]  # fmt: skip
    rows = startup.summarize(["a", "b"], runs)
    ready = next(r for r in rows if r["metric"] == "ready_s")
    assert ready["a"] == {"median": 7.0, "min": 6.0, "max": 9.0}
    assert ready["b"]["median"] == 3.5 and ready["ratio"] == 0.5
    assert "| default | to /health 200 (s) | 7.00 (6.00-9.00) | 3.50" in startup.table(
        ["a", "b"], rows
    )
    startup.plot(["a", "b"], runs, tmp_path / "startup.png")  # (the panels: revisions.dots)
    assert (tmp_path / "startup.png").stat().st_size > 0
    busy = subprocess.Popen([sys.executable, "-c", "import time\nt=time.process_time()\n"
                             "while time.process_time() - t < 0.5: pass\ntime.sleep(30)"])  # fmt: skip
    try:
        import os

        deadline = time.monotonic() + 30  # it has spun its half second
        while startup.tree_cpu_s(busy.pid) < 0.5 and time.monotonic() < deadline:
            time.sleep(0.1)
        child = startup.tree_cpu_s(busy.pid)
        assert child >= 0.5
        assert startup.tree_cpu_s(os.getpid()) >= child + time.process_time() - 0.05
    finally:
        busy.kill()
        busy.wait()
