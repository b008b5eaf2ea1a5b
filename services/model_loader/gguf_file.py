"""Opening a GGUF file: gguf's reader, with a faster header parse.

``open_gguf`` is the one way the engine opens a GGUF file (the converter, the worker's
weight loader, the benchmarks); ``PlainViewReader`` is gguf's ``GGUFReader`` with the same
fields and tensors, read in ~0.3 s instead of ~3 s for the default model's header
(``bench/startup.py`` measures what it did to start-up).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
from gguf import GGUFReader, GGUFValueType

from services.model_loader.errors import ModelLoadError


class PlainViewReader(GGUFReader):
    """gguf's reader, its header parsed through a plain ndarray view of the memory map.

    ``GGUFReader`` reads every header value (a vocabulary is ~150,000 of them: its
    strings, types and merges) by slicing its ``np.memmap``, whose Python-level
    ``__getitem__`` and ``__array_finalize__`` cost most of the ~3 s it took to open the
    default model's file in each worker, through a recursive call per array element. The
    same slices of an ``ndarray`` view of the same mapping, and arrays of strings and
    scalars read in one loop, take ~0.3 s; fields and tensors are what gguf builds
    (tests/test_model_loader.py compares them), and tensor data is an ndarray on the same
    mapping instead of a memmap.
    """

    _plain: np.ndarray | None = None

    def _get(
        self, offset: int, dtype: Any, count: int = 1, override_order: Any = None
    ) -> np.ndarray:
        if self._plain is None:
            self._plain = self.data.view(np.ndarray)
        count, dt = int(count), np.dtype(dtype)
        arr = self._plain[offset : offset + dt.itemsize * count].view(dt)[:count]
        order = self.byte_order if override_order is None else override_order
        return arr.view(arr.dtype.newbyteorder(order))

    def _get_field_parts(
        self, orig_offs: int, raw_type: int
    ) -> tuple[int, list[np.ndarray], list[int], list[GGUFValueType]]:
        """An array's parts as gguf lays them out (the type, the length, then each element's
        parts), read in one loop instead of a recursive call per element: a vocabulary's
        strings and scores are most of the header."""
        if raw_type != GGUFValueType.ARRAY or self.byte_order != "I":
            return super()._get_field_parts(orig_offs, raw_type)
        raw_itype = self._get(orig_offs, np.uint32)
        alen = self._get(orig_offs + 4, np.uint64)
        itype, n, offs = GGUFValueType(int(raw_itype[0])), int(alen[0]), orig_offs + 12
        parts: list[np.ndarray] = [raw_itype, alen]
        nptype = self.gguf_scalar_to_np.get(itype)
        if itype == GGUFValueType.STRING:
            plain = self._plain
            assert plain is not None  # (set by the first _get)
            u64, u8 = np.dtype(np.uint64), np.dtype(np.uint8)
            for _ in range(n):
                length = plain[offs : offs + 8].view(u64)
                end = offs + 8 + int(length[0])
                parts += (length, plain[offs + 8 : end].view(u8))
                offs = end
            if offs > len(plain):
                raise ValueError("a string array runs past the end of the file")
            data = list(range(3, 2 + 2 * n, 2))
        elif nptype is not None:
            size = np.dtype(nptype).itemsize
            values = self._get(offs, nptype, n)
            if len(values) < n:
                raise ValueError("an array runs past the end of the file")
            parts += [values[i : i + 1] for i in range(n)]
            offs += size * n
            data = list(range(2, 2 + n))
        else:  # arrays of arrays
            return super()._get_field_parts(orig_offs, raw_type)
        types = [GGUFValueType.ARRAY, itype] if n else [GGUFValueType.ARRAY]
        return offs - orig_offs, parts, data, types


def open_gguf(path: Path) -> GGUFReader:
    """A memory-mapped reader; a truncated or foreign file becomes a ModelLoadError."""
    try:
        with open(path, "rb") as f:
            magic = f.read(4)
        if magic != b"GGUF":
            raise ModelLoadError(f"{path} is not a GGUF file (bad magic bytes {magic!r})")
        return PlainViewReader(path, "r")
    except ModelLoadError:
        raise
    except Exception as e:  # the reader raises ValueError, IndexError, struct errors...
        msg = str(e).splitlines()[0] if str(e) else type(e).__name__
        raise ModelLoadError(f"{path} is corrupt or truncated: {msg}") from None
