"""Blocking predicates: why a running request sits out a step.

Each is registered by name by the feature it belongs to (``Scheduler.add_blocker``); the
running pass skips a request any of them blocks, and schedules it in a later step once
none does. A request that is not running yet waits in a state of the request table
instead (its grammar compiling, its KV loading).
"""

from __future__ import annotations

from collections.abc import Callable

from services.request import Request, reaches_length

Blocker = Callable[[Request], bool]


class Blockers:
    """Named predicates in the order they were added; ``blocking`` names the first that
    holds a request back, or None."""

    def __init__(self) -> None:
        self._by_name: dict[str, Blocker] = {}

    def add(self, name: str, blocker: Blocker) -> None:
        if name in self._by_name:
            raise ValueError(f"a blocker named {name!r} is already registered")
        self._by_name[name] = blocker

    def remove(self, name: str) -> None:
        """Unregister ``name``; unknown names are ignored."""
        self._by_name.pop(name, None)

    def set(self, name: str, blocker: Blocker | None) -> None:
        """Register ``blocker`` under ``name``, replacing any; None unregisters it."""
        self.remove(name)
        if blocker is not None:
            self._by_name[name] = blocker

    def blocking(self, request: Request) -> str | None:
        return next((name for name, blocks in self._by_name.items() if blocks(request)), None)

    def __contains__(self, name: str) -> bool:
        return name in self._by_name


def num_to_compute(request: Request) -> int:
    """Tokens of the request not yet in any plan: known ones, and with async scheduling the
    ones its plans in flight sample (the workers feed those in themselves)."""
    return request.num_tokens + request.num_output_placeholders - request.num_computed_tokens


def token_in_flight(request: Request) -> bool:
    """Every token it has is in a plan: the next one is the token a plan in flight samples
    (plans in flight: pipeline parallelism, async scheduling)."""
    return num_to_compute(request) == 0


def grammar_needs_token_in_flight(request: Request) -> bool:
    """Structured outputs: its next bitmask row depends on a token a plan in flight samples."""
    return request.grammar is not None and request.num_output_placeholders > 0


def ends_in_flight(max_model_len: int) -> Blocker:
    """Async scheduling: the tokens its plans in flight sample end it (max_tokens or
    max_model_len), so no step may go past them."""

    def blocks(request: Request) -> bool:
        pending = request.num_output_placeholders
        return pending > 0 and reaches_length(request, max_model_len, pending)

    return blocks
