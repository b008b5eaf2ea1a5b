"""The model folder a simulated server runs on: the simulated model's ``config.json`` (a
shipped one by name, or any HF config) with a real tokenizer (``--model``'s, or the
default model's), whose BOS and EOS ids it takes, since those come from the tokenizer.

Some architectures only the simulated backend models (``SIM_ONLY_ARCHITECTURES``:
DeepSeek-V2/V3, whose multi-head latent attention the engine does not implement). The
folder's ``config.json`` then names a supported architecture of the same layer layout
(Qwen3-MoE: routed experts, dense first layers as ``mlp_only_layers``), so that every
process of the server can read it, keeps every original field the sim worker reads (MLA's
ranks, the shared experts, fp8 weights), and says what it stands for under
``SIM_ARCHITECTURE_KEY``. The real worker never sees such a folder (``--sim-model`` is
refused without ``--worker-backend sim``), and the original config is refused by
``ModelArchConfig`` as an unsupported architecture.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import tempfile
from pathlib import Path
from typing import Any

from services.flags import ConfigError

MODELS_DIR = Path(__file__).parent / "sim_models"
_NOT_TOKENIZER = (".safetensors", ".bin", ".gguf", ".pt", ".pth")


# Modelled by the simulated backend only (the real worker refuses them): the architecture
# the sim folder's config.json names instead.
SIM_ONLY_ARCHITECTURES = {
    "DeepseekV3ForCausalLM": "Qwen3MoeForCausalLM",
    "DeepseekV2ForCausalLM": "Qwen3MoeForCausalLM",
}
SIM_ARCHITECTURE_KEY = "actorserve_sim_architecture"


def sim_engine_config(config: dict[str, Any]) -> dict[str, Any]:
    """``config`` as the engine's processes read it: unchanged for an architecture the
    engine runs; for one in ``SIM_ONLY_ARCHITECTURES`` its stand-in (module docstring).

    DeepSeek's layer ``i`` has routed experts when ``i >= first_k_dense_replace`` and
    ``i % moe_layer_freq == 0``; the others keep a dense MLP of ``intermediate_size``
    (Qwen3-MoE's ``mlp_only_layers``). ``head_dim`` is the query/key head width
    (``qk_nope_head_dim + qk_rope_head_dim``); the KV cache and attention cost are the sim
    worker's MLA terms (``services/gpu_worker/sim/cost_model.py``), not these heads'."""
    archs = config.get("architectures") or []
    arch = archs[0] if archs else ""
    if arch not in SIM_ONLY_ARCHITECTURES:
        return config
    try:
        layers = int(config["num_hidden_layers"])
        first_dense = int(config.get("first_k_dense_replace", 0))
        freq = max(1, int(config.get("moe_layer_freq", 1)))
        num_experts = int(config["n_routed_experts"])
        head_dim = int(config["qk_nope_head_dim"]) + int(config["qk_rope_head_dim"])
    except (KeyError, TypeError, ValueError) as e:
        raise ConfigError(f"{arch} config.json is missing or has a bad value for {e}") from None
    dense = [i for i in range(layers) if i < first_dense or i % freq]
    return {
        **config,
        "architectures": [SIM_ONLY_ARCHITECTURES[arch]],
        SIM_ARCHITECTURE_KEY: arch,
        "num_experts": num_experts,
        "decoder_sparse_step": 1,
        "mlp_only_layers": dense,
        "head_dim": head_dim,
        "norm_topk_prob": bool(config.get("norm_topk_prob", False)),
    }


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
    config = sim_engine_config(json.loads(sim_config_path(sim_model).read_text()))
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
