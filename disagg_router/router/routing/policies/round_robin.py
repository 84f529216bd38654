"""``round_robin``: cycles through the candidates; for identical instances and uniform requests."""

from __future__ import annotations

from collections.abc import Sequence
from typing import ClassVar

from disagg_router.router.config import LoadSignalsConfig, PoolConfig
from disagg_router.router.instances.state import BackendState
from disagg_router.router.routing.policies.base import NO_INPUT, RoutingInput, Signal


class RoundRobin:
    """Cycles through the candidates in pool order."""

    name: ClassVar[str] = "round_robin"
    settings: ClassVar[frozenset[str]] = frozenset()
    signals: ClassVar[frozenset[Signal]] = frozenset()

    def __init__(self) -> None:
        self._next = 0

    @classmethod
    def from_config(cls, config: PoolConfig, signals: LoadSignalsConfig) -> RoundRobin:
        return cls()

    def choose(
        self, candidates: Sequence[BackendState], request: RoutingInput = NO_INPUT
    ) -> BackendState:
        chosen = candidates[self._next % len(candidates)]
        self._next += 1
        return chosen
