"""The tokenizer of an HF folder, with the special-token facts the engine needs."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from tokenizers import Tokenizer

from services.model_loader.errors import ModelLoadError


@dataclass
class TokenizerInfo:
    """A ``tokenizers.Tokenizer`` plus what ``tokenizer_config.json`` says around it.

    ``encode(text)`` adds special tokens the way HF's ``tokenizer(text)`` does: whatever the
    tokenizer.json post-processor adds, and a BOS in front iff ``add_bos_token`` (never two).
    """

    tokenizer: Tokenizer
    chat_template: str | None
    bos_token: str | None
    eos_token: str | None
    bos_token_id: int | None
    eos_token_id: int | None
    add_bos_token: bool
    all_special_ids: set[int] = field(default_factory=set)
    # Named templates besides the default (HF's list form), e.g. "tool_use": chosen, as HF
    # and vLLM choose it, for a conversation that comes with tools
    named_chat_templates: dict[str, str] = field(default_factory=dict)

    def chat_template_for(self, tools: bool) -> str | None:
        if tools and "tool_use" in self.named_chat_templates:
            return self.named_chat_templates["tool_use"]
        return self.chat_template

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        # The batch path without offsets: the same ids, ~15 % faster, and it lets go of the
        # GIL for part of the work (plain ``encode`` holds it throughout: 10+ ms for a
        # 6k-token prompt, during which an event loop in another thread stands still).
        (enc,) = self.tokenizer.encode_batch_fast([text], add_special_tokens=add_special_tokens)
        ids = enc.ids
        if (
            add_special_tokens
            and self.add_bos_token
            and self.bos_token_id is not None
            and (not ids or ids[0] != self.bos_token_id)
        ):
            ids.insert(0, self.bos_token_id)
        return ids

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=skip_special_tokens)

    def bad_words_token_ids(self, words: list[str]) -> list[list[int]]:
        """vLLM's ``bad_words`` as token sequences: each word as written and, when that
        tokenizes differently, after a space (the same word mid-sentence)."""
        sequences: list[list[int]] = []
        for word in words:
            plain = self.tokenizer.encode(word.lstrip(), add_special_tokens=False).ids
            spaced = self.tokenizer.encode(" " + word.lstrip(), add_special_tokens=False).ids
            sequences += [plain] if plain else []
            if spaced and spaced != plain and (not plain or spaced[0] != plain[0]):
                sequences.append(spaced)
        return sequences


def _token_text(value: Any) -> str | None:
    # tokenizer_config.json writes a token either as a string or as a serialized AddedToken.
    if isinstance(value, dict):
        value = value.get("content")
    return value if isinstance(value, str) else None


def _named_chat_templates(cfg: dict[str, Any]) -> dict[str, str]:
    template = cfg.get("chat_template")
    if not isinstance(template, list):  # named templates: [{"name": ..., "template": ...}]
        return {}
    return {
        t["name"]: t["template"]
        for t in template
        if isinstance(t, dict) and isinstance(t.get("name"), str)
        and isinstance(t.get("template"), str)
    }  # fmt: skip


def _chat_template(folder: Path, cfg: dict[str, Any]) -> str | None:
    jinja = folder / "chat_template.jinja"
    if jinja.exists():
        return jinja.read_text(encoding="utf-8")
    template = cfg.get("chat_template")
    if isinstance(template, list):  # named templates: [{"name": ..., "template": ...}]
        named = {t.get("name"): t.get("template") for t in template if isinstance(t, dict)}
        template = named.get("default") or next(iter(named.values()), None)
    return template if isinstance(template, str) else None


def load_tokenizer(folder: Path) -> TokenizerInfo:
    """Load ``tokenizer.json`` and ``tokenizer_config.json`` from an HF folder."""
    folder = Path(folder)
    try:
        tokenizer = Tokenizer.from_file(str(folder / "tokenizer.json"))
    except Exception as e:
        msg = str(e).splitlines()[0] if str(e) else type(e).__name__
        raise ModelLoadError(f"cannot load {folder / 'tokenizer.json'}: {msg}") from None
    cfg: dict[str, Any] = {}
    cfg_path = folder / "tokenizer_config.json"
    if cfg_path.exists():
        try:
            cfg = json.loads(cfg_path.read_text(encoding="utf-8"))
        except ValueError as e:
            raise ModelLoadError(f"cannot parse {cfg_path}: {e}") from None
    bos, eos = _token_text(cfg.get("bos_token")), _token_text(cfg.get("eos_token"))
    bos_id = tokenizer.token_to_id(bos) if bos else None
    eos_id = tokenizer.token_to_id(eos) if eos else None
    special = {i for i, t in tokenizer.get_added_tokens_decoder().items() if t.special}
    special |= {i for i in (bos_id, eos_id) if i is not None}
    return TokenizerInfo(
        tokenizer=tokenizer,
        chat_template=_chat_template(folder, cfg),
        bos_token=bos,
        eos_token=eos,
        bos_token_id=bos_id,
        eos_token_id=eos_id,
        add_bos_token=bool(cfg.get("add_bos_token", False)),
        all_special_ids=special,
        named_chat_templates=_named_chat_templates(cfg),
    )
