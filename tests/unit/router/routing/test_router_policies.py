"""Policies and pools: round-robin order, least-in-flight choice, usability rules."""

from __future__ import annotations

from typing import get_args

import pytest

from disagg_router.router.config import InstanceConfig, PolicyName, PoolConfig, PushIdentity
from disagg_router.router.errors import NoBackendAvailable
from disagg_router.router.instances.state import BackendState
from disagg_router.router.routing.policies.base import RoutingInput
from disagg_router.router.routing.policies.factory import POLICIES, make_policy
from disagg_router.router.routing.policies.kv_aware import KvAware
from disagg_router.router.routing.policies.least_in_flight import LeastInFlight
from disagg_router.router.routing.policies.power_of_two import PowerOfTwo
from disagg_router.router.routing.policies.prefix_affinity import PrefixAffinity
from disagg_router.router.routing.policies.round_robin import RoundRobin
from disagg_router.router.routing.policies.session_affinity import SessionAffinity
from disagg_router.router.routing.pools import Pool


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
    instances = [InstanceConfig(url="http://127.0.0.1:1")]
    expected = {
        "round_robin": RoundRobin,
        "least_in_flight": LeastInFlight,
        "power_of_two": PowerOfTwo,
        "prefix_affinity": PrefixAffinity,
        "session_affinity": SessionAffinity,
        "kv_aware": KvAware,
    }
    for name, kind in expected.items():
        policy = make_policy(PoolConfig.model_validate({"instances": instances, "policy": name}))
        assert isinstance(policy, kind)
        assert policy.name == name


def test_the_factory_knows_exactly_the_names_the_config_accepts() -> None:
    assert set(POLICIES) == set(get_args(PolicyName))


def test_only_the_policies_that_read_load_signals_get_them_scraped() -> None:
    policies = {
        name: Pool("decode", PoolConfig(instances=_instances(1), policy=name), False).policy
        for name in POLICIES
    }
    assert {name for name, p in policies.items() if "load" in p.signals} == {"power_of_two"}
    assert {name for name, p in policies.items() if "kv_events" in p.signals} == {"kv_aware"}


def test_update_rebuilds_the_policy_when_a_setting_it_reads_changes_and_only_then() -> None:
    cfg = PoolConfig(instances=_instances(1, 3), policy="session_affinity")
    pool = Pool("decode", cfg, require_identity=False)
    before = pool.policy
    pool.update(cfg.model_copy(update={"prefix_chars": 4096}))  # not read by session_affinity
    assert pool.policy is before
    pool.update(cfg.model_copy(update={"session_header": "x-user"}))
    assert pool.policy is not before


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
    pool.backends[1].learned_identity = ident
    pool.backends[2].healthy = False
    assert [b.url[-1] for b in pool.usable()] == ["1", "2"]
    assert pool.choose(exclude={"http://127.0.0.1:1"}).url.endswith("2")
    for b in pool.backends:
        b.healthy = False
    with pytest.raises(NoBackendAvailable):
        pool.choose()


def test_pool_exclusion_falls_back_when_nothing_else_is_usable() -> None:
    pool = Pool("decode", PoolConfig(instances=[InstanceConfig(url="http://127.0.0.1:9")]), False)
    assert pool.choose(exclude={"http://127.0.0.1:9"}).url == "http://127.0.0.1:9"


def _instances(*ports: int) -> list[InstanceConfig]:
    return [InstanceConfig(url=f"http://127.0.0.1:{p}", name=f"i{p}") for p in ports]


def test_set_instances_keeps_state_drains_leavers_and_holds_joiners_until_checked() -> None:
    pool = Pool("decode", PoolConfig(instances=_instances(1, 2, 3)), require_identity=False)
    kept, leaving, idle_leaver = pool.backends[0], pool.backends[1], pool.backends[2]
    kept.in_flight, leaving.in_flight = 2, 1
    change = pool.set_instances(_instances(1, 4))
    assert [b.label for b in change.added] == ["i4"]
    assert [b.label for b in change.removed] == ["i2", "i3"]
    assert pool.backends[0] is kept and kept.in_flight == 2
    joined = pool.backends[1]
    assert not joined.healthy  # probed before use
    assert pool.usable() == [kept]
    assert pool.draining == [leaving]  # the idle leaver is gone at once
    assert idle_leaver not in pool.draining
    leaving.in_flight = 0
    assert pool.prune_draining() == [leaving] and pool.draining == []
    joined.healthy = True
    assert {b.label for b in pool.usable()} == {"i1", "i4"}


def test_set_instances_replaces_an_instance_whose_config_changed() -> None:
    pool = Pool("decode", PoolConfig(instances=_instances(1)), require_identity=False)
    old = pool.backends[0]
    moved = InstanceConfig(url="http://127.0.0.1:9", name="i1")
    change = pool.set_instances([moved])
    assert change.removed == (old,) and change.added[0].url == "http://127.0.0.1:9"


def test_update_swaps_the_policy_only_when_its_settings_change() -> None:
    cfg = PoolConfig(instances=_instances(1, 2), policy="round_robin")
    pool = Pool("decode", cfg, require_identity=False)
    assert pool.choose().label == "i1"
    pool.update(cfg)
    assert pool.choose().label == "i2"  # the cursor survived a no-op update
    pool.update(cfg.model_copy(update={"policy": "least_in_flight"}))
    pool.backends[1].in_flight = 0  # the leg chosen above (choose() counts it) has ended
    pool.backends[0].in_flight = 1
    assert pool.choose().label == "i2"


def test_a_burst_of_choices_counts_each_leg_and_keeps_the_affinity_load_bound() -> None:
    """30 choices with one prefix over 3 instances, none of the legs started yet: each choice
    is counted at once, so the hot prefix spills and no instance exceeds the bound (13)."""
    cfg = PoolConfig(instances=_instances(1, 2, 3), policy="prefix_affinity", load_factor=1.25)
    pool = Pool("prefill", cfg, require_identity=False)
    hot = RoutingInput({"prompt": "the same system prompt " * 20})
    for _ in range(30):
        pool.choose(request=hot)
    loads = sorted(b.in_flight for b in pool.backends)
    assert sum(loads) == 30
    assert loads[-1] <= 13, loads
