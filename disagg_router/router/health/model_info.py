"""What an instance says about its model: ``max_model_len`` from its own ``/v1/models``.

Who calls it: the health monitor (:mod:`disagg_router.router.health.monitor`), after a passed health
check of an instance whose ``max_model_len`` is not known yet or that rejoins after failing a check
(a restarted vLLM may serve with another context length), so ``/v1/models`` of the router answers
from what is kept on the backend and never asks an instance per request. vLLM 0.32 answers
``{"data": [{"id": <served name>, "max_model_len": <int>, ...}]}``. A failure here is logged and
leaves the known value as it is: it never takes an instance out of rotation (that is the health
check's job). Bounded by ``timeouts.health``; raises nothing.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any

from disagg_router.router.errors import UpstreamError
from disagg_router.router.ids import new_request_id
from disagg_router.router.instances.state import BackendState
from disagg_router.router.upstream import codec
from disagg_router.router.upstream.calls import get_ok
from disagg_router.router.upstream.client import UpstreamClient

log = logging.getLogger(__name__)


def model_len_of(answer: Any, model: str) -> int | None:
    """``max_model_len`` of ``model`` (else of the first model listed) in a ``/v1/models``
    answer; None when the answer has none."""
    data = answer.get("data") if isinstance(answer, dict) else None
    cards = [c for c in data if isinstance(c, dict)] if isinstance(data, list) else []
    cards.sort(key=lambda c: c.get("id") != model)  # stable: the served name first
    for card in cards:
        value = card.get("max_model_len")
        if isinstance(value, int) and not isinstance(value, bool) and value > 0:
            return value
    return None


async def learn_max_model_len(
    client: UpstreamClient, backend: BackendState, timeout: float
) -> None:
    """Ask ``backend`` for its ``/v1/models`` (within ``timeout`` seconds) and keep its
    ``max_model_len``; on any failure log it and keep what was known."""
    asked = get_ok(client, backend, backend.role, "/v1/models", new_request_id())
    try:
        found = model_len_of(codec.loads(await asyncio.wait_for(asked, timeout)), backend.model)
    except (UpstreamError, ValueError, TimeoutError) as exc:
        log.info("%s %s: /v1/models unusable: %r", backend.role, backend.label, exc)
        return
    if found is None:
        log.info("%s %s: /v1/models has no max_model_len", backend.role, backend.label)
        return
    backend.max_model_len = found
