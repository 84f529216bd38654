"""A pool of backends of one role of one model plus its policy; picks instances for a dispatch.

Who calls it: the orchestrator, once per dispatch and leg, on the pools of the routing table
(:mod:`disagg_router.router.routing.table`), which builds them and on hot reload updates them
(:meth:`Pool.update`); :mod:`disagg_router.router.discovery.manager` sets a discovered pool's
members. ``require_identity`` is set for the prefill pool in push mode: an instance whose identity
is neither configured nor learned yet cannot be paired and is skipped.

Membership changes (:meth:`Pool.update`) keep the state of instances that stay (health, in-flight
count, learned identity, load signals) and apply at once, between two dispatches:
- an instance that leaves is no longer chosen; dispatches already using it finish on it (they hold
  its state), and it is listed in ``draining`` until its last leg ends;
- an instance that joins starts unhealthy and is chosen only after it passes a health check (and,
  for a P in push mode, an identity probe): the health monitor re-checks unhealthy backends each
  ``health.unhealthy_interval``, and the caller may check the returned ``added`` at once.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Collection, Sequence
from dataclasses import dataclass

from disagg_router.router.config import (
    AdmissionConfig,
    BreakerConfig,
    InstanceConfig,
    LoadSignalsConfig,
    PoolConfig,
)
from disagg_router.router.errors import NoBackendAvailable
from disagg_router.router.instances.demand import KvDemand
from disagg_router.router.instances.registry import BackendRegistry
from disagg_router.router.instances.state import BackendState, Role
from disagg_router.router.routing.policies.base import NO_INPUT, Policy, RoutingInput
from disagg_router.router.routing.policies.factory import make_policy, policy_type

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class MembershipChange:
    """What one :meth:`Pool.update` did: the backends that joined and those that left."""

    added: tuple[BackendState, ...]
    removed: tuple[BackendState, ...]


class Pool:
    def __init__(
        self,
        role: Role,
        config: PoolConfig,
        require_identity: bool,
        model: str = "",
        signals: LoadSignalsConfig | None = None,
        checked: bool = True,
        admission: AdmissionConfig | None = None,
        breaker: BreakerConfig | None = None,
        registry: BackendRegistry | None = None,
    ) -> None:
        """``checked`` False: every backend starts unhealthy until its first health check
        passes (a pool created while serving, e.g. for a model added by a reload).
        ``registry``: where the backend states come from, shared with the router's other pools
        (default: one of the pool's own, with ``admission``/``breaker`` as the settings of each
        backend's admission gate and breaker)."""
        self.role = role
        self.model = model
        self._registry = registry or BackendRegistry(admission, breaker)
        self.require_identity = require_identity
        self.config = config
        self.backends = [self._backend(i, checked)[0] for i in config.instances]
        self.draining: list[BackendState] = []
        self.kv_demand = KvDemand()  # a D pool's: what push.bind adaptive weighs
        self._policy: Policy = make_policy(config, signals)

    def _backend(self, instance: InstanceConfig, checked: bool) -> tuple[BackendState, bool]:
        """The (possibly shared) state of ``instance``; True when it was created now."""
        return self._registry.get(self.role, instance, self.model, checked)

    def usable(self) -> list[BackendState]:
        """Routable backends (healthy, breaker closed; with a push identity where required), in
        pool order."""
        return [
            b
            for b in self.backends
            if b.routable and (not self.require_identity or b.identity is not None)
        ]

    def choose(
        self,
        exclude: Collection[str] = (),
        request: RoutingInput = NO_INPUT,
        strict: bool = False,
        refuse: Callable[[BackendState], str | None] | None = None,
    ) -> BackendState:
        """Pick a usable backend for ``request`` and count the leg in flight on it, in one step.

        Avoids labels in ``exclude`` when any other is usable (``strict``: never one of them);
        backends with a free admission slot come first. The chosen backend's ``in_flight`` is
        incremented before this returns, so the next choice (even in the same burst, before any
        leg starts) sees it: the caller owns that count and must decrement it when the leg ends
        or is given up. :class:`NoBackendAvailable` when there is no candidate (nothing counted).
        ``refuse``: why a backend cannot serve this dispatch (``None``: it can); refused ones are
        skipped, and when every usable one is refused the error names the first reason.
        """
        usable = self.usable()
        if refuse is not None:
            usable = self._served(usable, refuse)
        fresh = [b for b in usable if b.label not in exclude]
        candidates = fresh if strict else (fresh or usable)
        if not candidates:
            raise NoBackendAvailable(f"no usable {self.role} instance")
        roomy = [b for b in candidates if b.gate.has_room()]
        chosen = self._policy.choose(roomy or candidates, request)
        chosen.in_flight += 1
        return chosen

    def claim(
        self, backend: BackendState, refuse: Callable[[BackendState], str | None] | None = None
    ) -> BackendState | None:
        """``backend`` counted in flight, as :meth:`choose` would count it, when it is usable
        here and ``refuse`` lets it through; None (nothing counted) otherwise."""
        usable = any(b is backend for b in self.usable())
        if not usable or (refuse is not None and refuse(backend) is not None):
            return None
        backend.in_flight += 1
        return backend

    def _served(
        self, usable: list[BackendState], refuse: Callable[[BackendState], str | None]
    ) -> list[BackendState]:
        """The backends of ``usable`` that ``refuse`` lets through; :class:`NoBackendAvailable`
        naming the first reason when it refuses every one."""
        reasons = [refuse(b) for b in usable]
        served = [b for b, why in zip(usable, reasons, strict=True) if why is None]
        if usable and not served:
            raise NoBackendAvailable(
                f"no {self.role} instance can be paired (the KV connector cannot serve the "
                f"combination): {reasons[0]}"
            )
        return served

    def set_instances(self, instances: Sequence[InstanceConfig]) -> MembershipChange:
        """Make ``instances`` the pool's members (matched by label); the one membership update.

        Kept instances keep their state (an instance whose config changed, e.g. a new url or
        identity under the same name, counts as removed and added). New ones start unhealthy
        until a health check passes; one another pool already lists joins with its state as it
        is (and is not in ``added``: it needs no check). Removed ones move to ``draining`` while
        legs are in flight.
        """
        current = {b.label: b for b in self.backends}
        members: list[BackendState] = []
        added: list[BackendState] = []
        for instance in instances:
            kept = current.get(instance.label)
            if kept is not None and kept.config == instance:
                members.append(kept)
                continue
            joining, created = self._backend(instance, checked=False)
            members.append(joining)
            if created:
                added.append(joining)
        member_ids = {id(b) for b in members}
        removed = [b for b in self.backends if id(b) not in member_ids]
        self.backends = members
        self.draining = [b for b in self.draining + removed if b.in_flight > 0]
        for b in removed:
            log.info(
                "%s %s (%s) leaves the pool; %d legs in flight finish on it",
                self.role,
                b.label,
                self.model,
                b.in_flight,
            )
        return MembershipChange(tuple(added), tuple(removed))

    @property
    def policy(self) -> Policy:
        """The policy in force (rebuilt by :meth:`update` when a setting it reads changes); its
        ``signals`` say what the pool's instances must be watched for (``"load"``: the load
        scraper keeps their vLLM gauges)."""
        return self._policy

    def update(
        self, config: PoolConfig, signals: LoadSignalsConfig | None = None
    ) -> MembershipChange:
        """Apply a new config of this pool: members via :meth:`set_instances` (static pools only:
        a discovered pool's members come from its discovery source), and a fresh policy when the
        policy settings changed (the policy's state, e.g. a round-robin cursor, resets)."""
        static = config.discovery.source == "static"
        change = self.set_instances(config.instances) if static else MembershipChange((), ())
        keys = {"policy"} | policy_type(config).settings
        if config.model_dump(include=keys) != self.config.model_dump(include=keys):
            self._policy = make_policy(config, signals)
        self.config = config
        return change

    def prune_draining(self) -> list[BackendState]:
        """Forget draining backends whose last leg ended; returns those forgotten."""
        done = [b for b in self.draining if b.in_flight == 0]
        self.draining = [b for b in self.draining if b.in_flight > 0]
        return done
