"""The order in which an instance's admission queue hands out freed slots.

Who calls it: the instance's :class:`~disagg_router.router.instances.admission.Gate`, when a caller
queues for a slot (:meth:`FairQueue.push`), gives up (:meth:`FairQueue.remove`) or a slot frees
(:meth:`FairQueue.peek` for the next waiter that may take it, then :meth:`FairQueue.remove`).
Who waits is a :class:`Claim` (the tenant's name, priority class and weight, made by the tenants
package). The order:

1. a waiter of a lower class than the highest waiting one that has waited ``max_priority_wait``
   seconds (its claim's) goes first, oldest first: the bound on a lower class's starvation;
   (the gate may rule some claims out of a slot, :meth:`FairQueue.peek`'s ``allowed``: the order
   is then that of the others)
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
from collections.abc import Callable
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
    """One queued caller: ``item`` is what the gate hands the slot to."""

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
        cls = self._classes[self._index(claim)]
        start = max(cls.virtual_time, cls.last_finish.get(claim.tenant, 0.0))
        finish = start + 1.0 / claim.weight
        cls.last_finish[claim.tenant] = finish
        waiter = Waiter(item, claim, now, start, finish, next(self._seq))
        cls.waiters.append(waiter)
        self._size += 1
        return waiter

    def remove(self, waiter: Waiter[T]) -> None:
        """Take ``waiter`` out (served, or it gave up); nothing if it is no longer queued. A
        waiter served moves its class's virtual time to its start."""
        cls = self._classes[self._index(waiter.claim)]
        if waiter in cls.waiters:
            cls.waiters.remove(waiter)
            self._size -= 1
            cls.virtual_time = max(cls.virtual_time, waiter.start)
            self._forget_if_idle(cls)

    def peek(
        self, now: float, allowed: Callable[[Claim], bool] = lambda _: True
    ) -> Waiter[T] | None:
        """The waiter next in order among those whose claim is ``allowed`` (None: none is).
        Nothing changes until it is taken out (:meth:`remove`)."""
        waiting = [c for c in self._classes if c.waiters]
        late = [
            w
            for cls in waiting[1:]
            for w in cls.waiters
            if now - w.since >= w.claim.max_priority_wait and allowed(w.claim)
        ]
        if late:
            return min(late, key=lambda w: (w.since, w.seq))
        for cls in waiting:
            fair = [w for w in cls.waiters if allowed(w.claim)]
            if fair:
                return min(fair, key=lambda w: (w.finish, w.seq))
        return None

    def _index(self, claim: Claim) -> int:
        return min(max(claim.priority, 0), len(self._classes) - 1)

    @staticmethod
    def _forget_if_idle(cls: _Class[T]) -> None:
        """An empty class starts its next busy period with every tenant equal (and its tag
        table does not grow with every tenant ever seen)."""
        if not cls.waiters:
            cls.virtual_time = 0.0
            cls.last_finish.clear()
