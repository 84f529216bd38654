"""The one retry loop of every request the router forwards.

Who calls it: :mod:`disagg_router.router.dispatch.orchestrator` (a generation request's P/D pair)
and :mod:`disagg_router.router.dispatch.forward` (a pass-through request's instance), with how to
choose (instances counted in flight by their pools) and how to open one attempt. An attempt that
fails with a retryable :class:`UpstreamError` before anything went to the client is retried once on
instances that exclude the one that failed (the caller's choice sees the failure, so a dispatch
whose D failed keeps its P), when ``retry_on_fresh_pair`` is on; the retry is logged and counted
(``disagg_router_retries_total``) only when it happens (no other usable instance: the first failure
is the answer). Each attempt gets a fresh request id but the first, which keeps the client's; all
share the request's one deadline, which the caller sets.
"""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable
from typing import TypeVar

from disagg_router.router.errors import NoBackendAvailable, UpstreamError
from disagg_router.router.ids import new_request_id
from disagg_router.router.runtime import Runtime

log = logging.getLogger(__name__)

C = TypeVar("C")
R = TypeVar("R")

Choose = Callable[[set[str], UpstreamError | None], C]
"""``(labels to avoid, failure) -> the chosen instance(s)``, counted in flight by their pools;
``failure``: the failed attempt's error for a retry (None for the first attempt), which must not
fall back to an avoided instance (:class:`NoBackendAvailable` instead)."""


async def first_that_opens(
    runtime: Runtime,
    what: str,
    first_id: str,
    choose: Choose[C],
    open_attempt: Callable[[C, str], Awaitable[R]],
) -> R:
    """The first attempt that opens (see the module docstring); raises the last failure.

    ``open_attempt(chosen, request_id)`` opens one attempt on ``chosen`` under ``request_id``
    (``first_id`` for the first, a fresh one for the retry) and, when it fails, has given back
    what it held before raising. ``what``: the request kind, for the retry's log line.
    """
    attempts = 2 if runtime.settings.retry_on_fresh_pair else 1
    avoid: set[str] = set()
    failure: tuple[str, UpstreamError] | None = None  # the failed attempt's id and error
    for number in range(1, attempts + 1):
        try:
            chosen = choose(avoid, failure[1] if failure is not None else None)
        except NoBackendAvailable:
            if failure is not None:
                raise failure[1] from None
            raise
        if failure is not None:
            failed_id, exc = failure
            log.warning("%s %s failed (%s); retrying on others", what, failed_id, exc.message)
            runtime.metrics.retries.inc()
        request_id = first_id if number == 1 else new_request_id()
        try:
            return await open_attempt(chosen, request_id)
        except UpstreamError as exc:
            if number == attempts or not exc.retryable:
                raise
            avoid.add(exc.backend)
            failure = request_id, exc
    raise AssertionError("unreachable")  # pragma: no cover
