"""P's writer logic with an in-memory endpoint (the real-NIXL version is tests/integration)."""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from typing import Any

import pytest

from connector.config import ConnectorConfig
from connector.producer import PushProducer
from connector.protocol import (
    LayoutSpec,
    Notification,
    RegionSpec,
    Registration,
    decode_notification,
    decode_reply,
    encode_registration,
    encode_request,
)

LAYOUT = LayoutSpec(regions=(RegionSpec(0, 64, 64, 32),))


class MemoryEndpoint:
    """Behaves like NixlEndpoint without a progress thread: WRITEs complete on the next poll and
    a sent notification leaves (lands in ``notifs``) only when ``progress`` runs."""

    def __init__(self) -> None:
        self.name = "p-agent"
        self.layout = LAYOUT
        self.writes: list[tuple[str, list[int], list[int], Notification]] = []
        self.notifs: list[tuple[str, Notification]] = []
        self.unsent: list[tuple[str, Notification]] = []
        self.peers: set[str] = set()
        self.fail_writes = False

    def prepare_remote(self, agent_name: str, metadata: bytes, layout: LayoutSpec) -> None:
        self.peers.add(agent_name)

    def connect(self, agent_name: str) -> None:
        assert agent_name in self.peers

    def write(self, agent: str, local: list[int], remote: list[int], notif: bytes) -> Any:
        assert agent in self.peers
        if self.fail_writes:
            raise RuntimeError("NIXL rejected the WRITE")
        self.writes.append((agent, local, remote, decode_notification(notif)))
        return len(self.writes)

    def state(self, handle: Any) -> str:
        return "DONE"

    def release(self, handle: Any) -> None:
        pass

    def send_notif(self, agent: str, message: bytes) -> None:
        self.unsent.append((agent, decode_notification(message)))

    def progress(self) -> None:
        self.notifs.extend(self.unsent)
        self.unsent.clear()


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


@pytest.fixture
def env() -> Iterator[tuple[PushProducer, MemoryEndpoint, Clock]]:
    ep, clock = MemoryEndpoint(), Clock()
    cfg = ConnectorConfig(side_channel_port=0, lease_s=5.0, registration_ttl_s=5.0)
    producer = PushProducer(ep, "p0", cfg, clock=clock)  # type: ignore[arg-type]
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


def until(cond: Callable[[], bool], timeout: float = 3.0) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, "condition not reached"
        time.sleep(0.005)


def test_finish_then_register_writes_only_the_tail(env: Any) -> None:
    producer, ep, _ = env
    producer.add_finished("k", "p-1", (10, 11, 12, 13))
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
    producer.add_finished("a", "p-a", (5,))
    until(lambda: len(ep.writes) == 1)
    producer.handle_request(reg("b", (2,)))
    cancel = decode_reply(producer.handle_request(encode_request("cancel", {"transfer_key": "b"})))
    assert cancel.status == "cancelled"
    producer.add_finished("b", "p-b", (6,))  # arrives after the cancel: freed, never written
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
    producer.abort("x", "prefill ended with status FINISHED_ABORTED")
    until(lambda: len(ep.notifs) == 1)
    assert ep.notifs[0][1].kind == "failed" and "ABORTED" in ep.notifs[0][1].reason
    late = decode_reply(producer.handle_request(reg("x", (1,))))
    assert late.status == "failed" and "ABORTED" in late.reason


def test_lease_frees_unclaimed_prefill_and_ttl_fails_orphan_registration(env: Any) -> None:
    producer, ep, clock = env
    producer.add_finished("lonely", "p-l", (1,))
    producer.handle_request(reg("orphan", (2,)))
    clock.now += 6.0
    until(lambda: "p-l" in producer.take_released())
    until(lambda: any(n.transfer_key == "orphan" and n.kind == "failed" for _, n in ep.notifs))
    assert ep.writes == []


def test_no_write_starts_after_ds_budget(env: Any) -> None:
    producer, ep, clock = env
    producer.handle_request(reg("late", (2,), budget=1.0))
    clock.now += 2.0
    producer.add_finished("late", "p-late", (3,))
    until(lambda: "p-late" in producer.take_released())
    assert ep.writes == []


def test_bad_registrations_are_refused_with_a_reason(env: Any) -> None:
    producer, ep, _ = env
    wrong = reg("w", (1,)).replace(b'"p0"', b'"p9"')
    assert "engine id" in decode_reply(producer.handle_request(wrong)).reason
    assert "protocol" in decode_reply(producer.handle_request(b'{"v": 7}')).reason
    producer.add_finished("short", "p-s", (1,))
    producer.handle_request(reg("short", (1, 2, 3)))
    until(lambda: "p-s" in producer.take_released())
    assert ep.notifs and ep.notifs[-1][1].kind == "failed"


def test_failed_write_is_reported_to_d(env: Any) -> None:
    producer, ep, _ = env
    ep.fail_writes = True
    producer.add_finished("f", "p-f", (1,))
    producer.handle_request(reg("f", (2,)))
    until(lambda: "p-f" in producer.take_released())
    assert ep.notifs[-1][1].kind == "failed" and "rejected" in ep.notifs[-1][1].reason
    assert not producer.take_records()[0].ok


def test_cancel_during_write_says_in_flight_until_the_write_is_done(env: Any) -> None:
    producer, ep, _ = env
    states = {"value": "PROC"}
    ep.state = lambda handle: states["value"]
    producer.add_finished("w", "p-w", (1,))
    producer.handle_request(reg("w", (2,)))
    until(lambda: len(ep.writes) == 1)
    cancel = encode_request("cancel", {"transfer_key": "w"})
    assert decode_reply(producer.handle_request(cancel)).status == "in_flight"
    assert producer.take_released() == set()  # P's blocks stay pinned while the WRITE runs
    states["value"] = "DONE"
    until(lambda: "p-w" in producer.take_released())
    assert decode_reply(producer.handle_request(cancel)).status == "unknown"


def test_registration_overtaken_by_its_cancel_never_writes(env: Any) -> None:
    producer, ep, _ = env
    producer.add_finished("o", "p-o", (1,))
    cancel = encode_request("cancel", {"transfer_key": "o"})
    assert decode_reply(producer.handle_request(cancel)).status == "cancelled"
    late = decode_reply(producer.handle_request(reg("o", (2,))))
    assert late.status == "failed" and "cancelled" in late.reason
    until(lambda: "p-o" in producer.take_released())
    assert ep.writes == []
