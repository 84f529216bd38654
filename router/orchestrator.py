"""Chooses the (P, D) pair for a client request, opens the dispatch, retries once if configured.

Who calls it: the app's generation endpoints. P and D are both chosen before any leg starts.
A retry happens only when ``retry_on_fresh_pair`` is set, the failure is retryable (not a 4xx
from vLLM) and nothing has been sent to the client yet (we are still before the commit point);
the retry avoids the backend that failed and uses a fresh request id.
"""

from __future__ import annotations

import logging

from router.dispatch import Dispatch
from router.errors import UpstreamError
from router.runtime import Runtime
from router.validation import ClientRequest

log = logging.getLogger(__name__)


async def open_dispatch(runtime: Runtime, request: ClientRequest) -> Dispatch:
    """An opened dispatch (first token in hand); the caller must ``close()`` it.

    Raises the last attempt's :class:`RouterError`; failed attempts are closed here.
    """
    prefill_pool, decode_pool = runtime.pools_for(request.model)
    attempts = 2 if runtime.settings.retry_on_fresh_pair else 1
    avoid: set[str] = set()
    for attempt in range(1, attempts + 1):
        prefill = prefill_pool.choose(avoid)
        decode = decode_pool.choose(avoid)
        dispatch = Dispatch(runtime, request, prefill, decode)
        opened = False
        try:
            await dispatch.open()
            opened = True
            return dispatch
        except UpstreamError as exc:
            if attempt == attempts or not exc.retryable:
                raise
            log.warning(
                "dispatch %s failed before commit (%s); retrying on a fresh pair",
                dispatch.request_id,
                exc.message,
            )
            runtime.metrics.retries.inc()
            avoid.add(exc.backend)
        finally:
            if not opened:
                await dispatch.close()
    raise AssertionError("unreachable")  # pragma: no cover
