"""Runtime state of one upstream vLLM instance (a P or D backend).

Who mutates it: the load-signal scraper (``signals``), the dispatch (``in_flight`` and an
admission slot around each leg, the leg's outcome into the ``breaker``, what it learns of the
instance's ``pace``) and the health monitor
(``healthy``, ``checked``, ``max_model_len``, breaker probes; the learned identity goes through
:func:`disagg_router.router.instances.identity.learn_identity`, the learned engine shape through
:func:`disagg_router.router.health.shapes.learn_shape`). All mutation happens on the router's event
loop, so no locking is needed. Policies only read it.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

from disagg_router.connector.contract import EngineShape
from disagg_router.router.config import AdmissionConfig, BreakerConfig, InstanceConfig, PushIdentity
from disagg_router.router.instances.admission import Gate
from disagg_router.router.instances.breaker import Breaker
from disagg_router.router.instances.pace import Pace

Role = Literal["prefill", "decode"]


@dataclass(frozen=True)
class LoadSignals:
    """One scrape of vLLM's gauges: queued and running requests, KV cache usage (0..1), when it
    was taken (``time.monotonic()``), this router's own legs in flight on the instance at that
    moment and the KV cache's size in tokens (0: not reported); see
    :mod:`disagg_router.router.health.load_signals`."""

    waiting: float
    running: float
    kv_usage: float
    at: float
    own_in_flight: int = 0
    kv_tokens: int = 0


@dataclass
class BackendState:
    config: InstanceConfig
    role: Role
    healthy: bool = True
    in_flight: int = 0
    learned_identity: PushIdentity | None = None
    identity_learned_at: float | None = None  # time.monotonic() of the last identity probe
    shape: EngineShape | None = None  # learned by identity probes; None: unknown (pairs with all)
    shape_unknown_logged: bool = False  # "answers no shape" was logged once
    failed_checks: int = 0  # consecutive failed health checks
    last_error: str | None = field(default=None)
    model: str = ""  # the served model name of the pool this backend belongs to
    signals: LoadSignals | None = None  # last scraped vLLM load signals (power_of_two)
    checked: bool = False  # a health check has completed (passed or failed) at least once
    max_model_len: int | None = (
        None  # from the instance's /v1/models (disagg_router.router.health.model_info)
    )
    gate: Gate = field(default_factory=lambda: Gate(AdmissionConfig()))
    breaker: Breaker = field(default_factory=lambda: Breaker(BreakerConfig()))
    pace: Pace = field(default_factory=Pace)  # learned prefill speed (P) and lead (D)

    @property
    def url(self) -> str:
        return self.config.url

    @property
    def label(self) -> str:
        return self.config.label

    @property
    def api_key(self) -> str | None:
        """Sent as a Bearer token with every request to this instance (None: no key)."""
        return self.config.api_key

    @property
    def identity(self) -> PushIdentity | None:
        """The push identity: configured if given, else the last one learned (probe or P leg)."""
        return self.config.identity or self.learned_identity

    @property
    def needs_identity_probe(self) -> bool:
        return self.role == "prefill" and self.config.identity is None

    @property
    def routable(self) -> bool:
        """Healthy by the last active check and not taken out by its breaker; a breaker on
        trial (its probe passed) admits one leg at a time until a leg's outcome decides."""
        if not self.healthy or not self.breaker.admits:
            return False
        return self.breaker.closed or self.in_flight == 0

    def missing(self, require_identity: bool) -> str | None:
        """Why this backend cannot take traffic now (None when it can)."""
        if not self.checked:
            return "not checked yet"
        if not self.healthy:
            return f"unhealthy: {self.last_error}"
        if not self.breaker.admits:
            return f"breaker {self.breaker.state}: {self.breaker.last_error}"
        if require_identity and self.identity is None:
            return "identity not learned yet"
        return None
