"""Load the serving tokenizer once per process (the tokenizer and detokenizer processes share it)."""

from __future__ import annotations

import functools

from services.model_loader import TokenizerInfo, load_tokenizer, prepare_model


@functools.lru_cache(maxsize=4)
def load_serving_tokenizer(model: str | None = None, load_format: str = "auto") -> TokenizerInfo:
    """The tokenizer of ``model`` (GGUF file or HF folder; None = the default model)."""
    return load_tokenizer(prepare_model(model, load_format))
