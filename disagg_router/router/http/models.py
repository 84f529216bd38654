"""The body of ``GET /v1/models``: each served model as an OpenAI model card, with what the
router knows of it.

Who calls it: the app (:mod:`disagg_router.router.http.app`) for ``/v1/models``. Beside OpenAI's
fields each card carries ``max_model_len`` (as vLLM's own cards do: the smallest that the model's
instances reported on their ``/v1/models``, kept by the health monitor,
:mod:`disagg_router.router.health.model_info`; null until one has answered) and ``pools``, per role
the instances listed and those usable now (healthy, breaker admitting, a push identity where
needed). OpenAI clients ignore both. Reads only what the runtime holds: no upstream call per
request.
"""

from __future__ import annotations

import time
from typing import Any

from disagg_router.router.config import RouterSettings
from disagg_router.router.routing.pools import Pool
from disagg_router.router.runtime import Runtime


def _pool_status(pool: Pool) -> dict[str, int]:
    return {"instances": len(pool.backends), "usable": len(pool.usable())}


def _card(runtime: Runtime | None, model: str, created: int) -> dict[str, Any]:
    card: dict[str, Any] = {
        "id": model,
        "object": "model",
        "created": created,
        "owned_by": "disagg-router",
    }
    if runtime is None:
        return card
    found = runtime.model(model)
    pools = (found.prefill, found.decode)
    lengths = [b.max_model_len for p in pools for b in p.backends if b.max_model_len is not None]
    card["max_model_len"] = min(lengths) if lengths else None
    card["pools"] = {p.role: _pool_status(p) for p in pools}
    return card


def model_list(settings: RouterSettings, runtime: Runtime | None) -> dict[str, Any]:
    """The ``/v1/models`` body for ``settings``' models (``runtime`` None: the router is not
    running yet, so the cards carry OpenAI's fields only)."""
    created = int(time.time())
    return {"object": "list", "data": [_card(runtime, m, created) for m in settings.model_names]}
