"""Passive health of one instance: a circuit breaker fed by the outcomes of real legs.

Who calls it: each :class:`disagg_router.router.instances.state.BackendState` holds one; the
dispatch records each leg's outcome (:meth:`Breaker.record_success`,
:meth:`Breaker.record_failure`); the pools route only to instances whose breaker admits legs; the
health monitor sends a half-open probe to an open instance once its backoff has passed and reports
it through :meth:`Breaker.probe_passed` or :meth:`Breaker.record_failure`.

States: ``closed`` (in rotation), ``open`` (out for ``backoff`` seconds), ``half_open`` (the
monitor's probe runs), ``trial`` (the probe passed: the instance takes real legs again, one at a
time, see :attr:`disagg_router.router.instances.state.BackendState.routable`). A probe is not a real
leg (an instance can pass every probe and still fail every leg), so only a real leg's success closes
the breaker; a failed probe or a failed trial leg opens it again with the backoff doubled (up to
``max_backoff``), so an instance that keeps failing real legs gets ever fewer of them. The backoff
resets when the breaker closes. ``failure_threshold`` consecutive failures open a closed breaker (an
unreachable instance opens it at once).

``on_change(open)`` is called on every change between closed and not closed (the breaker gauge
follows it); it must not raise or await. Single event loop: no locking.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Literal

from disagg_router.router.config import BreakerConfig

BreakerState = Literal["closed", "open", "half_open", "trial"]


def _ignore(_: bool) -> None:
    return None


class Breaker:
    """Closed (in rotation) or open (out, until a probe after ``backoff`` passes and then a real
    leg succeeds)."""

    def __init__(
        self,
        config: BreakerConfig,
        clock: Callable[[], float] = time.monotonic,
        on_change: Callable[[bool], None] = _ignore,
    ) -> None:
        self.config = config
        self._clock = clock
        self.on_change = on_change
        self.failures = 0  # consecutive
        self.opened_at: float | None = None
        self.backoff = config.backoff
        self.probing = False
        self.on_trial = False
        self.last_error: str | None = None

    @property
    def state(self) -> BreakerState:
        if self.opened_at is None:
            return "closed"
        if self.probing:
            return "half_open"
        return "trial" if self.on_trial else "open"

    @property
    def closed(self) -> bool:
        return self.opened_at is None

    @property
    def admits(self) -> bool:
        """True when real legs may go to the instance (closed, or on trial)."""
        return self.opened_at is None or self.on_trial

    def probe_due(self) -> bool:
        """True when the breaker is open, its backoff has passed and no probe or trial runs."""
        if self.opened_at is None or self.probing or self.on_trial:
            return False
        return self._clock() - self.opened_at >= self.backoff

    def begin_probe(self) -> None:
        self.probing = True

    def probe_passed(self) -> None:
        """The half-open probe passed: real legs may try the instance (the next one decides)."""
        if self.opened_at is None:
            return
        self.probing = False
        self.on_trial = True

    def record_success(self) -> None:
        """A real leg succeeded: close, forget the failures, reset the backoff."""
        was_open = self.opened_at is not None
        self.failures = 0
        self.opened_at = None
        self.probing = False
        self.on_trial = False
        self.backoff = self.config.backoff
        self.last_error = None
        if was_open:
            self.on_change(False)

    def record_failure(self, reason: str, *, trip: bool = False) -> bool:
        """A leg or probe failed; True when this opened (or re-opened) the breaker."""
        self.failures += 1
        self.last_error = reason
        if self.probing or self.on_trial:  # the probe or the trial leg failed: back off longer
            self.probing = self.on_trial = False
            self.backoff = min(self.backoff * 2, self.config.max_backoff)
            self.opened_at = self._clock()
            return True
        if self.opened_at is None and (trip or self.failures >= self.config.failure_threshold):
            self.opened_at = self._clock()
            self.on_change(True)
            return True
        return False
