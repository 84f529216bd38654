"""Policies and pools: round-robin order, least-in-flight choice, usability rules."""

from __future__ import annotations

import pytest

from router.backends import BackendState
from router.config import InstanceConfig, PoolConfig, PushIdentity
from router.errors import NoBackendAvailable
from router.policies import LeastInFlight, RoundRobin, make_policy
from router.pools import Pool


def _backends(n: int) -> list[BackendState]:
    return [
        BackendState(InstanceConfig(url=f"http://127.0.0.1:{8100 + i}"), role="decode")
        for i in range(n)
    ]


def test_round_robin_cycles() -> None:
    bs = _backends(3)
    rr = RoundRobin()
    assert [rr.choose(bs).url[-4:] for _ in range(7)] == [
        "8100",
        "8101",
        "8102",
        "8100",
        "8101",
        "8102",
        "8100",
    ]


def test_least_in_flight_picks_the_idlest_and_rotates_ties() -> None:
    bs = _backends(3)
    bs[0].in_flight, bs[1].in_flight, bs[2].in_flight = 3, 1, 1
    lif = LeastInFlight()
    picks = [lif.choose(bs).url[-4:] for _ in range(4)]
    assert picks == ["8101", "8102", "8101", "8102"]
    bs[2].in_flight = 0
    assert lif.choose(bs) is bs[2]


def test_make_policy_by_name() -> None:
    assert isinstance(make_policy("round_robin"), RoundRobin)
    assert isinstance(make_policy("least_in_flight"), LeastInFlight)


def test_pool_skips_unhealthy_and_identityless_prefills() -> None:
    ident = PushIdentity(engine_id="e", host="127.0.0.1", port=5600)
    cfg = PoolConfig(
        instances=[
            InstanceConfig(url="http://127.0.0.1:1", identity=ident),
            InstanceConfig(url="http://127.0.0.1:2"),
            InstanceConfig(url="http://127.0.0.1:3", identity=ident),
        ]
    )
    pool = Pool("prefill", cfg, require_identity=True)
    assert [b.url[-1] for b in pool.usable()] == ["1", "3"]
    pool.backends[1].discovered_identity = ident
    pool.backends[2].mark_failed("down")
    assert [b.url[-1] for b in pool.usable()] == ["1", "2"]
    assert pool.choose(exclude={"http://127.0.0.1:1"}).url.endswith("2")
    for b in pool.backends:
        b.healthy = False
    with pytest.raises(NoBackendAvailable):
        pool.choose()


def test_pool_exclusion_falls_back_when_nothing_else_is_usable() -> None:
    pool = Pool("decode", PoolConfig(instances=[InstanceConfig(url="http://127.0.0.1:9")]), False)
    assert pool.choose(exclude={"http://127.0.0.1:9"}).url == "http://127.0.0.1:9"
