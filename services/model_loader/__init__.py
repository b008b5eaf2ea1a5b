"""Model loading: every model becomes a Hugging Face folder (a GGUF file is converted once).

``prepare_model`` resolves ``--model``/``--load-format`` to that folder; everything downstream
reads it with ``load_hf_config``, ``iter_weights`` (or ``dummy_weights``) and ``load_tokenizer``.
A CPU worker serving a GGUF model reads the weights from the file itself instead
(``gguf_convert.iter_gguf_weights``): quantized matrices come as their blocks (``GGUFBlocks``).
"""

from services.model_loader.errors import ModelLoadError
from services.model_loader.resolve import default_model_path, prepare_engine_model, prepare_model
from services.model_loader.tokenizer import TokenizerInfo, load_tokenizer
from services.model_loader.weights import dummy_weights, iter_weights, load_hf_config

__all__ = [
    "ModelLoadError",
    "TokenizerInfo",
    "default_model_path",
    "dummy_weights",
    "iter_weights",
    "load_hf_config",
    "load_tokenizer",
    "prepare_engine_model",
    "prepare_model",
]
