"""Admission control: a bounded number of legs per instance and a bounded wait for a slot.

Who calls it: the dispatch (:mod:`disagg_router.router.dispatch.holds`), for its P and D instance,
before any leg starts. Each instance has one :class:`Gate` (on its
:class:`~disagg_router.router.instances.state.BackendState`): at most ``max_in_flight`` slots held
at once; up to ``queue_size`` callers wait for one, each at most ``max_wait`` seconds; anyone beyond
that gets :class:`~disagg_router.router.errors.Overloaded` (429 with ``Retry-After``) at once.
Nothing here waits without a bound.
"""

from __future__ import annotations

import asyncio
import time

from disagg_router.router.config import AdmissionConfig
from disagg_router.router.errors import Overloaded


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
        self._free = asyncio.Semaphore(config.max_in_flight)
        self.in_use = 0
        self.waiting = 0

    def has_room(self) -> bool:
        """True when a slot is free right now and nobody queues for one."""
        return self.in_use < self.config.max_in_flight and self.waiting == 0

    async def acquire(self, label: str, max_wait: float | None = None) -> tuple[Slot, float]:
        """A slot and the seconds waited for it; :class:`Overloaded` beyond the bounds.

        ``max_wait``: wait at most this long (default, and at most: ``config.max_wait``), for a
        caller whose admission already spent part of its wait elsewhere."""
        c = self.config
        wait = c.max_wait if max_wait is None else min(max(max_wait, 0.0), c.max_wait)
        if self.has_room():
            await self._free.acquire()  # cannot block: a slot is free and nobody queues
            self.in_use += 1
            return Slot(self), 0.0
        if self.waiting >= c.queue_size:
            raise Overloaded(
                f"instance {label} is at capacity and its queue is full",
                retry_after=c.retry_after,
            )
        start = time.monotonic()
        self.waiting += 1
        try:
            await asyncio.wait_for(self._free.acquire(), wait)
        except TimeoutError as exc:
            raise Overloaded(
                f"no slot on instance {label} within {c.max_wait:g}s", retry_after=c.retry_after
            ) from exc
        finally:
            self.waiting -= 1
        self.in_use += 1
        return Slot(self), time.monotonic() - start

    def release(self) -> None:
        self.in_use -= 1
        self._free.release()
