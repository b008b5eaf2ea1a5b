"""The scheduler's side of structured outputs (vLLM's StructuredOutputManager).

Each constrained request gets a matcher for its grammar. Grammars compile on a worker
thread, off the engine's busy loop; a request waits (``WAITING_FOR_GRAMMAR``) until its
matcher is ready, and ``wake`` tells the loop. Before a step goes out, the manager fills a
bitmask row (the tokens allowed next) for every constrained request that samples in it; the
workers apply the rows to the logits. The sampled tokens come back and advance the
matchers. The backend is loaded on the first constrained request (so a server that never
sees one never imports the grammar engine).

Offline (``LLM``) the grammar compiles at once, on the caller's thread: ``synchronous``.
"""

from __future__ import annotations

import json
import logging
import threading
from collections.abc import Callable, Iterable
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import TYPE_CHECKING

from services.config import StructuredOutputsConfig
from services.config.structured_outputs import UNBOUNDED
from services.protocol import ReasoningParams, StructuredOutputsParams
from services.request import Matcher
from services.structured_output.backend import (
    Constraint,
    GrammarBackend,
    GrammarError,
    VocabInfo,
    allocate_bitmask,
    choose_backend,
    load_backend,
)
from services.structured_output.reasoning import ThinkingMatcher, TokenTexts

if TYPE_CHECKING:
    from services.model_loader import TokenizerInfo
    from services.request import Request

logger = logging.getLogger(__name__)


def vocab_info(tokenizer: TokenizerInfo, model_vocab_size: int) -> VocabInfo:
    """The grammar engine's view of a model: its tokenizer, the logits' width (a model may
    pad its vocabulary past the tokenizer's; a simulated one may differ) and EOS."""
    tok = tokenizer.tokenizer
    width = max(model_vocab_size, tok.get_vocab_size(with_added_tokens=True))
    eos = (tokenizer.eos_token_id,) if tokenizer.eos_token_id is not None else ()
    return VocabInfo(tok, width, eos)


def vocab_from_folder(folder: str) -> Callable[[], VocabInfo]:
    """``vocab_info`` of an HF-style model folder, loaded when first called."""

    def load() -> VocabInfo:
        from services.model_arch import ModelArchConfig
        from services.model_loader import load_hf_config, load_tokenizer

        arch = ModelArchConfig.from_hf_config(load_hf_config(Path(folder)))
        return vocab_info(load_tokenizer(Path(folder)), arch.vocab_size)

    return load


def constraint_of(params: StructuredOutputsParams, config: StructuredOutputsConfig) -> Constraint:
    """The one constraint of valid ``params`` (``SamplingParams.validate`` checked them),
    with the server's settings: compact JSON, the bounds of a JSON constraint."""
    kind = params.kinds()[0]
    value = getattr(params, kind)
    spec = json.dumps(value) if kind == "choice" else "" if kind == "json_object" else value
    whitespace = not (params.disable_any_whitespace or config.disable_any_whitespace)
    bounds = UNBOUNDED
    if kind in ("json", "json_object"):
        bounds = config.json_bounds(params.unbounded_json, params.json_max_string_length)
    return Constraint(kind, spec, any_whitespace=whitespace, bounds=bounds)


class StructuredOutputManager:
    """Matchers for the constrained requests of one scheduler.

    ``vocab`` is called once, on the compile thread, when the first constrained request
    arrives: what the grammar engine needs of the tokenizer, and the model's vocabulary
    size (the logits' width, which the bitmask rows cover).
    """

    def __init__(
        self,
        config: StructuredOutputsConfig,
        vocab: Callable[[], VocabInfo],
        *,
        wake: Callable[[], None] | None = None,
        synchronous: bool = False,
    ) -> None:
        self.config = config  # backend "auto" picks per constraint (choose_backend)
        self._vocab = vocab
        self._vocab_info: VocabInfo | None = None
        self._backends: dict[str, GrammarBackend] = {}
        self._backend_lock = threading.Lock()
        self._wake = wake
        # Two threads: one slow grammar (compile time grows fast with a schema's size) does
        # not hold up every other constrained request; xgrammar lets go of the GIL.
        self._pool = (
            None if synchronous else ThreadPoolExecutor(2, thread_name_prefix="grammar-compile")
        )
        self._compiling: dict[str, tuple[Request, Future[Matcher]]] = {}
        self._token_texts: TokenTexts | None = None  # for thinking models' matchers

    @property
    def vocab_size(self) -> int:
        with self._backend_lock:
            if self._vocab_info is None:
                self._vocab_info = self._vocab()
            return self._vocab_info.vocab_size

    def _get_backend(self, name: str) -> GrammarBackend:
        self.vocab_size  # noqa: B018 (loads the vocabulary once)
        with self._backend_lock:
            if name not in self._backends:
                logger.info("structured outputs: loading the %s backend", name)
                assert self._vocab_info is not None
                self._backends[name] = load_backend(name, self._vocab_info)
            return self._backends[name]

    def _compile(self, constraint: Constraint, reasoning: ReasoningParams | None) -> Matcher:
        """The constraint's matcher, from the backend that takes it; ``GrammarError`` also
        for a grammar that allows nothing at all (it could only fail the request later).
        A thinking model's matcher holds the grammar back until the thinking ends
        (``reasoning.py``), unless ``enable_in_reasoning``."""
        name = choose_backend(self.config.backend, constraint, not self.config.disable_fallback)
        matcher: Matcher = self._get_backend(name).matcher(constraint)
        import numpy as np  # here: the tokenizer processes import this module, never numpy

        row = np.zeros((1, (self.vocab_size + 31) // 32), dtype=np.int32)
        matcher.fill(row, 0)
        if not row.any():
            raise GrammarError(f"the {constraint.kind} constraint allows no output at all")
        if reasoning is not None and not self.config.enable_in_reasoning:
            with self._backend_lock:
                if self._token_texts is None:
                    assert self._vocab_info is not None
                    info = self._vocab_info
                    self._token_texts = TokenTexts(info.tokenizer, info.vocab_size)
            matcher = ThinkingMatcher(matcher, reasoning, self._token_texts)
        return matcher

    # ---- requests in and out

    def add(self, request: Request) -> bool:
        """Start compiling ``request``'s grammar. True when its matcher is already set
        (synchronous); ``GrammarError`` then if the grammar is bad."""
        params = request.sampling_params.structured_outputs
        assert params is not None
        constraint = constraint_of(params, self.config)
        reasoning = request.sampling_params.reasoning
        if self._pool is None:
            request.grammar = self._compile(constraint, reasoning)
            return True
        future = self._pool.submit(self._compile, constraint, reasoning)
        self._compiling[request.req_id] = (request, future)
        if self._wake is not None:
            wake = self._wake
            future.add_done_callback(lambda _: wake())
        return False

    def discard(self, req_id: str) -> None:
        """Forget a request that finished while compiling (its result is dropped)."""
        entry = self._compiling.pop(req_id, None)
        if entry is not None:
            entry[1].cancel()

    def num_compiling(self) -> int:
        """Requests whose grammar is still compiling (not those ready to be taken)."""
        return sum(not future.done() for _, future in self._compiling.values())

    def __contains__(self, req_id: str) -> bool:
        return req_id in self._compiling

    def take_compiled(self) -> tuple[list[Request], list[tuple[Request, str | None]]]:
        """Requests whose grammar is ready (matcher set), and those whose grammar failed,
        in arrival order, with what was wrong with it (None: the engine failed, not the
        grammar); both leave the manager's care."""
        ready: list[Request] = []
        failed: list[tuple[Request, str | None]] = []
        for req_id, (request, future) in list(self._compiling.items()):
            if not future.done():
                continue
            del self._compiling[req_id]
            error = future.exception()  # never cancelled here: discard() takes those out
            if error is None:
                request.grammar = future.result()
                ready.append(request)
            elif isinstance(error, GrammarError):
                failed.append((request, str(error)))
            else:  # the engine itself (or loading it) failed: the request fails, not the server
                logger.error("structured outputs: compiling for %s failed: %r", req_id, error)
                failed.append((request, None))
        return ready, failed

    # ---- one step

    def bitmask(self, requests: Iterable[Request]) -> tuple[list[str], bytes]:
        """For constrained ``requests`` that sample in the step: their ids and one bitmask
        row each, the tokens their grammar allows next."""
        rows = [r for r in requests if r.grammar is not None]
        if not rows:
            return [], b""
        mask = allocate_bitmask(len(rows), self.vocab_size)
        for i, request in enumerate(rows):
            assert request.grammar is not None
            request.grammar.fill(mask, i)
        return [r.req_id for r in rows], mask.tobytes()

    @staticmethod
    def accept(request: Request, token_id: int) -> bool:
        """Advance ``request``'s matcher by its sampled token; False if the grammar forbids
        it (the mask and the matcher disagree: a bug, the request ends in an error)."""
        assert request.grammar is not None
        return request.grammar.accept(token_id)
