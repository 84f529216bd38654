"""``push``: when, in push mode, D is chosen and its leg sent (``bind``)."""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from disagg_router.router.config._base import Frozen

Bind = Literal["eager", "just_in_time", "adaptive"]


class PushConfig(Frozen):
    """Push mode's binding of D (docs/router.md, "Binding D late"). ``eager``: D is chosen
    with P when the request arrives and its leg goes out at once; D's blocks then wait empty
    through P's queue and prefill. ``just_in_time``: P's leg goes out at once, D is chosen and
    its leg sent when P is predicted to finish less D's lead (learned per P and per D); at
    once if P finishes first. ``adaptive``: eager while every D's KV cache is emptier than
    ``adaptive_kv_usage`` (an idle block costs nothing then), just in time otherwise."""

    bind: Bind = Field(default="eager", description="eager, just_in_time or adaptive")
    adaptive_kv_usage: float = Field(
        default=0.5,
        ge=0.0,
        le=1.0,
        description="adaptive: bind just in time when some D's KV cache usage (vLLM's "
        "kv_cache_usage_perc, from load_signals) is at least this",
    )
    lead_margin: float = Field(
        default=0.02,
        ge=0.0,
        le=10.0,
        description="seconds added to D's learned lead (D leg sent to D accepting it), for "
        "the block allocation and registration that follow",
    )
