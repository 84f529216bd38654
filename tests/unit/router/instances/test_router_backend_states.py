"""One backend state per instance across models, the breaker gauge following the breaker, and an
instance's metric series removed when it leaves every pool."""

from __future__ import annotations

from typing import Any

from prometheus_client import CollectorRegistry

from disagg_router.router.config import (
    BreakerConfig,
    InstanceConfig,
    RouterSettings,
    settings_from_mapping,
)
from disagg_router.router.instances.breaker import Breaker
from disagg_router.router.runtime import Runtime, http_client

P0, P1, D0 = "http://127.0.0.1:9101", "http://127.0.0.1:9102", "http://127.0.0.1:9201"


def _pools(prefill: list[str], decode: list[str]) -> dict[str, Any]:
    return {
        "prefill": {"instances": [{"url": u} for u in prefill]},
        "decode": {"instances": [{"url": u} for u in decode]},
    }


def _two_models(a_prefill: list[str], b_prefill: list[str]) -> RouterSettings:
    return settings_from_mapping(
        {"models": {"a": _pools(a_prefill, [D0]), "b": _pools(b_prefill, [D0])}}
    )


def _runtime(settings: RouterSettings) -> Runtime:
    return Runtime.create(settings, http_client(settings))  # makes no call: nothing to close


def _sample(rt: Runtime, name: str, **labels: str) -> float | None:
    registry: CollectorRegistry = rt.metrics.registry
    return registry.get_sample_value(name, labels)


def _series_of(rt: Runtime, label: str) -> list[str]:
    """Every exported sample line that names ``label``."""
    text = rt.metrics.render().decode()
    return [line for line in text.splitlines() if f'"{label}"' in line]


def test_an_instance_under_two_models_has_one_state_gate_and_breaker() -> None:
    rt = _runtime(_two_models([P0], [P0, P1]))
    a, b = rt.model("a"), rt.model("b")
    assert a.prefill.backends[0] is b.prefill.backends[0]
    assert a.decode.backends[0] is b.decode.backends[0]
    assert len(rt.backends()) == 3  # p0, p1, d0 once each
    short = _runtime(settings_from_mapping({"models": ["x", "y"], **_pools([P0], [D0])}))
    assert short.model("x").prefill.backends[0] is short.model("y").prefill.backends[0]


def test_reload_and_discovery_keep_sharing_and_joiners_already_known_need_no_check() -> None:
    rt = _runtime(_two_models([P0], [P1]))
    p0 = rt.model("a").prefill.backends[0]
    (change,) = rt.routing.apply(_two_models([P0], [P0, P1]))
    assert rt.model("b").prefill.backends[0] is p0
    assert change.added == () and change.removed == ()
    pool_b = rt.model("b").prefill
    change = rt.routing.set_instances(pool_b, [InstanceConfig(url=P1)])
    assert change.removed == ()  # p0 left model b but model a still lists it
    assert rt.model("a").prefill.backends == [p0]


def test_breaker_gauge_follows_the_breaker_wherever_it_changes() -> None:
    settings = settings_from_mapping(
        {"models": ["m"], **_pools([P0], [D0]), "breaker": {"failure_threshold": 1}}
    )
    rt = _runtime(settings)
    p0 = rt.model("m").prefill.backends[0]
    gauge = "disagg_router_backend_breaker_open"
    assert p0.breaker.record_failure("500")
    assert _sample(rt, gauge, role="prefill", backend=P0) == 1
    p0.breaker.begin_probe()
    p0.breaker.probe_passed()  # on trial: still not closed
    assert _sample(rt, gauge, role="prefill", backend=P0) == 1
    p0.breaker.record_success()
    assert _sample(rt, gauge, role="prefill", backend=P0) == 0


def test_breaker_closes_only_on_a_real_leg_and_a_failed_trial_doubles_the_backoff() -> None:
    now = [100.0]
    b = Breaker(BreakerConfig(failure_threshold=1, backoff=1.0, max_backoff=8.0), lambda: now[0])
    b.record_failure("500")
    for backoff in (2.0, 4.0, 8.0, 8.0):
        now[0] += b.backoff
        assert b.probe_due()
        b.begin_probe()
        b.probe_passed()
        assert b.state == "trial" and b.admits and not b.closed and not b.probe_due()
        assert b.record_failure("leg 500")  # the real leg still fails
        assert b.state == "open" and b.backoff == backoff
    now[0] += b.backoff
    b.begin_probe()
    b.probe_passed()
    b.record_success()
    assert b.closed and b.backoff == 1.0


def _record_everything(rt: Runtime, role: str, label: str) -> None:
    m = rt.metrics
    m.child(m.in_flight, role, label).set(1)
    m.child(m.healthy, role, label).set(1)
    m.child(m.admission_queue, role, label).set(0)
    m.child(m.admission_rejected, role, label).inc()
    m.breaker_probes.labels(role, label, "ok").inc()
    m.set_breaker_open(role, label, True)
    if role == "prefill":
        m.child(m.prefill_duration, label, "ok").observe(0.1)
        m.child(m.prefill_duration, label, "error").observe(0.1)
        m.identity_changes.labels(label).inc()
    else:
        m.child(m.decode_first_token, label).observe(0.1)


def test_every_series_of_an_instance_goes_when_it_leaves_every_pool() -> None:
    rt = _runtime(_two_models([P0, P1], [P0]))
    for label in (P0, P1):
        _record_everything(rt, "prefill", label)
    _record_everything(rt, "decode", D0)
    rt.routing.apply(_two_models([P0], [P0]))  # p1 leaves
    assert _series_of(rt, P1) == []
    assert _series_of(rt, P0) and _series_of(rt, D0)
    rt.routing.apply(_two_models([P1], [P0]))  # p0 leaves model a only: still served by b
    assert _series_of(rt, P0)


def test_a_departed_instance_with_legs_in_flight_is_forgotten_when_they_end() -> None:
    rt = _runtime(_two_models([P0, P1], [P1]))
    p1 = rt.model("a").prefill.backends[1]
    _record_everything(rt, "prefill", P1)
    p1.in_flight = 1
    rt.routing.apply(_two_models([P0], [P0]))
    assert _series_of(rt, P1)  # its leg still runs and records
    p1.in_flight = 0
    rt.routing.forget_idle()
    assert _series_of(rt, P1) == []


def test_an_instance_on_trial_takes_one_leg_at_a_time() -> None:
    settings = settings_from_mapping(
        {"models": ["m"], **_pools([P0], [D0]), "breaker": {"failure_threshold": 1}}
    )
    p0 = _runtime(settings).model("m").prefill.backends[0]
    p0.checked = True
    p0.breaker.record_failure("500")
    assert not p0.routable
    p0.breaker.begin_probe()
    p0.breaker.probe_passed()
    assert p0.routable and p0.missing(False) is None
    p0.in_flight = 1  # the trial leg runs: nobody else until it decides
    assert not p0.routable
