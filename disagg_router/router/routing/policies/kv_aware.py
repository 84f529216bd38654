"""``kv_aware``: pick the instance by what its KV cache holds (vLLM's KV events).

Who calls it: :func:`disagg_router.router.routing.policies.factory.make_policy` builds it for a pool
whose policy is ``kv_aware``; the pool calls ``choose`` with the usable candidates and the request,
whose ``kv`` (a ``KvRequest`` of disagg_router.router.routing.kv_model) answers how many prompt
tokens each candidate holds; cheap and non-blocking: the block keys are computed once per request
and each candidate costs one set lookup per matched block.

- P: the lowest cost = prompt tokens left to prefill there (prompt minus its cached prefix) plus
  the prefill tokens this router has queued there (:meth:`KvRequest.queued`);
- D: the longest cached prefix (less to transfer, or to prefill itself when served alone), then
  the fewest legs in flight;
- both: only candidates within the load bound of the affinity policies
  (:func:`disagg_router.router.routing.policies.affinity.load_bound`); equal costs are broken by the
  rendezvous order of the request's first block key, so requests sharing their first block (and a
  cold cache) go to the same instance. Nothing is random: two router replicas with the same index
  and loads choose the same instance.
- fallback: when the index cannot answer for every candidate (the model has no ``kv_events``, its
  tokenizer is not loaded yet, the request's tokens cannot be reproduced, an instance's event
  stream is not live), ``prefix_affinity`` decides.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import ClassVar

from disagg_router.router.config import LoadSignalsConfig, PoolConfig
from disagg_router.router.instances.state import BackendState
from disagg_router.router.routing.policies.affinity import load_bound, rendezvous_order
from disagg_router.router.routing.policies.base import NO_INPUT, RoutingInput, Signal
from disagg_router.router.routing.policies.prefix_affinity import PrefixAffinity


class KvAware:
    """The ``kv_aware`` policy; see the module docstring."""

    name: ClassVar[str] = "kv_aware"
    settings: ClassVar[frozenset[str]] = PrefixAffinity.settings
    signals: ClassVar[frozenset[Signal]] = frozenset({"kv_events"})

    def __init__(self, prefix_chars: int, load_factor: float) -> None:
        self._load_factor = load_factor
        self._fallback = PrefixAffinity(prefix_chars, load_factor)

    @classmethod
    def from_config(cls, config: PoolConfig, signals: LoadSignalsConfig) -> KvAware:
        return cls(config.prefix_chars, config.load_factor)

    def choose(
        self, candidates: Sequence[BackendState], request: RoutingInput = NO_INPUT
    ) -> BackendState:
        kv = request.kv
        matched = kv.matched(candidates) if kv is not None else None
        if kv is None or matched is None:
            return self._fallback.choose(candidates, request)
        bound = load_bound(candidates, self._load_factor)
        within = [c for c in candidates if c.in_flight + 1 <= bound] or list(candidates)
        order = rendezvous_order(kv.tie_key, within)
        total = kv.prompt_tokens
        if candidates[0].role == "prefill":
            best = min(order, key=lambda c: total - matched[c.label] + kv.queued(c))
        else:
            best = min(order, key=lambda c: (-matched[c.label], c.in_flight))
        kv.chose(best, matched[best.label])
        return best
