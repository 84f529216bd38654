"""P's decisions under tensor parallelism (ProducerState, fake clock, no threads): one P rank
serves the D ranks that take heads from it, and keeps its blocks until each had its WRITE."""

from __future__ import annotations

from dataclasses import replace

from disagg_router.connector.config import ConnectorConfig
from disagg_router.connector.layout import LayoutSpec
from disagg_router.connector.producer_state import ProducerState
from disagg_router.connector.protocol import Registration, decode_notification
from disagg_router.connector.specs import SendSpec
from tests.unit.connector.core_support import FakeClock
from tests.unit.connector.test_pp_layout import model_layout
from tests.unit.connector.test_tp_layout import HEAD, rank_layout

CFG = ConnectorConfig(lease_s=5.0, registration_ttl_s=5.0)


def reg(d: LayoutSpec, key: str = "k", blocks: tuple[int, ...] = (3, 4)) -> Registration:
    return Registration(
        transfer_key=key,
        d_request_id=f"d-{key}",
        p_engine_id="p0",
        d_agent_name=f"d-agent-{d.tp_rank}",
        d_agent_metadata=b"meta",
        d_layout=d,
        block_ids=(blocks,),
        first_block=0,
        budget_s=10.0,
    )


def p_state(p: LayoutSpec, clock: FakeClock) -> ProducerState:
    return ProducerState("p0", p, CFG, clock)


def run_writes(state: ProducerState, now: float) -> list[str]:
    """Post every planned WRITE and finish it as landed; the D agents written to."""
    work = state.plan(now)
    for write in work.writes:
        state.posted(write, object())
        state.finish(write, ok=True)
    return [w.reg.d_agent_name for w in work.writes]


def test_p_tp1_keeps_its_blocks_until_both_d_ranks_had_their_head() -> None:
    clock = FakeClock()
    p = rank_layout(2, 1, 0)
    state = p_state(p, clock)
    state.add_finished(SendSpec("p-1", "k", (5, 6)))
    assert state.register(reg(rank_layout(2, 2, 0))).status == "accepted"
    assert run_writes(state, clock.now) == ["d-agent-0"]
    assert state.take_released() == set()  # D rank 1 still to serve
    d1 = reg(rank_layout(2, 2, 1))
    assert state.register(d1).status == "accepted"
    local, remote = state.views(d1)
    assert local.regions[0].addr == p.regions[0].addr + HEAD  # P's second head ...
    assert remote.regions[0].addr == d1.d_layout.regions[0].addr  # ... at D rank 1's offset 0
    assert local.regions[0].block_bytes == remote.regions[0].block_bytes == HEAD
    assert run_writes(state, clock.now) == ["d-agent-1"]
    assert state.take_released() == {"p-1"}
    assert [r.num_bytes for r in state.take_records()] == [2 * 2 * HEAD] * 2  # 2 blocks, 2 layers


def test_an_mla_p_rank_0_writes_whole_latent_blocks_into_both_d_ranks() -> None:
    """MLA at P TP 2 -> D TP 2: rank 0 holds the one latent head and serves both D ranks with
    whole blocks; rank 1 is a replica that frees at once."""
    clock = FakeClock()
    state = p_state(rank_layout(1, 2, 0), clock)
    state.add_finished(SendSpec("p-1", "k", (5, 6)))
    for d_rank in (0, 1):
        assert state.register(reg(rank_layout(1, 2, d_rank))).status == "accepted"
    assert sorted(run_writes(state, clock.now)) == ["d-agent-0", "d-agent-1"]
    assert state.take_released() == {"p-1"}
    assert [r.num_bytes for r in state.take_records()] == [2 * 2 * HEAD] * 2  # whole blocks
    replica = p_state(rank_layout(1, 2, 1), clock)
    replica.add_finished(SendSpec("p-1", "k", (5, 6)))
    assert replica.take_released() == {"p-1"}


def test_a_d_rank_that_never_registers_frees_p_after_the_lease_and_is_refused_later() -> None:
    clock = FakeClock()
    state = p_state(rank_layout(2, 1, 0), clock)
    state.add_finished(SendSpec("p-1", "k", (5, 6)))
    state.register(reg(rank_layout(2, 2, 0)))
    run_writes(state, clock.now)
    clock.now += CFG.lease_s
    state.expire(clock.now)
    assert state.take_released() == {"p-1"}
    late = state.register(reg(rank_layout(2, 2, 1)))
    assert late.status == "failed" and "lease" in late.reason


def test_p_tp2_ranks_each_write_their_head_into_d_tp1() -> None:
    clock = FakeClock()
    d = rank_layout(2, 1, 0)
    for p_rank in (0, 1):
        state = p_state(rank_layout(2, 2, p_rank), clock)
        state.add_finished(SendSpec(f"p-{p_rank}", "k", (5, 6)))
        assert state.register(reg(d)).status == "accepted"
        _, remote = state.views(reg(d))
        assert remote.regions[0].addr == d.regions[0].addr + p_rank * HEAD
        assert run_writes(state, clock.now) == ["d-agent-0"]
        assert state.take_released() == {f"p-{p_rank}"}


def test_a_replica_rank_frees_at_once_and_refuses_registrations() -> None:
    clock = FakeClock()
    state = p_state(rank_layout(1, 2, 1), clock)  # 1 KV head on 2 ranks: rank 1 is a replica
    state.add_finished(SendSpec("p-1", "k", (5, 6)))
    assert state.take_released() == {"p-1"}
    refused = state.register(reg(rank_layout(1, 1, 0)))
    assert refused.status == "failed" and "takes no KV heads from P rank 1" in refused.reason


def test_a_cancel_from_one_d_rank_fails_the_others_and_frees_p() -> None:
    clock = FakeClock()
    state = p_state(rank_layout(2, 1, 0), clock)
    state.register(reg(rank_layout(2, 2, 0)))
    state.register(reg(rank_layout(2, 2, 1)))
    assert state.cancel("k", d_rank=1).status == "cancelled"
    notes = [decode_notification(n) for _, n in state.take_notifications()]
    assert [(n.kind, n.d_request_id) for n in notes] == [("failed", "d-k")]
    state.add_finished(SendSpec("p-1", "k", (5, 6)))  # the prefill ends after the cancel
    assert state.take_released() == {"p-1"} and state.plan(clock.now).writes == []


def test_a_cancel_while_another_rank_writes_frees_p_after_that_write() -> None:
    clock = FakeClock()
    state = p_state(rank_layout(2, 1, 0), clock)
    state.add_finished(SendSpec("p-1", "k", (5, 6)))
    state.register(reg(rank_layout(2, 2, 0)))
    [write] = state.plan(clock.now).writes
    state.posted(write, object())
    assert state.cancel("k", d_rank=0).status == "in_flight"
    assert state.cancel("k", d_rank=1).status == "cancelled"
    assert state.take_released() == set()  # rank 0's WRITE may still land
    state.finish(write, ok=True)
    assert state.take_released() == {"p-1"}


def test_a_duplicate_registration_from_one_d_rank_is_refused() -> None:
    clock = FakeClock()
    state = p_state(rank_layout(2, 1, 0), clock)
    d0 = reg(rank_layout(2, 2, 0))
    assert state.register(d0).status == "accepted"
    assert "registered k twice" in state.register(replace(d0, d_request_id="x")).reason


def test_p_notifications_name_the_p_rank() -> None:
    clock = FakeClock()
    state = p_state(rank_layout(2, 2, 1), clock)
    state.add_finished(SendSpec("p-1", "k", (5, 6)))
    state.register(reg(rank_layout(2, 1, 0)))
    [write] = state.plan(clock.now).writes
    assert decode_notification(write.notif).p_rank == 1
    state.finish(write, ok=False, reason="boom")
    [(_, note)] = state.take_notifications()
    assert decode_notification(note).p_rank == 1


def test_a_pipeline_stage_writes_its_layers_into_ds_and_names_its_vllm_rank() -> None:
    """P PP 2 x TP 2 -> D TP 1: stage 1, TP rank 1 (vLLM rank 3) writes its head of its six
    layers into D's regions of those layers; its notifications carry rank 3."""
    clock = FakeClock()
    p = model_layout(2, 2, 1, pp=2, stage=1)
    d = model_layout(2, 1, 0)
    state = p_state(p, clock)
    state.add_finished(SendSpec("p-1", "k", (5, 6)))
    assert state.register(reg(d)).status == "accepted"
    [write] = state.plan(clock.now).writes
    _, remote = state.views(write.reg)
    d_addr = dict(zip(d.region_layers, (r.addr for r in d.regions), strict=True))
    assert [r.addr for r in remote.regions] == [d_addr[i] + HEAD for i in p.region_layers]
    assert write.remote_ids.tolist() == [b + 8 * i for i in range(6) for b in (3, 4)]
    assert decode_notification(write.notif).p_rank == 3
    state.posted(write, object())
    state.finish(write, ok=True)
    assert state.take_released() == {"p-1"}
    assert [r.num_bytes for r in state.take_records()] == [2 * 6 * HEAD]  # 2 blocks, 6 layers
