"""One :class:`BackendState` per instance (role and URL), shared by every pool that lists it.

Who calls it: the pools (:mod:`disagg_router.router.routing.pools`), whenever they need the state of
a member (:meth:`BackendRegistry.get`); :class:`disagg_router.router.routing.table.LiveRouting` owns
the router's one registry and, after every membership update (reload, discovery), drops the states
no pool lists any more (:meth:`BackendRegistry.retain`). An instance listed under several models (or
under the short form's shared pools) thus has one admission gate, one breaker, one in-flight count
and one set of metric series. An instance is the same when its role and URL are; a second config of
the same URL that differs (another name, key or identity) gets a state of its own and replaces the
first for pools that join later.

Hooks: ``breaker_changed(backend, open)`` is called whenever a breaker opens or closes (the
``disagg_router_backend_breaker_open`` gauge follows it). Single event loop: no locking.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass

from disagg_router.router.config import AdmissionConfig, BreakerConfig, InstanceConfig
from disagg_router.router.instances.admission import Gate
from disagg_router.router.instances.breaker import Breaker
from disagg_router.router.instances.state import BackendState, Role


def _no_breaker_hook(_backend: BackendState, _open: bool) -> None:
    return None


def _no_forget_hook(_role: str, _label: str, _label_in_use: bool) -> None:
    return None


@dataclass(frozen=True)
class BackendHooks:
    """What the routing layer reports to the rest of the router (metrics).

    ``breaker_changed(backend, open)``: a breaker opened (True) or closed (False).
    ``forget(role, label, label_in_use)``: no pool lists the instance any more and no leg runs
    on it; ``label_in_use``: another live instance (of the other role) has the same label.
    Both run on the event loop and must not raise or await.
    """

    breaker_changed: Callable[[BackendState, bool], None] = _no_breaker_hook
    forget: Callable[[str, str, bool], None] = _no_forget_hook


class BackendRegistry:
    """The live backend states by (role, URL); see the module docstring."""

    def __init__(
        self,
        admission: AdmissionConfig | None = None,
        breaker: BreakerConfig | None = None,
        hooks: BackendHooks | None = None,
    ) -> None:
        self.admission = admission or AdmissionConfig()
        self.breaker = breaker or BreakerConfig()
        self.hooks = hooks or BackendHooks()
        self._states: dict[tuple[str, str], BackendState] = {}

    def get(
        self, role: Role, instance: InstanceConfig, model: str, checked: bool
    ) -> tuple[BackendState, bool]:
        """The state of ``instance`` in ``role`` and whether it was created now. A new state
        (``checked`` False) starts unhealthy until its first health check passes."""
        key = (role, instance.url)
        found = self._states.get(key)
        if found is not None and found.config == instance:
            return found, False
        backend = BackendState(config=instance, role=role, model=model, gate=Gate(self.admission))
        backend.breaker = Breaker(
            self.breaker, on_change=lambda is_open: self.hooks.breaker_changed(backend, is_open)
        )
        if not checked:
            backend.healthy = False
            backend.last_error = "not checked yet"
        self._states[key] = backend
        return backend, True

    def retain(self, live: Iterable[BackendState]) -> None:
        """Forget every state not in ``live`` (the members of all pools now)."""
        keep = {id(b) for b in live}
        self._states = {k: b for k, b in self._states.items() if id(b) in keep}
