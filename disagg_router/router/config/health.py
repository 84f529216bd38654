"""``health`` (active checks and identity probes) and ``load_signals`` (vLLM's gauges, scraped)."""

from __future__ import annotations

from typing import Any

from pydantic import (
    Field,
    model_validator,
)

from disagg_router.router.config._base import Frozen, renamed_keys


class HealthConfig(Frozen):
    interval: float = Field(default=10.0, gt=0, description="seconds between health checks")
    unhealthy_interval: float = Field(
        default=1.0, gt=0, description="seconds between checks while any backend is unhealthy"
    )
    identity_interval: float | None = Field(
        default=300.0,
        gt=0,
        description=(
            "seconds between identity probes of a healthy prefill instance (push mode); "
            "null: probe only at start and when an instance (re)joins "
            "(old name: discovery_interval)"
        ),
    )
    identity_prompt: str = Field(
        default="ping",
        min_length=1,
        description="prompt of the identity probe (old name: discovery_prompt)",
    )
    failure_threshold: int = Field(
        default=2, ge=1, description="consecutive timed-out checks that take a backend out"
    )
    startup_wait: float = Field(
        default=5.0,
        gt=0,
        description=(
            "seconds a request that arrives before the first health check has finished waits "
            "for it (not at all once the health monitor has crashed)"
        ),
    )

    @model_validator(mode="before")
    @classmethod
    def _old_names(cls, data: Any) -> Any:
        return renamed_keys("health", data)


class LoadSignalsConfig(Frozen):
    """Scraping of each instance's ``/metrics`` for ``power_of_two`` (only pools using it) and
    for ``push.bind: adaptive`` (every D).

    ``interval``: seconds between scrapes; ``stale_after``: older signals are ignored (the policy
    falls back to the router's in-flight counts).
    """

    interval: float = Field(default=2.0, gt=0)
    stale_after: float = Field(default=6.0, gt=0)

    @model_validator(mode="after")
    def _consistent(self) -> LoadSignalsConfig:
        if self.stale_after < self.interval:
            raise ValueError("stale_after must be >= interval")
        return self
