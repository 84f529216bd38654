"""The burner: a step spent as CPU time on one core, by a child process the engine talks to."""

from __future__ import annotations

import asyncio
import os
import signal
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path

import pytest

from devstack.burner import Burner, BurnerGone, spend
from devstack.emulator.engine import Engine, Fabric
from devstack.emulator.profile import Profile, StepModel, Transfer
from devstack.emulator.scheduler import Seq

CORE = min(os.sched_getaffinity(0))
BOUND_S = 10.0
PROFILE = Profile(
    name="test",
    source="unit test",
    model="tiny",
    block_size=4,
    num_blocks=64,
    max_num_batched_tokens=64,
    max_num_seqs=8,
    max_model_len=1024,
    step=StepModel(base_s=0.002, per_token_s=0.0),
    transfer=Transfer(bytes_per_token=1, bandwidth_bytes_per_s=1e9, latency_s=0.001),
)


@asynccontextmanager
async def burner_on(core: int) -> AsyncIterator[Burner]:
    burner = await Burner(core).start()
    try:
        yield burner
    finally:
        await burner.close()


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
    async with burner_on(CORE) as burner:
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
    async with burner_on(CORE) as burner:
        assert burner.pid is not None
        os.kill(burner.pid, signal.SIGKILL)
        with pytest.raises(BurnerGone, match=f"core {CORE}"):
            await burner.burn(0.001)


async def _decode(engine: Engine, tokens: int) -> list[int]:
    task = asyncio.create_task(engine.run())
    try:
        outlet = engine.submit(Seq("a", list(range(1, 11)), tokens))
        out = []
        async with asyncio.timeout(BOUND_S):
            while (index := await outlet.queue.get()) is not None:
                out.append(index)
        return out
    finally:
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)


async def test_an_engine_with_a_burner_spends_its_steps_there() -> None:
    async with burner_on(CORE) as burner:
        engine = Engine(PROFILE, "e0", Fabric(), burner=burner)
        spent_at_start = burner.spent_s
        assert await _decode(engine, 3) == [0, 1, 2]
        assert engine.counters.steps == 3
        assert burner.spent_s - spent_at_start >= 3 * max(0.0, 0.002 - burner.round_trip_s)
        assert (engine.counters.lost_s, engine.counters.burner_failures) == (0.0, 0)


async def test_an_engine_whose_burner_dies_counts_it_and_sleeps_its_steps() -> None:
    async with burner_on(CORE) as burner:
        assert burner.pid is not None
        os.kill(burner.pid, signal.SIGKILL)
        engine = Engine(PROFILE, "e0", Fabric(), burner=burner)
        assert await _decode(engine, 3) == [0, 1, 2]
        assert engine.burner is None
        assert engine.counters.burner_failures == 1
        assert engine.counters.steps == 3
