"""``power_of_two``: two random candidates, the less loaded wins; for instances of uneven speed,
or shared by several router replicas. Load: this router's in-flight legs and vLLM's own
queue/KV gauges (:func:`disagg_router.router.instances.load.backend_load`)."""

from __future__ import annotations

import random
import time
from collections.abc import Callable, Sequence
from typing import ClassVar

from disagg_router.router.config import LoadSignalsConfig, PoolConfig
from disagg_router.router.instances.load import backend_load
from disagg_router.router.instances.state import BackendState
from disagg_router.router.routing.policies.base import NO_INPUT, RoutingInput, Signal


class PowerOfTwo:
    """Two distinct random candidates; the one with the lower load wins (ties: the first drawn)."""

    name: ClassVar[str] = "power_of_two"
    settings: ClassVar[frozenset[str]] = frozenset()
    signals: ClassVar[frozenset[Signal]] = frozenset({"load"})

    def __init__(
        self,
        stale_after: float,
        rng: random.Random | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._stale_after = stale_after
        self._rng = rng or random.Random()
        self._clock = clock

    @classmethod
    def from_config(cls, config: PoolConfig, signals: LoadSignalsConfig) -> PowerOfTwo:
        return cls(signals.stale_after)

    def choose(
        self, candidates: Sequence[BackendState], request: RoutingInput = NO_INPUT
    ) -> BackendState:
        if len(candidates) == 1:
            return candidates[0]
        a, b = self._rng.sample(list(candidates), 2)
        now = self._clock()
        load_a = backend_load(a, now, self._stale_after)
        load_b = backend_load(b, now, self._stale_after)
        return b if load_b < load_a else a
