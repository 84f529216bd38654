"""What a P leg or an identity probe teaches about a prefill instance: its push identity.

Who calls it: the dispatch (:mod:`disagg_router.router.dispatch.legs`), with the identity a P leg
answered, and the health monitor (:mod:`disagg_router.router.health.monitor`), with the one an
identity probe answered; the one place an identity is recorded. Runs on the event loop; never
raises, never awaits.
"""

from __future__ import annotations

import logging
import time

from disagg_router.router.config import PushIdentity
from disagg_router.router.instances.state import BackendState
from disagg_router.router.observability.metrics import RouterMetrics

log = logging.getLogger(__name__)


def learn_identity(backend: BackendState, identity: PushIdentity, metrics: RouterMetrics) -> bool:
    """Record ``identity`` as learned from ``backend`` now; True (logged, counted) if it changed."""
    backend.identity_learned_at = time.monotonic()
    if identity == backend.learned_identity:
        return False
    log.info("prefill %s identity: %s (was %s)", backend.label, identity, backend.learned_identity)
    backend.learned_identity = identity
    metrics.identity_changes.labels(backend.label).inc()
    return True
