"""Data parallelism: N engine cores behind one api_server, balanced by load and prefix.

The balancer's rule is tested on its own with hand-made engine states; the server
test runs ``actorserve serve -dp 2`` and checks that a concurrent load is spread
over both engines with the tokens one engine gives, that ``X-data-parallel-rank``
pins a request, and that ``/metrics`` carries each engine's series.
"""

from __future__ import annotations

import concurrent.futures
import time

import httpx
import msgspec
import openai
import pytest
import zmq

from services.protocol import AllBlocksCleared, BlockRemoved, BlockStored, EngineState, KVEventBatch
from services.tokenizer.balancer import DataParallelBalancer
from tests.server_utils import RemoteServer, free_port, metric

MODEL = "SmolLM2-135M-Instruct"
BLOCK = 4


def _stored(balancer: DataParallelBalancer, prompt: list[int]) -> BlockStored:
    hashes = balancer.hasher.hash_blocks(prompt)
    return BlockStored(hashes, None, prompt[: len(hashes) * BLOCK], BLOCK)


def test_balancer_prefers_the_least_loaded_engine() -> None:
    b = DataParallelBalancer(3, BLOCK, "sha256")
    b.on_state(EngineState(0, num_waiting=2, num_running=0, kv_cache_usage=0.1))
    b.on_state(EngineState(1, num_waiting=0, num_running=5, kv_cache_usage=0.1))
    b.on_state(EngineState(2, num_waiting=0, num_running=3, kv_cache_usage=0.1))
    assert [b.load(d) for d in range(3)] == [8, 5, 3]
    assert b.choose(list(range(10)), None, None) == 2
    # Routed requests count as waiting until the engine reports again: a burst spreads.
    assert [b.choose([d], None, None) for d in range(3)] == [1, 2, 0]  # loads 7/9/11 -> 8
    assert b.choose([7], None, pinned=0) == 0 and b.routed[0] == 2  # pinned, counted too


def test_balancer_prefix_affinity_within_the_slack_only() -> None:
    b = DataParallelBalancer(2, BLOCK, "sha256")
    prompt = list(range(100, 117))  # 4 full blocks
    b.on_state(EngineState(1, 0, 1, 0.1, [_stored(b, prompt)]))
    assert b.cached_blocks(prompt, None) == [0, 4]
    assert b.cached_blocks(prompt, "salted") == [0, 0]  # cache_salt changes every hash
    assert b.cached_blocks(prompt[:9] + [1] * 8, None) == [0, 2]  # the shared leading blocks
    assert b.choose(prompt, None, None) == 1  # load 1 vs 0: within one waiting request
    b.on_state(EngineState(1, 2, 1, 0.1))  # now clearly busier
    assert b.choose(prompt, None, None) == 0
    # Evictions and a cleared cache take the blocks out of the index.
    b.on_state(EngineState(1, 0, 0, 0.1, [BlockRemoved(b.hasher.hash_blocks(prompt)[1:2])]))
    assert b.cached_blocks(prompt, None) == [0, 1]
    b.on_state(EngineState(1, 0, 0, 0.0, [AllBlocksCleared()]))
    assert b.cached_blocks(prompt, None) == [0, 0]


def _two_free_ports() -> int:
    """A port p with p + 1 free too (engine d publishes on p + d)."""
    import socket

    for _ in range(100):
        p = free_port()
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", p + 1))
                return p
            except OSError:
                continue
    raise RuntimeError("no two consecutive free ports")


KV_EVENTS_PORT = _two_free_ports()


@pytest.fixture(scope="module")
def dp_server():
    endpoint = f"tcp://127.0.0.1:{KV_EVENTS_PORT}"
    with RemoteServer("-dp", "2", "--kv-events-endpoint", endpoint) as s:
        yield s.wait_ready()


def _completion(url: str, prompt: str, headers: dict[str, str] | None = None) -> list[int]:
    client = openai.OpenAI(base_url=f"{url}/v1", api_key="x", max_retries=0, timeout=120)
    out = client.completions.create(
        model=MODEL, prompt=prompt, max_tokens=8, temperature=0,
        extra_body={"ignore_eos": True, "return_token_ids": True}, extra_headers=headers,
    )  # fmt: skip
    return list(out.choices[0].token_ids)  # type: ignore[attr-defined]


def _successes(server: RemoteServer, engine: str) -> float:
    return metric(server, "vllm:request_success_total", engine=engine) or 0.0


def test_dp2_spreads_a_concurrent_load_with_one_engines_tokens(dp_server, greedy_prompts) -> None:
    from launch.llm import LLM, SamplingParams

    prompts = [f"Question {i}: name a colour, a city and a number." for i in range(32)]
    with concurrent.futures.ThreadPoolExecutor(32) as pool:
        got = list(pool.map(lambda p: _completion(dp_server.url, p), prompts))
    one = LLM(max_model_len=512, num_gpu_blocks_override=256).generate(
        prompts, SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    )
    assert got == [r.outputs[0].token_ids for r in one]
    by_engine = [_successes(dp_server, "0"), _successes(dp_server, "1")]
    assert sum(by_engine) == 32 and min(by_engine) >= 8, by_engine


def test_pinned_rank_and_per_engine_metrics(dp_server) -> None:
    before = _successes(dp_server, "1")
    for _ in range(3):
        _completion(dp_server.url, "The capital of France is", {"X-data-parallel-rank": "1"})
    assert _successes(dp_server, "1") == before + 3
    for bad, message in (("2", "out of range"), ("one", "must be an integer")):
        r = httpx.post(
            f"{dp_server.url}/v1/completions",
            json={"model": MODEL, "prompt": "Hi", "max_tokens": 2},
            headers={"X-data-parallel-rank": bad},
            timeout=30,
        )
        assert r.status_code == 400 and message in r.json()["error"]["message"]
    text = httpx.get(f"{dp_server.url}/metrics", timeout=10).text
    for engine in ("0", "1"):
        assert f'vllm:num_requests_running{{engine="{engine}"' in text
        assert f'vllm:kv_cache_usage_perc{{engine="{engine}"' in text


def test_kv_events_carry_the_data_parallel_rank(dp_server) -> None:
    ctx = zmq.Context()
    subs = []
    for d in (0, 1):
        sub = ctx.socket(zmq.SUB)
        sub.setsockopt(zmq.SUBSCRIBE, b"")
        sub.connect(f"tcp://127.0.0.1:{KV_EVENTS_PORT + d}")
        subs.append(sub)
    try:
        time.sleep(0.5)  # PUB/SUB: the subscriptions must arrive before the events
        prompt = "A prompt long enough to fill a few blocks of sixteen tokens, " * 3
        _completion(dp_server.url, prompt, {"X-data-parallel-rank": "1"})
        assert subs[1].poll(10_000)
        topic, seq, payload = subs[1].recv_multipart()  # vLLM's frames
        assert topic == f"kv@127.0.0.1:{dp_server.port}@{MODEL}".encode()
        assert len(seq) == 8  # big-endian sequence number
        batch = msgspec.msgpack.decode(payload, type=KVEventBatch)
        assert batch.data_parallel_rank == 1 and batch.events
        assert not subs[0].poll(500)  # engine 0 stored nothing
    finally:
        for sub in subs:
            sub.close(linger=0)
        ctx.term()


@pytest.mark.slow  # make test-slow; make test: DP=2 and TP=2 each
def test_dp2_with_tp2_is_four_workers(small_model) -> None:
    """-dp 2 -tp 2: two engine cores of two ranks each, every one serving the same tokens."""
    from launch.llm import LLM, SamplingParams

    args = ["--model", str(small_model), "--load-format", "dummy", "--seed", "5",
            "--max-model-len", "256", "-dp", "2", "-tp", "2"]  # fmt: skip
    prompt = [1, 100, 200, 300]
    want = (
        LLM(model=str(small_model), load_format="dummy", seed=5, max_model_len=256)
        .generate([prompt], SamplingParams(temperature=0, max_tokens=8, ignore_eos=True))[0]
        .outputs[0]
        .token_ids
    )
    with RemoteServer(*args) as server:
        server.wait_ready()
        workers = [p for p in server.processes() if "worker" in " ".join(p.cmdline())]
        assert sorted(p.cmdline()[-2:] for p in workers) == [
            ["0", "0"],
            ["0", "1"],
            ["1", "0"],
            ["1", "1"],
        ]  # (rank, engine)
        client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="x", max_retries=0)
        for engine in ("0", "1"):
            out = client.completions.create(
                model=str(small_model), prompt=prompt, max_tokens=8, temperature=0,
                extra_body={"ignore_eos": True, "return_token_ids": True},
                extra_headers={"X-data-parallel-rank": engine},
            )  # fmt: skip
            assert out.choices[0].token_ids == want  # type: ignore[attr-defined]


def test_requests_that_change_no_load_do_not_starve_an_engine(dp_server) -> None:
    """A request that ends in its first step with no full block leaves its engine's load and
    cache as they were; the engine must still report, or the balancer keeps counting it as
    routed there and, once the other engine reports, never chooses this one again (found by
    review). Then 6 long requests, each started once the last one runs, must alternate."""
    import threading

    client = openai.OpenAI(base_url=f"{dp_server.url}/v1", api_key="x", max_retries=0)
    for i in range(20):
        client.completions.create(model=MODEL, prompt=f"Hi {i}", max_tokens=1)
    before = [_successes(dp_server, e) for e in ("0", "1")]

    def stream(i: int, started: threading.Event) -> None:
        chunks = client.completions.create(
            model=MODEL, prompt=f"Story {i}:", max_tokens=48, stream=True,
            extra_body={"ignore_eos": True},
        )  # fmt: skip
        for _ in chunks:
            started.set()

    threads = []
    for i in range(6):
        started = threading.Event()
        threads.append(threading.Thread(target=stream, args=(i, started)))
        threads[-1].start()
        assert started.wait(60)  # running: its engine has reported it
    for t in threads:
        t.join(120)
    took = [
        a - b for a, b in zip([_successes(dp_server, e) for e in ("0", "1")], before, strict=True)
    ]
    assert took == [3, 3], took
