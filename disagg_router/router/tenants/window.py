"""A sliding minute of counts: what a per-minute limit has used, and when it frees up.

Who calls it: the tenant limiter (:mod:`disagg_router.router.tenants.limiter`) keeps one
:class:`Window` per tenant and limit in memory; the shared store
(:mod:`disagg_router.router.tenants.store`) keeps the same per-second counts in Redis and reads
them back as a :class:`Usage`. Counts are kept per whole second; a count leaves the window 60
seconds after its second began, so over any 60 seconds at most ``limit`` is taken (within one
second's granularity). Pure: the caller passes the clock; nothing here sleeps or does I/O.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

WINDOW_S = 60


@dataclass(frozen=True)
class Usage:
    """One window at ``now``: ``slots`` are (second, amount) still inside it, oldest first."""

    limit: int
    now: float
    slots: tuple[tuple[int, int], ...]

    @property
    def used(self) -> int:
        return sum(amount for _, amount in self.slots)

    @property
    def remaining(self) -> int:
        return max(self.limit - self.used, 0)

    def wait_for(self, amount: int) -> float:
        """Seconds until ``amount`` more fits (0.0 if it fits now); an amount larger than the
        limit waits for the whole window to empty."""
        excess = self.used + min(amount, self.limit) - self.limit
        if excess <= 0:
            return 0.0
        for second, leaving in self.slots:
            excess -= leaving
            if excess <= 0:
                return max(second + WINDOW_S - self.now, 0.0)
        return self.reset_s  # not reached: every count leaving makes room for any amount

    @property
    def reset_s(self) -> float:
        """Seconds until everything counted now has left the window (0.0 when empty)."""
        return max(self.slots[-1][0] + WINDOW_S - self.now, 0.0) if self.slots else 0.0


def current_second(now: float) -> int:
    return math.floor(now)


def live_slots(counts: dict[int, int], now: float) -> tuple[tuple[int, int], ...]:
    """``counts`` (second -> amount) that are inside the window at ``now``, oldest first."""
    start = current_second(now) - WINDOW_S
    return tuple(sorted((s, a) for s, a in counts.items() if s > start))


class Window:
    """The per-second counts of one limit, in this process."""

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self._counts: dict[int, int] = {}

    def usage(self, now: float) -> Usage:
        self._expire(now)
        return Usage(self.limit, now, live_slots(self._counts, now))

    def take(self, amount: int, now: float, force: bool = False) -> tuple[bool, Usage]:
        """Count ``amount`` if it fits in the limit (an amount larger than the limit fits an
        empty window), or whatever it is when ``force`` (a correction, possibly negative).
        Returns whether it was counted and the usage after."""
        before = self.usage(now)
        fits = before.used + min(amount, self.limit) <= self.limit
        if not (fits or force):
            return False, before
        second = current_second(now)
        self._counts[second] = self._counts.get(second, 0) + amount
        return True, self.usage(now)

    def _expire(self, now: float) -> None:
        start = current_second(now) - WINDOW_S
        for second in [s for s in self._counts if s <= start]:
            del self._counts[second]
