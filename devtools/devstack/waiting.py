"""The one wait helper: block until an observable condition holds, or fail saying what was awaited.

Who calls it: tests and dev tools that wait on state another thread or process changes (a
server's records, a log line, an endpoint's answer). It polls ``predicate`` every ``interval``
seconds; it never decides an order by sleeping a fixed time.
"""

from __future__ import annotations

import time
from collections.abc import Callable


class WaitTimeout(AssertionError):
    """The awaited condition did not hold within the timeout."""


def wait_until(
    predicate: Callable[[], bool], timeout: float, what: str, interval: float = 0.02
) -> None:
    """Return once ``predicate()`` is true; raise :class:`WaitTimeout` naming ``what`` after
    ``timeout`` seconds. Exceptions from ``predicate`` propagate (a dead server fails at once)."""
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() >= deadline:
            raise WaitTimeout(f"timed out after {timeout}s waiting for {what}")
        time.sleep(interval)
