"""Rendezvous (highest-random-weight) hashing with bounded loads: what the affinity policies
(``prefix_affinity``, ``session_affinity``) and ``kv_aware``'s tie-break share.

The choice depends only on the key and the set of usable instances (the same on every router
replica); the load bound uses this replica's in-flight counts (a leg counts from the moment its
pool chose it, so a burst of choices sees each other).
"""

from __future__ import annotations

import hashlib
import math
from collections.abc import Sequence

from disagg_router.router.instances.state import BackendState
from disagg_router.router.routing.policies.base import NO_INPUT, RoutingInput
from disagg_router.router.routing.policies.least_in_flight import LeastInFlight


def _weight(key: bytes, backend: BackendState) -> bytes:
    return hashlib.blake2b(key + b"\x00" + backend.label.encode(), digest_size=8).digest()


def rendezvous_order(key: bytes, candidates: Sequence[BackendState]) -> list[BackendState]:
    """Candidates by descending rendezvous weight for ``key`` (depends on labels only)."""
    return sorted(candidates, key=lambda b: _weight(key, b), reverse=True)


def load_bound(candidates: Sequence[BackendState], load_factor: float) -> int:
    """Most in-flight legs one candidate may hold when taking one more leg:
    ``ceil(load_factor * (total in flight + 1) / candidates)`` (always >= 1)."""
    total = sum(c.in_flight for c in candidates)
    return max(1, math.ceil(load_factor * (total + 1) / len(candidates)))


class BoundedAffinity:
    """Rendezvous hashing with bounded loads over a key taken from the request.

    The first candidate in the key's rendezvous order whose in-flight legs stay within
    :func:`load_bound` wins; one always does (the bound is at least the mean load + 1). Removing
    an instance moves only the keys it held; adding one moves only the keys it now wins. Requests
    without a key go to the least loaded candidate. Subclasses say what the key is.
    """

    def __init__(self, load_factor: float) -> None:
        self._load_factor = load_factor
        self._fallback = LeastInFlight()

    def key(self, request: RoutingInput) -> bytes | None:
        raise NotImplementedError

    def choose(
        self, candidates: Sequence[BackendState], request: RoutingInput = NO_INPUT
    ) -> BackendState:
        key = self.key(request)
        if key is None:
            return self._fallback.choose(candidates, request)
        bound = load_bound(candidates, self._load_factor)
        order = rendezvous_order(key, candidates)
        return next((c for c in order if c.in_flight + 1 <= bound), order[0])
