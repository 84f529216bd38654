"""OpenAI's rate-limit headers, from the usage of a tenant's buckets.

Who calls it: the tenant limiter (:mod:`disagg_router.router.tenants.limiter`), which puts them on
every generation answer of a tenant with per-minute limits (a refusal's too). Names and value forms
follow OpenAI's API: ``x-ratelimit-limit-requests``, ``x-ratelimit-remaining-requests``,
``x-ratelimit-reset-requests`` (a duration such as ``250ms``, ``12s``, ``1m6s``: until the bucket
is full again) and the same three for ``tokens``. Pure.
"""

from __future__ import annotations

from disagg_router.router.tenants.bucket import Usage


def duration(seconds: float) -> str:
    """``seconds`` as OpenAI writes a reset time: ``0s``, ``250ms``, ``12s``, ``1m6s``."""
    if seconds <= 0:
        return "0s"
    if seconds < 1:
        return f"{max(round(seconds * 1000), 1)}ms"
    minutes, rest = divmod(round(seconds), 60)
    return f"{minutes}m{rest}s" if minutes else f"{rest}s"


def rate_limit_headers(kind: str, usage: Usage) -> dict[str, str]:
    """The three headers of one limit (``kind``: ``requests`` or ``tokens``)."""
    return {
        f"x-ratelimit-limit-{kind}": str(usage.limit),
        f"x-ratelimit-remaining-{kind}": str(usage.remaining),
        f"x-ratelimit-reset-{kind}": duration(usage.reset_s),
    }
