"""``disagg-bench fleet-binding``'s runs that meet real processes, at a small scale: our router
over a real emulated 2P2D fleet (the fast profile) in each binding mode. Every request completes;
eager binds every pushed request at once, just in time never does once P's speed is learned;
D's blocks wait unwritten under eager binding; P's wait is observed for every pushed request."""

from __future__ import annotations

from pathlib import Path

import pytest

from bench.dataset import BenchRequest
from bench.fleet_binding import FleetBindingSpec, offered_rate, run_mode
from devstack.emulator.profile import load_profile

Prompts = tuple[list[BenchRequest], list[BenchRequest]]
SPEC = FleetBindingSpec(
    size=2, profile="cpu-tiny", input_len=1024, short_len=64, output_len=4, requests=16
)


@pytest.fixture(scope="module")
def prompts() -> Prompts:
    return SPEC.prompts()


@pytest.mark.parametrize("bind", ["eager", "just_in_time"])
def test_every_request_completes_bound_as_its_mode_says(
    bind: str, prompts: Prompts, tmp_path: Path
) -> None:
    rate = offered_rate(SPEC, load_profile(SPEC.profile))
    mode = run_mode(bind, SPEC, prompts, rate, tmp_path)
    pushed = SPEC.requests // 2
    assert (mode["completed"], mode["failed"]) == (SPEC.requests, 0), mode
    assert mode["p_wait"]["count"] == pushed
    assert sum(mode["binds"].values()) == pushed
    if bind == "eager":
        assert mode["binds"] == {"eager": pushed}
        assert mode["unwritten_block_s"] > 0
    else:
        assert "eager" not in mode["binds"]
