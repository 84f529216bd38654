"""Breaker and admission gate in isolation (fake clock, one event loop)."""

from __future__ import annotations

import asyncio

import pytest

from disagg_router.router.config import AdmissionConfig, BreakerConfig
from disagg_router.router.errors import Overloaded, error_payload
from disagg_router.router.instances.admission import Gate
from disagg_router.router.instances.breaker import Breaker


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_breaker_opens_after_consecutive_failures_and_a_success_resets_the_count() -> None:
    b = Breaker(BreakerConfig(failure_threshold=3), Clock())
    assert not b.record_failure("500")
    assert not b.record_failure("500")
    b.record_success()
    assert not b.record_failure("500")
    assert not b.record_failure("500")
    assert b.record_failure("500")
    assert b.state == "open" and not b.closed


def test_unreachable_instance_opens_the_breaker_at_once() -> None:
    b = Breaker(BreakerConfig(failure_threshold=5), Clock())
    assert b.record_failure("refused", trip=True)
    assert b.state == "open"


def test_probe_after_backoff_and_backoff_doubles_on_failed_probe_up_to_the_cap() -> None:
    clock = Clock()
    b = Breaker(BreakerConfig(failure_threshold=1, backoff=1.0, max_backoff=3.0), clock)
    b.record_failure("500")
    assert not b.probe_due()
    clock.now += 1.0
    assert b.probe_due()
    b.begin_probe()
    assert b.state == "half_open" and not b.probe_due()
    assert b.record_failure("still 500")
    assert b.backoff == 2.0 and b.state == "open"
    clock.now += 1.9
    assert not b.probe_due()
    clock.now += 0.1
    b.begin_probe()
    b.record_failure("still 500")
    assert b.backoff == 3.0  # capped
    clock.now += 3.0
    b.begin_probe()
    b.record_success()
    assert b.closed and b.backoff == 1.0 and b.failures == 0


async def _until_waiting(gate: Gate, n: int) -> None:
    while gate.waiting < n:
        await asyncio.sleep(0)  # yield to the waiting task; no time passes


async def test_gate_queues_then_admits_in_order_and_refuses_beyond_the_queue() -> None:
    gate = Gate(AdmissionConfig(max_in_flight=1, queue_size=1, max_wait=30, retry_after=7))
    first, waited = await gate.acquire("p0")
    assert waited == 0.0 and not gate.has_room()
    second = asyncio.create_task(gate.acquire("p0"))
    await _until_waiting(gate, 1)
    with pytest.raises(Overloaded) as refused:
        await gate.acquire("p0")
    assert refused.value.status == 429 and refused.value.retry_after == 7
    assert error_payload(refused.value)["error"]["code"] == "rate_limit_exceeded"
    first.release()
    first.release()  # idempotent
    slot, _ = await second
    assert gate.in_use == 1 and gate.waiting == 0
    slot.release()
    assert gate.in_use == 0 and gate.has_room()


async def test_gate_wait_is_bounded() -> None:
    gate = Gate(AdmissionConfig(max_in_flight=1, queue_size=4, max_wait=0.05))
    held, _ = await gate.acquire("d0")
    with pytest.raises(Overloaded, match=r"within 0\.05s"):
        await gate.acquire("d0")
    assert gate.waiting == 0
    held.release()
    assert gate.has_room()
