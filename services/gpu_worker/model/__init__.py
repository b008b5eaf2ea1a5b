"""Model definitions. Every supported architecture (``SUPPORTED_ARCHITECTURES``) is a
Llama-family decoder served by ``LlamaForCausalLM``."""

from services.gpu_worker.model.llama import LlamaForCausalLM

__all__ = ["LlamaForCausalLM"]
