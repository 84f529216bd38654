"""The routing table: for each served model its P and D pools and its disaggregation rule.

Who calls it: the runtime (:mod:`router.runtime`) holds one :class:`LiveRouting`; requests read
its current ``table``
(an immutable snapshot) once, at dispatch; hot reload calls :meth:`LiveRouting.apply` with a new,
already validated config. ``apply`` runs without awaiting, so on the router's event loop the swap
is atomic: a request sees either the old table or the new one. Pools of a model present in both
configs are updated in place through :meth:`router.routing.pools.Pool.update` (instances that
stay keep their state; dispatches in flight keep the backends they started on).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

from router.config import ModelRoute, RouterSettings
from router.errors import ModelNotFound
from router.routing.pools import MembershipChange, Pool


@dataclass(frozen=True)
class ModelPools:
    """One served model's effective route and its live pools."""

    route: ModelRoute
    prefill: Pool
    decode: Pool


@dataclass(frozen=True)
class RoutingTable:
    """One config's worth of routing: the settings it came from and the per-model pools."""

    settings: RouterSettings
    models: Mapping[str, ModelPools]

    def pools(self) -> list[Pool]:
        """Every pool of every model (P then D per model, in file order)."""
        return [p for m in self.models.values() for p in (m.prefill, m.decode)]

    def lookup(self, model: str) -> ModelPools:
        """The pools serving ``model``; a 404 naming the served models otherwise."""
        found = self.models.get(model)
        if found is None:
            raise ModelNotFound(model, self.models)
        return found


def _pool(
    settings: RouterSettings,
    route: ModelRoute,
    role: str,
    previous: Pool | None,
    previous_table_exists: bool,
) -> tuple[Pool, MembershipChange | None]:
    """The pool for one role of one model: the previous one updated, or a new one (whose
    backends wait for a health check when created while serving)."""
    config = route.prefill if role == "prefill" else route.decode
    if previous is not None:
        previous.require_identity = role == "prefill" and settings.mode == "push"
        return previous, previous.update(config, settings.load_signals)
    serving = previous_table_exists
    pool = Pool(
        "prefill" if role == "prefill" else "decode",
        config,
        require_identity=role == "prefill" and settings.mode == "push",
        model=route.model,
        signals=settings.load_signals,
        checked=not serving,
        admission=settings.admission,
        breaker=settings.breaker,
    )
    return pool, MembershipChange(tuple(pool.backends), ()) if serving else None


def build_table(
    settings: RouterSettings, previous: RoutingTable | None = None
) -> tuple[RoutingTable, list[MembershipChange]]:
    """The table for ``settings``, reusing (and updating) the pools of ``previous`` per model."""
    models: dict[str, ModelPools] = {}
    changes: list[MembershipChange] = []
    for name, route in settings.routes().items():
        old = previous.models.get(name) if previous is not None else None
        serving = previous is not None
        prefill, p_change = _pool(settings, route, "prefill", old.prefill if old else None, serving)
        decode, d_change = _pool(settings, route, "decode", old.decode if old else None, serving)
        changes += [c for c in (p_change, d_change) if c is not None]
        models[name] = ModelPools(route, prefill, decode)
    return RoutingTable(settings, models), changes


class LiveRouting:
    """The current :class:`RoutingTable`; replaced whole by :meth:`apply`."""

    def __init__(self, settings: RouterSettings) -> None:
        self.table, _ = build_table(settings)

    def apply(self, settings: RouterSettings) -> list[MembershipChange]:
        """Swap in the table for ``settings`` (atomic on the event loop); the membership changes
        of the pools that stayed. Pools of models no longer served are simply dropped."""
        self.table, changes = build_table(settings, self.table)
        return changes
