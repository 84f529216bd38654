"""Start and stop of one app run: the initial checks, the dispatches in flight, the drain.

Who calls it: the runtime (:class:`disagg_router.router.runtime.Runtime`) owns one
:class:`Lifecycle`; dispatches register while they run; the server (``disagg-router serve``) calls
:meth:`Lifecycle.drain` on SIGTERM/SIGINT before it stops: from then on ``/ready`` and new requests
answer 503, requests in flight get ``drain.timeout`` seconds to finish, and whatever still runs is
then aborted (its client gets an error, both legs are cancelled, P and D are released).
"""

from __future__ import annotations

import asyncio
import logging
from typing import Protocol

log = logging.getLogger(__name__)


class Abortable(Protocol):
    def abort(self, reason: str) -> None: ...


class Lifecycle:
    """Mutable start/stop state of one runtime (single event loop, no locking)."""

    def __init__(self) -> None:
        self.draining = False
        self.initial_check_done = asyncio.Event()
        self._active: set[Abortable] = set()
        self._idle = asyncio.Event()
        self._idle.set()

    @property
    def in_flight(self) -> int:
        return len(self._active)

    def enter(self, item: Abortable) -> None:
        self._active.add(item)
        self._idle.clear()

    def leave(self, item: Abortable) -> None:
        self._active.discard(item)
        if not self._active:
            self._idle.set()

    async def drain(self, timeout: float, abort_grace: float = 5.0) -> int:
        """Stop taking requests, wait up to ``timeout`` for those in flight, abort the rest
        (waiting at most ``abort_grace`` more for them to unwind). Returns how many were aborted."""
        self.draining = True
        log.info("draining: %d request(s) in flight, up to %gs", self.in_flight, timeout)
        try:
            await asyncio.wait_for(self._idle.wait(), timeout)
            return 0
        except TimeoutError:
            pass
        left = list(self._active)
        log.warning("drain time over: aborting %d request(s)", len(left))
        for item in left:
            item.abort("the router is shutting down")
        try:
            await asyncio.wait_for(self._idle.wait(), abort_grace)
        except TimeoutError:
            log.error("%d request(s) did not unwind after abort", self.in_flight)
        return len(left)
