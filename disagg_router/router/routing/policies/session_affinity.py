"""``session_affinity``: bounded rendezvous hashing (:mod:`.affinity`) over a session key (a
header, or the request's ``user``); pins a conversation without relying on its text."""

from __future__ import annotations

from typing import ClassVar

from disagg_router.router.config import LoadSignalsConfig, PoolConfig
from disagg_router.router.routing.policies.affinity import BoundedAffinity
from disagg_router.router.routing.policies.base import RoutingInput, Signal
from disagg_router.router.routing.prompt_keys import session_key


class SessionAffinity(BoundedAffinity):
    """Affinity on a session key: the ``header`` value, else the request's ``user``."""

    name: ClassVar[str] = "session_affinity"
    settings: ClassVar[frozenset[str]] = frozenset({"session_header", "load_factor"})
    signals: ClassVar[frozenset[Signal]] = frozenset()

    def __init__(self, header: str, load_factor: float) -> None:
        super().__init__(load_factor)
        self._header = header

    @classmethod
    def from_config(cls, config: PoolConfig, signals: LoadSignalsConfig) -> SessionAffinity:
        return cls(config.session_header, config.load_factor)

    def key(self, request: RoutingInput) -> bytes | None:
        session = session_key(request.headers, request.body, self._header)
        return None if session is None else b"session:" + session.encode()
