"""Emulated engines on a real event loop (``devstack.emulator.engine``): a P and a D engine hand a
request's KV over through their fabric in push order (D waits first) and pull order (P is held
first); a P whose D never comes frees its blocks when the lease passes, a D whose P never comes
fails its request; an aborted D leaves nothing behind; steps take the profile's step time; each
engine counts its side of a hand-over as our connector's metrics do; the step clock keeps the
profile's pace when the loop wakes an engine late."""

from __future__ import annotations

import asyncio
import os
import signal
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from dataclasses import replace

import pytest

from devstack.burner import Burner
from devstack.emulator.engine import WAIT_FOR_REGISTRATION, Engine, Fabric, Outlet, StepClock
from devstack.emulator.profile import Profile, StepModel, Transfer
from devstack.emulator.scheduler import Phase, Role, Seq

BOUND_S = 10.0
SIZE = 4
PROFILE = Profile(
    name="test",
    source="unit test",
    model="tiny",
    block_size=SIZE,
    num_blocks=64,
    max_num_batched_tokens=64,
    max_num_seqs=8,
    max_model_len=1024,
    step=StepModel(base_s=0.001, per_token_s=0.0),
    transfer=Transfer(bytes_per_token=1, bandwidth_bytes_per_s=1e9, latency_s=0.001),
    kv_lease_s=BOUND_S,  # long enough that a hand-over never races the lease
)
SHORT_LEASE = replace(PROFILE, kv_lease_s=0.2)


@asynccontextmanager
async def running(*engines: Engine) -> AsyncIterator[None]:
    """The engines' step loops, cancelled on the way out."""
    tasks = [asyncio.create_task(engine.run()) for engine in engines]
    try:
        yield
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


async def until(predicate: Callable[[], bool], what: str) -> None:
    """Poll ``predicate`` on the loop until it holds (bounded)."""
    try:
        async with asyncio.timeout(BOUND_S):
            while not predicate():
                await asyncio.sleep(0.005)
    except TimeoutError:
        raise AssertionError(f"timed out after {BOUND_S:g}s waiting for {what}") from None


async def drain(outlet: Outlet) -> list[int]:
    """The token indexes an outlet delivers before its end."""
    out = []
    async with asyncio.timeout(BOUND_S):
        while (index := await outlet.queue.get()) is not None:
            out.append(index)
    return out


def _pair(profile: Profile = PROFILE) -> tuple[Fabric, Engine, Engine]:
    fabric = Fabric()
    return fabric, Engine(profile, "p0", fabric), Engine(profile, "d0", fabric)


def _leg(fabric: Fabric, role: Role, key: str, max_tokens: int, prompt: int = 10) -> Seq:
    seq = Seq(f"{role}-{key}", list(range(1, prompt + 1)), max_tokens, role=role)
    fabric.expect(seq, key)
    return seq


def _all_free(engine: Engine) -> bool:
    return engine.pool.free_blocks == engine.pool.num_blocks


def _waits(engine: Engine) -> tuple[float, float, float]:
    """P's waits for D's registration as its ``/metrics`` histogram holds them: those of 0 s,
    all of them, their sum."""

    def sample(suffix: str, **labels: str) -> float:
        name = f"{WAIT_FOR_REGISTRATION}_{suffix}"
        value = engine.handovers.registry.get_sample_value(
            name, {"model_name": engine.profile.model, **labels}
        )
        assert value is not None, name
        return value

    return sample("bucket", le="0.0"), sample("count"), sample("sum")


def _fabric_empty(fabric: Fabric) -> bool:
    return not (fabric._held or fabric._waiting or fabric._keys)


async def test_push_order_hand_over_completes() -> None:
    fabric, p, d = _pair()
    async with running(p, d):
        d_seq = _leg(fabric, "decode", "t1", max_tokens=4)
        d_out = d.submit(d_seq)
        await until(lambda: d_seq.phase is Phase.REMOTE_KV, "D registered")
        assert d_out.queue.empty()  # nothing before the KV
        p_seq = _leg(fabric, "prefill", "t1", max_tokens=1)
        p_out = p.submit(p_seq)
        assert await drain(p_out) == [0]
        assert await drain(d_out) == [0, 1, 2, 3]
        assert d_out.error is None
        assert (fabric.transfers, fabric.failures) == (1, 0)
        assert d_seq.kv_loaded and d_seq.prefix_hit_tokens == 0
        assert p_seq.phase is Phase.DONE and _all_free(p) and _all_free(d)
        assert _fabric_empty(fabric)
        # D registered first: P did not wait, D's 3 blocks did (through P's prefill)
        assert p.handovers.transfers == d.handovers.transfers == 1
        assert _waits(p) == (1, 1, 0.0)  # one wait, of 0 s
        assert d.handovers.unwritten_block_s > 0 and p.handovers.unwritten_block_s == 0


async def test_pull_order_hand_over_completes() -> None:
    fabric, p, d = _pair()
    async with running(p, d):
        p_seq = _leg(fabric, "prefill", "t2", max_tokens=1)
        assert await drain(p.submit(p_seq)) == [0]
        assert p_seq.phase is Phase.HELD  # its blocks wait for D
        assert p.pool.free_blocks == p.pool.num_blocks - 3
        d_seq = _leg(fabric, "decode", "t2", max_tokens=3)
        d_out = d.submit(d_seq)
        assert await drain(d_out) == [0, 1, 2]
        assert d_out.error is None
        assert (fabric.transfers, fabric.failures) == (1, 0)
        assert _all_free(p) and _all_free(d)
        assert p.counters.success == d.counters.success == 1
        assert _fabric_empty(fabric)
        # P finished first: its prefill waited for D's registration
        at_zero, count, total = _waits(p)
        assert at_zero == 0 and count == 1
        assert total > 0


async def test_a_held_prefill_is_freed_when_no_decode_comes_within_the_lease() -> None:
    fabric, p, d = _pair(SHORT_LEASE)
    async with running(p, d):
        p_seq = _leg(fabric, "prefill", "t3", max_tokens=1)
        assert await drain(p.submit(p_seq)) == [0]
        assert not _all_free(p)
        await until(lambda: fabric.failures == 1, "the lease to pass")
        assert p_seq.phase is Phase.DONE and _all_free(p)
        assert fabric.transfers == 0
        assert _fabric_empty(fabric)


async def test_a_decode_whose_prefill_never_comes_fails_after_the_lease() -> None:
    fabric, p, d = _pair(SHORT_LEASE)
    async with running(p, d):
        d_seq = _leg(fabric, "decode", "t4", max_tokens=3)
        d_out = d.submit(d_seq)
        assert await drain(d_out) == []  # the end comes after the lease
        assert d_out.error is not None and "t4" in d_out.error
        assert fabric.failures == 1 and fabric.transfers == 0
        assert d_seq.phase is Phase.DONE and _all_free(d)
        assert _fabric_empty(fabric)


async def test_aborting_a_waiting_decode_frees_its_blocks_and_the_fabric() -> None:
    fabric, p, d = _pair()
    async with running(p, d):
        d_seq = _leg(fabric, "decode", "t5", max_tokens=3)
        d.submit(d_seq)
        await until(lambda: d_seq.phase is Phase.REMOTE_KV, "D registered")
        assert not _all_free(d)
        d.abort(d_seq)
        assert d_seq.phase is Phase.DONE and _all_free(d)
        assert _fabric_empty(fabric)
        # a P leg under the same key later finds no D: it is held, not handed over
        p_seq = _leg(fabric, "prefill", "t5", max_tokens=1)
        assert await drain(p.submit(p_seq)) == [0]
        assert p_seq.phase is Phase.HELD and "t5" in fabric._held
        p.abort(p_seq)
        assert _all_free(p) and _fabric_empty(fabric)
        assert fabric.transfers == 0


def test_step_seconds_follow_the_step_model() -> None:
    model = StepModel(
        base_s=0.5,
        per_token_s=0.01,
        per_seq_s=0.1,
        per_context_token_s=0.001,
        per_attention_pair_s=0.0001,
    )
    engine = Engine(replace(PROFILE, step=model), "e0", Fabric())
    engine.scheduler.add(Seq("a", list(range(1, 11)), 2))
    prefill = engine.scheduler.schedule()
    # 10 tokens of one sequence, no context, 10 * 11 / 2 query-key pairs
    assert engine.step_seconds(prefill) == pytest.approx(0.5 + 0.1 + 0.1 + 55 * 0.0001)
    engine.scheduler.finish(prefill)
    decode = engine.scheduler.schedule()
    # one token attending to the 10 computed before it
    assert engine.step_seconds(decode) == pytest.approx(0.5 + 0.01 + 0.1 + 10 * 0.001)


async def test_busy_time_adds_up_the_steps_run() -> None:
    model = StepModel(base_s=0.001, per_token_s=0.0001, per_seq_s=0.0002)
    engine = Engine(replace(PROFILE, step=model), "e0", Fabric())
    async with running(engine):
        out = engine.submit(Seq("a", list(range(1, 11)), 3))
        assert await drain(out) == [0, 1, 2]
    assert engine.counters.steps == 3
    expected = (0.001 + 10 * 0.0001 + 0.0002) + 2 * (0.001 + 0.0001 + 0.0002)
    assert engine.counters.busy_s == pytest.approx(expected)
    assert (engine.counters.prompt_tokens, engine.counters.generation_tokens) == (10, 3)


def test_a_step_after_idle_starts_when_the_engine_starts_it() -> None:
    clock = StepClock(max_lag_s=0.005)
    assert clock.step_end(now=10.0, seconds=0.002, after_idle=True) == (10.002, 0.0)
    # idle again: a late start is no debt
    assert clock.step_end(now=20.0, seconds=0.002, after_idle=True) == (20.002, 0.0)


def test_steps_woken_late_keep_the_profiles_pace() -> None:
    clock = StepClock(max_lag_s=0.005)
    end, _ = clock.step_end(now=0.0, seconds=0.002, after_idle=True)
    for _ in range(99):  # every wake-up a millisecond late: each step starts at the last end
        end, lost = clock.step_end(now=end + 0.001, seconds=0.002, after_idle=False)
        assert lost == 0.0
    assert end == pytest.approx(100 * 0.002)


def test_a_wake_up_later_than_the_lag_bound_loses_the_rest() -> None:
    clock = StepClock(max_lag_s=0.005)
    end, _ = clock.step_end(now=0.0, seconds=0.002, after_idle=True)
    end, lost = clock.step_end(now=end + 0.050, seconds=0.002, after_idle=False)
    assert lost == pytest.approx(0.045)  # 50 ms late, 5 ms made up
    assert end == pytest.approx(0.002 + 0.045 + 0.002)


CORE = min(os.sched_getaffinity(0))
TWO_MS_STEPS = replace(PROFILE, step=StepModel(base_s=0.002, per_token_s=0.0))


async def test_an_engine_with_a_burner_spends_its_steps_there() -> None:
    async with Burner(CORE) as burner:
        engine = Engine(TWO_MS_STEPS, "e0", Fabric(), burner=burner)
        spent_at_start = burner.spent_s
        async with running(engine):
            assert await drain(engine.submit(Seq("a", list(range(1, 11)), 3))) == [0, 1, 2]
        assert engine.counters.steps == 3
        assert burner.spent_s - spent_at_start >= 3 * max(0.0, 0.002 - burner.round_trip_s)
        assert (engine.counters.lost_s, engine.counters.burner_failures) == (0.0, 0)


async def test_an_engine_whose_burner_dies_counts_it_and_sleeps_its_steps() -> None:
    async with Burner(CORE) as burner:
        assert burner.pid is not None
        os.kill(burner.pid, signal.SIGKILL)
        engine = Engine(TWO_MS_STEPS, "e0", Fabric(), burner=burner)
        async with running(engine):
            assert await drain(engine.submit(Seq("a", list(range(1, 11)), 3))) == [0, 1, 2]
        assert engine.burner is None
        assert engine.counters.burner_failures == 1
        assert engine.counters.steps == 3
