"""Load-balancing policies: pick one instance of a pool for one dispatch.

Who calls it: :class:`router.backends.Pool` with the currently usable candidates (never empty).
A policy must be cheap, must not block, and must not mutate the backends it is given.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Protocol

from router.backends import BackendState


class Policy(Protocol):
    """Chooses one of ``candidates`` (non-empty, in pool order)."""

    def choose(self, candidates: Sequence[BackendState]) -> BackendState: ...


class RoundRobin:
    """Cycles through the candidates in pool order."""

    def __init__(self) -> None:
        self._next = 0

    def choose(self, candidates: Sequence[BackendState]) -> BackendState:
        chosen = candidates[self._next % len(candidates)]
        self._next += 1
        return chosen


class LeastInFlight:
    """The candidate with the fewest in-flight legs; ties are broken round-robin."""

    def __init__(self) -> None:
        self._tiebreak = RoundRobin()

    def choose(self, candidates: Sequence[BackendState]) -> BackendState:
        low = min(c.in_flight for c in candidates)
        return self._tiebreak.choose([c for c in candidates if c.in_flight == low])


POLICIES: dict[str, Callable[[], Policy]] = {
    "round_robin": RoundRobin,
    "least_in_flight": LeastInFlight,
}


def make_policy(name: str) -> Policy:
    """A fresh policy instance by config name; ``KeyError`` for unknown names (config prevents)."""
    return POLICIES[name]()
