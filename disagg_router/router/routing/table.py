"""The routing table: for each served model its P and D pools and its disaggregation rule.

Who calls it: the runtime (:mod:`disagg_router.router.runtime`) holds one :class:`LiveRouting`;
requests read its current ``table`` (an immutable snapshot) once, at dispatch; hot reload calls
:meth:`LiveRouting.apply` with a new, already validated config. ``apply`` runs without awaiting, so
on the router's event loop the swap is atomic: a request sees either the old table or the new one.
Pools of a model present in both configs are updated in place through
:meth:`disagg_router.router.routing.pools.Pool.update` (instances that stay keep their state;
dispatches in flight keep the backends they started on). Every pool takes its backend states from
the one :class:`~disagg_router.router.instances.registry.BackendRegistry`, so an instance listed
under several models has one state; an instance that no pool lists any more is forgotten (its metric
series removed through ``hooks.forget``) once its last leg has ended.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from disagg_router.router.config import InstanceConfig, ModelRoute, RouterSettings
from disagg_router.router.errors import ModelNotFound
from disagg_router.router.instances.registry import BackendHooks, BackendRegistry
from disagg_router.router.instances.state import BackendState
from disagg_router.router.routing.pools import MembershipChange, Pool


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

    def backends(self) -> list[BackendState]:
        """Every member of every pool, once each (pools may share an instance's state)."""
        seen: dict[int, BackendState] = {}
        for pool in self.pools():
            for b in pool.backends:
                seen.setdefault(id(b), b)
        return list(seen.values())

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
    registry: BackendRegistry,
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
        registry=registry,
    )
    return pool, MembershipChange(tuple(pool.backends), ()) if serving else None


def build_table(
    settings: RouterSettings,
    previous: RoutingTable | None = None,
    registry: BackendRegistry | None = None,
) -> tuple[RoutingTable, list[MembershipChange]]:
    """The table for ``settings``, reusing (and updating) the pools of ``previous`` per model;
    backend states come from ``registry`` (default: a fresh one)."""
    registry = registry or BackendRegistry(settings.admission, settings.breaker)
    models: dict[str, ModelPools] = {}
    changes: list[MembershipChange] = []
    for name, route in settings.routes().items():
        old = previous.models.get(name) if previous is not None else None
        serving = previous is not None
        pools = [
            _pool(settings, route, role, getattr(old, role) if old else None, serving, registry)
            for role in ("prefill", "decode")
        ]
        changes += [c for _, c in pools if c is not None]
        models[name] = ModelPools(route, pools[0][0], pools[1][0])
    return RoutingTable(settings, models), changes


class LiveRouting:
    """The current :class:`RoutingTable`; replaced whole by :meth:`apply`; the one place pool
    membership changes (:meth:`apply`, :meth:`set_instances`), so instances that leave every
    pool are seen here."""

    def __init__(self, settings: RouterSettings, hooks: BackendHooks | None = None) -> None:
        self._hooks = hooks or BackendHooks()
        self._registry = BackendRegistry(settings.admission, settings.breaker, self._hooks)
        self.table, _ = build_table(settings, None, self._registry)
        self._leaving: list[BackendState] = []

    def apply(self, settings: RouterSettings) -> list[MembershipChange]:
        """Swap in the table for ``settings`` (atomic on the event loop): one change with the
        states created for joining instances (to be checked) and those that left every pool.
        Pools of models no longer served are simply dropped."""
        before = self.table.backends()
        self._registry.admission, self._registry.breaker = settings.admission, settings.breaker
        self.table, changes = build_table(settings, self.table, self._registry)
        added = tuple(b for c in changes for b in c.added)
        return [MembershipChange(added, self._left(before))]

    def set_instances(self, pool: Pool, instances: Sequence[InstanceConfig]) -> MembershipChange:
        """Make ``instances`` the members of ``pool`` (discovery); like :meth:`apply`, the change
        names the instances that left every pool (not those another pool still lists)."""
        before = self.table.backends()
        change = pool.set_instances(instances)
        return MembershipChange(change.added, self._left(before))

    def _left(self, before: Sequence[BackendState]) -> tuple[BackendState, ...]:
        """The states in ``before`` that no pool lists now; forgotten once idle."""
        now = self.table.backends()
        self._registry.retain(now)
        live = {id(b) for b in now}
        left = tuple(b for b in before if id(b) not in live)
        self._leaving += left
        self.forget_idle()
        return left

    def forget_idle(self) -> None:
        """Report (``hooks.forget``) the instances that left every pool and have no leg in
        flight any more; the health monitor calls this every tick for those still draining."""
        idle = [b for b in self._leaving if b.in_flight == 0]
        self._leaving = [b for b in self._leaving if b.in_flight > 0]
        if not idle:
            return
        live = self.table.backends()
        in_use = {(b.role, b.label) for b in live}
        labels = {b.label for b in live}
        for b in idle:
            if (b.role, b.label) not in in_use:
                self._hooks.forget(b.role, b.label, b.label in labels)
