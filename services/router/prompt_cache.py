"""Prompts' token ids and block hashes, cached per text segment: a prompt that shares a
prefix with an earlier one is tokenized and hashed only past it.

Tokenizing a 6,000-token prompt costs ~5-7 ms of CPU in HF tokenizers (~1.4-2.2 ms where
tiktoken reads the vocabulary: ``services/tokenizer/fast_bpe.py``, for the segments after
the first), hashing its ~390 blocks ~0.5-1 ms, and a fleet's prompts mostly repeat a prefix
(a system prompt, a document, a conversation so far). A prompt is cut into segments of about ``SEGMENT_CHARS``
characters, each cut at a lone ASCII space (a non-space character before it and after
it), the first such space at or after every multiple of ``SEGMENT_CHARS``; the cuts of two
prompts agree up to where the prompts differ. The segments form a tree (each node: its
segment's token ids, and the hashes of the blocks it completes, per salt and hash
function), and a prompt is looked up from the root, segment by segment: only the
segments past the longest known path are tokenized, and only the blocks past its
hashed ones hashed.

The ids are the whole prompt's, exactly: the first segment is tokenized as the whole
prompt would be (special tokens and all), the later ones without special tokens, and a
lone space is where every pre-tokenizer the router meets starts a new piece (the
GPT-2/Llama-3/Qwen regexes, ``ByteLevel``, ``Digits``, ``Metaspace``, whitespace splits:
no piece runs across a space that has a non-space on both sides, and none of them looks
further than the next character). What could still differ (a normalizer that adds text
at the start, a template that appends an end token, an added token that strips the
spaces around it, truncation) is checked when the cache is built: a tokenizer that
tokenizes a sample whole otherwise than by segments, or has such added tokens, gets no
segments (the whole prompt is one; exact repeats are still cached). And every
``CHECK_EVERY``-th prompt of several segments is tokenized whole too (by HF) and
compared: a difference turns tiktoken off (segments, where it was already off) and is
logged. tiktoken is checked on the same sample at start-up.
"""

from __future__ import annotations

import itertools
import logging
from array import array
from collections import OrderedDict
from collections.abc import Hashable
from dataclasses import dataclass, field

from services.kv_cache.block_hash import BlockHasher
from services.model_loader import TokenizerInfo
from services.protocol import BlockHash
from services.tokenizer.fast_bpe import FastBPE

log = logging.getLogger(__name__)

SEGMENT_CHARS = 512
CAPACITY_TOKENS = 1 << 21  # ids kept (4 bytes each, plus their segments' text)
CHECK_EVERY = 64
_HASH_KEYS = 4  # hash keys (salt, block size, function) kept per node
_SAMPLE = (
    "The committee met on 12 March 2024 at 10:30.  It reviewed items 1-17 (of 20) and\n"
    'found them in order; the chair\'s note said: "Résumé: naïve café, 日本語, ¿qué?" '
    "Costs were $1,234.56 or 3.5e-3 per unit.\tNext:\n\n  indented   text,     gaps, "
    "end.\r\nwe'll see what they've done, isn't it? x+y=z; a/b\\c <tag attr='1'> "
)


def _root(add_special: bool) -> int:
    """The parent serial of a prompt's first segment (a tree per special-token choice)."""
    return -1 if add_special else -2


@dataclass(eq=False)
class _Node:
    serial: int
    parent: _Node | None
    ids: array[int]  # this segment's token ids
    n_tokens: int  # the prompt's up to this segment's end
    hashes: dict[Hashable, list[BlockHash]] = field(default_factory=dict)  # blocks it completes


@dataclass
class Plan:
    """A prompt looked up: its segments (``bounds``) and the known ones (``path``)."""

    text: str
    add_special: bool
    bounds: list[int]
    path: list[_Node]
    keys: list[tuple[int, str]]  # the path's nodes' (parent's serial, segment)
    check: bool = False  # tokenize it whole too, and compare

    @property
    def new_chars(self) -> int:
        return len(self.text) - self.bounds[len(self.path)]

    def segment(self, i: int) -> str:
        return self.text[self.bounds[i] : self.bounds[i + 1]]


class PrefixTokenCache:
    """``plan`` (looks a prompt up), ``tokenize`` (its unknown segments: pure, may run in
    a thread), ``commit`` (stores them; returns the token count and block hashes)."""

    def __init__(
        self,
        info: TokenizerInfo,
        capacity_tokens: int = CAPACITY_TOKENS,
        segment_chars: int = SEGMENT_CHARS,
    ) -> None:
        self.info = info
        self.capacity = capacity_tokens
        self.every = segment_chars
        self._nodes: OrderedDict[tuple[int, str], _Node] = OrderedDict()
        self._serial = itertools.count(1)
        self._tokens = 0
        self._plans = 0
        self.fast: FastBPE | None = None
        self.segmenting = self._segments_are_exact()  # (HF's segments)
        # Later segments through tiktoken where it reads this vocabulary as HF does.
        if self.segmenting and (fast := FastBPE.build(info.tokenizer)) is not None:
            self.fast = fast
            if not self._sample_agrees():
                log.info("router prompt cache: tiktoken tokenizes the sample otherwise than "
                         "HF tokenizers: HF's only")  # fmt: skip
                self.fast = None

    # ---- cuts

    def cuts(self, text: str) -> list[int]:
        """Where ``text``'s segments start (after the first)."""
        out: list[int] = []
        n, every = len(text), self.every
        start = every
        while start < n - 1:
            b = text.find(" ", start, n - 1)
            while b > 0 and (text[b - 1].isspace() or text[b + 1].isspace()):
                b = text.find(" ", b + 1, n - 1)
            if b < 0:
                break
            out.append(b)
            start = (b // every + 1) * every
        return out

    def _segments_are_exact(self) -> bool:
        tok = self.info.tokenizer
        if tok.truncation is not None or tok.padding is not None:
            log.info("router prompt cache: the tokenizer truncates or pads: whole prompts only")
            return False
        added = tok.get_added_tokens_decoder().values()
        if any(t.lstrip or t.rstrip or t.single_word for t in added):
            log.info("router prompt cache: added tokens strip spaces: whole prompts only")
            return False
        if not self._sample_agrees():
            log.info("router prompt cache: this tokenizer's segments differ from its whole "
                     "prompts: whole prompts only")  # fmt: skip
            return False
        return True

    def _sample_agrees(self) -> bool:
        """A sample (its added tokens in it) tokenized by segments as whole, both with
        special tokens and without."""
        added = self.info.tokenizer.get_added_tokens_decoder().values()
        specials = " ".join(t.content for t in added)
        sample = (_SAMPLE + specials + " ") * 4 + _SAMPLE
        return all(self._by_segments(sample, add_special) == self.info.encode(sample, add_special)
                   for add_special in (True, False))  # fmt: skip

    def _by_segments(self, text: str, add_special: bool) -> list[int]:
        bounds = [0, *self.cuts(text), len(text)]
        plan = Plan(text, add_special, bounds, [], [])
        return [i for ids in self.tokenize(plan) for i in ids]

    # ---- the three steps

    def plan(self, text: str, add_special: bool) -> Plan:
        bounds = [0, *(self.cuts(text) if self.segmenting else ()), len(text)]
        path: list[_Node] = []
        keys: list[tuple[int, str]] = []
        parent = _root(add_special)
        nodes = self._nodes
        for i in range(len(bounds) - 1):
            key = (parent, text[bounds[i] : bounds[i + 1]])
            node = nodes.get(key)
            if node is None:
                break
            path.append(node)
            keys.append(key)
            parent = node.serial
        plan = Plan(text, add_special, bounds, path, keys)
        if len(bounds) > 2:
            self._plans += 1
            plan.check = self._plans % CHECK_EVERY == 1
        return plan

    def tokenize(self, plan: Plan) -> list[list[int]]:
        """The token ids of the plan's unknown segments, one list each (and, for a plan to
        check, the whole prompt's last)."""
        first = len(plan.path)
        segments = [plan.segment(i) for i in range(first, len(plan.bounds) - 1)]
        out: list[list[int]] = []
        if first == 0:
            out.append(self.info.encode(segments.pop(0), plan.add_special))
        if segments and self.fast is not None:
            encoded = [self.fast.encode(s) for s in segments]
            if all(ids is not None for ids in encoded):
                out += encoded  # type: ignore[arg-type]
                segments = []
        if segments:
            tok = self.info.tokenizer
            out += [e.ids for e in tok.encode_batch_fast(segments, add_special_tokens=False)]
        if plan.check:
            out.append(self.info.encode(plan.text, plan.add_special))
        return out

    def commit(self, plan: Plan, new: list[list[int]], hasher: BlockHasher | None,
               salt: str | None) -> tuple[int, list[BlockHash]]:  # fmt: skip
        """Store the plan's new segments; the prompt's token count and block hashes (none
        without ``hasher``)."""
        if plan.check:
            whole = new.pop()
            ids = [i for node in plan.path for i in node.ids] + [i for s in new for i in s]
            if ids != whole:
                if self.fast is not None:
                    log.warning("router prompt cache: a prompt tokenized by segments (tiktoken) "
                                "differs from the whole prompt's tokens (HF): HF's only from "
                                "now on")  # fmt: skip
                    self.fast = None
                else:
                    log.warning("router prompt cache: a prompt tokenized by segments differs "
                                "from the whole prompt's tokens: whole prompts only from now "
                                "on")  # fmt: skip
                    self.segmenting = False
                self._nodes.clear()
                self._tokens = 0
                hashes = hasher.hash_blocks(whole, salt) if hasher is not None else []
                return len(whole), hashes
        path, keys, nodes = plan.path, plan.keys, self._nodes
        for k, seg_ids in enumerate(new, start=len(path)):
            parent = path[-1] if path else None
            key = (parent.serial if parent else _root(plan.add_special), plan.segment(k))
            node = nodes.get(key)
            if node is None:  # (else stored meanwhile, by a prompt with the same segments)
                before = parent.n_tokens if parent else 0
                node = _Node(next(self._serial), parent, array("I", seg_ids), before + len(seg_ids))
            path.append(node)
            keys.append(key)
        for key, node in zip(reversed(keys), reversed(path), strict=True):
            if key in nodes:  # a parent ends up fresher than its children
                nodes.move_to_end(key)
            else:  # new, or dropped since the plan
                nodes[key] = node
                self._tokens += len(node.ids)
        while self._tokens > self.capacity and len(nodes) > len(path):
            _, old = nodes.popitem(last=False)
            self._tokens -= len(old.ids)
        n_tokens = path[-1].n_tokens if path else 0
        if hasher is None:
            return n_tokens, []
        return n_tokens, self._hashes(path, hasher, salt)

    def _hashes(self, path: list[_Node], hasher: BlockHasher, salt: str | None) -> list[BlockHash]:
        """The blocks' hashes: those the path's nodes hold for this key, then the rest."""
        bs = hasher.block_size
        key = (salt, bs, hasher.hash_fn, hasher.root)
        known: list[BlockHash] = []
        j = 0
        while j < len(path) and key in path[j].hashes:
            known += path[j].hashes[key]
            j += 1
        if j == len(path):
            return known
        # The tokens from the first block not hashed yet: its start in the nodes before j
        # (their ends), then the nodes from j. The ones before it are not read: zeros.
        start = len(known) * bs
        tail: list[int] = []
        need, k = (path[j - 1].n_tokens if j else 0) - start, j - 1
        while need > 0:
            seg = path[k].ids
            take = min(need, len(seg))
            tail[:0] = seg[len(seg) - take :]
            need, k = need - take, k - 1
        ids = [0] * start + tail
        for node in path[j:]:
            ids += node.ids
        hashes = known + hasher.hash_blocks(ids, salt, known)
        done = len(known)
        for node in path[j:]:
            upto = node.n_tokens // bs
            if len(node.hashes) >= _HASH_KEYS:
                node.hashes.pop(next(iter(node.hashes)))
            node.hashes[key] = hashes[done:upto]
            done = upto
        return hashes

    def __len__(self) -> int:
        return len(self._nodes)
