"""Admission control: a bounded number of legs per instance and a bounded wait for a slot.

Who calls it: the dispatch (:mod:`disagg_router.router.dispatch.holds`), for its P and D instance,
before any leg starts. Each instance has one :class:`Gate` (on its
:class:`~disagg_router.router.instances.state.BackendState`): at most ``max_in_flight`` slots held
at once; up to ``queue_size`` callers wait for one, each at most ``max_wait`` seconds; anyone beyond
that gets :class:`~disagg_router.router.errors.Overloaded` (429 with ``Retry-After``) at once.
A freed slot goes straight to the next waiter in the order of
:mod:`disagg_router.router.instances.fairness` (priority classes, then fair shares between
tenants). Nothing here waits without a bound.
"""

from __future__ import annotations

import asyncio
import time

from disagg_router.router.config import AdmissionConfig
from disagg_router.router.errors import Overloaded
from disagg_router.router.instances.fairness import NO_CLAIM, Claim, FairQueue, Waiter


class Slot:
    """One held slot; ``release()`` is idempotent."""

    def __init__(self, gate: Gate) -> None:
        self._gate: Gate | None = gate

    def release(self) -> None:
        gate, self._gate = self._gate, None
        if gate is not None:
            gate.release()


class Gate:
    """Admission of legs to one instance (see the module docstring)."""

    def __init__(self, config: AdmissionConfig) -> None:
        self.config = config
        self.in_use = 0
        self._queue: FairQueue[asyncio.Future[None]] = FairQueue()

    @property
    def waiting(self) -> int:
        """Callers queued for a slot now."""
        return len(self._queue)

    def has_room(self, claim: Claim = NO_CLAIM) -> bool:
        """True when a slot ``claim`` may take is free right now and no waiter may take it.

        One comparison: every change of the slots or the queue ends in :meth:`_hand_out`, so a
        waiter never stays queued while a slot it may take is free; the waiters left beside a
        free slot are those it is reserved against."""
        return self._may_take(claim, self.in_use)

    def _next(self, now: float) -> Waiter[asyncio.Future[None]] | None:
        """The waiter next in order that may take a free slot now."""
        return self._queue.peek(now, lambda c: self._may_take(c, self.in_use))

    def _may_take(self, claim: Claim, in_use: int) -> bool:
        """Whether ``claim`` may take a slot while ``in_use`` are taken: the last
        ``reserved_for_high`` slots are the high priority class's alone."""
        c = self.config
        reserved = 0 if claim.priority == 0 else c.reserved_for_high
        return in_use < c.max_in_flight - reserved

    async def acquire(
        self, label: str, max_wait: float | None = None, claim: Claim = NO_CLAIM
    ) -> tuple[Slot, float]:
        """A slot and the seconds waited for it; :class:`Overloaded` beyond the bounds.

        ``max_wait``: wait at most this long (default, and at most: ``config.max_wait``), for a
        caller whose admission already spent part of its wait elsewhere. ``claim``: who waits,
        which places it in the queue (:mod:`disagg_router.router.instances.fairness`)."""
        c = self.config
        wait = c.max_wait if max_wait is None else min(max(max_wait, 0.0), c.max_wait)
        if self.has_room(claim):
            self.in_use += 1
            return Slot(self), 0.0
        if self.waiting >= c.queue_size:
            raise Overloaded(
                f"instance {label} is at capacity and its queue is full",
                retry_after=c.retry_after,
            )
        start = time.monotonic()
        handed: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        waiter = self._queue.push(handed, claim, start)
        self._hand_out()  # a reserved slot may be free for this one while others wait
        try:
            async with asyncio.timeout(wait):
                await asyncio.shield(handed)
        except BaseException as exc:
            self._give_up(waiter, handed)
            if isinstance(exc, TimeoutError):
                raise Overloaded(
                    f"no slot on instance {label} within {c.max_wait:g}s",
                    retry_after=c.retry_after,
                ) from exc
            raise
        return Slot(self), time.monotonic() - start

    def _give_up(self, waiter: Waiter[asyncio.Future[None]], handed: asyncio.Future[None]) -> None:
        """A caller leaves the queue (timed out, cancelled): a slot handed to it meanwhile goes
        to the next one."""
        if handed.done():
            self.release()
        else:
            handed.cancel()
            self._queue.remove(waiter)

    def release(self) -> None:
        """A slot is given back: it goes to the waiters in order (:meth:`_hand_out`)."""
        self.in_use -= 1
        self._hand_out()

    def _hand_out(self) -> None:
        """Free slots to the waiters next in order that may take them (a slot reserved for the
        high class goes to a high request only)."""
        while self._queue:
            waiter = self._next(time.monotonic())
            if waiter is None:
                return
            self._queue.remove(waiter)
            self.in_use += 1
            waiter.item.set_result(None)
