"""``prefix_affinity``: bounded rendezvous hashing of the prompt's leading characters; requests
sharing a prefix go to the same instance so vLLM's prefix cache hits (:mod:`.affinity`)."""

from __future__ import annotations

from typing import ClassVar

from disagg_router.router.config import LoadSignalsConfig, PoolConfig
from disagg_router.router.routing.policies.affinity import BoundedAffinity
from disagg_router.router.routing.policies.base import RoutingInput, Signal
from disagg_router.router.routing.prompt_keys import prefix_key


class PrefixAffinity(BoundedAffinity):
    """Affinity on the prompt's first ``prefix_chars`` characters
    (:mod:`disagg_router.router.routing.prompt_keys`)."""

    name: ClassVar[str] = "prefix_affinity"
    settings: ClassVar[frozenset[str]] = frozenset({"prefix_chars", "load_factor"})
    signals: ClassVar[frozenset[Signal]] = frozenset()

    def __init__(self, prefix_chars: int, load_factor: float) -> None:
        super().__init__(load_factor)
        self._prefix_chars = prefix_chars

    @classmethod
    def from_config(cls, config: PoolConfig, signals: LoadSignalsConfig) -> PrefixAffinity:
        return cls(config.prefix_chars, config.load_factor)

    def key(self, request: RoutingInput) -> bytes | None:
        prompt = request.prompt
        return prefix_key(prompt, self._prefix_chars) if prompt else None
