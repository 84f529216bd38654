"""The burner: a step spent as CPU time on one core, by a child process the engine talks to
(an engine's steps on it: test_emulator_engine.py)."""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path

import pytest

from devstack.burner import Burner, BurnerGone, spend

CORE = min(os.sched_getaffinity(0))


def _allowed_cores(pid: int) -> str:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("Cpus_allowed_list:"):
            return line.split(":", 1)[1].strip()
    raise AssertionError(f"no Cpus_allowed_list for {pid}")


def _is_burner(pid: int) -> bool:
    try:
        return b"devstack.burner" in Path(f"/proc/{pid}/cmdline").read_bytes()
    except FileNotFoundError:
        return False


def test_spend_uses_at_least_the_cpu_time_asked_for() -> None:
    before = time.thread_time()
    used = spend(0.01)
    assert used >= 0.01
    assert time.thread_time() - before >= 0.01


async def test_the_child_pins_itself_to_its_core_and_spends_what_it_is_asked() -> None:
    async with Burner(CORE) as burner:
        assert burner.pid is not None
        assert _allowed_cores(burner.pid) == str(CORE)
        assert burner.round_trip_s > 0.0
        spent_at_start = burner.spent_s
        for _ in range(3):
            await burner.burn(0.005)
        # each step less the round trip the start measured, never less than asked for that
        assert burner.spent_s - spent_at_start >= 3 * max(0.0, 0.005 - burner.round_trip_s)


async def test_close_ends_the_process_and_a_burn_after_it_fails() -> None:
    burner = await Burner(CORE).start()
    pid = burner.pid
    assert pid is not None
    await burner.close()
    assert burner.pid is None
    assert not _is_burner(pid)
    with pytest.raises(BurnerGone):
        await burner.burn(0.001)
    await burner.close()  # idempotent


async def test_a_burner_killed_under_it_is_reported_as_gone() -> None:
    async with Burner(CORE) as burner:
        assert burner.pid is not None
        os.kill(burner.pid, signal.SIGKILL)
        with pytest.raises(BurnerGone, match=f"core {CORE}"):
            await burner.burn(0.001)
