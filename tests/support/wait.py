"""The one wait helper of the tests: poll an observable condition, bounded, with a clear failure.

Tests order themselves on state they can observe (a counter, a file, a log line, an HTTP answer),
never on a sleep of a guessed length. ``wait_until`` polls ``predicate`` until it returns a truthy
value and returns that value; past ``timeout`` it fails the test with ``what`` and the last
value seen. The bound is generous (a loaded 2-core machine) because it only costs time on failure.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import TypeVar

T = TypeVar("T")

DEFAULT_TIMEOUT_S = 15.0
_INTERVAL_S = 0.02


class WaitTimeout(AssertionError):
    """A condition did not hold within its bound."""


def wait_until(
    predicate: Callable[[], T],
    timeout: float = DEFAULT_TIMEOUT_S,
    what: str = "a condition",
    interval: float = _INTERVAL_S,
) -> T:
    """Poll ``predicate()`` until truthy and return its value; after ``timeout`` seconds raise
    :class:`WaitTimeout` naming ``what``. Exceptions from ``predicate`` propagate (a dead server
    fails at once)."""
    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() >= deadline:
            raise WaitTimeout(f"timed out after {timeout:g}s waiting for {what} (last: {value!r})")
        time.sleep(interval)
