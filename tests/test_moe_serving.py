"""A mixture-of-experts model (the small random Qwen3-MoE of test_moe_model.py) behind
``actorserve router`` and behind ``actorserve pd-proxy`` (issue 33).

- Two MoE replicas behind the router (``--policy prefix_approx``): HF's greedy tokens for
  token-id prompts, every round of a shared prefix goes back to the replica that first
  computed it, and the hits the router predicts are the hits each replica reports.
- Prefill/decode disaggregation with the ``p2p`` connector: HF's greedy tokens through the
  proxy, and the decode instance pulled the prompt's KV instead of computing it (one
  transfer per request and TP rank, the layout's exact bytes, external prefix-cache hits
  of all but the last prompt token, one prompt token computed per request); both sides
  free their blocks. Both instances plain, and (``make test-slow``) both with
  ``--enable-expert-parallel -tp 2``.

Prompts are token ids: the folder's tokenizer (the default model's) has text ids past this
model's 256-token vocabulary.
"""

from __future__ import annotations

import contextlib
import random
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import httpx
import pytest
import torch

from tests.server_utils import RemoteServer, metric, wait_metric
from tests.test_expert_parallel import _complete
from tests.test_kv_transfer import _p2p, pd_proxy
from tests.test_moe_model import VOCAB, _hf_config, _hf_model, _save, greedy_with_cache
from tests.test_router_engine import router

BLOCK = 16  # the servers' default block size (the router reads it from their /metrics)
_rng = random.Random(33)
# The router's prompts: four prefixes of four whole blocks, each asked three times with
# another 5-token question.
PREFIXES = [[_rng.randrange(3, VOCAB) for _ in range(4 * BLOCK)] for _ in range(4)]
ROUNDS = [[p + [_rng.randrange(3, VOCAB) for _ in range(5)] for p in PREFIXES] for _ in range(3)]
# The PD prompts: KV of ceil((n - 1) / 16) blocks each, 5 and 10.
PD_PROMPTS = [[_rng.randrange(3, VOCAB) for _ in range(n)] for n in (71, 150)]


@pytest.fixture(scope="module")
def moe(tmp_path_factory) -> tuple[Path, dict[tuple[int, ...], list[int]]]:
    """(HF folder of the small Qwen3-MoE, prompt -> HF's greedy continuation), computed
    before any server starts."""
    model = _hf_model("qwen3_moe")
    folder = _save("qwen3_moe", model, tmp_path_factory.mktemp("qwen3_moe_serving"))
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # a few times faster than two threads on busy shared cores
    try:
        prompts = [*(p for r in ROUNDS for p in r), *PD_PROMPTS]
        greedy = {tuple(p): greedy_with_cache(model, p) for p in prompts}
    finally:
        torch.set_num_threads(threads)
    return folder, greedy


def _server(folder: Path, *extra: str) -> RemoteServer:
    return RemoteServer(
        "--model", str(folder), "--served-model-name", "moe", "--max-model-len", "256", *extra
    )  # fmt: skip


@contextlib.contextmanager
def _two(first: RemoteServer, second: RemoteServer) -> Iterator[tuple[RemoteServer, RemoteServer]]:
    """Both servers started side by side, ready; closed afterwards."""
    with first, second:
        first.wait_ready()
        second.wait_ready()
        yield first, second


def _router_metric(url: str, name: str) -> dict[str, float]:
    """Replica URL -> value of the router's ``name{...,replica="URL"}`` samples."""
    out: dict[str, float] = {}
    for line in httpx.get(url + "/metrics", timeout=10).text.splitlines():
        if line.startswith(name + "{") and 'replica="' in line:
            replica = line.split('replica="', 1)[1].split('"', 1)[0]
            out[replica] = out.get(replica, 0.0) + float(line.rsplit(" ", 1)[1])
    return out


def _poll(read: Callable[[], object], want: object, timeout_s: float = 30) -> object:
    """``read()`` once it equals ``want``, or its last value after ``timeout_s``."""
    deadline = time.monotonic() + timeout_s
    while (got := read()) != want and time.monotonic() < deadline:
        time.sleep(0.1)
    return got


def test_two_moe_replicas_behind_the_router(moe) -> None:
    folder, greedy = moe
    with (
        _two(_server(folder), _server(folder)) as replicas,
        router(list(replicas), "--policy", "prefix_approx") as url,
    ):
        urls = [s.url for s in replicas]
        holder: dict[int, str] = {}
        for prompts in ROUNDS:
            for g, prompt in enumerate(prompts):
                before = _router_metric(url, "router:decisions_total")
                assert _complete(url, prompt) == greedy[tuple(prompt)]
                after = _router_metric(url, "router:decisions_total")
                (served,) = [u for u in urls if after.get(u, 0) - before.get(u, 0) == 1]
                assert holder.setdefault(g, served) == served  # the prefix's replica again
        assert set(holder.values()) == set(urls)  # new prefixes spread over both
        # Rounds 2 and 3 of each prefix hit its four blocks, as the router predicted, on
        # the replica it predicted them on.
        predicted = _router_metric(url, "router:predicted_cached_tokens_total")
        assert sum(predicted.values()) == len(PREFIXES) * 2 * 4 * BLOCK
        for s in replicas:
            hits = _poll(lambda s=s: metric(s, "vllm:prefix_cache_hits_total"),
                         predicted.get(s.url, 0.0))  # fmt: skip
            assert hits == predicted.get(s.url, 0.0), (s.url, hits, predicted)


EP_TP2 = ("--enable-expert-parallel", "-tp", "2")


@pytest.mark.parametrize(
    "layout",
    [
        pytest.param((), id="plain"),
        # Four worker processes on two cores: about twice the start-up of the plain pair.
        pytest.param(EP_TP2, id="ep_tp2", marks=pytest.mark.slow),  # make test-slow
    ],
)
def test_moe_prefill_decode_disaggregation_over_p2p(moe, layout) -> None:
    folder, greedy = moe
    prompts = PD_PROMPTS
    producer, consumer = (
        _server(folder, *layout, *_p2p("kv_producer")),
        _server(folder, *layout, *_p2p("kv_consumer")),
    )
    with _two(producer, consumer) as (prefill, decode), pd_proxy(prefill, decode) as url:
        for prompt in prompts:
            assert _complete(url, prompt) == greedy[tuple(prompt)]
        n = len(prompts)
        # One pull per request and TP rank (each rank pulls its KV heads); nothing failed.
        ranks = 2 if layout else 1
        assert wait_metric(decode, "vllm:nixl_xfer_time_seconds_count", n * ranks, 30), decode.log
        assert metric(decode, "vllm:nixl_num_failed_transfers_total") == 0
        # All but the last prompt token's KV, in whole blocks: K and V x 3 layers x 2 KV
        # heads x 16 dims x 4 bytes (fp32) a token, over all ranks.
        arch = _hf_config("qwen3_moe")
        per_token = 2 * arch.num_hidden_layers * arch.num_key_value_heads * arch.head_dim * 4
        blocks = sum(-(-(len(p) - 1) // BLOCK) for p in prompts)
        assert metric(decode, "vllm:nixl_bytes_transferred_sum") == blocks * BLOCK * per_token
        # The decode side took those tokens from the prefill's KV and computed only the
        # last prompt token of each; the prefill side computed every prompt token.
        external = sum(len(p) - 1 for p in prompts)
        assert wait_metric(decode, "vllm:external_prefix_cache_hits_total", external, 30)
        assert metric(decode, "vllm:prefix_cache_hits_total") == 0
        assert wait_metric(decode, "vllm:request_prefill_kv_computed_tokens_sum", n, 30)
        computed = sum(len(p) for p in prompts)
        assert wait_metric(prefill, "vllm:request_prefill_kv_computed_tokens_sum", computed, 30)
        # The prefill side freed its holds once pulled; the decode side its blocks.
        assert wait_metric(prefill, "vllm:kv_cache_usage_perc", 0.0, 30)
        assert wait_metric(decode, "vllm:kv_cache_usage_perc", 0.0, 30)
        if layout:
            for s in (prefill, decode):
                assert "rank 1 holds experts [4, 8) of 8" in s.log
