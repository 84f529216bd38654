"""The flags of the benchmarks that load one emulated fleet at a share of its prefill capacity.

Who calls it: :mod:`bench.fleet_binding_cmd` and :mod:`bench.fleet_failover_cmd`, each with its
spec's defaults; each adds its own flags beside these.
"""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Protocol

from devstack.emulator.profile import profile_option


class FleetDefaults(Protocol):
    """What a fleet benchmark's spec offers as the flags' defaults."""

    @property
    def size(self) -> int: ...
    @property
    def profile(self) -> str: ...
    @property
    def requests(self) -> int: ...
    @property
    def loaded_fraction(self) -> float: ...


def add_fleet_arguments(
    parser: argparse.ArgumentParser, defaults: FleetDefaults, outputs: str
) -> None:
    """``--size``, ``--profile``, ``--requests``, ``--loaded-fraction`` with ``defaults``, and
    ``--out-dir`` (where ``outputs`` go) and ``--work-dir`` (the logs)."""
    parser.add_argument("--size", type=int, default=defaults.size, help="P (and D) in the fleet")
    parser.add_argument(
        "--profile",
        type=profile_option,
        default=defaults.profile,
        help="the emulator's profile (a name or a file)",
    )
    parser.add_argument("--requests", type=int, default=defaults.requests)
    parser.add_argument(
        "--loaded-fraction",
        type=float,
        default=defaults.loaded_fraction,
        help="of the fleet's prefill capacity",
    )
    parser.add_argument("--out-dir", type=Path, default=Path("."), help=outputs)
    parser.add_argument("--work-dir", type=Path, help="logs (default: a temp dir)")
