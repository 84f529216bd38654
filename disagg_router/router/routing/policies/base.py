"""What every policy shares: the request as a policy sees it and the interface it implements.

Who calls it: the pools (:mod:`disagg_router.router.routing.pools`) and the dispatch build one
:class:`RoutingInput` per request; every policy module implements :class:`Policy`.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from functools import cached_property
from typing import TYPE_CHECKING, Any, ClassVar, Literal, Protocol

from disagg_router.router.config import LoadSignalsConfig, PoolConfig
from disagg_router.router.instances.state import BackendState
from disagg_router.router.routing.prompt_keys import prompt_of

if TYPE_CHECKING:
    from disagg_router.router.routing.kv_model import KvRequest

Signal = Literal["load", "kv_events"]
"""A signal a policy reads beyond the router's own counts: ``load``, vLLM's gauges scraped from
the pool's instances (:mod:`disagg_router.router.health.load_signals`); ``kv_events``, the model's
KV index."""


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
        """The rendered prompt (see :mod:`disagg_router.router.routing.prompt_keys`), computed
        once."""
        return prompt_of(self.body, self.chat)


NO_INPUT = RoutingInput()


class Policy(Protocol):
    """Chooses one of ``candidates`` (non-empty, in pool order) for ``request``.

    ``name``: the config's name for it; ``settings``: the :class:`PoolConfig` fields it reads;
    ``signals``: what it reads beyond the router's own counts. ``from_config`` builds a fresh one.
    """

    name: ClassVar[str]
    settings: ClassVar[frozenset[str]]
    signals: ClassVar[frozenset[Signal]]

    @classmethod
    def from_config(cls, config: PoolConfig, signals: LoadSignalsConfig) -> Policy: ...

    def choose(self, candidates: Sequence[BackendState], request: RoutingInput) -> BackendState: ...
