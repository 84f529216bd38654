"""A per-minute limit as a bucket: refilled at ``limit / 60`` per second, holding ``burst``
seconds' worth.

Who calls it: the tenant limiter (:mod:`disagg_router.router.tenants.limiter`) keeps one
:class:`Bucket` per tenant and limit in memory; the shared store
(:mod:`disagg_router.router.tenants.store`) keeps the same state in Redis and reads it back as a
:class:`Usage`. The state is what the bucket owes (units taken and not yet back) as of a time;
kept in units, not as a time, so a reload that changes the limit refills what is owed at the new
rate from then on. Over any minute at most ``limit`` plus one burst is taken, and a
tenant that keeps asking gets ``limit / 60`` per second: its share, also over a few seconds, not
just on a minute's average. An amount larger than the whole burst is taken from a full bucket
(the bucket then owes the rest). Pure: the caller passes the clock; nothing here sleeps or does
I/O.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

EPSILON = 1e-9
"""Units: what float rounding may leave of a whole unit."""


@dataclass(frozen=True)
class Rate:
    """``limit`` per minute; the bucket holds ``burst_s`` seconds of it (at least one unit)."""

    limit: int
    burst_s: float

    @property
    def interval(self) -> float:
        """Seconds one unit takes to come back."""
        return 60.0 / self.limit

    @property
    def capacity(self) -> float:
        """Units a full bucket holds."""
        return max(self.limit * self.burst_s / 60.0, 1.0)


@dataclass(frozen=True)
class Usage:
    """A bucket at one moment: ``owed`` units are still to come back."""

    rate: Rate
    owed: float

    @property
    def limit(self) -> int:
        return self.rate.limit

    @property
    def remaining(self) -> int:
        """Whole units the bucket holds now."""
        return max(math.floor(self.rate.capacity - self.owed + EPSILON), 0)

    def wait_for(self, amount: int) -> float:
        """Seconds until ``amount`` fits (0.0 if it fits now)."""
        excess = self.owed - (self.rate.capacity - min(amount, self.rate.capacity))
        return max(excess * self.rate.interval, 0.0)

    @property
    def reset_s(self) -> float:
        """Seconds until the bucket is full again."""
        return self.owed * self.rate.interval


def owed_at(rate: Rate, owed: float, since: float, now: float) -> float:
    """What a bucket that owed ``owed`` units at ``since`` owes at ``now``."""
    return max(owed - max(now - since, 0.0) / rate.interval, 0.0)


def take(rate: Rate, owed: float, amount: int, force: bool) -> tuple[bool, float]:
    """One take from a bucket owing ``owed`` now: whether ``amount`` was counted (it fits, or
    ``force``: a correction, possibly negative) and what the bucket owes after (never below
    zero: a full bucket holds no more)."""
    if not force and owed > rate.capacity - min(amount, rate.capacity) + EPSILON:
        return False, owed
    return True, max(owed + amount, 0.0)


class Bucket:
    """One limit's bucket in this process."""

    def __init__(self) -> None:
        self._owed = 0.0
        self._since = 0.0

    def take(self, rate: Rate, amount: int, now: float, force: bool = False) -> tuple[bool, Usage]:
        """Count ``amount`` against ``rate`` (see :func:`take`); whether it was counted and the
        usage after."""
        owed = owed_at(rate, self._owed, self._since, now)
        counted, self._owed = take(rate, owed, amount, force)
        self._since = now
        return counted, Usage(rate, self._owed)
