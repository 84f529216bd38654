"""What one dispatch attempt holds on its instances: the in-flight count of each leg and its
admission slot.

Who calls it: :class:`disagg_router.router.dispatch.attempt.Dispatch` and its legs
(:mod:`disagg_router.router.dispatch.legs`, :mod:`disagg_router.router.dispatch.binding`). The
counts are taken by the pools when they choose the pair
(:meth:`disagg_router.router.routing.pools.Pool.choose`: choosing and counting are one step); a
:class:`Holds` takes them over, admits the pair (:meth:`Holds.admit`; a D bound late on its own,
:meth:`Holds.add`) and gives
each leg's count and slot back once (:meth:`Holds.release`) when the leg ends, and whatever is left
at the attempt's close (:meth:`Holds.release_all`). The ``disagg_router_backend_in_flight`` gauge
follows the counts. It also holds the attempt's prompt tokens in its D pool's
:class:`~disagg_router.router.instances.demand.KvDemand` from its start to its close.
"""

from __future__ import annotations

import time

from disagg_router.router.errors import RouterError
from disagg_router.router.instances.admission import Slot
from disagg_router.router.instances.demand import KvDemand
from disagg_router.router.instances.fairness import NO_CLAIM, Claim
from disagg_router.router.instances.state import BackendState, Role
from disagg_router.router.observability.metrics import RouterMetrics


class Holds:
    """The counts and slots of one attempt's legs (single event loop, no locking)."""

    def __init__(
        self,
        metrics: RouterMetrics,
        backends: list[BackendState],
        claim: Claim = NO_CLAIM,
        demand: tuple[KvDemand, int] | None = None,
    ) -> None:
        """``backends``: the attempt's P (if any) and D, each already counted by its pool;
        ``claim``: the request's tenant, which places it in the instances' queues; ``demand``:
        the D pool's KV demand and the prompt tokens to hold in it until :meth:`release_all`."""
        self._metrics = metrics
        self._claim = claim
        self._demand = demand
        if demand is not None:
            demand[0].add(demand[1])
        self._counted: dict[Role, BackendState] = {b.role: b for b in backends}
        self._slots: dict[Role, Slot] = {}
        for backend in backends:
            self._show(backend)

    def _show(self, backend: BackendState) -> None:
        m = self._metrics
        m.child(m.in_flight, backend.role, backend.label).set(backend.in_flight)

    def release(self, role: Role) -> None:
        """Give back the count and the slot of ``role``'s leg (idempotent)."""
        backend = self._counted.pop(role, None)
        if backend is not None:
            backend.in_flight -= 1
            self._show(backend)
        slot = self._slots.pop(role, None)
        if slot is not None:
            slot.release()

    def release_all(self) -> None:
        """Give back everything still held (the attempt's close)."""
        for role in list(self._counted):
            self.release(role)
        for slot in self._slots.values():
            slot.release()
        self._slots.clear()
        if self._demand is not None:
            self._demand[0].remove(self._demand[1])
            self._demand = None

    async def admit(self) -> None:
        """An admission slot on every leg's instance that has none yet; no leg holds one while
        waiting for another.

        All slots are taken in one step (no await suspends in between) once every instance has
        room. While one is full this waits in that instance's queue holding nothing; with its
        slot, it takes the others if they have room, else gives the slot back and waits for the
        one now full. The whole wait is bounded by ``admission.max_wait``; beyond it, or beyond
        a full queue, :class:`~disagg_router.router.errors.Overloaded`, worded and counted against
        the instance that is full.
        """
        backends = [b for b in self._counted.values() if b.role not in self._slots]
        start = time.monotonic()
        full = next((b for b in backends if not b.gate.has_room(self._claim)), None)
        while full is not None:
            waited = time.monotonic() - start
            slot = await self._queue_for(full, full.gate.config.max_wait - waited)
            blocked = next(
                (b for b in backends if b is not full and not b.gate.has_room(self._claim)), None
            )
            if blocked is None:
                self._slots[full.role] = slot
            else:
                slot.release()
            full = blocked
        m = self._metrics
        for backend in backends:
            if backend.role not in self._slots:  # has room: acquire() does not suspend
                self._slots[backend.role], _ = await backend.gate.acquire(
                    backend.label, claim=self._claim
                )
            m.child(m.admission_wait, backend.role).observe(time.monotonic() - start)
        if backends and self._claim.tenant:
            m.child(m.tenants.queue_wait, self._claim.tenant).observe(time.monotonic() - start)

    async def add(self, backend: BackendState) -> None:
        """Take over the count of ``backend`` (a D bound after the others were admitted,
        :mod:`disagg_router.router.dispatch.binding`) and admit it: its slot now if it has room,
        else after waiting in its queue, bounded like :meth:`admit`."""
        self._counted[backend.role] = backend
        self._show(backend)
        await self.admit()

    async def _queue_for(self, backend: BackendState, max_wait: float) -> Slot:
        """Wait (at most ``max_wait``) in the queue of ``backend``, which has no free slot."""
        m = self._metrics
        queue = m.child(m.admission_queue, backend.role, backend.label)
        queue.inc()
        try:
            slot, _ = await backend.gate.acquire(backend.label, max_wait, self._claim)
        except RouterError:
            m.child(m.admission_rejected, backend.role, backend.label).inc()
            raise
        finally:
            queue.dec()
        return slot
