"""P's writer logic with an in-memory endpoint (the real-NIXL version is tests/integration)."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from dataclasses import replace
from typing import Any

import pytest

from disagg_router.connector.config import ConnectorConfig
from disagg_router.connector.producer import PushProducer
from disagg_router.connector.protocol import (
    Notification,
    Registration,
    decode_reply,
    encode_registration,
    encode_request,
)
from disagg_router.connector.specs import SendAbort, SendSpec
from disagg_router.connector.stats import PushTransferStats
from tests.unit.connector.core_support import LAYOUT, FakeClock, MemoryEndpoint, until


@pytest.fixture
def env() -> Iterator[tuple[PushProducer, MemoryEndpoint, FakeClock]]:
    ep, clock = MemoryEndpoint(), FakeClock()
    cfg = ConnectorConfig(side_channel_port=0, lease_s=5.0, registration_ttl_s=5.0)
    producer = PushProducer(ep, "p0", cfg, clock=clock)
    yield producer, ep, clock
    producer.close()


def reg(key: str, blocks: tuple[int, ...], first: int = 0, budget: float = 10.0) -> bytes:
    return encode_registration(
        Registration(
            transfer_key=key,
            d_request_id=f"d-{key}",
            p_engine_id="p0",
            d_agent_name="d-agent",
            d_agent_metadata=b"meta",
            d_layout=LAYOUT,
            block_ids=(blocks,),
            first_block=first,
            budget_s=budget,
        )
    )


def test_finish_then_register_writes_only_the_tail(env: Any) -> None:
    producer, ep, _ = env
    producer.add_finished(SendSpec("p-1", "k", (10, 11, 12, 13)))
    assert decode_reply(producer.handle_request(reg("k", (7, 8), first=2))).status == "accepted"
    until(lambda: len(ep.writes) == 1)
    agent, local, remote, note = ep.writes[0]
    assert (agent, local, remote) == ("d-agent", [12, 13], [7, 8])
    assert note == Notification("done", "k", "d-k")
    until(lambda: "p-1" in producer.take_released())
    rec = producer.take_records()[0]
    assert rec.ok and rec.num_blocks == 2 and rec.num_bytes == 128


def test_register_then_finish_and_cancel_while_waiting(env: Any) -> None:
    producer, ep, _ = env
    producer.handle_request(reg("a", (1,)))
    producer.add_finished(SendSpec("p-a", "a", (5,)))
    until(lambda: len(ep.writes) == 1)
    producer.handle_request(reg("b", (2,)))
    cancel = decode_reply(producer.handle_request(encode_request("cancel", {"transfer_key": "b"})))
    assert cancel.status == "cancelled"
    producer.add_finished(
        SendSpec("p-b", "b", (6,))
    )  # arrives after the cancel: freed, never written
    released: set[str] = set()

    def both_released() -> bool:
        released.update(producer.take_released())
        return {"p-a", "p-b"} <= released

    until(both_released)
    assert len(ep.writes) == 1
    unknown = producer.handle_request(encode_request("cancel", {"transfer_key": "zzz"}))
    assert decode_reply(unknown).status == "unknown"


def test_abort_notifies_registered_d_and_refuses_later_registrations(env: Any) -> None:
    producer, ep, _ = env
    producer.handle_request(reg("x", (1,)))
    producer.abort(SendAbort("x", "prefill ended with status FINISHED_ABORTED"))
    until(lambda: len(ep.notifs) == 1)
    assert ep.notifs[0][1].kind == "failed" and "ABORTED" in ep.notifs[0][1].reason
    late = decode_reply(producer.handle_request(reg("x", (1,))))
    assert late.status == "failed" and "ABORTED" in late.reason


def test_lease_frees_unclaimed_prefill_and_ttl_fails_orphan_registration(env: Any) -> None:
    producer, ep, clock = env
    producer.add_finished(SendSpec("p-l", "lonely", (1,)))
    producer.handle_request(reg("orphan", (2,)))
    clock.now += 6.0
    until(lambda: "p-l" in producer.take_released())
    until(lambda: any(n.transfer_key == "orphan" and n.kind == "failed" for _, n in ep.notifs))
    assert ep.writes == []


def test_no_write_starts_after_ds_budget(env: Any) -> None:
    producer, ep, clock = env
    producer.handle_request(reg("late", (2,), budget=1.0))
    clock.now += 2.0
    producer.add_finished(SendSpec("p-late", "late", (3,)))
    until(lambda: "p-late" in producer.take_released())
    assert ep.writes == []


def test_bad_registrations_are_refused_with_a_reason(env: Any) -> None:
    producer, ep, _ = env
    wrong = reg("w", (1,)).replace(b'"p0"', b'"p9"')
    assert "engine id" in decode_reply(producer.handle_request(wrong)).reason
    assert "protocol" in decode_reply(producer.handle_request(b'{"v": 7}')).reason
    producer.add_finished(SendSpec("p-s", "short", (1,)))
    producer.handle_request(reg("short", (1, 2, 3)))
    until(lambda: "p-s" in producer.take_released())
    assert ep.notifs and ep.notifs[-1][1].kind == "failed"
    assert ep.notifs[-1][1].reason == "P has 1 blocks, D asked for 0+3"


@pytest.mark.parametrize("registered_first", [True, False])
def test_p_blocks_outside_ps_layout_fail_the_write_whichever_half_came_last(
    env: Any, registered_first: bool
) -> None:
    """P's descriptors are computed by whichever thread completes the pair (the engine thread
    or the side channel); a bad block fails the WRITE with the reason either way."""
    producer, ep, _ = env
    fin = SendSpec("p-x", "x", (LAYOUT.regions[0].num_blocks,))  # one past P's last block
    if registered_first:
        producer.handle_request(reg("x", (1,)))
        producer.add_finished(fin)
    else:
        producer.add_finished(fin)
        producer.handle_request(reg("x", (1,)))
    until(lambda: "p-x" in producer.take_released())
    assert ep.writes == []
    assert (
        ep.notifs[-1][1].reason == "WRITE could not be posted: block 32 outside region of 32 blocks"
    )


def test_d_blocks_outside_ds_layout_fail_the_write_with_the_reason(env: Any) -> None:
    producer, ep, _ = env
    producer.handle_request(reg("o", (LAYOUT.regions[0].num_blocks,)))  # one past D's last
    producer.add_finished(SendSpec("p-o", "o", (1,)))
    until(lambda: "p-o" in producer.take_released())
    assert ep.writes == []
    assert ep.notifs[-1][1].kind == "failed" and "outside region" in ep.notifs[-1][1].reason


def test_failed_write_is_reported_to_d(env: Any) -> None:
    producer, ep, _ = env
    ep.fail_writes = True
    producer.add_finished(SendSpec("p-f", "f", (1,)))
    producer.handle_request(reg("f", (2,)))
    until(lambda: "p-f" in producer.take_released())
    assert ep.notifs[-1][1].kind == "failed" and "rejected" in ep.notifs[-1][1].reason
    assert not producer.take_records()[0].ok


def test_cancel_during_write_says_in_flight_until_the_write_is_done(env: Any) -> None:
    producer, ep, _ = env
    ep.write_state = "PROC"
    producer.add_finished(SendSpec("p-w", "w", (1,)))
    producer.handle_request(reg("w", (2,)))
    until(lambda: len(ep.writes) == 1)
    cancel = encode_request("cancel", {"transfer_key": "w"})
    assert decode_reply(producer.handle_request(cancel)).status == "in_flight"
    assert producer.take_released() == set()  # P's blocks stay pinned while the WRITE runs
    ep.write_state = "DONE"
    until(lambda: "p-w" in producer.take_released())
    assert decode_reply(producer.handle_request(cancel)).status == "unknown"


def test_registration_overtaken_by_its_cancel_never_writes(env: Any) -> None:
    producer, ep, _ = env
    producer.add_finished(SendSpec("p-o", "o", (1,)))
    cancel = encode_request("cancel", {"transfer_key": "o"})
    assert decode_reply(producer.handle_request(cancel)).status == "cancelled"
    late = decode_reply(producer.handle_request(reg("o", (2,))))
    assert late.status == "failed" and "cancelled" in late.reason
    until(lambda: "p-o" in producer.take_released())
    assert ep.writes == []


def _second_write_poster(producer: PushProducer, ep: MemoryEndpoint) -> str:
    """Connect D's agent with a first transfer, park the writer thread, finish a second prefill
    whose D registered: the name of the thread that posted the second WRITE."""
    producer.handle_request(reg("a", (1,)))
    producer.add_finished(SendSpec("p-a", "a", (5,)))
    until(lambda: len(ep.writes) == 1)  # the writer connected D's agent before any WRITE
    ep.in_progress.clear()
    ep.progress_open.clear()
    assert ep.in_progress.wait(10)  # the writer is parked after planning its step
    producer.handle_request(reg("b", (2,)))
    producer.add_finished(SendSpec("p-b", "b", (6,)))
    ep.progress_open.set()
    until(lambda: len(ep.writes) == 2)
    assert ep.writes[1][1:3] == ([6], [2])
    until(lambda: "p-b" in producer.take_released())
    return ep.writers[1]


@pytest.mark.parametrize("post_on_finish", [True, False])
def test_who_posts_a_write_to_a_connected_d(post_on_finish: bool) -> None:
    ep, clock = MemoryEndpoint(), FakeClock()
    cfg = ConnectorConfig(side_channel_port=0, lease_s=5.0, registration_ttl_s=5.0)
    producer = PushProducer(ep, "p0", replace(cfg, post_on_finish=post_on_finish), clock=clock)
    try:
        poster = _second_write_poster(producer, ep)
    finally:
        producer.close()
    assert poster == (threading.current_thread().name if post_on_finish else "dpc-writer")


def test_a_record_says_how_long_p_waited_for_the_registration_and_how_long_d_blocks_sat_empty(
    env: Any,
) -> None:
    producer, _, clock = env
    records: list[Any] = []

    def recorded(n: int) -> bool:
        records.extend(producer.take_records())
        return len(records) == n

    producer.add_finished(SendSpec("p-late", "late", (1, 2)))
    clock.now += 0.3  # D registers 0.3 s after P finished: P waited
    producer.handle_request(reg("late", (5, 6)))
    until(lambda: recorded(1))
    producer.handle_request(reg("early", (7,)))
    clock.now += 0.2  # D registered 0.2 s before P finished: D's block waited
    producer.add_finished(SendSpec("p-early", "early", (3,)))
    until(lambda: recorded(2))
    late, early = records
    assert late.wait_for_registration_s == pytest.approx(0.3)
    assert late.registration_to_write_s == 0.0
    assert early.wait_for_registration_s == 0.0
    assert early.registration_to_write_s == pytest.approx(0.2)
    stats = PushTransferStats()
    for rec in records:
        stats.record(rec)
    reduced = stats.reduce()
    assert reduced["avg_wait_for_registration_ms"] == pytest.approx(150.0)
    assert reduced["unwritten_block_seconds"] == pytest.approx(1 * 0.2)  # late's 2 blocks: 0 s
