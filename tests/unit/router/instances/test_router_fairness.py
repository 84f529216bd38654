"""The admission queue's order (priority classes, weighted fair shares, the starvation bound) and
the gate that hands freed slots out in that order."""

from __future__ import annotations

import asyncio
from collections import Counter

import pytest

from disagg_router.router.config import AdmissionConfig
from disagg_router.router.errors import Overloaded
from disagg_router.router.instances.admission import Gate
from disagg_router.router.instances.fairness import Claim, FairQueue

A, B = Claim("a"), Claim("b")
HIGH, LOW = Claim("hi", priority=0), Claim("lo", priority=2, max_priority_wait=5.0)


def pop(queue: FairQueue[str], now: float) -> str:
    """The next item in order, taken out (as the gate takes a waiter when a slot frees)."""
    waiter = queue.peek(now)
    assert waiter is not None
    queue.remove(waiter)
    return waiter.item


def drain(queue: FairQueue[str], now: float = 0.0) -> list[str]:
    return [pop(queue, now) for _ in range(len(queue))]


def test_a_burst_from_one_tenant_does_not_go_before_another_tenants_request() -> None:
    q: FairQueue[str] = FairQueue()
    for i in range(4):
        q.push(f"a{i}", A, 0.0)
    q.push("b0", B, 0.0)
    assert drain(q) == ["a0", "b0", "a1", "a2", "a3"]


def test_slots_are_shared_in_proportion_to_the_weights_while_both_wait() -> None:
    q: FairQueue[str] = FairQueue()
    heavy = Claim("heavy", weight=3.0)
    for i in range(30):
        q.push(f"h{i}", heavy, 0.0)
        q.push(f"l{i}", Claim("light"), 0.0)
    first = Counter(item[0] for item in drain(q)[:20])
    assert first == {"h": 15, "l": 5}


def test_one_tenants_requests_keep_their_arrival_order() -> None:
    q: FairQueue[str] = FairQueue()
    for i in range(5):
        q.push(f"a{i}", A, 0.0)
        q.push(f"b{i}", B, 0.0)
    order = drain(q)
    assert [x for x in order if x[0] == "a"] == [f"a{i}" for i in range(5)]


def test_a_higher_class_goes_first_until_a_lower_one_has_waited_its_bound() -> None:
    q: FairQueue[str] = FairQueue()
    q.push("low", LOW, 0.0)
    q.push("high0", HIGH, 1.0)
    q.push("high1", HIGH, 1.0)
    assert pop(q, now=2.0) == "high0"  # the low request has waited 2 s of its 5
    assert pop(q, now=5.0) == "low"  # its bound: it goes before the waiting high one
    assert pop(q, now=5.0) == "high1"


def test_within_the_highest_waiting_class_fair_shares_hold_however_long_they_wait() -> None:
    q: FairQueue[str] = FairQueue()
    for i in range(3):
        q.push(f"a{i}", Claim("a", max_priority_wait=0.1), 0.0)
    q.push("b0", Claim("b", max_priority_wait=0.1), 0.0)
    assert drain(q, now=100.0) == ["a0", "b0", "a1", "a2"]


def test_a_waiter_that_leaves_is_not_handed_anything() -> None:
    q: FairQueue[str] = FairQueue()
    q.push("a0", A, 0.0)
    gone = q.push("b0", B, 0.0)
    q.remove(gone)
    q.remove(gone)  # twice: nothing
    assert drain(q) == ["a0"]
    assert len(q) == 0


def test_an_idle_queue_starts_every_tenant_equal_again() -> None:
    q: FairQueue[str] = FairQueue()
    for i in range(10):
        q.push(f"a{i}", A, 0.0)
    drain(q)
    q.push("a-new", A, 1.0)
    q.push("b-new", B, 1.0)
    assert drain(q, 1.0) == ["a-new", "b-new"]  # a's old tags are forgotten (ties by arrival)


async def _queued(gate: Gate, claim: Claim, name: str, order: list[str]) -> None:
    slot, _ = await gate.acquire("i", claim=claim)
    order.append(name)
    slot.release()


async def _until_waiting(gate: Gate, count: int) -> None:
    while gate.waiting < count:
        await asyncio.sleep(0)


async def test_a_freed_slot_goes_to_the_waiters_in_fair_order() -> None:
    gate = Gate(AdmissionConfig(max_in_flight=1, queue_size=10, max_wait=30))
    held, _ = await gate.acquire("i", claim=A)
    order: list[str] = []
    tasks = [asyncio.create_task(_queued(gate, A, f"a{i}", order)) for i in range(3)]
    await _until_waiting(gate, 3)
    tasks.append(asyncio.create_task(_queued(gate, B, "b0", order)))
    await _until_waiting(gate, 4)
    held.release()
    await asyncio.gather(*tasks)
    assert order == ["a0", "b0", "a1", "a2"]
    assert gate.in_use == 0 and gate.waiting == 0


async def test_a_waiter_that_times_out_leaves_the_queue_and_the_slot_count_intact() -> None:
    gate = Gate(AdmissionConfig(max_in_flight=1, queue_size=10, max_wait=30))
    held, _ = await gate.acquire("i")
    with pytest.raises(Overloaded):
        await gate.acquire("i", max_wait=0.0)
    assert gate.waiting == 0
    held.release()
    assert gate.in_use == 0 and gate.has_room()


async def test_a_slot_handed_to_a_waiter_that_is_cancelled_goes_to_the_next_one() -> None:
    gate = Gate(AdmissionConfig(max_in_flight=1, queue_size=10, max_wait=30))
    held, _ = await gate.acquire("i")
    first = asyncio.create_task(gate.acquire("i", claim=A))
    await _until_waiting(gate, 1)
    order: list[str] = []
    second = asyncio.create_task(_queued(gate, B, "b", order))
    await _until_waiting(gate, 2)
    held.release()  # handed to ``first``, which is cancelled before it runs
    first.cancel()
    await second
    assert order == ["b"]
    assert gate.in_use == 0 and gate.waiting == 0


async def test_slots_reserved_for_the_high_class_wait_free_for_it() -> None:
    gate = Gate(AdmissionConfig(max_in_flight=2, queue_size=10, max_wait=30, reserved_for_high=1))
    low = Claim("bulk", priority=2)
    first, _ = await gate.acquire("i", claim=low)
    assert not gate.has_room(low) and gate.has_room(HIGH)
    order: list[str] = []
    queued = asyncio.create_task(_queued(gate, low, "low", order))
    await _until_waiting(gate, 1)
    assert gate.in_use == 1  # the free slot stays free: it is the high class's
    high, waited = await gate.acquire("i", claim=HIGH)  # at once, past the waiting low one
    assert waited == 0.0 and gate.in_use == 2
    high.release()
    assert gate.waiting == 1  # a slot freed, but the reserved one: the low one still waits
    first.release()
    await queued
    assert order == ["low"] and gate.in_use == 0 and gate.waiting == 0


def test_reserved_slots_must_leave_one_for_the_others() -> None:
    with pytest.raises(ValueError, match="reserved_for_high"):
        AdmissionConfig(max_in_flight=2, reserved_for_high=2)
