"""Which GGUF file a converted folder was made from (``source.json``), without torch.

The launcher, tokenizers and detokenizer resolve ``--model`` on every start (a warm start
finds the converted folder and only refreshes this record); ``gguf_convert`` holds the
conversion itself, which needs torch, numpy and gguf, and is imported only to convert.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any


def source_record(gguf_path: Path) -> dict[str, Any]:
    """``source.json``'s content for a GGUF file: its path, size and modification time."""
    st = gguf_path.stat()
    return {"gguf": str(gguf_path.resolve()), "size": st.st_size, "mtime_ns": st.st_mtime_ns}


def record_source(folder: Path, gguf_path: Path) -> None:
    """Point ``folder/source.json`` at ``gguf_path`` (a file whose digest names the folder):
    the folder is shared by every copy of the same file, and the last one prepared is the
    one known to exist now."""
    record = source_record(gguf_path)
    path = Path(folder) / "source.json"
    try:
        if json.loads(path.read_text()) == record:
            return
    except (OSError, ValueError):
        pass
    tmp = path.with_name(f".source.{os.getpid()}.tmp")
    try:
        tmp.write_text(json.dumps(record))
        os.replace(tmp, path)
    except OSError:
        tmp.unlink(missing_ok=True)  # an unwritable cache: gguf_source then finds it or not


def gguf_source(folder: Path) -> Path | None:
    """The GGUF file a converted folder was made from, when it is still there unchanged
    (same size and modification time as when it was prepared)."""
    try:
        record = json.loads((Path(folder) / "source.json").read_text())
        path = Path(record["gguf"])
        return path if source_record(path) == record else None
    except (OSError, ValueError, KeyError, TypeError):
        return None
