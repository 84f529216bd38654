"""The router settings the benches start our router with (``bench.routers``): the timeouts
they give slow instances are ones the router's config accepts, with the rest at its defaults."""

from __future__ import annotations

from bench.routers import leg_timeouts
from disagg_router.router.config.timeouts import TimeoutsConfig


def test_leg_timeouts_set_both_legs_and_what_else_is_named() -> None:
    config = TimeoutsConfig.model_validate(leg_timeouts(300.0, total=600.0))
    assert (config.prefill, config.first_token, config.after_prefill) == (300.0, 300.0, 300.0)
    assert config.total == 600.0
    assert config.health == TimeoutsConfig().health  # not named: the router's default


def test_extra_timeouts_are_passed_through() -> None:
    assert leg_timeouts(120.0, health=60.0)["health"] == 60.0
