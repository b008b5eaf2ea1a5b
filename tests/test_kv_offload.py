"""Block-store KV connectors: ``offload`` (a host tier under the device pool), ``storage``
(files by block hash, across restarts) and ``multi`` (several in order).

Worker halves are checked on tensors (what goes in comes back, into other blocks); the
scheduler half on a real ``Scheduler`` (what it plans, LRU, pinning); and end to end: an
evicted prefix comes back from the host tier instead of being recomputed, a restarted
server hits the prefix it saved, and greedy outputs equal a server without them.
"""

from __future__ import annotations

import json

import httpx
import msgspec
import pytest
import torch

from services.config import EngineConfig, SchedulerConfig
from services.config.kv_transfer import KVTransferConfig
from services.flags import ConfigError
from services.kv_transfer.multi import MultiConnectorScheduler
from services.kv_transfer.offload import (
    OffloadConnectorScheduler,
    OffloadConnectorWorker,
    dequantize_int8,
    quantize_int8,
)
from services.kv_transfer.storage import StorageConnectorWorker
from services.protocol import (
    BlockRemoved,
    BlockStored,
    BlockStoreLoad,
    BlockStoreMetadata,
    KVLayout,
    KVTransferDone,
    SamplingParams,
    StepResult,
)
from services.request import Request, RequestStatus
from services.scheduler.scheduler import Scheduler
from tests.server_utils import RemoteServer, metric

LAYOUT = KVLayout(num_layers=2, block_size=4, num_kv_heads=2, head_dim=8, dtype="float32")
_encode = msgspec.msgpack.Encoder().encode


def caches(num_blocks: int = 8) -> list:
    shape = (num_blocks, LAYOUT.block_size, LAYOUT.num_kv_heads, LAYOUT.head_dim)
    return [(torch.randn(shape), torch.randn(shape)) for _ in range(LAYOUT.num_layers)]


class Reports(list):
    def __call__(self, done: KVTransferDone) -> None:
        self.append(done)


def engine(**extra) -> EngineConfig:
    cfg = EngineConfig.from_kwargs(block_size=4)
    cfg.kv_transfer = KVTransferConfig("offload", kv_connector_extra_config=extra)
    return cfg


def step(w, **meta) -> None:
    w.bind_connector_metadata(_encode(BlockStoreMetadata(**meta)))
    w.start_load_kv()


# ---------------------------------------------------------------- worker halves


@pytest.mark.parametrize("dtype", ["auto", "int8"])
def test_offloaded_blocks_come_back_into_other_blocks(dtype):
    cfg = engine(kv_offload_bytes=1 << 20, kv_offload_dtype=dtype)
    reports = Reports()
    w = OffloadConnectorWorker(cfg.kv_transfer, cfg, 0, reports)
    kv = caches()
    w.register_kv_caches(kv, LAYOUT)
    want = [(k[[1, 3]].clone(), v[[1, 3]].clone()) for k, v in kv]
    # Saved before the step's forward; the forward then overwrites the blocks.
    step(w, save_keys=[70, 5], save_block_ids=[1, 3])  # slot 70: a second host chunk
    for k, v in kv:
        k[[1, 3]] = 0.0
        v[[1, 3]] = 0.0
    step(w, loads=[BlockStoreLoad("r", [70, 5], [6, 2])])
    assert reports == [KVTransferDone(0, finished_recving=["r"])]
    for (k, v), (wk, wv) in zip(kv, want, strict=True):
        if dtype == "auto":
            assert torch.equal(k[[6, 2]], wk) and torch.equal(v[[6, 2]], wv)
        else:  # int8: within half a step (absmax / 127 of each token's head vector)
            for got, ref in ((k[[6, 2]], wk), (v[[6, 2]], wv)):
                step_size = ref.abs().amax(dim=3, keepdim=True) / 127
                assert ((got - ref).abs() <= step_size / 2 + 1e-6).all()
                assert not torch.equal(got, torch.zeros_like(got))


def test_int8_quantization_is_exact_on_its_grid():
    block = torch.randn(2, 2, 4, 2, 8)
    q, scale = quantize_int8(block)
    assert q.dtype == torch.int8 and scale.shape == (2, 2, 4, 2)
    again, scale2 = quantize_int8(dequantize_int8(q, scale))
    assert torch.equal(q, again)
    torch.testing.assert_close(scale, scale2)


def test_storage_worker_writes_files_another_process_reads(tmp_path):
    cfg = EngineConfig.from_kwargs(block_size=4)
    cfg.kv_transfer = KVTransferConfig("storage", kv_connector_extra_config={"path": str(tmp_path)})
    reports = Reports()
    w = StorageConnectorWorker(cfg.kv_transfer, cfg, 0, reports)
    kv = caches()
    w.register_kv_caches(kv, LAYOUT)
    want = [(k[2].clone(), v[2].clone()) for k, v in kv]
    step(w, save_keys=["ab" * 32], save_block_ids=[2])
    w.shutdown()  # waits for the write
    files = list(tmp_path.rglob("*.safetensors"))
    assert [f.name for f in files] == ["ab" * 32 + ".safetensors"]

    # A new worker (a restarted server) loads it; a missing file fails the load.
    reports2 = Reports()
    w2 = StorageConnectorWorker(cfg.kv_transfer, cfg, 0, reports2)
    kv2 = caches()
    w2.register_kv_caches(kv2, LAYOUT)
    step(w2, loads=[BlockStoreLoad("r", ["ab" * 32], [5]), BlockStoreLoad("s", ["cd" * 32], [6])])
    w2.shutdown()  # waits for the loads
    got = {r for d in reports2 for r in d.finished_recving}
    failed = {r for d in reports2 for r in d.failed_recving}
    assert got == {"r"} and failed == {"s"}
    for (k, v), (wk, wv) in zip(kv2, want, strict=True):
        assert torch.equal(k[5], wk) and torch.equal(v[5], wv)

    # Another KV layout reads nothing of it.
    other = KVLayout(2, 4, 2, 8, "bfloat16")
    w3 = StorageConnectorWorker(cfg.kv_transfer, cfg, 0, Reports())
    w3.register_kv_caches(caches(), other)
    with pytest.raises(ValueError, match="another KV layout"):
        w3.get("ab" * 32)
    w3.shutdown()


# ---------------------------------------------------------------- scheduler half


def _scheduler(num_blocks: int, connector) -> Scheduler:
    return Scheduler(
        SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=64, max_model_len=20),
        engine().cache,
        num_blocks,
        enable_kv_cache_events=True,
        kv_connector=connector,
    )


def _request(req_id: str, tokens: list[int]) -> Request:
    return Request(req_id, tokens, SamplingParams(max_tokens=1, temperature=0.0))


def _run(s: Scheduler, req: Request) -> bytes:
    """Admit ``req`` and run its one step (it samples its one token and ends); that
    step's connector metadata."""
    s.add_request(req)
    plan = s.schedule()
    assert [r.req_id for r in plan.new_requests] == [req.req_id]
    s.update_from_output(plan, StepResult(plan.step_id, [req.req_id], [7]))
    assert req.status != RequestStatus.RUNNING
    return plan.kv_connector_metadata


A = list(range(100, 117))  # 17 tokens: 4 full blocks of 4


def _evict_a(connector) -> Scheduler:
    """A scheduler over 5 usable blocks where prompt A ran, then a 20-token prompt took
    every block: A's 4 cached blocks were evicted (to the connector's tier, if it keeps
    them)."""
    s = _scheduler(6, connector)
    _run(s, _request("a", A))
    _run(s, _request("b", list(range(200, 220))))
    return s


def _offload(slots: int) -> OffloadConnectorScheduler:
    cfg = engine(kv_offload_bytes=slots * 2048)  # the tests' blocks are 2,048 bytes
    return OffloadConnectorScheduler(cfg.kv_transfer, cfg, kv_block_bytes=2048)


def test_scheduler_saves_evicted_blocks_and_loads_them_back():
    off = _offload(3)
    s = _scheduler(6, off)  # 5 usable blocks of 4 tokens
    a = A
    _run(s, _request("a", a))
    s.take_events()
    # 20 other tokens need all 5 blocks: a's 4 cached blocks are evicted to the host tier.
    meta = msgspec.msgpack.decode(
        _run(s, _request("b", list(range(200, 220)))), type=BlockStoreMetadata
    )
    # Evicted last block first (the free queue's order); 3 slots: the prefix's first block
    # takes the slot of its last, whose save this step's worker then overwrites.
    assert meta.save_block_ids == [4, 3, 2, 1] and meta.save_keys == [0, 1, 2, 0]
    events = s.take_events()
    assert sum(isinstance(e, BlockStored) and e.medium == "CPU" for e in events) == 4
    assert sum(isinstance(e, BlockRemoved) and e.medium == "CPU" for e in events) == 1
    assert off.num_stored == 3

    # a again: no device hit, 3 blocks (12 tokens) from the host tier, then the rest.
    again = _request("a2", a)
    s.add_request(again)
    plan = s.schedule()
    assert again.status == RequestStatus.WAITING_FOR_REMOTE_KVS and plan.is_empty
    meta = msgspec.msgpack.decode(plan.kv_connector_metadata, type=BlockStoreMetadata)
    assert [ld.req_id for ld in meta.loads] == ["a2"] and len(meta.loads[0].keys) == 3
    s.update_from_output(plan, None)
    s.update_from_kv_transfers(KVTransferDone(0, finished_recving=["a2"]))
    plan = s.schedule()
    assert [r.req_id for r in plan.new_requests] == ["a2"]
    assert plan.new_requests[0].num_computed_tokens == 12
    assert plan.num_scheduled_tokens == [5]
    s.check_integrity()
    stats = s.get_stats().connector_prefix_cache_stats
    assert stats is not None and stats.hits == 12


def test_a_failed_load_recomputes_and_forgets_the_blocks():
    off = _offload(8)
    s = _evict_a(off)
    a = A
    assert off.num_stored == 4
    again = _request("a2", a)
    s.add_request(again)
    plan = s.schedule()
    s.update_from_output(plan, None)
    s.update_from_kv_transfers(KVTransferDone(0, failed_recving=["a2"]))
    # a's blocks are forgotten (b's, evicted for a2's load, went in meanwhile)
    assert all(off.key_of(h) is None for h in again.block_hashes)
    assert off.num_stored == 4
    assert any(isinstance(e, BlockRemoved) and e.medium == "CPU" for e in s.take_events())
    plan = s.schedule()  # computes its whole prompt now
    assert [r.num_computed_tokens for r in plan.new_requests] == [0]
    s.check_integrity()


def test_an_abort_while_loading_frees_the_blocks_once_the_load_ends():
    off = _offload(8)
    s = _evict_a(off)
    a = A
    s.add_request(_request("a2", a))
    plan = s.schedule()
    s.abort_requests(["a2"])
    s.update_from_output(plan, None)
    assert "a2" in s.held  # the workers may be writing its blocks
    s.update_from_kv_transfers(KVTransferDone(0, finished_recving=["a2"]))
    assert not s.held and s.kv_cache_manager.block_pool.get_usage() == 0.0
    s.check_integrity()


def test_loaded_requests_that_compute_the_rest_of_their_prompt_never_deadlock():
    """A load takes blocks for the whole prompt, not only the loaded part: two requests
    that load a shared first block and then compute 14 tokens each never wait, loaded,
    for blocks only the other's run would free."""
    s = _evict_a(_offload(8))  # a's blocks went to the host tier
    a = A
    for name, first in (("c1", 300), ("c2", 400)):
        s.add_request(_request(name, a[:4] + list(range(first, first + 14))))
    finished: set[str] = set()
    for _ in range(30):
        plan = s.schedule()
        for req_id in list(s.loading):
            s.update_from_kv_transfers(KVTransferDone(0, finished_recving=[req_id]))
        sampled = sorted(s._sampling_by_step.get(plan.step_id, set()))
        result = None if plan.is_empty else StepResult(plan.step_id, sampled, [7] * len(sampled))
        finished.update(o.req_id for o in s.update_from_output(plan, result) if o.finish_reason)
        s.check_integrity()
    assert finished == {"c1", "c2"}
    assert s.kv_cache_manager.block_pool.get_usage() == 0.0


def test_the_host_tier_evicts_a_prefix_from_its_tail():
    """LRU over chains: a lookup touches the blocks last first, so the tier later evicts
    the tail of a prefix, never its head (which would strand the rest)."""
    off = _offload(4)
    s = _evict_a(off)
    a = A
    again = _request("a2", a)
    s.add_request(again)
    assert off.get_num_new_matched_tokens(again, 0) == (16, True)
    off.build_connector_meta()
    off.on_block_evicted(b"x" * 32, 5)  # one new block into the full tier
    assert [off.key_of(h) is not None for h in again.block_hashes] == [True, True, True, False]
    assert off.get_num_new_matched_tokens(again, 0) == (12, True)


def test_a_failed_load_counts_its_recompute_apart():
    s = _evict_a(_offload(8))
    a = A
    local = s.kv_cache_manager.block_pool.prefix_cache_stats
    queries = local.queries
    again = _request("a2", a)
    s.add_request(again)
    plan = s.schedule()
    s.update_from_output(plan, None)
    s.update_from_kv_transfers(KVTransferDone(0, failed_recving=["a2"]))
    plan = s.schedule()
    s.update_from_output(plan, StepResult(plan.step_id, ["a2"], [7]))
    assert again.num_cached_tokens == 0  # what the recompute found, not the failed load
    assert local.queries - queries == 17 and local.preempted_queries == 17


def test_multi_loads_from_the_connector_that_supplies_most():
    """multi [offload, p2p] on a decode instance: the host tier holds 8 of the prompt's
    tokens, the prefill instance all but the last: p2p loads it."""
    from services.kv_transfer.p2p import prompt_hash

    cfg = EngineConfig.from_kwargs(block_size=4)
    cfg.kv_transfer = KVTransferConfig.from_json(json.dumps({
        "kv_connector": "multi", "kv_role": "kv_consumer", "kv_connector_extra_config": {
            "connectors": [{"kv_connector": "offload",
                            "kv_connector_extra_config": {"kv_offload_bytes": 2 * 2048}},
                           {"kv_connector": "p2p", "kv_port": 1}]}}))  # fmt: skip
    multi = MultiConnectorScheduler(cfg.kv_transfer, cfg, 2048)
    off, p2p = multi.children
    s = _evict_a(multi)
    a = A
    assert off.num_stored == 2
    params = {"do_remote_prefill": True, "remote_request_id": "pre-1",
              "remote_block_ids": [1, 2, 3, 4, 5], "remote_host": "127.0.0.1",
              "remote_port": 1, "remote_prompt_hash": prompt_hash(a)}  # fmt: skip
    s.add_request(Request("d1", a, SamplingParams(max_tokens=3), kv_transfer_params=params))
    plan = s.schedule()
    assert "d1" in p2p._loading and "d1" not in off._loading
    assert s.requests["d1"].num_computed_tokens == 16
    # Reports are routed by the connector's place in the list.
    s.update_from_output(plan, None)
    s.update_from_kv_transfers(KVTransferDone(0, finished_recving=["d1"], connector=0))
    assert "d1" in s.loading
    s.update_from_kv_transfers(KVTransferDone(0, finished_recving=["d1"], connector=1))
    assert "d1" in s.loaded

    # A tie (the tier holds the whole prompt too): the first listed loads it, and p2p
    # gives the prefill instance's hold up instead of renewing it until the request ends.
    cfg.kv_transfer.kv_connector_extra_config["connectors"][0]["kv_connector_extra_config"][
        "kv_offload_bytes"
    ] = 8 * 2048
    multi = MultiConnectorScheduler(cfg.kv_transfer, cfg, 2048)
    off, p2p = multi.children
    s = _evict_a(multi)
    s.add_request(Request("d2", a, SamplingParams(max_tokens=3), kv_transfer_params=params))
    s.schedule()
    assert "d2" in off._loading and "d2" not in p2p._loading and "d2" not in p2p._queued


def test_storage_namespaces_part_what_differs(tmp_path):
    from services.kv_transfer.storage import store_dir

    def ns(**kwargs) -> str:
        cfg = EngineConfig.from_kwargs(device="cpu", **kwargs)
        kv = KVTransferConfig("storage", kv_connector_extra_config={"path": str(tmp_path)})
        return store_dir(kv, cfg).name

    assert ns(load_format="dummy", seed=1) != ns(load_format="dummy", seed=2)
    assert ns(dtype="auto") == ns(dtype="float32") == ns(dtype="float")
    assert ns(dtype="bfloat16") != ns(dtype="float32")
    assert ns(block_size=16) != ns(block_size=32)


def test_config_errors_are_clear(tmp_path):
    cfg = engine()
    with pytest.raises(ConfigError, match="kv_offload_bytes"):
        OffloadConnectorScheduler(cfg.kv_transfer, cfg, kv_block_bytes=2048)
    cfg = engine(kv_offload_bytes=100)
    with pytest.raises(ConfigError, match="holds no KV block"):
        OffloadConnectorScheduler(cfg.kv_transfer, cfg, kv_block_bytes=2048)
    with pytest.raises(ConfigError, match="put the offload connector"):
        KVTransferConfig.from_flags('{"kv_connector": "p2p"}', 1 << 30)
    assert KVTransferConfig.from_flags(None, 1 << 30).kv_connector == "offload"
    multi = KVTransferConfig.from_json(json.dumps({"kv_connector": "multi", "kv_connector_extra_config": {"connectors": [{"kv_connector": "storage"}]}}))  # fmt: skip
    cfg.kv_transfer = multi
    with pytest.raises(ConfigError, match="path"):
        MultiConnectorScheduler(multi, cfg, 2048)
    nocache = EngineConfig.from_kwargs(block_size=4, enable_prefix_caching=False)
    with pytest.raises(ConfigError, match="prefix caching"):
        OffloadConnectorScheduler(engine(kv_offload_bytes=1e6).kv_transfer, nocache, 2048)


# ---------------------------------------------------------------- end to end


def _complete(server: RemoteServer, prompt: str, **body) -> dict:
    r = httpx.post(server.url + "/v1/completions", timeout=300,
                   json={"prompt": prompt, "max_tokens": 8, "temperature": 0, **body})  # fmt: skip
    assert r.status_code == 200, r.text
    return r.json()


def _filler(i: int) -> str:
    return " ".join(f"Filler {i}.{j} has the number {j * 31 % 17}." for j in range(40))


def test_an_evicted_prefix_comes_back_from_the_host_tier():
    """A small device pool (40 blocks) under a 64 MiB host tier: a prompt's blocks are
    evicted by other prompts, then it comes again: its prefix loads from the host tier
    (external hits, not computed), and the output equals the first one's."""
    prompt = " ".join(f"Fact {i}: the river number {i} runs {i * 3 % 7} miles." for i in range(30))
    with RemoteServer(
        "--num-gpu-blocks-override", "40", "--max-model-len", "600", "--kv-offload-bytes", "64MiB"
    ) as srv:
        srv.wait_ready()
        first = _complete(srv, prompt)
        n = first["usage"]["prompt_tokens"]
        assert n > 200
        for i in range(3):  # ~500 tokens each: the pool holds 640, so the prompt is evicted
            _complete(srv, _filler(i))
        hits0 = metric(srv, "vllm:external_prefix_cache_hits_total")
        local0 = metric(srv, "vllm:prefix_cache_hits_total")
        again = _complete(srv, prompt)
        external = metric(srv, "vllm:external_prefix_cache_hits_total") - hits0
        local = metric(srv, "vllm:prefix_cache_hits_total") - local0
        assert again["choices"][0]["text"] == first["choices"][0]["text"]
        assert external >= (n // 16 - 1) * 16 - local, (external, local, n)
        assert external > 0
        assert again["usage"]["prompt_tokens_details"]["cached_tokens"] == external + local
        assert metric(srv, "vllm:kv_cache_usage_perc") == 0.0


def test_a_restarted_server_hits_the_prefix_it_saved(tmp_path):
    """storage under multi (offload first): a prompt's blocks are written to files; a new
    server over the same directory loads them instead of computing them."""
    cfg = {"kv_connector": "multi", "kv_connector_extra_config": {"connectors": [
        {"kv_connector": "offload", "kv_connector_extra_config": {"kv_offload_bytes": 1 << 24}},
        {"kv_connector": "storage", "kv_connector_extra_config": {"path": str(tmp_path)}},
    ]}}  # fmt: skip
    args = ("--kv-transfer-config", json.dumps(cfg))
    prompt = " ".join(f"Rule {i}: keep {i * 5 % 11} apples in basket {i}." for i in range(25))
    with RemoteServer(*args) as srv:
        srv.wait_ready()
        first = _complete(srv, prompt)
        n = first["usage"]["prompt_tokens"]
        # Writes trail the step that saved the blocks; a clean stop finishes them (leaving
        # the block would SIGKILL the server with writes still queued).
        srv.popen.terminate()
        assert srv.wait_exit(60) == 0, srv.log
    files = list(tmp_path.rglob("*.safetensors"))
    assert len(files) >= n // 16 - 1
    with RemoteServer(*args) as srv:
        srv.wait_ready()
        again = _complete(srv, prompt)
        assert again["choices"][0]["text"] == first["choices"][0]["text"]
        assert metric(srv, "vllm:external_prefix_cache_hits_total") >= (n // 16 - 1) * 16
        assert metric(srv, "vllm:prefix_cache_hits_total") == 0
        assert metric(srv, "vllm:kv_cache_usage_perc") == 0.0
