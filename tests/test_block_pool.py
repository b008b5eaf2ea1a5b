"""Block hashing, the free-block queue, the block pool and the KV cache manager."""

from __future__ import annotations

import hashlib
import logging
import pickle
import random

import pytest

from services.config import ConfigError
from services.kv_cache.block_hash import BlockHasher, _cbor, sha256_cbor
from services.kv_cache.block_pool import BlockPool
from services.kv_cache.capacity import check_kv_capacity
from services.kv_cache.free_block_queue import FreeBlockQueue, KVCacheBlock
from services.kv_cache.manager import KVCacheManager
from services.kv_cache.metrics import KVCacheMetrics
from services.protocol import BlockRemoved, BlockStored, SamplingParams
from services.request import Request

# ---------------------------------------------------------------- hashing


def test_hash_chains_through_the_parent():
    hasher = BlockHasher(block_size=4)
    base = hasher.hash_blocks([1, 2, 3, 4, 5, 6, 7, 8, 9])
    assert len(base) == 2  # the partial third block is not hashed
    # Independent reference: vLLM's recipe, sha256 over the pickled (parent, tokens, extra).
    h0 = hashlib.sha256(pickle.dumps((hasher.root, (1, 2, 3, 4), None), protocol=5)).digest()
    h1 = hashlib.sha256(pickle.dumps((h0, (5, 6, 7, 8), None), protocol=5)).digest()
    assert base == [h0, h1]
    # Same second block after a different first block: a different hash.
    other = hasher.hash_blocks([0, 2, 3, 4, 5, 6, 7, 8])
    assert other[0] != base[0] and other[1] != base[1]
    # Incremental hashing continues the chain.
    assert hasher.hash_blocks([1, 2, 3, 4, 5, 6, 7, 8], prev_hashes=base[:1]) == base[1:]


@pytest.mark.parametrize("algo", ["sha256", "sha256_cbor", "builtin"])
def test_every_algorithm_is_deterministic_and_prefix_sensitive(algo):
    a, b = BlockHasher(4, algo), BlockHasher(4, algo)
    tokens = list(range(12))
    assert a.hash_blocks(tokens) == b.hash_blocks(tokens)
    assert a.hash_blocks(tokens)[2] != a.hash_blocks([99] + tokens[1:])[2]


def test_cbor_is_canonical():
    # Encodings from RFC 8949 Appendix A.
    assert _cbor(0) == bytes.fromhex("00")
    assert _cbor(23) == bytes.fromhex("17")
    assert _cbor(24) == bytes.fromhex("1818")
    assert _cbor(1000) == bytes.fromhex("1903e8")
    assert _cbor(1000000) == bytes.fromhex("1a000f4240")
    assert _cbor(1000000000000) == bytes.fromhex("1b000000e8d4a51000")
    assert _cbor(-1000) == bytes.fromhex("3903e7")
    assert _cbor(b"\x01\x02\x03\x04") == bytes.fromhex("4401020304")
    assert _cbor("IETF") == bytes.fromhex("6449455446")
    assert _cbor([1, [2, 3], [4, 5]]) == bytes.fromhex("8301820203820405")
    assert _cbor(None) == bytes.fromhex("f6")
    assert sha256_cbor((1, 2)) == hashlib.sha256(bytes.fromhex("820102")).digest()


def test_cache_salt_is_an_extra_key_of_the_first_block_only():
    hasher = BlockHasher(4)
    tokens = list(range(8))
    plain = hasher.hash_blocks(tokens)
    salted = hasher.hash_blocks(tokens, cache_salt="tenant")
    assert salted[0] != plain[0] and salted[1] != plain[1]  # the chain carries it on
    assert hasher.hash_blocks(tokens, cache_salt="tenant") == salted
    assert hasher.hash_blocks(tokens, cache_salt="other")[0] != salted[0]
    h0 = hashlib.sha256(pickle.dumps((hasher.root, (0, 1, 2, 3), ("tenant",)), protocol=5))
    h1 = hashlib.sha256(pickle.dumps((h0.digest(), (4, 5, 6, 7), None), protocol=5))
    assert salted == [h0.digest(), h1.digest()]


# ---------------------------------------------------------------- free block queue


def test_free_block_queue_is_a_linked_list_with_o1_removal():
    blocks = [KVCacheBlock(i) for i in range(5)]
    queue = FreeBlockQueue(blocks)
    queue.remove(blocks[2])
    queue.remove(blocks[0])
    assert [b.block_id for b in queue] == [1, 3, 4] and len(queue) == 3
    queue.append(blocks[2])
    assert queue.popleft() is blocks[1]
    assert [b.block_id for b in queue] == [3, 4, 2]
    assert queue.popleft_n(3) == [blocks[3], blocks[4], blocks[2]]
    with pytest.raises(ValueError):
        queue.popleft()
    with pytest.raises(ValueError):
        queue.remove(blocks[0])


# ---------------------------------------------------------------- block pool


def _pool(num_blocks=6, **kwargs) -> BlockPool:
    return BlockPool(num_blocks, block_size=2, enable_kv_cache_events=True, **kwargs)


def _cache(pool: BlockPool, blocks, hashes, tokens=None) -> None:
    tokens = tokens or list(range(2 * len(blocks)))
    pool.cache_full_blocks(blocks, hashes, 0, len(blocks), tokens)


def test_null_block_is_never_handed_out():
    pool = _pool()
    assert pool.num_usable_blocks == 5
    assert sorted(b.block_id for b in pool.get_new_blocks(5)) == [1, 2, 3, 4, 5]
    with pytest.raises(ValueError):
        pool.get_new_blocks(1)


def test_lru_eviction_order_and_lazy_eviction():
    pool = _pool()
    a = pool.get_new_blocks(2)
    b = pool.get_new_blocks(2)
    _cache(pool, a, [b"a0", b"a1"])
    _cache(pool, b, [b"b0", b"b1"])
    pool.take_events()
    pool.free_blocks(reversed(a))  # a freed first: a1, a0 at the head
    pool.free_blocks(reversed(b))
    assert pool.get_cached_block(b"a0") is a[0]  # freed but still a hit
    assert [blk.block_id for blk in pool.free_block_queue] == [
        5,
        a[1].block_id,
        a[0].block_id,
        b[1].block_id,
        b[0].block_id,
    ]
    got = pool.get_new_blocks(2)  # the plain free block, then the LRU cached one
    assert [blk.block_id for blk in got] == [5, a[1].block_id]
    assert pool.get_cached_block(b"a1") is None and pool.get_cached_block(b"a0") is a[0]
    assert pool.take_events() == [BlockRemoved(block_hashes=[b"a1"])]
    assert got[1].block_hash is None and got[1].ref_cnt == 1
    pool.check_integrity()


def test_touch_on_hit_protects_the_block():
    pool = _pool(num_blocks=4)
    blocks = pool.get_new_blocks(2)
    _cache(pool, blocks, [b"x0", b"x1"])
    pool.free_blocks(reversed(blocks))
    hit = pool.get_cached_block(b"x0")
    pool.touch([hit])
    assert hit.ref_cnt == 1 and hit not in list(pool.free_block_queue)
    got = pool.get_new_blocks(2)  # takes everything else, never the touched block
    assert hit not in got and pool.get_cached_block(b"x0") is hit
    pool.touch([hit])
    assert hit.ref_cnt == 2
    pool.free_blocks([hit, hit])
    assert list(pool.free_block_queue) == [hit]
    pool.check_integrity()


def test_one_block_per_hash_and_stored_events_per_run():
    pool = _pool(num_blocks=8)
    first = pool.get_new_blocks(3)
    _cache(pool, first, [b"h0", b"h1", b"h2"], tokens=[0, 1, 2, 3, 4, 5])
    second = pool.get_new_blocks(3)  # same content in the middle block, new around it
    pool.cache_full_blocks(second, [b"g0", b"h1", b"g2"], 0, 3, [9, 9, 2, 3, 8, 8])
    assert pool.get_cached_block(b"h1") is first[1] and second[1].block_hash is None
    assert pool.take_events() == [
        BlockStored([b"h0", b"h1", b"h2"], None, [0, 1, 2, 3, 4, 5], 2),
        BlockStored([b"g0"], None, [9, 9], 2),
        BlockStored([b"g2"], b"h1", [8, 8], 2),
    ]
    pool.check_integrity()


def test_reset_prefix_cache_only_when_idle():
    pool = _pool()
    blocks = pool.get_new_blocks(2)
    _cache(pool, blocks, [b"r0", b"r1"])
    assert not pool.reset_prefix_cache()
    pool.free_blocks(blocks)
    pool.take_events()
    assert pool.reset_prefix_cache()
    assert pool.get_cached_block(b"r0") is None
    assert [type(e).__name__ for e in pool.take_events()] == ["AllBlocksCleared"]
    pool.check_integrity()


def test_residency_metrics_with_a_fake_clock():
    now = [0.0]
    metrics = KVCacheMetrics(sample_rate=1.0, clock=lambda: now[0], rng=random.Random(0))
    pool = _pool(num_blocks=2, metrics=metrics)
    (blk,) = pool.get_new_blocks(1)  # t=0: allocated
    _cache(pool, [blk], [b"m0"])
    now[0] = 2.0
    pool.free_blocks([blk])  # t=2: released
    now[0] = 5.0
    pool.touch([blk])  # t=5: reused, 5 s after allocation
    now[0] = 6.0
    pool.free_blocks([blk])  # t=6: released again
    now[0] = 10.0
    pool.get_new_blocks(1)  # t=10: evicted
    observed = metrics.take()
    assert observed.reuse_gap_s == [5.0]
    assert observed.block_lifetime_s == [10.0]
    assert observed.idle_before_evict_s == [4.0]
    assert metrics.take().block_lifetime_s == []


def test_residency_metrics_sample_a_share_of_blocks():
    metrics = KVCacheMetrics(sample_rate=0.25, rng=random.Random(1))
    pool = _pool(num_blocks=401, metrics=metrics)
    pool.free_blocks(pool.get_new_blocks(400))
    pool.get_new_blocks(400)
    assert 60 < len(metrics.take().block_lifetime_s) < 140


# ---------------------------------------------------------------- KV cache manager


def _request(req_id: str, tokens: list[int], hasher: BlockHasher) -> Request:
    req = Request(req_id, tokens, SamplingParams())
    req.set_block_hasher(
        lambda r: hasher.hash_blocks(r.all_token_ids, r.cache_salt, r.block_hashes)
    )
    return req


def test_manager_frees_tail_first_and_hits_the_freed_prefix():
    hasher = BlockHasher(2)
    kv = KVCacheManager(num_blocks=8, block_size=2)
    req = _request("a", [1, 2, 3, 4, 5, 6, 7], hasher)
    blocks = kv.allocate_slots(req, 7)
    assert [b.block_id for b in blocks] == [1, 2, 3, 4]
    req.num_computed_tokens = 7
    kv.cache_blocks(req)  # 3 full blocks; the 4th holds one token and stays uncached
    kv.free(req)
    order = [b.block_id for b in kv.block_pool.free_block_queue]
    assert order == [5, 6, 7, 4, 3, 2, 1]  # the chain's end is evicted first
    again = _request("b", [1, 2, 3, 4, 5, 6, 9], hasher)
    hits, num_hit = kv.get_computed_blocks(again)
    assert [b.block_id for b in hits] == [1, 2, 3] and num_hit == 6
    kv.check_integrity()


def test_allocate_slots_counts_evictable_hits_against_free_blocks():
    hasher = BlockHasher(2)
    kv = KVCacheManager(num_blocks=4, block_size=2)  # 3 usable blocks
    a = _request("a", [1, 2, 3, 4], hasher)
    kv.allocate_slots(a, 4)
    a.num_computed_tokens = 4
    kv.cache_blocks(a)
    kv.free(a)
    b = _request("b", [1, 2, 3, 4, 5, 6, 7, 8], hasher)
    hits, num_hit = kv.get_computed_blocks(b)
    assert num_hit == 4
    # 2 hit blocks (still in the free queue) + 2 new ones > 3 usable: refused, nothing changed.
    assert kv.allocate_slots(b, 4, hits, num_hit) is None
    assert b.req_id not in kv.req_to_blocks and all(h.ref_cnt == 0 for h in hits)
    assert kv.allocate_slots(b, 2, hits, num_hit) is not None
    kv.check_integrity()


# ---------------------------------------------------------------- start-up capacity


def test_capacity_log_and_error(caplog):
    log = logging.getLogger("test_capacity")
    with caplog.at_level(logging.INFO, logger="test_capacity"):
        concurrency = check_kv_capacity(40_201, 16, 40_960, log)
    assert "KV cache size: 643,200 tokens" in caplog.text
    assert "Maximum concurrency for 40,960 tokens per request: 15.70x" in caplog.text
    assert concurrency == pytest.approx(40_200 / 2560)
    with pytest.raises(ConfigError, match="lower --max-model-len to at most 1,008") as err:
        check_kv_capacity(64, 16, 2048)
    assert "\n" not in str(err.value)
