"""Runtime state of one upstream vLLM instance (a P or D backend).

Who mutates it: the load-signal scraper (``signals``), the dispatch (``in_flight`` around each
leg, ``mark_failed`` when an instance cannot be reached) and the health monitor (``healthy``;
the discovered identity goes through :func:`router.health.learn_identity`). All mutation
happens on the router's event loop, so no locking is needed. Policies only read it.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

from router.config import InstanceConfig, PushIdentity

Role = Literal["prefill", "decode"]


@dataclass(frozen=True)
class LoadSignals:
    """One scrape of vLLM's gauges: queued and running requests, KV cache usage (0..1), and
    when it was taken (``time.monotonic()``); see :mod:`router.load_signals`."""

    waiting: float
    running: float
    kv_usage: float
    at: float


@dataclass
class BackendState:
    config: InstanceConfig
    role: Role
    healthy: bool = True
    in_flight: int = 0
    discovered_identity: PushIdentity | None = None
    discovered_at: float | None = None  # time.monotonic() of the last successful probe
    failed_checks: int = 0  # consecutive failed health checks
    last_error: str | None = field(default=None)
    model: str = ""  # the served model name of the pool this backend belongs to
    signals: LoadSignals | None = None  # last scraped vLLM load signals (power_of_two)

    @property
    def url(self) -> str:
        return self.config.url

    @property
    def label(self) -> str:
        return self.config.label

    @property
    def identity(self) -> PushIdentity | None:
        """The push identity: configured if given, else the last one discovered."""
        return self.config.identity or self.discovered_identity

    @property
    def needs_discovery(self) -> bool:
        return self.role == "prefill" and self.config.identity is None

    def mark_failed(self, reason: str) -> None:
        """Take the backend out of rotation until the next successful health check."""
        self.healthy = False
        self.last_error = reason
