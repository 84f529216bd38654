"""D's decisions with a fake clock (ConsumerState), and the PushConsumer threads around them.

The real-NIXL, two-process version of these paths is tests/integration/connector.
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from disagg_router.connector.config import ConnectorConfig
from disagg_router.connector.consumer import PushConsumer
from disagg_router.connector.consumer_state import ConsumerState
from disagg_router.connector.errors import ProtocolError, SideChannelError, SideChannelRefusedError
from disagg_router.connector.protocol import (
    Notification,
    Reply,
    decode_request,
    encode_notification,
    encode_reply,
    registration_from_body,
)
from disagg_router.connector.specs import KeyCancel, RecvSpec
from tests.unit.connector.core_support import LAYOUT, FakeClock, MemoryEndpoint, until

CFG = ConnectorConfig(transfer_timeout_s=10.0, max_inflight_s=4.0, liveness_interval_s=0.5)


def spec(rid: str = "d-1", key: str = "k1", port: int = 5601) -> RecvSpec:
    return RecvSpec(rid, key, "p0", "10.0.0.1", port, (7, 8, 9), first_block=2)


@pytest.fixture
def clock() -> FakeClock:
    return FakeClock()


@pytest.fixture
def state(clock: FakeClock) -> ConsumerState:
    return ConsumerState(CFG, LAYOUT, "d-agent", b"d-meta", clock)


def done(rid: str = "d-1", key: str = "k1") -> bytes:
    return encode_notification(Notification("done", key, rid))


def test_registration_carries_d_agent_layout_and_blocks(state: ConsumerState) -> None:
    ask = state.register(spec())[0]
    assert (ask.kind, ask.host, ask.port, ask.d_request_id) == ("register", "10.0.0.1", 5601, "d-1")
    kind, body = decode_request(ask.payload)
    reg = registration_from_body(body)
    assert kind == "register" and reg.transfer_key == "k1" and reg.p_engine_id == "p0"
    assert (reg.d_agent_name, reg.d_agent_metadata, reg.d_layout) == ("d-agent", b"d-meta", LAYOUT)
    assert reg.block_ids == ((7, 8, 9),) and reg.first_block == 2
    assert reg.budget_s == CFG.transfer_timeout_s


def test_done_notification_finishes_once_with_a_record(state: ConsumerState) -> None:
    ask = state.register(spec())[0]
    assert state.answer(ask, Reply("accepted")) == []
    assert state.take_results() == (set(), set()) and state.pending_count() == 1
    state.notifications([done()])
    assert state.take_results() == ({"d-1"}, set())
    rec = state.take_records()[0]
    assert rec.ok and rec.num_blocks == 3 and rec.num_bytes == 3 * 64
    state.notifications([done()])  # a duplicate is not reported twice
    assert state.take_results() == (set(), set()) and state.pending_count() == 0


def test_refusal_and_unreachable_p_fail_at_once(state: ConsumerState) -> None:
    refused = state.register(spec("d-1"))[0]
    assert state.answer(refused, Reply("failed", "incompatible KV layout: dtype differs")) == []
    gone = state.register(spec("d-2", "k2"))[0]
    assert state.answer(gone, SideChannelRefusedError("connection refused")) == []
    assert state.take_results() == ({"d-1", "d-2"}, {"d-1", "d-2"})
    reasons = {r.request_id: r.reason for r in state.take_records()}
    assert reasons["d-1"] == "P refused: incompatible KV layout: dtype differs"
    assert reasons["d-2"].startswith("P unreachable")


def test_unconfirmed_registration_is_released_only_through_a_cancel(
    state: ConsumerState,
) -> None:
    ask = state.register(spec())[0]
    (cancel,) = state.answer(ask, SideChannelError("timed out"))
    assert cancel.kind == "cancel" and decode_request(cancel.payload)[1]["transfer_key"] == "k1"
    assert state.take_results() == (set(), set())  # P may have accepted it: nothing freed yet
    state.answer(cancel, Reply("cancelled"))
    assert state.take_results() == ({"d-1"}, {"d-1"})
    assert state.take_records()[0].reason.startswith("registration unconfirmed")


def test_timeout_cancels_then_in_flight_waits_for_the_write(
    state: ConsumerState, clock: FakeClock
) -> None:
    state.answer(state.register(spec())[0], Reply("accepted"))
    clock.now += 9.9
    assert [a.kind for a in state.tick(clock.now)] == ["ping"]
    clock.now += 0.2
    (cancel,) = [a for a in state.tick(clock.now) if a.kind == "cancel"]
    assert cancel.reason == "timed out waiting for P"
    assert state.tick(clock.now) == []  # one cancel, not one per tick
    state.answer(cancel, Reply("in_flight"))
    clock.now += 3.9  # the WRITE gets max_inflight_s to land
    assert not any(a.kind == "cancel" for a in state.tick(clock.now))
    state.notifications([done()])
    assert state.take_results() == ({"d-1"}, set())


def test_timeout_confirmed_by_p_fails_the_transfer(state: ConsumerState, clock: FakeClock) -> None:
    state.answer(state.register(spec())[0], Reply("accepted"))
    clock.now += 10.5
    (cancel,) = [a for a in state.tick(clock.now) if a.kind == "cancel"]
    state.answer(cancel, Reply("cancelled"))
    assert state.take_results() == ({"d-1"}, {"d-1"})


def test_unanswered_cancel_waits_for_the_hard_bound(state: ConsumerState, clock: FakeClock) -> None:
    state.answer(state.register(spec())[0], Reply("accepted"))
    clock.now += 10.5
    (cancel,) = [a for a in state.tick(clock.now) if a.kind == "cancel"]
    state.answer(cancel, SideChannelError("timed out"))  # P may be alive and still WRITE
    state.answer(cancel, ProtocolError("garbage"))
    clock.now += 3.0
    for again in [a for a in state.tick(clock.now) if a.kind == "cancel"]:
        state.answer(again, SideChannelError("timed out"))
    assert state.take_results() == (set(), set())
    clock.now = 1000.0 + CFG.transfer_timeout_s + CFG.max_inflight_s
    state.tick(clock.now)
    assert state.take_results() == ({"d-1"}, {"d-1"})
    assert state.take_records()[0].reason == "timed out (hard bound)"


def test_unanswered_cancel_is_asked_again_and_a_confirmation_fails_fast(
    state: ConsumerState, clock: FakeClock
) -> None:
    """One lost answer costs a liveness interval, not the hard bound."""
    (cancel,) = state.answer(state.register(spec())[0], SideChannelError("timed out"))
    assert cancel.reason.startswith("registration unconfirmed")
    state.answer(cancel, SideChannelError("timed out"))
    assert not [a for a in state.tick(clock.now) if a.kind == "cancel"]  # not before the interval
    clock.now += CFG.liveness_interval_s
    (again,) = [a for a in state.tick(clock.now) if a.kind == "cancel"]
    assert (again.port, again.reason, again.payload) == (cancel.port, cancel.reason, cancel.payload)
    state.answer(again, Reply("cancelled"))
    assert state.take_results() == ({"d-1"}, {"d-1"})
    assert state.take_records()[0].reason == cancel.reason
    clock.now += CFG.liveness_interval_s
    assert not [a for a in state.tick(clock.now) if a.kind == "cancel"]


def test_cancel_refused_means_p_is_gone(state: ConsumerState, clock: FakeClock) -> None:
    state.answer(state.register(spec())[0], Reply("accepted"))
    clock.now += 10.5
    (cancel,) = [a for a in state.tick(clock.now) if a.kind == "cancel"]
    state.answer(cancel, SideChannelRefusedError("refused"))
    assert state.take_results() == ({"d-1"}, {"d-1"})
    assert state.take_records()[0].reason == "timed out waiting for P; P is gone"


def test_abort_by_d_is_reported_but_not_as_a_failed_load(state: ConsumerState) -> None:
    state.answer(state.register(spec())[0], Reply("accepted"))
    [cancel] = state.cancel("d-1")
    assert cancel is not None and cancel.reason == "aborted by D"
    assert state.cancel("d-1") == []  # already under way
    assert state.cancel("unknown") == []
    state.answer(cancel, Reply("cancelled"))
    assert state.take_results() == ({"d-1"}, set())


def test_two_refused_pings_fail_only_that_ps_transfers(
    state: ConsumerState, clock: FakeClock
) -> None:
    for ask in (
        state.register(spec("d-1", "k1", 5601))[0],
        state.register(spec("d-2", "k2", 5602))[0],
    ):
        state.answer(ask, Reply("accepted"))
    pings = state.tick(clock.now)
    assert sorted((a.kind, a.port) for a in pings) == [("ping", 5601), ("ping", 5602)]
    assert state.tick(clock.now) == []  # next round after liveness_interval_s
    by_port = {a.port: a for a in pings}
    state.answer(by_port[5601], SideChannelRefusedError("refused"))
    state.answer(by_port[5602], SideChannelError("slow"))
    assert state.take_results() == (set(), set())  # one miss is not enough
    state.answer(by_port[5601], SideChannelRefusedError("refused"))
    state.answer(by_port[5602], SideChannelError("slow"))  # alive but slow: keep waiting
    assert state.take_results() == ({"d-1"}, {"d-1"})
    assert state.take_records()[0].reason == "P at 10.0.0.1:5601 is gone"


def test_p_dying_while_d_aborts_is_released_by_the_pings(
    state: ConsumerState, clock: FakeClock
) -> None:
    """D's abort reaches a dying P (reset, not refused): the pings still find P gone."""
    state.answer(state.register(spec())[0], Reply("accepted"))
    [cancel] = state.cancel("d-1")
    assert cancel is not None
    state.answer(cancel, SideChannelError("connection reset"))  # P may be alive: keep waiting
    assert state.take_results() == (set(), set())
    for _ in range(2):  # liveness_interval_s x 2 (the cancel is also asked again meanwhile)
        (ping,) = [a for a in state.tick(clock.now) if a.kind == "ping"]
        assert ping.port == 5601
        state.answer(ping, SideChannelRefusedError("refused"))
        clock.now += CFG.liveness_interval_s
    assert state.take_results() == ({"d-1"}, set())  # released; an abort, not a failed load
    assert state.take_records()[0].reason == "P at 10.0.0.1:5601 is gone"


def test_a_timed_out_transfer_whose_cancel_is_unanswered_still_pings_p(
    state: ConsumerState, clock: FakeClock
) -> None:
    state.answer(state.register(spec())[0], Reply("accepted"))
    clock.now += CFG.transfer_timeout_s + 0.1
    (cancel,) = [a for a in state.tick(clock.now) if a.kind == "cancel"]
    state.answer(cancel, SideChannelError("timed out"))
    clock.now += CFG.liveness_interval_s
    asks = state.tick(clock.now)
    assert sorted(a.kind for a in asks) == ["cancel", "ping"]  # the cancel asked again
    (ping,) = [a for a in asks if a.kind == "ping"]
    state.answer(ping, SideChannelRefusedError("refused"))
    state.answer(ping, SideChannelRefusedError("refused"))
    assert state.take_results() == ({"d-1"}, {"d-1"})


def test_a_pong_resets_the_miss_count(state: ConsumerState, clock: FakeClock) -> None:
    state.answer(state.register(spec())[0], Reply("accepted"))
    (ping,) = state.tick(clock.now)
    state.answer(ping, SideChannelRefusedError("refused"))
    state.answer(ping, Reply("pong"))
    state.answer(ping, SideChannelRefusedError("refused"))
    assert state.take_results() == (set(), set())


def test_fail_notification_and_foreign_ones(state: ConsumerState) -> None:
    state.answer(state.register(spec())[0], Reply("accepted"))
    failed = encode_notification(Notification("failed", "k1", "d-1", "x"))
    state.notifications([b"cmpl-1:1", failed])  # vLLM's own notification format is ignored
    assert state.take_results() == ({"d-1"}, {"d-1"})
    assert state.take_records()[0].reason == "P failed: x"


def test_forgetting_a_key_asks_p_to_cancel_it(state: ConsumerState) -> None:
    [ask] = state.forget(KeyCancel("k9", "10.0.0.2", 5609))
    assert (ask.kind, ask.host, ask.port) == ("forget", "10.0.0.2", 5609)
    kind, body = decode_request(ask.payload)
    assert kind == "cancel" and body["transfer_key"] == "k9"
    assert state.answer(ask, SideChannelRefusedError("refused")) == []  # best effort
    assert state.pending_count() == 0


class Transport:
    """Answers side-channel frames like a live P: accepts registrations, pongs pings."""

    def __init__(self) -> None:
        self.seen: list[tuple[str, int, str]] = []

    def __call__(self, host: str, port: int, payload: bytes, timeout_s: float) -> bytes:
        kind, _ = decode_request(payload)
        self.seen.append((host, port, kind))
        return encode_reply(Reply("pong" if kind == "ping" else "accepted"))


@pytest.fixture
def consumer() -> Iterator[tuple[PushConsumer, MemoryEndpoint, Transport]]:
    ep, transport = MemoryEndpoint("d-agent"), Transport()
    c = PushConsumer(ep, CFG, transport=transport)
    yield c, ep, transport
    c.close()


def test_consumer_threads_send_registrations_and_read_notifications(
    consumer: tuple[PushConsumer, MemoryEndpoint, Transport],
) -> None:
    c, ep, transport = consumer
    c.register(spec())
    until(lambda: ("10.0.0.1", 5601, "register") in transport.seen)
    until(lambda: ("10.0.0.1", 5601, "ping") in transport.seen)  # the receiver pings P
    ep.deliver(done())
    finished: set[str] = set()

    def reported() -> bool:
        finished.update(c.take_results()[0])
        return "d-1" in finished

    until(reported)
    assert c.pending_count() == 0


class DyingP(Transport):
    """A P killed while D's abort is on its way: the cancel's connection is reset, and from
    then on nothing listens (every later request is refused)."""

    def __call__(self, host: str, port: int, payload: bytes, timeout_s: float) -> bytes:
        kind, _ = decode_request(payload)
        if kind == "cancel" or ("cancel" in {k for _, _, k in self.seen}):
            self.seen.append((host, port, kind))
            if kind == "cancel":
                raise SideChannelError("connection reset by peer")
            raise SideChannelRefusedError("connection refused")
        return super().__call__(host, port, payload, timeout_s)


def test_consumer_releases_an_aborted_transfer_when_p_dies_during_the_cancel() -> None:
    ep, transport = MemoryEndpoint("d-agent"), DyingP()
    c = PushConsumer(ep, CFG, transport=transport)
    try:
        c.register(spec()).result(timeout=3)
        c.cancel("d-1")
        finished: set[str] = set()

        def released() -> bool:
            done_ids, failed = c.take_results()
            assert not failed  # an abort is not a failed load
            finished.update(done_ids)
            return "d-1" in finished

        # the documented bound for a dead P (two pings), plus one interval of slack
        until(released, timeout=3 * CFG.liveness_interval_s + 0.5)
        assert ("10.0.0.1", 5601, "ping") in transport.seen
    finally:
        c.close()


class _NoReceiver(PushConsumer):
    """A consumer whose receiver thread never reads (as if it slept through the WRITE)."""

    def _run(self) -> None:
        self._stop.wait()


def test_the_engine_step_reads_a_landed_write_itself_while_one_is_pending() -> None:
    ep, transport = MemoryEndpoint("d-agent"), Transport()
    c = _NoReceiver(ep, CFG, transport=transport)
    try:
        ep.deliver(done("d-0", "k0"))  # for nobody pending: not read while D waits on nothing
        assert c.take_results() == (set(), set())
        assert ep.take_notifs() == [done("d-0", "k0")]
        c.register(spec()).result(timeout=3)
        ep.deliver(done())
        assert c.take_results() == ({"d-1"}, set())
        assert c.pending_count() == 0
    finally:
        c.close()
