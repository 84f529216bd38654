"""``migration``: a stream whose D fails after the first token goes on on another D."""

from __future__ import annotations

from pydantic import Field

from disagg_router.router.config._base import Frozen


class MigrationConfig(Frozen):
    """When a stream's D fails (dies, hangs, drops the connection) after the first token, the
    router continues it on another D from the tokens already sent (docs/router.md, "Failover")."""

    enabled: bool = Field(default=True, description="continue a stream on another D")
    max_per_request: int = Field(
        default=2, ge=1, le=8, description="migrations one stream may make at most"
    )
    seeded: bool = Field(
        default=False,
        description="also continue a request with a `seed` (the new D cannot go on with the "
        "seed's random sequence: the text after the seam differs from an uninterrupted run's)",
    )
