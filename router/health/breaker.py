"""Passive health of one instance: a circuit breaker fed by the outcomes of real legs.

Who calls it: each :class:`router.routing.backends.BackendState` holds one; the dispatch
records each leg's outcome (:meth:`Breaker.record_success`,
:meth:`Breaker.record_failure`); the pools route only to instances whose breaker is closed; the
health monitor sends a half-open probe to an open instance once its backoff has passed and
reports the probe's outcome the same way. ``failure_threshold`` consecutive failures open the
breaker (an unreachable instance opens it at once); the backoff doubles on every failed probe up
to ``max_backoff`` and resets when the breaker closes. Single event loop: no locking.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Literal

from router.config import BreakerConfig

BreakerState = Literal["closed", "open", "half_open"]


class Breaker:
    """Closed (in rotation) or open (out, until a probe after ``backoff`` succeeds)."""

    def __init__(self, config: BreakerConfig, clock: Callable[[], float] = time.monotonic) -> None:
        self.config = config
        self._clock = clock
        self.failures = 0  # consecutive
        self.opened_at: float | None = None
        self.backoff = config.backoff
        self.probing = False
        self.last_error: str | None = None

    @property
    def state(self) -> BreakerState:
        if self.opened_at is None:
            return "closed"
        return "half_open" if self.probing else "open"

    @property
    def closed(self) -> bool:
        return self.opened_at is None

    def probe_due(self) -> bool:
        """True when the breaker is open, its backoff has passed and no probe runs."""
        if self.opened_at is None or self.probing:
            return False
        return self._clock() - self.opened_at >= self.backoff

    def begin_probe(self) -> None:
        self.probing = True

    def record_success(self) -> None:
        """A leg or probe succeeded: close, forget the failures, reset the backoff."""
        self.failures = 0
        self.opened_at = None
        self.probing = False
        self.backoff = self.config.backoff
        self.last_error = None

    def record_failure(self, reason: str, *, trip: bool = False) -> bool:
        """A leg or probe failed; True when this opened (or re-opened) the breaker."""
        self.failures += 1
        self.last_error = reason
        if self.probing:  # the half-open probe failed: back off longer
            self.probing = False
            self.backoff = min(self.backoff * 2, self.config.max_backoff)
            self.opened_at = self._clock()
            return True
        if self.opened_at is None and (trip or self.failures >= self.config.failure_threshold):
            self.opened_at = self._clock()
            return True
        return False
