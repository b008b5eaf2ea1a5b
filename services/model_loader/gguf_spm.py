"""A SentencePiece vocabulary (``tokenizer.ggml.model == "llama"``) rebuilt as a ``tokenizers`` BPE.

Llama-2, TinyLlama, Mistral and CodeLlama GGUFs store SentencePiece's pieces, one score per
piece and a token type, but no merges. SentencePiece's BPE repeatedly joins the adjacent pair
whose joined piece scores highest; a ``tokenizers`` BPE whose merge ranks follow those scores
makes the same choices. Around it we rebuild what these models' own ``tokenizer.json`` holds
(the "legacy" Llama layout that ``LlamaTokenizerFast`` loads): a normalizer that prepends "▁"
and turns spaces into "▁", byte fallback to the ``<0xXX>`` pieces for characters the vocabulary
lacks, a decoder that undoes both, and the BOS the post-processor adds.
"""

from __future__ import annotations

from typing import Any

from gguf import TokenType
from tokenizers import AddedToken, Tokenizer, decoders, models, normalizers, processors

from services.model_loader.errors import ModelLoadError

SPACE = "\u2581"  # "▁", SentencePiece's spelling of a space
# Pieces SentencePiece never builds by merging (it keeps them out of its piece table).
_UNMERGEABLE = {TokenType.UNKNOWN, TokenType.CONTROL, TokenType.BYTE}


def spm_merges(tokens: list[str], scores: list[float], types: list[int]) -> list[tuple[str, str]]:
    """BPE merges, best first, that reproduce SentencePiece's score-driven merging.

    Every split of a piece into two pieces is a merge ranked by the joined piece's score. Ties
    are broken as transformers' ``generate_merges`` does (longer left, then longer right, then
    vocabulary order), so that our ids match a tokenizer transformers converted.
    """
    ids = {tok: i for i, tok in enumerate(tokens) if types[i] not in _UNMERGEABLE}
    ranked: list[tuple[float, int, int, int, int, int, str, str]] = []
    for piece, piece_id in ids.items():
        score = scores[piece_id]
        for cut in range(1, len(piece)):
            left, right = piece[:cut], piece[cut:]
            left_id, right_id = ids.get(left), ids.get(right)
            if left_id is not None and right_id is not None:
                key = (-score, -len(left), -len(right), piece_id, left_id, right_id)
                ranked.append((*key, left, right))
    ranked.sort()
    return [(left, right) for *_, left, right in ranked]


def build_spm_tokenizer(meta: dict[str, Any], *, add_bos: bool, add_eos: bool) -> Tokenizer:
    """The tokenizer ``LlamaTokenizerFast`` would be for this SentencePiece vocabulary.

    ``add_bos``/``add_eos`` put BOS/EOS around every encoding with special tokens, in the
    post-processor, as a Llama ``tokenizer.json`` does. ``tokenizer.ggml.add_space_prefix``
    (default true, as in llama.cpp) controls the "▁" put in front of each run of text.
    """
    tokens: list[str] = list(meta.get("tokenizer.ggml.tokens") or [])
    if not tokens:
        raise ModelLoadError("GGUF file has no tokenizer vocabulary")
    n = len(tokens)
    scores: list[float] = list(meta.get("tokenizer.ggml.scores") or [])
    types: list[int] = list(meta.get("tokenizer.ggml.token_type") or [TokenType.NORMAL] * n)
    if len(scores) != n or len(types) != n:
        raise ModelLoadError(
            f"GGUF SentencePiece vocabulary has {n} tokens but {len(scores)} scores "
            f"and {len(types)} token types"
        )

    def token(key: str) -> str | None:
        idx = meta.get(f"tokenizer.ggml.{key}")
        return tokens[int(idx)] if idx is not None and 0 <= int(idx) < n else None

    typed = list(zip(tokens, types, strict=True))
    unk = token("unknown_token_id")
    if unk is None:
        unk = next((t for t, kind in typed if kind == TokenType.UNKNOWN), None)
    tokenizer = Tokenizer(
        models.BPE(
            vocab={tok: i for i, tok in enumerate(tokens)},
            merges=spm_merges(tokens, scores, types),
            unk_token=unk,
            fuse_unk=True,
            byte_fallback=True,
        )
    )

    # Prepend is a normalizer, not Metaspace, so text after a special token gets its "▁" too,
    # which is what llama.cpp and the legacy Llama tokenizer.json (the one users compare with) do.
    add_prefix = bool(meta.get("tokenizer.ggml.add_space_prefix", True))
    spaces = normalizers.Replace(" ", SPACE)
    tokenizer.normalizer = (
        normalizers.Sequence([normalizers.Prepend(SPACE), spaces]) if add_prefix else spaces
    )
    steps = [decoders.Replace(SPACE, " "), decoders.ByteFallback(), decoders.Fuse()]
    if add_prefix:
        steps.append(decoders.Strip(" ", 1, 0))
    tokenizer.decoder = decoders.Sequence(steps)

    # As in a Llama tokenizer.json: <unk>, <s>, </s> special (skipped when decoding), and
    # USER_DEFINED pieces matched whole in the text, as SentencePiece and llama.cpp do.
    special = (TokenType.CONTROL, TokenType.UNKNOWN)
    tokenizer.add_special_tokens(
        [AddedToken(t, special=True, normalized=False) for t, k in typed if k in special]
    )
    tokenizer.add_tokens(
        [AddedToken(t, normalized=False) for t, k in typed if k == TokenType.USER_DEFINED]
    )
    tokenizer.post_processor = _post_processor(
        token("bos_token_id") if add_bos else None,
        token("eos_token_id") if add_eos else None,
        tokenizer,
    )
    return tokenizer


def _post_processor(
    bos: str | None, eos: str | None, tokenizer: Tokenizer
) -> processors.PostProcessor | None:
    """LlamaTokenizerFast's template: ``<s> $A </s>``, each side only when asked for."""
    if bos is None and eos is None:
        return None
    single = " ".join([*([f"{bos}:0"] if bos else []), "$A:0", *([f"{eos}:0"] if eos else [])])
    pair = " ".join([*([f"{bos}:1"] if bos else []), "$B:1", *([f"{eos}:1"] if eos else [])])
    return processors.TemplateProcessing(
        single=single,
        pair=f"{single} {pair}",
        special_tokens=[(t, tokenizer.token_to_id(t)) for t in dict.fromkeys([bos, eos]) if t],
    )
