"""The order in which an instance's admission queue hands out freed slots.

Who calls it: the instance's :class:`~disagg_router.router.instances.admission.Gate`, when a caller
queues for a slot (:meth:`FairQueue.push`), gives up (:meth:`FairQueue.remove`) or a slot frees
(:meth:`FairQueue.pop`). Who waits is a :class:`Claim` (the tenant's name, priority class and
weight, :mod:`disagg_router.router.tenants`). The order:

1. a waiter of a lower class than the highest waiting one that has waited ``max_priority_wait``
   seconds (its claim's) goes first, oldest first: the bound on a lower class's starvation;
2. otherwise the highest class with waiters;
3. within a class, weighted fair queuing between tenants: each waiter gets a finish tag, its
   tenant's previous tag (or the class's virtual time, if later) plus ``1 / weight``, and the
   smallest tag goes first. A tenant with twice the weight gets twice the slots while both wait;
   one tenant's burst queues behind its own earlier requests, not before the others'; within one
   tenant the order is first come, first served.

Pure and single-threaded: the caller passes the clock; nothing here awaits.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field
from typing import Generic, TypeVar

T = TypeVar("T")

PRIORITY_CLASSES = ("high", "normal", "low")
"""The classes, highest first; a claim's ``priority`` is an index into this."""


@dataclass(frozen=True)
class Claim:
    """Who waits for a slot: ``priority`` indexes :data:`PRIORITY_CLASSES`."""

    tenant: str = ""
    priority: int = 1
    weight: float = 1.0
    max_priority_wait: float = 2.0


NO_CLAIM = Claim()
"""A request of no tenant (the router's own, or tenancy unconfigured): normal class."""


@dataclass(eq=False)
class Waiter(Generic[T]):
    """One queued caller: ``item`` is what :meth:`FairQueue.pop` returns for it."""

    item: T
    claim: Claim
    since: float
    start: float
    finish: float
    seq: int


@dataclass
class _Class(Generic[T]):
    """The waiters of one priority class and its fair-queuing clock."""

    waiters: list[Waiter[T]] = field(default_factory=list)
    virtual_time: float = 0.0
    last_finish: dict[str, float] = field(default_factory=dict)


class FairQueue(Generic[T]):
    """Waiters for one instance's slots, in the order of the module docstring."""

    def __init__(self) -> None:
        self._classes = [_Class[T]() for _ in PRIORITY_CLASSES]
        self._seq = itertools.count()
        self._size = 0

    def __len__(self) -> int:
        return self._size

    def push(self, item: T, claim: Claim, now: float) -> Waiter[T]:
        """Queue ``item`` for ``claim``; the returned waiter is what :meth:`remove` takes."""
        cls = self._classes[min(max(claim.priority, 0), len(self._classes) - 1)]
        start = max(cls.virtual_time, cls.last_finish.get(claim.tenant, 0.0))
        finish = start + 1.0 / claim.weight
        cls.last_finish[claim.tenant] = finish
        waiter = Waiter(item, claim, now, start, finish, next(self._seq))
        cls.waiters.append(waiter)
        self._size += 1
        return waiter

    def remove(self, waiter: Waiter[T]) -> None:
        """Take ``waiter`` out (it gave up); nothing if it is no longer queued."""
        for cls in self._classes:
            if waiter in cls.waiters:
                cls.waiters.remove(waiter)
                self._size -= 1
                self._forget_if_idle(cls)
                return

    def pop(self, now: float) -> T:
        """The item of the waiter that gets the freed slot; the queue must not be empty."""
        waiter = self._overdue(now) or self._next_fair()
        cls = self._classes[min(max(waiter.claim.priority, 0), len(self._classes) - 1)]
        cls.waiters.remove(waiter)
        self._size -= 1
        cls.virtual_time = max(cls.virtual_time, waiter.start)
        self._forget_if_idle(cls)
        return waiter.item

    def _overdue(self, now: float) -> Waiter[T] | None:
        """The oldest waiter of a class below the highest waiting one that has waited its
        ``max_priority_wait`` (within the highest class, fair queuing alone decides)."""
        waiting = [c for c in self._classes if c.waiters]
        late = [
            w
            for cls in waiting[1:]
            for w in cls.waiters
            if now - w.since >= w.claim.max_priority_wait
        ]
        return min(late, key=lambda w: (w.since, w.seq)) if late else None

    def _next_fair(self) -> Waiter[T]:
        cls = next(c for c in self._classes if c.waiters)
        return min(cls.waiters, key=lambda w: (w.finish, w.seq))

    @staticmethod
    def _forget_if_idle(cls: _Class[T]) -> None:
        """An empty class starts its next busy period with every tenant equal (and its tag
        table does not grow with every tenant ever seen)."""
        if not cls.waiters:
            cls.virtual_time = 0.0
            cls.last_finish.clear()
