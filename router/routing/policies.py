"""Load-balancing policies: pick one instance of a pool for one dispatch.

Who calls it: :class:`router.routing.pools.Pool` with the currently usable candidates (never
empty, in pool order) and the request being routed. A policy must be cheap, must not block, and
must not mutate the backends it is given.

- ``round_robin``: cycles; for identical instances and uniform requests.
- ``least_in_flight``: fewest legs in flight from this router; for uneven request sizes.
- ``power_of_two``: two random candidates, the less loaded wins, load from this router's
  in-flight legs and vLLM's own queue/KV gauges
  (:func:`router.health.load_signals.backend_load`); for
  instances of uneven speed, or shared by several router replicas.
- ``prefix_affinity``: rendezvous (highest-random-weight) hashing of the prompt's leading
  characters with a load bound; requests sharing a prefix go to the same instance so vLLM's
  prefix cache hits. The choice depends only on the prefix and the set of usable instances
  (the same on every router replica); the load bound uses this replica's in-flight counts
  (a leg counts from the moment its pool chose it, so a burst of choices sees each other).
- ``session_affinity``: the same bounded rendezvous hashing over a session key (a header, or
  the request's ``user``); pins a conversation without relying on its text.
- ``kv_aware``: by the prompt tokens each instance's KV cache holds, from vLLM's KV events
  (:mod:`router.routing.kv_policy`); ``prefix_affinity`` when the index cannot answer.
"""

from __future__ import annotations

import hashlib
import math
import random
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from functools import cached_property
from typing import TYPE_CHECKING, Any, Protocol

from router.config import LoadSignalsConfig, PoolConfig
from router.health.load_signals import backend_load
from router.routing.backends import BackendState
from router.routing.prompt_keys import prefix_key, prompt_of, session_key

if TYPE_CHECKING:
    from router.routing.kv_routing import KvRequest


@dataclass(frozen=True)
class RoutingInput:
    """What a policy may read of the request: its body, kind and (lower-cased) headers, and
    (``kv``) its view of the model's KV index when the model has ``kv_events``."""

    body: Mapping[str, Any] = field(default_factory=dict)
    chat: bool = False
    headers: Mapping[str, str] = field(default_factory=dict)
    kv: KvRequest | None = field(default=None, compare=False)

    @cached_property
    def prompt(self) -> str | list[int]:
        """The rendered prompt (see :mod:`router.routing.prompt_keys`), computed once."""
        return prompt_of(self.body, self.chat)


NO_INPUT = RoutingInput()


class Policy(Protocol):
    """Chooses one of ``candidates`` (non-empty, in pool order) for ``request``."""

    def choose(self, candidates: Sequence[BackendState], request: RoutingInput) -> BackendState: ...


class RoundRobin:
    """Cycles through the candidates in pool order."""

    def __init__(self) -> None:
        self._next = 0

    def choose(
        self, candidates: Sequence[BackendState], request: RoutingInput = NO_INPUT
    ) -> BackendState:
        chosen = candidates[self._next % len(candidates)]
        self._next += 1
        return chosen


class LeastInFlight:
    """The candidate with the fewest in-flight legs; ties are broken round-robin."""

    def __init__(self) -> None:
        self._tiebreak = RoundRobin()

    def choose(
        self, candidates: Sequence[BackendState], request: RoutingInput = NO_INPUT
    ) -> BackendState:
        low = min(c.in_flight for c in candidates)
        return self._tiebreak.choose([c for c in candidates if c.in_flight == low])


class PowerOfTwo:
    """Two distinct random candidates; the one with the lower load wins (ties: the first drawn)."""

    def __init__(
        self,
        stale_after: float,
        rng: random.Random | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._stale_after = stale_after
        self._rng = rng or random.Random()
        self._clock = clock

    def choose(
        self, candidates: Sequence[BackendState], request: RoutingInput = NO_INPUT
    ) -> BackendState:
        if len(candidates) == 1:
            return candidates[0]
        a, b = self._rng.sample(list(candidates), 2)
        now = self._clock()
        load_a = backend_load(a, now, self._stale_after)
        load_b = backend_load(b, now, self._stale_after)
        return b if load_b < load_a else a


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


class _BoundedAffinity:
    """Rendezvous hashing with bounded loads over a key taken from the request.

    The first candidate in the key's rendezvous order whose in-flight legs stay within
    :func:`load_bound` wins; one always does (the bound is at least the mean load + 1). Removing
    an instance moves only the keys it held; adding one moves only the keys it now wins. Requests
    without a key go to the least loaded candidate.
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


class PrefixAffinity(_BoundedAffinity):
    """Affinity on the prompt's first ``prefix_chars`` characters
    (:mod:`router.routing.prompt_keys`)."""

    def __init__(self, prefix_chars: int, load_factor: float) -> None:
        super().__init__(load_factor)
        self._prefix_chars = prefix_chars

    def key(self, request: RoutingInput) -> bytes | None:
        prompt = request.prompt
        return prefix_key(prompt, self._prefix_chars) if prompt else None


class SessionAffinity(_BoundedAffinity):
    """Affinity on a session key: the ``header`` value, else the request's ``user``."""

    def __init__(self, header: str, load_factor: float) -> None:
        super().__init__(load_factor)
        self._header = header

    def key(self, request: RoutingInput) -> bytes | None:
        session = session_key(request.headers, request.body, self._header)
        return None if session is None else b"session:" + session.encode()


def make_policy(config: PoolConfig, signals: LoadSignalsConfig | None = None) -> Policy:
    """A fresh policy for a pool's config (``signals``: staleness for ``power_of_two``)."""
    name = config.policy
    if name == "least_in_flight":
        return LeastInFlight()
    if name == "power_of_two":
        return PowerOfTwo((signals or LoadSignalsConfig()).stale_after)
    if name == "prefix_affinity":
        return PrefixAffinity(config.prefix_chars, config.load_factor)
    if name == "session_affinity":
        return SessionAffinity(config.session_header, config.load_factor)
    if name == "kv_aware":
        from router.routing.kv_policy import KvAware  # it builds on this module's policies

        return KvAware(config.prefix_chars, config.load_factor)
    return RoundRobin()
