"""``disagg-bench fleet-scale``'s report names the command that made it (the runs themselves
start emulated fleets, which no test does)."""

from __future__ import annotations

from dataclasses import asdict

from bench.fleet_scale import FleetScaleSpec
from bench.fleet_scale_cmd import _command


def test_a_default_run_names_no_option() -> None:
    command = _command(asdict(FleetScaleSpec()))
    assert command.endswith("disagg-bench fleet-scale --out-dir docs/benchmarks")


def test_sizes_are_named_as_the_flag_takes_them() -> None:
    spec = asdict(FleetScaleSpec(sizes=(1, 4), rate=10.0))
    spec["sizes"] = list(spec["sizes"])  # as the JSON result holds them
    command = _command(spec)
    assert command.endswith("fleet-scale --sizes 1,4 --rate 10.0 --out-dir docs/benchmarks")
