"""``storage``: prefix blocks saved to files by block hash, so a restarted server (or
another one sharing the directory) hits a prefix computed before.

Every block that enters the prefix cache is written (write-through), one safetensors
file per block and worker rank: ``PATH/<namespace>/rank<r>/<block hash>.safetensors``,
tensor ``kv`` ``[layers, 2 (K, V), block_size, heads, head_dim]``, the rank's KV layout
in the file's metadata. The namespace is a digest of what makes a block's content
(model, dtype, KV cache dtype, block size, parallel layout, prefix hash algorithm and seed), so servers
of another model or layout never read these blocks. A file is written under a temporary
name and renamed, so a crash leaves no half block; one that does not read (gone,
truncated, another layout) fails its load and the request recomputes.

At start-up the scheduler lists rank 0's directory: those hashes are stored. Blocks are
never deleted (``rm -r PATH`` empties the store). Hashes must be stable across
processes: ``--prefix-caching-hash-algo builtin`` is refused.

``kv_connector_extra_config``: ``path`` (the directory; required).
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import TYPE_CHECKING, Any

import msgspec

from services.config import DTYPES
from services.config.kv_transfer import KVTransferConfig
from services.flags import ConfigError
from services.kv_transfer.block_store import BlockStoreScheduler, BlockStoreWorker, Key
from services.protocol import BlockStoreLoad

if TYPE_CHECKING:
    import torch

    from services.config import EngineConfig
    from services.protocol import BlockHash

logger = logging.getLogger(__name__)
_SUFFIX = ".safetensors"
_MAX_WRITING = 4096  # blocks queued for the disk; past that a save is dropped
_SHUTDOWN_S = 3.0


def store_dir(config: KVTransferConfig, engine: EngineConfig) -> Path:
    """``PATH/<namespace>``: the blocks of servers whose blocks are interchangeable."""
    path = config.kv_connector_extra_config.get("path")
    if not isinstance(path, str) or not path:
        raise ConfigError(
            "--kv-transfer-config storage needs kv_connector_extra_config.path (a directory)"
        )
    model = engine.model.model or "default"
    if os.path.exists(model):
        model = os.path.realpath(model)
    dtype = DTYPES[engine.model.dtype]
    if dtype == "auto":  # the worker's rule (model_runner.resolve_dtype)
        dtype = "bfloat16" if engine.worker.resolved_device() == "cuda" else "float32"
    identity = {
        "model": model,
        "load_format": engine.model.load_format,
        "seed": engine.model.seed,  # a dummy model's weights
        "dtype": dtype,
        "block_size": engine.cache.block_size,
        "tp": engine.parallel.tensor_parallel_size,
        "pp": engine.parallel.pipeline_parallel_size,
        "hash": engine.cache.prefix_caching_hash_algo,
        "hash_seed": os.environ.get("PYTHONHASHSEED"),
    }
    kv_dtype = engine.cache.kv_cache_dtype
    if kv_dtype != "auto":  # (absent for auto: the namespaces of stores made before it)
        identity["kv_cache_dtype"] = "fp8_e4m3" if kv_dtype == "fp8" else kv_dtype
    digest = hashlib.sha256(json.dumps(identity, sort_keys=True).encode()).hexdigest()[:16]
    return Path(path).expanduser() / digest


def _key(block_hash: BlockHash) -> str:
    assert isinstance(block_hash, bytes), "storage needs digest block hashes"
    return block_hash.hex()


class StorageConnectorScheduler(BlockStoreScheduler):
    medium = "DISK"

    def __init__(
        self, config: KVTransferConfig, engine: EngineConfig, kv_block_bytes: int = 0
    ) -> None:
        super().__init__(config, engine, kv_block_bytes)
        if engine.cache.prefix_caching_hash_algo == "builtin":
            raise ConfigError(
                "--kv-transfer-config storage keeps blocks across restarts: it needs a stable "
                "--prefix-caching-hash-algo (sha256 or sha256_cbor), not builtin"
            )
        self.dir = store_dir(config, engine)
        rank0 = self.dir / "rank0"
        self._stored: set[str] = (
            {p.name.removesuffix(_SUFFIX) for p in rank0.glob("*" + _SUFFIX)}
            if rank0.is_dir()
            else set()
        )
        logger.info("storage: %d KV blocks stored in %s", len(self._stored), self.dir)

    def key_of(self, block_hash: BlockHash) -> Key | None:
        key = _key(block_hash)
        return key if key in self._stored else None

    def forget(self, block_hash: BlockHash) -> None:
        self._stored.discard(_key(block_hash))
        self.removed(block_hash)

    def on_block_cached(self, block_hash: BlockHash, block_id: int) -> None:
        key = _key(block_hash)
        if key not in self._stored:
            self._stored.add(key)
            self.save(key, block_id, block_hash)

    @property
    def num_stored(self) -> int:
        return len(self._stored)


class StorageConnectorWorker(BlockStoreWorker):
    """Saves: a copy in memory at once (the step may overwrite the block), written to its
    file by a writer thread; a load of a block still being written reads the copy. Loads
    run on a reader thread and are reported when done."""

    def __init__(self, config: KVTransferConfig, engine: Any, rank: int, report: Any) -> None:
        super().__init__(config, engine, rank, report)
        self.dir = store_dir(config, engine) / f"rank{rank}"
        self.dir.mkdir(parents=True, exist_ok=True)
        for tmp in self.dir.glob("*.tmp*"):  # a process killed mid-write left it
            if not _alive(tmp.suffix.removeprefix(".tmp")):  # not another server's
                tmp.unlink(missing_ok=True)
        self._lock = threading.Lock()
        self._writing: dict[str, torch.Tensor] = {}
        self._writer = ThreadPoolExecutor(1, thread_name_prefix="kv-storage-write")
        self._reader = ThreadPoolExecutor(1, thread_name_prefix="kv-storage-read")
        self._layout_json = ""

    def register_kv_caches(self, kv_caches: list[Any], layout: Any) -> None:
        super().register_kv_caches(kv_caches, layout)
        self._layout_json = msgspec.json.encode(layout).decode()

    def put(self, key: Key, block: torch.Tensor) -> None:
        assert isinstance(key, str)
        with self._lock:
            if len(self._writing) >= _MAX_WRITING:
                # The disk is behind: the block is not stored (a load of it fails, and
                # the request computes it).
                logger.warning(
                    "storage: %d blocks wait for the disk; not saving %s", len(self._writing), key
                )
                return
            copy = block.to("cpu", copy=True)
            self._writing[key] = copy
        self._writer.submit(self._write, key, copy)

    def _write(self, key: str, block: torch.Tensor) -> None:
        from safetensors.torch import save_file

        path = self.dir / (key + _SUFFIX)
        tmp = path.with_suffix(f".tmp{os.getpid()}")
        try:
            save_file({"kv": block}, str(tmp), metadata={"layout": self._layout_json})
            os.replace(tmp, path)
        except Exception:
            logger.exception("storage: writing block %s to %s failed", key, path)
            tmp.unlink(missing_ok=True)
        finally:
            with self._lock:
                if self._writing.get(key) is block:
                    del self._writing[key]

    def get(self, key: Key) -> torch.Tensor:
        from safetensors import safe_open

        assert isinstance(key, str)
        with self._lock:
            block = self._writing.get(key)
        if block is not None:
            return block
        with safe_open(str(self.dir / (key + _SUFFIX)), framework="pt") as f:
            if (f.metadata() or {}).get("layout") != self._layout_json:
                raise ValueError(f"block {key} was stored with another KV layout")
            return f.get_tensor("kv")

    def start_load_kv(self) -> None:
        loads, self._loads = self._loads, []
        for load in loads:
            self._reader.submit(self._load_and_report, load)

    def _load_and_report(self, load: BlockStoreLoad) -> None:
        self.report_loads([(load.req_id, self.load(load))])

    def shutdown(self, timeout_s: float = _SHUTDOWN_S) -> None:
        """Finish the loads and, for up to ``timeout_s`` (the launcher kills a worker
        that takes 5 s), the writes; blocks still queued then are not stored."""
        self._reader.shutdown(wait=True)
        self._writer.shutdown(wait=False)
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            with self._lock:
                if not self._writing:
                    return
            time.sleep(0.01)
        with self._lock:
            logger.warning("storage: %d blocks were not written in time", len(self._writing))


def _alive(pid: str) -> bool:
    try:
        os.kill(int(pid), 0)
    except (ValueError, ProcessLookupError):
        return False
    except PermissionError:
        return True
    return True
