"""D's decisions under tensor parallelism (ConsumerState, fake clock): a D rank waits for every
P rank it takes KV heads from, and a missing or failed one fails the request within its bounds."""

from __future__ import annotations

from disagg_router.connector.config import ConnectorConfig
from disagg_router.connector.consumer_state import ConsumerState
from disagg_router.connector.errors import SideChannelRefusedError
from disagg_router.connector.protocol import (
    Notification,
    Reply,
    cancel_from_body,
    decode_request,
    encode_notification,
    registration_from_body,
)
from disagg_router.connector.specs import KeyCancel, RecvSpec
from tests.unit.connector.core_support import FakeClock
from tests.unit.connector.test_tp_layout import rank_layout

CFG = ConnectorConfig(transfer_timeout_s=10.0, max_inflight_s=4.0, liveness_interval_s=0.5)


def d_state(tp: int, rank: int, clock: FakeClock) -> ConsumerState:
    return ConsumerState(CFG, rank_layout(2, tp, rank), f"d-agent-{rank}", b"meta", clock)


def spec(p_tp: int) -> RecvSpec:
    return RecvSpec("d-1", "k1", "p0", "10.0.0.1", 5600, (7, 8), first_block=0, p_tp_size=p_tp)


def done(p_rank: int) -> bytes:
    return encode_notification(Notification("done", "k1", "d-1", p_rank=p_rank))


def test_d_tp1_registers_with_both_p_ranks_and_finishes_after_both() -> None:
    state = d_state(1, 0, FakeClock())
    asks = state.register(spec(p_tp=2))
    assert [(a.kind, a.port, a.p_rank) for a in asks] == [
        ("register", 5600, 0),
        ("register", 5601, 1),
    ]
    reg = registration_from_body(decode_request(asks[0].payload)[1])
    assert (reg.d_layout.tp_rank, reg.d_layout.tp_size, reg.d_layout.kv_heads()) == (0, 1, (0, 2))
    for ask in asks:
        state.answer(ask, Reply("accepted"))
    state.notifications([done(1)])
    assert state.take_results() == (set(), set())  # P rank 0's heads have not landed yet
    state.notifications([done(1), done(0)])
    assert state.take_results() == ({"d-1"}, set())
    assert state.take_records()[0].ok


def test_an_mla_d_registers_with_p_rank_0_only_at_any_tp() -> None:
    """MLA (one latent head on every rank): P rank 0 is each D rank's one source, so D waits on
    it alone; P's other ranks are never asked."""
    clock = FakeClock()
    for d_tp, p_tp in ((1, 2), (2, 1), (2, 2)):
        for rank in range(d_tp):
            state = ConsumerState(CFG, rank_layout(1, d_tp, rank), f"d-{rank}", b"m", clock)
            asks = state.register(spec(p_tp))
            assert [(a.port, a.p_rank) for a in asks] == [(5600, 0)]
            state.answer(asks[0], Reply("accepted"))
            state.notifications([done(0)])
            assert state.take_results() == ({"d-1"}, set())


def test_d_tp2_ranks_each_register_with_their_p_rank() -> None:
    clock = FakeClock()
    for rank, p_tp, ports in ((0, 1, [5600]), (1, 1, [5600]), (0, 2, [5600]), (1, 2, [5601])):
        state = d_state(2, rank, clock)
        assert [a.port for a in state.register(spec(p_tp))] == ports


def test_one_p_rank_refusing_cancels_the_other_and_fails_once_it_confirms() -> None:
    state = d_state(1, 0, FakeClock())
    first, second = state.register(spec(p_tp=2))
    state.answer(first, Reply("accepted"))
    (cancel,) = state.answer(second, Reply("failed", "incompatible KV layout: x"))
    assert (cancel.kind, cancel.port, cancel.p_rank) == ("cancel", 5600, 0)
    assert cancel_from_body(decode_request(cancel.payload)[1]) == ("k1", 0)
    assert state.take_results() == (set(), set())  # P rank 0 may still WRITE: wait for it
    state.answer(cancel, Reply("cancelled"))
    assert state.take_results() == ({"d-1"}, {"d-1"})
    assert state.take_records()[0].reason == "P refused: incompatible KV layout: x"


def test_a_missing_p_rank_fails_the_request_by_its_pings() -> None:
    clock = FakeClock()
    state = d_state(1, 0, clock)
    for ask in state.register(spec(p_tp=2)):
        state.answer(ask, Reply("accepted"))
    state.notifications([done(0)])  # rank 0 delivered; rank 1's process is gone
    for _ in range(2):
        pings = {a.port: a for a in state.tick(clock.now)}
        assert sorted(pings) == [5601]  # only the P rank D still waits on
        state.answer(pings[5601], SideChannelRefusedError("refused"))
        clock.now += CFG.liveness_interval_s
    assert state.take_results() == ({"d-1"}, {"d-1"})
    assert state.take_records()[0].reason == "P at 10.0.0.1:5601 is gone"


def test_a_failed_notification_from_one_rank_cancels_the_other_on_the_next_tick() -> None:
    clock = FakeClock()
    state = d_state(1, 0, clock)
    for ask in state.register(spec(p_tp=2)):
        state.answer(ask, Reply("accepted"))
    state.notifications([encode_notification(Notification("failed", "k1", "d-1", "x", p_rank=0))])
    cancels = [a for a in state.tick(clock.now) if a.kind == "cancel"]
    assert [(a.port, a.reason) for a in cancels] == [(5601, "another P rank failed: P failed: x")]
    state.answer(cancels[0], Reply("in_flight"))  # rank 1's WRITE is landing: wait for it
    assert state.take_results() == (set(), set())
    state.notifications([done(1)])
    assert state.take_results() == ({"d-1"}, {"d-1"})


def test_timeout_and_abort_cancel_every_p_rank() -> None:
    clock = FakeClock()
    state = d_state(1, 0, clock)
    for ask in state.register(spec(p_tp=2)):
        state.answer(ask, Reply("accepted"))
    assert sorted(a.port for a in state.cancel("d-1")) == [5600, 5601]
    clock.now += CFG.transfer_timeout_s
    assert [a for a in state.tick(clock.now) if a.kind == "cancel"] == []  # under way already
    clock.now = 1000.0 + CFG.transfer_timeout_s + CFG.max_inflight_s
    state.tick(clock.now)
    assert state.take_results() == ({"d-1"}, set())  # hard bound; an abort, not a failed load


def test_a_p_tp_size_that_does_not_fit_the_heads_fails_at_once() -> None:
    state = d_state(1, 0, FakeClock())
    assert state.register(spec(p_tp=3)) == []
    assert state.take_results() == ({"d-1"}, {"d-1"})
    assert "tensor-parallel size 3 does not fit" in state.take_records()[0].reason


def test_forgetting_a_key_tells_every_source_p_rank() -> None:
    state = d_state(1, 0, FakeClock())
    asks = state.forget(KeyCancel("k9", "10.0.0.2", 5600, p_tp_size=2))
    assert [(a.kind, a.port) for a in asks] == [("forget", 5600), ("forget", 5601)]


def pp_spec(p_tp: int, p_pp: int) -> RecvSpec:
    return RecvSpec("d-1", "k1", "p0", "10.0.0.1", 5600, (7, 8), 0, p_tp, p_pp)


def test_d_registers_with_every_stage_of_a_pipeline_parallel_p_and_waits_for_each() -> None:
    """P PP 2 x TP 2 -> D TP 1: four legs, at vLLM's ranks ``stage * 2 + tp_rank``."""
    state = d_state(1, 0, FakeClock())
    asks = state.register(pp_spec(p_tp=2, p_pp=2))
    assert [(a.port, a.p_rank) for a in asks] == [(5600 + r, r) for r in range(4)]
    for ask in asks:
        state.answer(ask, Reply("accepted"))
    state.notifications([done(0), done(1), done(3)])
    assert state.take_results() == (set(), set())  # stage 1's TP rank 0 has not landed yet
    state.notifications([done(2)])
    assert state.take_results() == ({"d-1"}, set())


def test_one_failed_stage_cancels_the_other_stages_legs() -> None:
    clock = FakeClock()
    state = d_state(1, 0, clock)
    for ask in state.register(pp_spec(p_tp=1, p_pp=2)):
        state.answer(ask, Reply("accepted"))
    state.notifications([encode_notification(Notification("failed", "k1", "d-1", "x", p_rank=1))])
    [cancel] = [a for a in state.tick(clock.now) if a.kind == "cancel"]
    assert (cancel.port, cancel.p_rank) == (5600, 0)
    state.answer(cancel, Reply("cancelled"))
    assert state.take_results() == ({"d-1"}, {"d-1"})


def test_forgetting_a_key_tells_every_stage() -> None:
    state = d_state(2, 1, FakeClock())
    asks = state.forget(KeyCancel("k9", "10.0.0.2", 5600, p_tp_size=2, p_pp_size=2))
    assert [a.port for a in asks] == [5601, 5603]
