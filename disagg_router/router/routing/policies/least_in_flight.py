"""``least_in_flight``: the fewest legs in flight from this router; for uneven request sizes."""

from __future__ import annotations

from collections.abc import Sequence
from typing import ClassVar

from disagg_router.router.config import LoadSignalsConfig, PoolConfig
from disagg_router.router.instances.state import BackendState
from disagg_router.router.routing.policies.base import NO_INPUT, RoutingInput, Signal
from disagg_router.router.routing.policies.round_robin import RoundRobin


class LeastInFlight:
    """The candidate with the fewest in-flight legs; ties are broken round-robin."""

    name: ClassVar[str] = "least_in_flight"
    settings: ClassVar[frozenset[str]] = frozenset()
    signals: ClassVar[frozenset[Signal]] = frozenset()

    def __init__(self) -> None:
        self._tiebreak = RoundRobin()

    @classmethod
    def from_config(cls, config: PoolConfig, signals: LoadSignalsConfig) -> LeastInFlight:
        return cls()

    def choose(
        self, candidates: Sequence[BackendState], request: RoutingInput = NO_INPUT
    ) -> BackendState:
        low = min(c.in_flight for c in candidates)
        return self._tiebreak.choose([c for c in candidates if c.in_flight == low])
