"""``tenancy``: who may call the router, which models, how much and at what priority.

A tenant is named by its API keys (stored as SHA-256 hex digests, never in the clear:
``disagg-router hash-key``). Its limits: requests and tokens per minute (refilled every second, with
a bounded burst), requests in flight at once; its ``priority`` class and ``weight`` order the
admission queues of the instances (docs/router.md, "Tenants")."""

from __future__ import annotations

import re
from typing import Literal

from pydantic import Field, field_validator, model_validator

from disagg_router.router.config._base import Frozen

Priority = Literal["high", "normal", "low"]
UnknownKey = Literal["reject", "default"]

DEFAULT_TENANT = "default"
_HEX64 = re.compile(r"[0-9a-f]{64}")


class TenantLimits(Frozen):
    """A tenant's limits and place in the queues; a limit left out is no limit."""

    requests_per_minute: int | None = Field(default=None, ge=1)
    tokens_per_minute: int | None = Field(
        default=None,
        ge=1,
        description="prompt tokens (estimated on admission) plus max_tokens, corrected by the "
        "usage the answer reports",
    )
    max_concurrent: int | None = Field(
        default=None, ge=1, description="requests admitted and not yet ended, at once"
    )
    priority: Priority = Field(default="normal", description="high, normal or low")
    weight: float = Field(
        default=1.0, gt=0, le=1000, description="share among the tenants of one priority"
    )
    models: list[str] | None = Field(
        default=None, description="the models it may call; absent: every model"
    )


class TenantConfig(TenantLimits):
    """One named tenant and the SHA-256 digests of its API keys."""

    name: str = Field(pattern=r"^[A-Za-z0-9_.\-]{1,64}$")
    key_sha256: list[str] = Field(
        min_length=1, description="hex SHA-256 of each key (`disagg-router hash-key`)"
    )

    @field_validator("key_sha256")
    @classmethod
    def _digests(cls, value: list[str]) -> list[str]:
        for digest in value:
            if not _HEX64.fullmatch(digest):
                raise ValueError("each key_sha256 must be 64 lower-case hex digits")
        return value


class StoreConfig(Frozen):
    """The shared store of every replica's request and token counts (Redis)."""

    url: str = Field(
        pattern=r"^(redis|rediss|unix)://", description="redis://host:port/db or unix:///path"
    )
    timeout: float = Field(
        default=0.05, gt=0, le=5.0, description="seconds for one store call; then local limits"
    )
    retry_after: float = Field(
        default=5.0, gt=0, description="seconds on local limits before the store is tried again"
    )
    prefix: str = Field(default="disagg-router", min_length=1, description="key prefix")


class TenancyConfig(Frozen):
    """Tenants and how they share the fleet. Without tenants and ``api_keys`` every request is
    the ``default`` tenant's; with any key configured, a request with no known key gets 401
    (``unknown_key: reject``) or is the ``default`` tenant's (``unknown_key: default``). Keys in
    ``api_keys`` are the ``default`` tenant's."""

    tenants: list[TenantConfig] = Field(default_factory=list)
    default: TenantLimits = TenantLimits()
    unknown_key: UnknownKey = "reject"
    replicas: int = Field(
        default=1,
        ge=1,
        le=1024,
        description="router processes sharing the limits (replicas x workers): without a "
        "store (or while it is away) each enforces its share of every limit; max_concurrent "
        "is always shared this way",
    )
    burst: float = Field(
        default=10.0,
        gt=0,
        le=60.0,
        description="seconds' worth of a per-minute limit a tenant may take at once (at least "
        "one request or token); after that, limit / 60 per second",
    )
    max_priority_wait: float = Field(
        default=2.0,
        gt=0,
        description="seconds after which a request waiting for a slot goes before higher "
        "priority classes (the bound on a lower class's starvation)",
    )
    engine_priority: bool = Field(
        default=False,
        description="send each request's priority class to vLLM (the request's `priority`: 0 "
        "high, 1 normal, 2 low; needs vLLM's --scheduling-policy priority); off: a client's own "
        "`priority` is removed once tenants are configured",
    )
    store: StoreConfig | None = None

    @model_validator(mode="after")
    def _distinct(self) -> TenancyConfig:
        names = [t.name for t in self.tenants]
        if DEFAULT_TENANT in names:
            raise ValueError(f"tenants: '{DEFAULT_TENANT}' is reserved (set tenancy.default)")
        if len(set(names)) != len(names):
            raise ValueError("tenants: names must be distinct")
        digests = [d for t in self.tenants for d in t.key_sha256]
        if len(set(digests)) != len(digests):
            raise ValueError("tenants: a key belongs to one tenant only")
        return self
