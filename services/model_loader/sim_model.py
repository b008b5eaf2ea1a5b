"""The model folder a simulated server runs on: the simulated model's ``config.json`` (a
shipped one by name, or any HF config) with a real tokenizer (``--model``'s, or the
default model's), whose BOS and EOS ids it takes, since those come from the tokenizer."""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import tempfile
from pathlib import Path

from services.flags import ConfigError

MODELS_DIR = Path(__file__).parent / "sim_models"
_NOT_TOKENIZER = (".safetensors", ".bin", ".gguf", ".pt", ".pth")


def shipped_models() -> list[str]:
    return sorted(p.name for p in MODELS_DIR.iterdir() if (p / "config.json").exists())


def sim_config_path(sim_model: str) -> Path:
    """``--sim-model``: a shipped name, a folder with ``config.json``, or the file itself."""
    shipped = MODELS_DIR / sim_model / "config.json"
    if shipped.exists():
        return shipped
    path = Path(sim_model).expanduser()
    if path.is_dir():
        path = path / "config.json"
    if not path.is_file():
        raise ConfigError(
            f"--sim-model {sim_model!r} is neither a shipped model "
            f"({', '.join(shipped_models())}) nor an HF config.json (or its folder)"
        )
    return path


def sim_model_folder(sim_model: str, tokenizer_folder: Path) -> Path:
    """A folder (made once per content, private to this user) with the simulated model's
    config and links to the tokenizer files of ``tokenizer_folder``."""
    config = json.loads(sim_config_path(sim_model).read_text())
    tok_config = tokenizer_folder / "config.json"
    if tok_config.exists():
        tok = json.loads(tok_config.read_text())
        for key in ("bos_token_id", "eos_token_id"):
            if key in tok:
                config[key] = tok[key]
            else:
                config.pop(key, None)
    text = json.dumps(config, indent=2, sort_keys=True)
    digest = hashlib.sha256(f"{text}\n{tokenizer_folder.resolve()}".encode()).hexdigest()[:16]
    root = Path(tempfile.gettempdir()) / f"actorserve-sim-{os.getuid()}"
    root.mkdir(mode=0o700, exist_ok=True)
    name = Path(sim_model).name if not (MODELS_DIR / sim_model).exists() else sim_model
    folder = root / f"{name}-{digest}"
    if (folder / "config.json").exists():
        return folder
    staging = Path(tempfile.mkdtemp(dir=root))
    for f in tokenizer_folder.iterdir():
        if f.is_file() and f.name != "config.json" and not f.name.endswith(_NOT_TOKENIZER):
            (staging / f.name).symlink_to(f.resolve())
    (staging / "config.json").write_text(text)
    try:
        staging.rename(folder)  # atomic: a concurrent start finds it whole or not at all
    except OSError:
        shutil.rmtree(staging, ignore_errors=True)
        if not (folder / "config.json").exists():
            raise
    return folder
