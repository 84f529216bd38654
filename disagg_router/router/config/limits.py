"""What an instance and the router accept: ``admission``, ``breaker``, ``limits``, ``drain``."""

from __future__ import annotations

from pydantic import (
    Field,
    model_validator,
)

from disagg_router.router.config._base import Frozen


class AdmissionConfig(Frozen):
    """Per-instance admission: at most ``max_in_flight`` legs at once on one instance; up to
    ``queue_size`` more wait at most ``max_wait`` seconds for a slot; beyond that a 429 with
    ``Retry-After: retry_after``."""

    max_in_flight: int = Field(default=256, ge=1)
    queue_size: int = Field(default=512, ge=0)
    max_wait: float = Field(default=10.0, gt=0)
    retry_after: int = Field(default=1, ge=1, description="seconds, sent as Retry-After")
    reserved_for_high: int = Field(
        default=0,
        ge=0,
        description="of max_in_flight, slots only high-priority tenants' requests take "
        "(tenancy): a high request then never waits behind the other classes for a slot",
    )

    @model_validator(mode="after")
    def _reserve_fits(self) -> AdmissionConfig:
        if self.reserved_for_high >= self.max_in_flight:
            raise ValueError("reserved_for_high must be < max_in_flight")
        return self


class BreakerConfig(Frozen):
    """Passive health: ``failure_threshold`` consecutive failed legs (5xx, timeouts, refused
    connections, protocol errors) open an instance's breaker for ``backoff`` seconds, doubling on
    each failed half-open trial up to ``max_backoff``; an unreachable instance opens it at once."""

    failure_threshold: int = Field(default=3, ge=1)
    backoff: float = Field(default=1.0, gt=0)
    max_backoff: float = Field(default=30.0, gt=0)

    @model_validator(mode="after")
    def _ordered(self) -> BreakerConfig:
        if self.max_backoff < self.backoff:
            raise ValueError("max_backoff must be >= backoff")
        return self


class LimitsConfig(Frozen):
    """Client-side bounds. ``max_body_bytes``: larger bodies get 413. ``body_timeout``: seconds
    to receive the whole body (408 after). ``max_header_bytes``: the request line plus headers
    (431 after). ``max_json_depth``: nesting of the JSON body. ``max_tokens``: the largest
    ``max_tokens``/``max_completion_tokens`` accepted. ``docs``: serve /docs, /redoc and
    /openapi.json."""

    max_body_bytes: int = Field(default=4 * 1024 * 1024, ge=1024)
    body_timeout: float = Field(default=30.0, gt=0)
    max_header_bytes: int = Field(default=32 * 1024, ge=1024)
    max_json_depth: int = Field(default=32, ge=4)
    max_tokens: int = Field(default=1_000_000, ge=1)
    docs: bool = False
    keep_alive: float = Field(
        default=75.0,
        gt=0,
        description=(
            "seconds an idle client connection is kept open; longer than clients' own idle "
            "expiry (httpx: 5 s), so a client never sends on a connection the router is closing"
        ),
    )
    header_timeout: float = Field(
        default=10.0,
        gt=0,
        description=(
            "seconds from a request's first byte to the end of its headers; after that the "
            "client gets 408 and the connection is closed"
        ),
    )
    idle_connection_timeout: float = Field(
        default=15.0,
        gt=0,
        description=(
            "seconds a new client connection may stay without sending a request; then it is "
            "closed without an answer"
        ),
    )
    max_connections: int = Field(
        default=4096,
        ge=1,
        description=(
            "client connections open at once; one opened beyond gets 503 with Retry-After: 1 "
            "and is closed at once"
        ),
    )


class DrainConfig(Frozen):
    """On SIGTERM/SIGINT: /ready answers 503 and new requests 503 at once; requests in flight get
    ``timeout`` seconds to finish, then their legs are cancelled."""

    timeout: float = Field(default=30.0, gt=0)
