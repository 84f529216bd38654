"""The burner: a step spent as CPU time on one core, by a child process the engine talks to
(an engine's steps on it: test_emulator_engine.py)."""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path

import pytest

from devstack.burner import Burner, BurnerGone, main, spend, spend_work, work_rate

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


def test_spend_work_does_the_work_as_many_times_as_asked() -> None:
    done: list[int] = []
    used = spend_work(7, lambda: done.append(1))
    assert len(done) == 7
    assert used >= 0.0


def test_work_rate_counts_the_pieces_done_per_cpu_second() -> None:
    done: list[int] = []

    def work() -> None:
        done.append(1)
        spend(0.0005)  # a piece of known CPU cost: at most 2,000 of them per CPU second

    before = time.thread_time()
    rate = work_rate(0.02, work)
    used = time.thread_time() - before
    assert len(done) % 100 == 0 and len(done) >= 100  # whole rounds of a hundred pieces
    assert 0 < rate <= 2000
    assert rate * used >= len(done) * 0.9  # pieces over the CPU time the count took


async def test_a_burner_given_a_work_rate_spends_a_step_as_that_much_work() -> None:
    async with Burner(CORE, work_rate=1e-6) as burner:
        assert burner.pid is not None
        assert b"--work-rate" in Path(f"/proc/{burner.pid}/cmdline").read_bytes()
        await burner.burn(2.0)  # 2e-6 pieces: none, where CPU seconds would be 2 of them
        assert burner.spent_s < 1.0


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


@pytest.mark.parametrize("rate", ["0", "-5", "nan", "fast"])
def test_the_child_refuses_a_work_rate_that_is_not_above_zero(
    rate: str, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as exit_info:
        main(["--core", str(CORE), "--work-rate", rate])
    assert exit_info.value.code == 2
    assert "--work-rate" in capsys.readouterr().err
