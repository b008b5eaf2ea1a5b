"""KV connectors (``--kv-transfer-config``), p2p: the worker halves over real sockets, the
scheduler half driving a Scheduler, the KV a pull delivers against the KV the model
computes, and prefill/decode disaggregation end to end through ``actorserve pd-proxy``."""

from __future__ import annotations

import contextlib
import json
import sys
import threading
import time
from collections.abc import Iterator

import httpx
import msgspec
import pytest
import torch

from services.config import EngineConfig, SchedulerConfig
from services.config.kv_transfer import KVTransferConfig
from services.flags import ConfigError
from services.kv_transfer.p2p import P2PConnectorScheduler, P2PConnectorWorker
from services.protocol import (
    KVLayout,
    KVTransferDone,
    P2PHold,
    P2PLoad,
    P2PMetadata,
    SamplingParams,
)
from services.request import Request, RequestStatus
from services.scheduler.scheduler import Scheduler
from tests.server_utils import RemoteServer, free_port, http_process, metric, wait_metric

_encode = msgspec.msgpack.Encoder().encode
LAYOUT = KVLayout(num_layers=2, block_size=4, num_kv_heads=2, head_dim=8, dtype="float32")


class Reports:
    """A worker half's ``report`` callable that tests can wait on."""

    def __init__(self) -> None:
        self.items: list[KVTransferDone] = []
        self._cond = threading.Condition()

    def __call__(self, done: KVTransferDone) -> None:
        with self._cond:
            self.items.append(done)
            self._cond.notify_all()

    def wait(self, field: str, req_id: str, timeout_s: float = 10.0) -> KVTransferDone:
        deadline = time.monotonic() + timeout_s
        with self._cond:
            while True:
                for done in self.items:
                    if req_id in getattr(done, field):
                        return done
                left = deadline - time.monotonic()
                assert left > 0, f"no {field} report for {req_id}: {self.items}"
                self._cond.wait(left)


def caches(fill: bool, layout: KVLayout = LAYOUT, num_blocks: int = 8) -> list:
    shape = (num_blocks, layout.block_size, layout.num_kv_heads, layout.head_dim)
    make = torch.randn if fill else torch.zeros
    return [(make(shape), make(shape)) for _ in range(layout.num_layers)]


@contextlib.contextmanager
def worker(role: str, kv_caches: list, layout: KVLayout = LAYOUT, **extra: float):
    cfg = KVTransferConfig("p2p", role, kv_port=free_port(), kv_connector_extra_config=extra)
    reports = Reports()
    w = P2PConnectorWorker(cfg, EngineConfig(), 0, reports)
    w.register_kv_caches(kv_caches, layout)
    try:
        yield w, reports
    finally:
        w.shutdown()


def _bind(w: P2PConnectorWorker, metadata: bytes) -> None:
    """What a worker rank does with a step's metadata before the forward."""
    w.bind_connector_metadata(metadata)
    w.start_load_kv()


def meta(**kwargs: list) -> bytes:
    return _encode(P2PMetadata(**kwargs))


def load(req_id: str, blocks: list[int], remote: str, remote_blocks: list[int], port: int,
         generations: list[int] | None = None) -> P2PLoad:  # fmt: skip
    gens = generations if generations is not None else [1] * len(remote_blocks)
    return P2PLoad(req_id, blocks, remote, remote_blocks, gens, "127.0.0.1", port)


# ---------------------------------------------------------------- worker halves


def test_pull_copies_the_blocks_then_releases_the_hold():
    src, dst = caches(True), caches(False)
    with worker("kv_producer", src) as (prod, sent), worker("kv_consumer", dst) as (cons, got):
        _bind(prod, meta(holds=[P2PHold("p1", [1, 3, 5], [1, 1, 1], 30.0)]))
        _bind(cons, meta(loads=[load("d1", [0, 2, 4], "p1", [1, 3, 5], prod.bound_port)]))  # fmt: skip
        done = got.wait("finished_recving", "d1")
        # 2 layers x K and V x 3 blocks x 4 slots x 2 heads x 8 dims x 4 bytes
        assert done.num_bytes == 2 * 2 * 3 * 4 * 2 * 8 * 4
        for (sk, sv), (dk, dv) in zip(src, dst, strict=True):
            assert torch.equal(dk[[0, 2, 4]], sk[[1, 3, 5]])
            assert torch.equal(dv[[0, 2, 4]], sv[[1, 3, 5]])
            assert not dk[[1, 3, 5, 6, 7]].any()  # nothing else written
        sent.wait("finished_sending", "p1")  # acknowledged: the prefill side frees them

        # The hold is over: a second pull is refused, never served from freed blocks.
        _bind(cons, meta(loads=[load("d2", [6], "p1", [1], prod.bound_port)]))
        got.wait("failed_recving", "d2")
        assert not dst[0][0][6].any()


def test_a_pull_over_nixl_reads_the_blocks_in_place():
    """transport nixl: the side channel says where the held blocks are; the decode rank
    READs them (NIXL's UCX backend, here over loopback) into its own blocks, releases the
    hold; a second pull is refused as with ZeroMQ."""
    pytest.importorskip("nixl_cu12")
    src, dst = caches(True), caches(False)
    with (
        worker("kv_producer", src, transport="nixl") as (prod, sent),
        worker("kv_consumer", dst, transport="nixl") as (cons, got),
    ):
        _bind(prod, meta(holds=[P2PHold("p1", [1, 3, 5], [1, 1, 1], 30.0)]))
        _bind(cons, meta(loads=[load("d1", [0, 2, 4], "p1", [1, 3, 5], prod.bound_port)]))  # fmt: skip
        done = got.wait("finished_recving", "d1")
        assert done.num_bytes == 2 * 2 * 3 * 4 * 2 * 8 * 4
        for (sk, sv), (dk, dv) in zip(src, dst, strict=True):
            assert torch.equal(dk[[0, 2, 4]], sk[[1, 3, 5]])
            assert torch.equal(dv[[0, 2, 4]], sv[[1, 3, 5]])
            assert not dk[[1, 3, 5, 6, 7]].any()
        sent.wait("finished_sending", "p1")
        _bind(cons, meta(loads=[load("d2", [6], "p1", [1], prod.bound_port)]))
        got.wait("failed_recving", "d2")
        assert not dst[0][0][6].any()
    # A prefill rank without NIXL refuses a NIXL pull: the decode side computes the prompt.
    with (
        worker("kv_producer", src) as (prod, _),
        worker("kv_consumer", caches(False), transport="nixl") as (cons, got),
    ):
        _bind(prod, meta(holds=[P2PHold("p1", [1], [1], 30.0)]))
        _bind(cons, meta(loads=[load("d1", [0], "p1", [1], prod.bound_port)]))
        got.wait("failed_recving", "d1")


def test_nixl_missing_or_misnamed_is_a_clear_error(monkeypatch):
    from services.kv_transfer import nixl_transport

    monkeypatch.setattr(nixl_transport, "_MODULES", ("no_such_nixl._api",))
    cfg = KVTransferConfig("p2p", "kv_consumer", kv_connector_extra_config={"transport": "nixl"})
    w = P2PConnectorWorker(cfg, EngineConfig(), 0, Reports())
    with pytest.raises(ConfigError, match="pip install --no-deps nixl-cu12"):
        w.register_kv_caches(caches(False), LAYOUT)
    w.shutdown()
    cfg.kv_connector_extra_config["transport"] = "ucx"
    with pytest.raises(ConfigError, match="transport must be one of zmq, nixl"):
        P2PConnectorWorker(cfg, EngineConfig(), 0, Reports())


def test_a_pull_naming_another_generation_is_refused():
    src, dst = caches(True), caches(False)
    with worker("kv_producer", src) as (prod, sent), worker("kv_consumer", dst) as (cons, got):
        _bind(prod, meta(holds=[P2PHold("p1", [1, 2], [4, 7], 30.0)]))
        stale = load("d1", [0, 1], "p1", [1, 2], prod.bound_port, generations=[4, 6])
        _bind(cons, meta(loads=[stale]))
        got.wait("failed_recving", "d1")
        sent.wait("finished_sending", "p1")  # the puller gave up: the blocks are freed
        assert not dst[0][0].any()


def test_an_unpulled_hold_lapses():
    with worker("kv_producer", caches(True), lease_s=0.3) as (prod, sent):
        start = time.monotonic()
        _bind(prod, meta(holds=[P2PHold("p1", [1], [1], 0.3)]))
        done = sent.wait("finished_sending", "p1")
        assert done.num_expired == 1
        assert time.monotonic() - start >= 0.3
        with worker("kv_consumer", caches(False)) as (cons, got):
            _bind(cons, meta(loads=[load("d1", [0], "p1", [1], prod.bound_port)]))
            got.wait("failed_recving", "d1")


def test_a_pull_that_overtakes_its_hold_waits_for_it():
    src, dst = caches(True), caches(False)
    with worker("kv_producer", src) as (prod, sent), worker("kv_consumer", dst) as (cons, got):
        _bind(cons, meta(loads=[load("d1", [3], "p1", [2], prod.bound_port)]))
        time.sleep(0.3)
        _bind(prod, meta(holds=[P2PHold("p1", [2], [1], 30.0)]))
        got.wait("finished_recving", "d1")
        assert torch.equal(dst[1][1][3], src[1][1][2])


def test_different_layouts_are_refused():
    other = msgspec.structs.replace(LAYOUT, block_size=8)
    with (
        worker("kv_producer", caches(True)) as (prod, _),
        worker("kv_consumer", caches(False, other), other) as (cons, got),
    ):
        _bind(prod, meta(holds=[P2PHold("p1", [1], [1], 30.0)]))
        _bind(cons, meta(loads=[load("d1", [0], "p1", [1], prod.bound_port)]))
        got.wait("failed_recving", "d1")


def test_the_side_channel_survives_what_it_cannot_serve():
    """A malformed pull is refused and a cache that cannot be read fails one pull; the
    side channel goes on serving and leases still lapse."""
    import zmq

    from services.protocol import KVPull

    kv = [(k.to("meta"), v.to("meta")) for k, v in caches(True)]  # unreadable, as a bug would
    with worker("kv_producer", kv) as (prod, sent):
        _bind(prod, meta(holds=[P2PHold("p1", [1, 2], [1, 1], 0.5)]))
        sock = zmq.Context.instance().socket(zmq.DEALER)
        sock.connect(f"tcp://127.0.0.1:{prod.bound_port}")
        try:
            for gens in ([1], [1, 1]):  # one generation short; then a valid pull
                sock.send(_encode(KVPull("p1", [1, 2], gens, LAYOUT)))
                assert sock.poll(5000)
                assert b"KVPullRefused" in sock.recv_multipart()[0]
        finally:
            sock.close(linger=0)
        assert sent.wait("finished_sending", "p1").num_expired == 1


def test_a_load_that_raises_is_reported_failed(monkeypatch):
    """Whatever breaks inside a pull (a bug, a device error), the request is reported
    failed (it recomputes) and later loads still run."""
    src, dst = caches(True), caches(False)
    with worker("kv_producer", src) as (prod, _), worker("kv_consumer", dst) as (cons, got):
        pull = cons._pull

        def first_breaks(load: P2PLoad) -> int:
            if load.req_id == "d1":
                raise RuntimeError("device error")
            return pull(load)

        monkeypatch.setattr(cons, "_pull", first_breaks)
        _bind(prod, meta(holds=[P2PHold("p2", [2], [1], 30.0)]))
        _bind(cons, meta(loads=[load("d1", [0], "p1", [1], prod.bound_port),
                                load("d2", [3], "p2", [2], prod.bound_port)]))  # fmt: skip
        got.wait("failed_recving", "d1")
        got.wait("finished_recving", "d2")
        assert torch.equal(dst[0][0][3], src[0][0][2])


def test_a_release_before_its_hold_frees_it_on_arrival():
    import zmq

    from services.protocol import KVRelease

    with worker("kv_producer", caches(True)) as (prod, sent):
        sock = zmq.Context.instance().socket(zmq.DEALER)
        sock.connect(f"tcp://127.0.0.1:{prod.bound_port}")
        sock.send(_encode(KVRelease("p1")))
        time.sleep(0.3)
        sock.close(linger=0)
        _bind(prod, meta(holds=[P2PHold("p1", [1], [1], 30.0)]))
        assert sent.wait("finished_sending", "p1", timeout_s=2).num_expired == 0


def test_a_simulated_backend_moves_no_data_and_takes_the_modelled_time():
    """The sim backend has no KV tensors: the same exchange (holds, pulls, checks,
    releases) with empty frames, then bytes / link bandwidth of simulated time."""
    layout = msgspec.structs.replace(LAYOUT, dtype="sim-bf16")
    link = (1e9, 0.0, 1.0)  # 1 GB/s, no latency, --sim-speed 1
    with worker("kv_producer", [], layout) as (prod, sent), worker("kv_consumer", [], layout) as (cons, got):  # fmt: skip
        prod.simulated_link = cons.simulated_link = link
        _bind(prod, meta(holds=[P2PHold("p1", [1, 2, 3], [1, 1, 1], 30.0)]))
        _bind(cons, meta(loads=[load("d1", [0, 1, 2], "p1", [1, 2, 3], prod.bound_port)]))  # fmt: skip
        done = got.wait("finished_recving", "d1")
        # 2 x 2 layers x 2 heads x 8 dims x 2 bytes x 4 tokens x 3 blocks
        assert done.num_bytes == 2 * 2 * 2 * 8 * 2 * 4 * 3
        assert done.seconds >= done.num_bytes / 1e9
        sent.wait("finished_sending", "p1")


def test_a_pull_from_nobody_times_out():
    with worker("kv_consumer", caches(False), pull_timeout_s=0.5) as (cons, got):
        _bind(cons, meta(loads=[load("d1", [0], "p1", [1], free_port())]))
        got.wait("failed_recving", "d1", timeout_s=5)


def test_bad_extra_config_is_a_clear_error():
    cfg = KVTransferConfig("p2p", kv_connector_extra_config={"lease_s": "soon"})
    with pytest.raises(ConfigError, match="lease_s must be a positive number"):
        P2PConnectorScheduler(cfg, EngineConfig())
    for text, match in (
        ('{"kv_connector": "nixl"}', "kv_connector must be one of p2p"),
        ('{"kv_connector": "p2p", "kv_role": "both"}', "kv_role must be one of"),
        ('{"kv_connector": "p2p", "kv_port": 70000}', "kv_port must be a port"),
        ('{"kv_connector": "p2p", "bogus": 1}', "unknown keys"),
        ("[1]", "must be a JSON object"),
    ):
        with pytest.raises(ConfigError, match=match):
            KVTransferConfig.from_json(text)


# ---------------------------------------------------------------- scheduler half

BS = 4


def scheduler(role: str, tp: int = 1, num_blocks: int = 128, max_model_len: int = 256) -> Scheduler:
    engine = EngineConfig()
    engine.parallel.tensor_parallel_size = tp
    engine.cache.block_size = BS
    connector = P2PConnectorScheduler(KVTransferConfig("p2p", role, kv_port=free_port()), engine)
    return Scheduler(
        SchedulerConfig(max_model_len=max_model_len, max_num_batched_tokens=64),
        engine.cache,
        num_blocks,
        kv_connector=connector,
    )


def remote_params(num_blocks: int, tp: int = 1) -> dict:
    return {"do_remote_prefill": True, "remote_request_id": "p1",
            "remote_block_ids": list(range(10, 10 + num_blocks)),
            "remote_block_generations": [3] * num_blocks,
            "remote_host": "127.0.0.1", "remote_port": free_port(), "tp_size": tp}  # fmt: skip


def request(req_id: str, n: int, max_tokens: int = 3, params: dict | None = None) -> Request:
    sampling = SamplingParams(max_tokens=max_tokens, ignore_eos=True)
    return Request(req_id, list(range(100, 100 + n)), sampling, kv_transfer_params=params)


def usage(s: Scheduler) -> float:
    return s.kv_cache_manager.block_pool.get_usage()


def test_decode_side_loads_then_computes_only_the_last_prompt_token():
    s = scheduler("kv_consumer")
    s.add_request(request("d1", 18, params=remote_params(5)))
    plan = s.schedule()
    assert plan.is_empty and plan.kv_connector_metadata
    (job,) = msgspec.msgpack.decode(plan.kv_connector_metadata, type=P2PMetadata).loads
    # 17 tokens (all but the last) in 5 blocks: blocks 10..14 of the prefill side
    assert job.remote_block_ids == list(range(10, 15)) and job.remote_generations == [3] * 5
    assert job.block_ids == s.kv_cache_manager.get_block_ids("d1")
    assert s.requests["d1"].status == RequestStatus.WAITING_FOR_REMOTE_KVS
    stats = s.get_stats()
    assert stats.num_waiting_reqs == 1 and stats.num_waiting_by_reason["deferred"] == 1
    assert not s.has_unfinished_requests()  # nothing to step until the load is reported
    s.check_integrity()
    s.update_from_output(plan, None)

    s.update_from_kv_transfers(KVTransferDone(0, finished_recving=["d1"]))
    plan = s.schedule()
    assert plan.num_scheduled_tokens == [1]
    assert plan.new_requests[0].num_computed_tokens == 17
    assert plan.new_requests[0].block_ids == job.block_ids
    s.check_integrity()


def test_decode_side_computes_the_prompt_when_the_load_fails():
    s = scheduler("kv_consumer")
    s.add_request(request("d1", 18, params=remote_params(5)))
    s.update_from_output(s.schedule(), None)
    s.update_from_kv_transfers(KVTransferDone(0, failed_recving=["d1"]))
    assert usage(s) == 0
    plan = s.schedule()
    assert plan.num_scheduled_tokens == [18] and plan.new_requests[0].num_computed_tokens == 0
    assert not plan.kv_connector_metadata  # never pulled again
    s.check_integrity()


def test_abort_while_loading_keeps_the_blocks_until_the_ranks_stop():
    s = scheduler("kv_consumer")
    s.add_request(request("d1", 18, params=remote_params(5)))
    s.update_from_output(s.schedule(), None)
    s.abort_requests(["d1"])
    plan = s.schedule()
    assert msgspec.msgpack.decode(plan.kv_connector_metadata, type=P2PMetadata).cancels == ["d1"]
    (out,) = s.update_from_output(plan, None)
    assert out.finish_reason == "abort"
    assert usage(s) > 0  # a rank may still be writing into them
    s.check_integrity()
    s.update_from_kv_transfers(KVTransferDone(0, failed_recving=["d1"]))
    assert usage(s) == 0 and not s.held
    s.check_integrity()


def test_prefill_side_holds_the_blocks_until_every_rank_is_done():
    s = scheduler("kv_producer", tp=2)
    s.add_request(request("p1", 18, max_tokens=1, params={"do_remote_decode": True}))
    plan = s.schedule()
    (out,) = s.update_from_output(plan, _sampled(plan))
    assert out.finish_reason == "length"
    params = out.kv_transfer_params
    table = s.kv_cache_manager.get_block_ids("p1")
    assert params["remote_block_ids"] == table and params["remote_request_id"] == "p1"
    assert params["do_remote_prefill"] and params["tp_size"] == 2
    plan = s.schedule()  # carries the hold to the workers
    (hold,) = msgspec.msgpack.decode(plan.kv_connector_metadata, type=P2PMetadata).holds
    assert hold.block_ids == table and hold.generations == params["remote_block_generations"]
    held = usage(s)
    assert held > 0
    s.update_from_kv_transfers(KVTransferDone(0, finished_sending=["p1"]))
    assert usage(s) == held  # rank 1 may still be serving its shard
    s.update_from_kv_transfers(KVTransferDone(1, finished_sending=["p1"]))
    assert usage(s) == 0
    s.check_integrity()


def test_bad_kv_transfer_params_refuse_the_request():
    s = scheduler("kv_consumer")
    with pytest.raises(ValueError, match="tensor parallel size 2"):
        s.add_request(request("d1", 8, params=remote_params(2, tp=2)))
    with pytest.raises(ValueError, match="KV blocks of 32 tokens and this one of 4"):
        s.add_request(request("d1", 8, params={**remote_params(2), "remote_block_size": 32}))
    with pytest.raises(ValueError, match="remote_block_ids must be a list, got None"):
        s.add_request(request("d2", 8, params={"do_remote_prefill": True}))
    with pytest.raises(ValueError, match="kv_role is kv_consumer"):
        s.add_request(request("d3", 8, params={"do_remote_decode": True}))
    assert not s.requests


def test_loaded_requests_never_wait_for_blocks_they_hold():
    """A load reserves the last prompt token's slot too: eight 33-token prompts (the last
    token alone in a 9th block) on 64 blocks all load, run and finish."""
    s = scheduler("kv_consumer", num_blocks=65)
    for i in range(8):
        s.add_request(
            request(f"d{i}", 33, params={**remote_params(9), "remote_request_id": f"p{i}"})
        )
    finished = set()
    for _ in range(100):
        plan = s.schedule()
        for out in s.update_from_output(plan, _sampled(plan)):
            if out.finish_reason is not None:
                finished.add(out.req_id)
        for req_id in list(s.loading):
            s.update_from_kv_transfers(KVTransferDone(0, finished_recving=[req_id]))
        s.check_integrity()
        if len(finished) == 8:
            break
    assert len(finished) == 8 and usage(s) == 0


@pytest.mark.parametrize("report_at", [39, 40, 41, 42])
def test_a_loaded_request_never_blocks_a_preempted_one(report_at):
    """The load is reported at different points of another request's decode, on a pool so
    small that it preempts: both always finish (a loaded request holds its blocks and
    runs first, so the preempted one never waits for blocks only it could free)."""
    s = scheduler("kv_consumer", num_blocks=20, max_model_len=64)
    other = Request("R", list(range(5000, 5036)), SamplingParams(max_tokens=25, ignore_eos=True))
    s.add_request(other)
    s.add_request(request("L", 33, max_tokens=3, params=remote_params(8)))
    finished: set[str] = set()
    for _ in range(300):
        # The load ends when R has this many tokens, or later: while nothing runs.
        if s.loading and (other.num_tokens >= report_at or not s.running):
            s.update_from_kv_transfers(KVTransferDone(0, finished_recving=["L"]))
        plan = s.schedule()
        for out in s.update_from_output(plan, _sampled(plan)):
            if out.finish_reason is not None:
                finished.add(out.req_id)
        s.check_integrity()
        if len(finished) == 2:
            break
    assert finished == {"R", "L"} and usage(s) == 0


def test_a_load_that_does_not_fit_waits_instead_of_computing_here():
    s = scheduler("kv_consumer", num_blocks=20, max_model_len=64)  # 19 usable
    busy = Request("busy", list(range(5000, 5040)), SamplingParams(max_tokens=20, ignore_eos=True))
    s.add_request(busy)  # 10 blocks, then more as it decodes
    plan = s.schedule()
    s.update_from_output(plan, _sampled(plan))
    s.add_request(request("d1", 41, params=remote_params(11)))  # needs 11 blocks
    plan = s.schedule()
    assert "d1" not in [r.req_id for r in plan.new_requests] and not s.loading
    assert s.requests["d1"].waiting_reason == "capacity"
    s.check_integrity()


def test_params_for_another_prompt_or_prompt_logprobs_compute_here():
    from services.kv_transfer.p2p import prompt_hash

    s = scheduler("kv_consumer")
    other = {**remote_params(5), "remote_prompt_hash": prompt_hash(list(range(7, 25)))}
    s.add_request(request("d1", 18, params=other))
    mine = {**remote_params(5), "remote_prompt_hash": prompt_hash(list(range(100, 118)))}
    logprobs = Request("d2", list(range(100, 118)), SamplingParams(max_tokens=2, prompt_logprobs=1),
                       kv_transfer_params=mine)  # fmt: skip
    s.add_request(logprobs)
    plan = s.schedule()
    assert not plan.kv_connector_metadata and not s.loading
    assert dict(zip([r.req_id for r in plan.new_requests], plan.num_scheduled_tokens,
                    strict=True)) == {"d1": 18, "d2": 18}  # fmt: skip
    s3 = scheduler("kv_consumer")
    s3.add_request(request("d3", 18, params=mine))  # the same prompt: pulled
    assert s3.schedule().kv_connector_metadata and "d3" in s3.loading


def _sampled(plan):
    from services.protocol import StepResult

    ids = [r.req_id for r in plan.new_requests] + [r.req_id for r in plan.running]
    return StepResult(plan.step_id, req_ids=ids, sampled_token_ids=[7] * len(ids))


# ---------------------------------------------------------------- real KV


def test_pulled_kv_equals_the_kv_the_decode_side_would_compute():
    """The default model computes one prompt twice (as the prefill instance, and as the
    decode instance would), and the decode side pulls the first copy over p2p."""
    from services.config import ModelArchConfig
    from services.gpu_worker.model_runner import ModelRunner
    from services.model_loader import load_hf_config, prepare_model
    from tests.test_model_runner import BLOCK_SIZE, Driver

    folder = prepare_model(None)
    config = EngineConfig.from_kwargs(num_threads=1, block_size=BLOCK_SIZE, max_model_len=256)
    config.finalize(ModelArchConfig.from_hf_config(load_hf_config(folder)))
    runner_ = ModelRunner(config, folder)
    runner_.initialize_kv_cache(16)
    driver = Driver(runner_)
    prompt = [(i * 37) % 4000 + 10 for i in range(45)]
    a = driver.add("prefill", prompt, max_new=1)
    b = driver.add("decode-would", prompt, max_new=1)
    driver.run()
    kv, layout = runner_.kv_caches_for_transfer()
    received = [(torch.zeros_like(k), torch.zeros_like(v)) for k, v in kv]
    n = -(-(len(prompt) - 1) // BLOCK_SIZE)
    local = list(range(n))
    with worker("kv_producer", kv, layout) as (prod, _), worker("kv_consumer", received, layout) as (cons, got):  # fmt: skip
        _bind(prod, meta(holds=[P2PHold("p", a.block_ids, [1] * len(a.block_ids), 30.0)]))  # fmt: skip
        _bind(cons, meta(loads=[load("d", local, "p", a.block_ids[:n], prod.bound_port)]))  # fmt: skip
        got.wait("finished_recving", "d")
    for (k, v), (rk, rv) in zip(kv, received, strict=True):
        for cache, got_cache in ((k, rk), (v, rv)):
            pulled = got_cache[local].flatten(0, 1)[: len(prompt) - 1]
            assert torch.equal(pulled, cache[a.block_ids[:n]].flatten(0, 1)[: len(prompt) - 1])
            computed = cache[b.block_ids[:n]].flatten(0, 1)[: len(prompt) - 1]
            torch.testing.assert_close(pulled, computed, rtol=1e-5, atol=1e-5)


# ---------------------------------------------------------------- end to end


@contextlib.contextmanager
def pd_proxy(prefill: RemoteServer, decode: RemoteServer) -> Iterator[str]:
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    cmd = [sys.executable, "-m", "launch.cli", "pd-proxy", "--port", str(port),
           "--prefill", prefill.url, "--decode", decode.url,
           "--health-check-interval", "0.2", "--seed", "0"]  # fmt: skip
    with http_process(cmd, url, "pd-proxy") as served:
        yield served


def _p2p(role: str, **extra: float | str) -> tuple[str, str]:
    cfg = {"kv_connector": "p2p", "kv_role": role, "kv_port": free_port(),
           "kv_connector_extra_config": extra}  # fmt: skip
    return "--kv-transfer-config", json.dumps(cfg)


def _complete(url: str, prompt: str, **body) -> dict:
    r = httpx.post(url + "/v1/completions", timeout=300,
                   json={"prompt": prompt, "max_tokens": 12, "temperature": 0, **body})  # fmt: skip
    assert r.status_code == 200, r.text
    return r.json()


@pytest.mark.slow  # make test-slow; make test runs PD on the simulated backend
def test_one_prefill_one_decode_over_nixl_matches_one_instance():
    """The same flow with NIXL moving the blocks (the decode rank READs them)."""
    pytest.importorskip("nixl_cu12")
    with (
        RemoteServer(*_p2p("kv_producer", transport="nixl")) as prefill,
        RemoteServer(*_p2p("kv_consumer", transport="nixl")) as decode,
    ):
        prefill.wait_ready()
        decode.wait_ready()
        long = " ".join(f"Item {i}: the weight is {i * 11 % 17} grams." for i in range(120))
        with pd_proxy(prefill, decode) as url:
            want = _complete(prefill.url, long, cache_salt="baseline")
            got = _complete(url, long)
            assert got["choices"][0]["text"] == want["choices"][0]["text"]
            assert got["usage"]["prompt_tokens"] > 1000
            assert metric(decode, "vllm:nixl_xfer_time_seconds_count") == 1
            assert metric(decode, "vllm:nixl_num_failed_transfers_total") == 0
            assert wait_metric(prefill, "vllm:kv_cache_usage_perc", 0.0, 30)
        assert "Initialized NIXL agent" in prefill.log and "Initialized NIXL agent" in decode.log


@pytest.mark.slow  # make test-slow; make test runs PD on the simulated backend
def test_one_prefill_one_decode_matches_one_instance():
    """The seeds' 1P1D flow through pd-proxy: greedy output equals a single instance's for
    a 15-token and a ~2,000-token prompt; the prefill side frees the blocks once pulled,
    frees a hold nobody pulls when its lease lapses, and a decode whose prefill instance
    was killed computes the prompt itself."""
    with (
        RemoteServer(*_p2p("kv_producer", lease_s=3)) as prefill,
        RemoteServer(*_p2p("kv_consumer", pull_timeout_s=2)) as decode,
    ):
        prefill.wait_ready()
        decode.wait_ready()
        short = "The quick brown fox jumps over the lazy dog because it"
        long = " ".join(f"Line {i}: the value is {i * 7 % 13}." for i in range(170))
        with pd_proxy(prefill, decode) as url:
            for prompt in (short, long):
                # The baseline on the prefill instance, with a salt: no prefix shared.
                want = _complete(prefill.url, prompt, cache_salt="baseline")
                got = _complete(url, prompt)
                assert got["choices"][0]["text"] == want["choices"][0]["text"]
                assert got["usage"]["prompt_tokens"] == want["usage"]["prompt_tokens"]
            assert want["usage"]["prompt_tokens"] >= 1900
            assert got["usage"]["prompt_tokens"] >= 1900
            assert metric(decode, "vllm:nixl_xfer_time_seconds_count") == 2
            assert wait_metric(prefill, "vllm:kv_cache_usage_perc", 0.0, 30)
            assert wait_metric(decode, "vllm:kv_cache_usage_perc", 0.0, 30)

        # A hold no decode instance pulls lapses with its lease.
        _complete(prefill.url, short + " again", max_tokens=1,
                         kv_transfer_params={"do_remote_decode": True})["kv_transfer_params"]  # fmt: skip
        assert metric(prefill, "vllm:kv_cache_usage_perc") > 0
        assert wait_metric(prefill, "vllm:kv_cache_usage_perc", 0.0, 30)
        assert metric(prefill, "vllm:nixl_num_kv_expired_reqs_total") == 1

        # kill -9 of the prefill instance: the decode side's pull fails; it computes the
        # prompt itself, answers the same text, and frees every block.
        # (Another prompt: the decode instance has the first one's blocks cached by now.)
        other = "Another list. " + long[: len(long) // 2]
        want = _complete(prefill.url, other, cache_salt="baseline")
        params = _complete(prefill.url, other, max_tokens=1,
                           kv_transfer_params={"do_remote_decode": True})["kv_transfer_params"]  # fmt: skip
        prefill.close()
        got = _complete(decode.url, other, kv_transfer_params=params)
        assert got["choices"][0]["text"] == want["choices"][0]["text"]
        assert metric(decode, "vllm:nixl_num_failed_transfers_total") == 1
        assert wait_metric(decode, "vllm:kv_cache_usage_perc", 0.0, 30)

        # Params this instance cannot honour: a 400 naming the problem, before queueing.
        r = httpx.post(decode.url + "/v1/completions", timeout=60,
                       json={"prompt": short, "kv_transfer_params": {**params, "tp_size": 2}})  # fmt: skip
        assert r.status_code == 400
        assert "tensor parallel size 2" in r.json()["error"]["message"]
        assert r.json()["error"]["param"] == "kv_transfer_params"
        for body in ({"prompt": short, "n": 2}, {"prompt": [short, long]}):
            r = httpx.post(decode.url + "/v1/completions", timeout=60,
                           json={**body, "kv_transfer_params": params})  # fmt: skip
            assert r.status_code == 400 and r.json()["error"]["param"] == "kv_transfer_params"


def test_simulated_instances_disaggregate_too():
    """1P1D on the simulated backend (the scale experiments): the decode instance pulls
    the modelled KV of every prompt, answers as one instance would (the tokens are the
    request's own, deterministic), and both sides free their blocks."""
    sim = ("--worker-backend", "sim", "--sim-model", "llama-3-8b", "--sim-hardware", "h200",
           "--kv-cache-memory-bytes", "1GiB")  # fmt: skip
    with (
        RemoteServer(*sim, *_p2p("kv_producer")) as prefill,
        RemoteServer(*sim, *_p2p("kv_consumer")) as decode,
    ):
        prefill.wait_ready()
        decode.wait_ready()
        prompt = [100 + (7 * j) % 5000 for j in range(900)]
        body = {"model": "llama-3-8b", "max_tokens": 8, "ignore_eos": True, "temperature": 0,
                "return_token_ids": True}  # fmt: skip
        with pd_proxy(prefill, decode) as url:
            got = httpx.post(url + "/v1/completions", json={**body, "prompt": prompt}, timeout=60)
        want = httpx.post(prefill.url + "/v1/completions", timeout=60,
                          json={**body, "prompt": prompt, "cache_salt": "baseline"})  # fmt: skip
        assert got.status_code == 200 and want.status_code == 200
        assert got.json()["choices"][0]["token_ids"] == want.json()["choices"][0]["token_ids"]
        # 900 prompt tokens' KV (all but the last, in whole blocks) of Llama-3-8B in bf16
        moved = metric(decode, "vllm:nixl_bytes_transferred_sum")
        assert moved == 57 * 16 * 2 * 32 * 8 * 128 * 2
        assert wait_metric(prefill, "vllm:kv_cache_usage_perc", 0.0, 30)
        assert wait_metric(decode, "vllm:kv_cache_usage_perc", 0.0, 30)
