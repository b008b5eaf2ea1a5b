"""Block hashes for prefix caching: H(parent hash, the block's token ids, extra keys).

Chaining the parent hash in means a hit on block i proves that every token
from the start of the prompt up to the end of block i is the same. Only full
blocks are hashed. ``cache_salt`` is an extra key of the first block only, so
requests with different salts share nothing (and, through the chain, no later
block either).

The root (the "parent" of every first block) is fixed: ``hash_fn(seed)`` with
the seed taken from ``PYTHONHASHSEED`` when set (as vLLM does), else a
constant. vLLM draws a random root per process when ``PYTHONHASHSEED`` is
unset; we do not, because the precise router and every data-parallel replica
must compute the same hash for the same tokens to match the replicas' KV
events. Hiding what is cached from other tenants is ``cache_salt``'s job, not
the root's. ``builtin`` hashes are Python's ``hash()``: fast, but stable only
within one process unless ``PYTHONHASHSEED`` is set.
"""

from __future__ import annotations

import hashlib
import os
import pickle
from collections.abc import Callable, Sequence
from typing import Any

from services.protocol import BlockHash
from services.registry import HASH_ALGORITHMS, load

HashFn = Callable[[Any], BlockHash]

_DEFAULT_SEED = "actorserve"


def sha256(obj: Any) -> bytes:
    """sha256 of the pickled object: vLLM's default, stable across processes of one Python."""
    return hashlib.sha256(pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)).digest()


def sha256_cbor(obj: Any) -> bytes:
    """sha256 of canonical CBOR (RFC 8949 §4.2.1): reproducible from any language."""
    return hashlib.sha256(_cbor(obj)).digest()


def builtin_hash(obj: Any) -> int:
    return hash(obj)


def _cbor_head(major: int, n: int) -> bytes:
    if n < 24:
        return bytes([major << 5 | n])
    for info, size in ((24, 1), (25, 2), (26, 4), (27, 8)):
        if n < 1 << (8 * size):
            return bytes([major << 5 | info]) + n.to_bytes(size, "big")
    raise ValueError(f"integer {n} does not fit CBOR's 64-bit head")


def _cbor(obj: Any) -> bytes:
    """Canonical CBOR for the few types a block hash input holds."""
    if obj is None:
        return b"\xf6"
    if isinstance(obj, bool):
        return b"\xf5" if obj else b"\xf4"
    if isinstance(obj, int):
        return _cbor_head(0, obj) if obj >= 0 else _cbor_head(1, -1 - obj)
    if isinstance(obj, bytes):
        return _cbor_head(2, len(obj)) + obj
    if isinstance(obj, str):
        data = obj.encode()
        return _cbor_head(3, len(data)) + data
    if isinstance(obj, list | tuple):
        return _cbor_head(4, len(obj)) + b"".join(_cbor(x) for x in obj)
    raise TypeError(f"cannot CBOR-encode {type(obj).__name__} in a block hash")


def hash_block_tokens(
    hash_fn: HashFn,
    parent_block_hash: BlockHash,
    token_ids: Sequence[int],
    extra_keys: tuple[Any, ...] | None = None,
) -> BlockHash:
    """The hash of one full block, chained to its parent's (the root for a first block)."""
    return hash_fn((parent_block_hash, tuple(token_ids), extra_keys))


class BlockHasher:
    """Hashes the full blocks of a token sequence with one algorithm and block size.

    Used by the scheduler for requests (incrementally, as blocks fill) and by
    anything outside it (the precise router) that must compute the same hashes.
    """

    def __init__(self, block_size: int, algo: str = "sha256") -> None:
        self.block_size = block_size
        self.hash_fn: HashFn = load("prefix caching hash algorithm", HASH_ALGORITHMS, algo)
        self.root: BlockHash = self.hash_fn(os.environ.get("PYTHONHASHSEED") or _DEFAULT_SEED)

    def hash_blocks(
        self,
        token_ids: Sequence[int],
        cache_salt: str | None = None,
        prev_hashes: Sequence[BlockHash] = (),
    ) -> list[BlockHash]:
        """Hashes of the full blocks of ``token_ids`` after the ``len(prev_hashes)`` known ones."""
        bs = self.block_size
        start = len(prev_hashes)
        if len(token_ids) // bs <= start:
            return []  # no block filled: most appends
        parent = prev_hashes[-1] if start else self.root
        new: list[BlockHash] = []
        for i in range(start, len(token_ids) // bs):
            extra = (cache_salt,) if i == 0 and cache_salt else None
            parent = hash_block_tokens(
                self.hash_fn, parent, token_ids[i * bs : (i + 1) * bs], extra
            )
            new.append(parent)
        return new
