"""``timeouts``: how long each step of a request, check or probe may take."""

from __future__ import annotations

from typing import Any

from pydantic import (
    Field,
    model_validator,
)

from disagg_router.router.config._base import Frozen, renamed_keys


class TimeoutsConfig(Frozen):
    """Seconds; all finite and positive.

    ``connect``: TCP connect to an instance. ``prefill``: the whole P leg. ``first_token``: from
    dispatch until D's first token. ``after_prefill``: from P's answer until D's first token (a D
    that hangs on the KV hand-off is found this long after P finished, whatever P's queue took).
    ``total``: the whole request, end to end. ``health``: one
    ``/health`` call. ``identity_probe``: one identity probe (a 1-token prefill on P).
    ``inter_token``: the longest silence of D in a stream after its first token.
    """

    connect: float = Field(default=5.0, gt=0)
    prefill: float = Field(default=120.0, gt=0)
    first_token: float = Field(default=180.0, gt=0)
    after_prefill: float = Field(
        default=60.0,
        gt=0,
        description=(
            "a stream whose D sends no first token this long after P answered ends (504 naming "
            "D, or a retry keeping P), however long P's queue took"
        ),
    )
    total: float = Field(default=600.0, gt=0)
    health: float = Field(default=10.0, gt=0)
    identity_probe: float = Field(
        default=60.0, gt=0, description="seconds for one identity probe (old name: discovery)"
    )
    inter_token: float = Field(
        default=60.0,
        gt=0,
        description=(
            "a streamed answer whose D sends nothing for this long after its first token ends "
            "with one SSE error event, counted against D's breaker"
        ),
    )

    @model_validator(mode="before")
    @classmethod
    def _old_names(cls, data: Any) -> Any:
        return renamed_keys("timeouts", data)

    @model_validator(mode="after")
    def _consistent(self) -> TimeoutsConfig:
        if self.total < self.first_token or self.total < self.prefill:
            raise ValueError("total must be >= first_token and >= prefill")
        return self
