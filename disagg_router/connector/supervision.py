"""Supervision of the transfer core's threads: errors they survive are logged and counted; an
error that stops one makes the instance unhealthy.

Who calls it: :class:`~disagg_router.connector.producer.PushProducer` and
:class:`~disagg_router.connector.consumer.PushConsumer` report from their threads (``dpc-writer``,
``dpc-receiver``, ``dpc-side-channel`` connections, ``dpc-sidechan`` pool tasks); the worker
reads it once per engine step (:meth:`CoreHealth.take_errors` for the stats,
:meth:`CoreHealth.check` to fail the step). Thread-safe; it never blocks beyond its lock.

The rule: an error a thread expects (NIXL's, surfacing as
:class:`~disagg_router.connector.errors.TransferError`; a side channel's) fails the transfers it
affects, is counted here and the thread goes on. Any other error ends a loop thread (its state may
be inconsistent): it is counted, logged with its traceback, and :meth:`CoreHealth.check` raises
:class:`~disagg_router.connector.errors.TransferCoreFailedError` at the next engine step, which
makes vLLM fail the engine (its ``/health`` answers 503, so the router ejects the instance).
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable

from disagg_router.connector.errors import TransferCoreFailedError

logger = logging.getLogger(__name__)


class CoreHealth:
    """Error count and the first fatal error of one worker's transfer core."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._errors = 0
        self._fatal: str | None = None

    def survived(self, where: str, exc: BaseException) -> None:
        """A thread met an expected error at ``where`` and goes on: log it, count it."""
        logger.warning("%s: %s (counted; the thread goes on)", where, exc)
        with self._lock:
            self._errors += 1

    def stopped(self, thread: str, exc: BaseException) -> None:
        """``thread`` cannot go on after ``exc``: count it and make :meth:`check` raise."""
        logger.critical(
            "connector thread %s stopped: %r; this instance reports itself unhealthy at its "
            "next engine step",
            thread,
            exc,
            exc_info=exc,
        )
        with self._lock:
            self._errors += 1
            if self._fatal is None:
                self._fatal = f"connector thread {thread} stopped: {exc!r}"

    def run(self, thread: str, loop: Callable[[], None]) -> None:
        """Run a thread's whole loop; an exception that ends it goes to :meth:`stopped` (and on
        to :mod:`threading`'s excepthook)."""
        try:
            loop()
        except BaseException as exc:
            self.stopped(thread, exc)
            raise

    def take_errors(self) -> int:
        """Errors counted since the last call."""
        with self._lock:
            out, self._errors = self._errors, 0
        return out

    def check(self) -> None:
        """Raise :class:`TransferCoreFailedError` once a thread has stopped (every call after)."""
        with self._lock:
            fatal = self._fatal
        if fatal is not None:
            raise TransferCoreFailedError(fatal)
