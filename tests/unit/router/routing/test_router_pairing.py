"""Pair choice over learned engine shapes: refused pairs are skipped, a 503 names the reason only
when no pair is served, unknown shapes pair with everything; the shape learning and the gauge."""

from __future__ import annotations

import pytest
from prometheus_client import CollectorRegistry

from disagg_router.connector.contract import EngineShape, engine_shape_params
from disagg_router.router.config import InstanceConfig, PoolConfig, RouterSettings
from disagg_router.router.errors import NoBackendAvailable
from disagg_router.router.health.shapes import (
    count_refused,
    learn_shape,
    speaks_shapes,
    unprobed_decodes,
)
from disagg_router.router.instances.state import BackendState
from disagg_router.router.observability.metrics import RouterMetrics
from disagg_router.router.routing.pairing import RefusedPair, choose_pair, refused_pairs
from disagg_router.router.routing.pools import Pool
from disagg_router.router.routing.table import LiveRouting

TP1, TP2, TP3 = (EngineShape(tp, 1, 16) for tp in (1, 2, 3))


def _pool(role: str, shapes: list[EngineShape | None], port: int) -> Pool:
    """A pool of ``len(shapes)`` checked, healthy instances named p0.. / d0.. with those shapes."""
    instances = [
        InstanceConfig(url=f"http://127.0.0.1:{port + i}", name=f"{role[0]}{i}")
        for i in range(len(shapes))
    ]
    pool = Pool(role, PoolConfig(instances=instances, policy="round_robin"), False)  # type: ignore[arg-type]
    for backend, shape in zip(pool.backends, shapes, strict=True):
        backend.shape = shape
        backend.checked = True
    return pool


def test_a_refused_pair_is_skipped_for_a_served_one() -> None:
    prefill, decode = _pool("prefill", [TP2], 8100), _pool("decode", [TP3, TP1], 8200)
    for _ in range(4):
        p, d = choose_pair(prefill, decode)
        assert (p.label, d.label) == ("p0", "d1")  # d0 (TP3) is never paired with TP2
        p.in_flight = d.in_flight = 0


def test_a_p_without_any_served_d_is_skipped() -> None:
    big_blocks = EngineShape(2, 1, 32)  # D has 16-token blocks
    prefill, decode = _pool("prefill", [big_blocks, TP2], 8100), _pool("decode", [TP1], 8200)
    chosen = [choose_pair(prefill, decode)[0].label for _ in range(3)]
    assert chosen == ["p1", "p1", "p1"]


def test_no_served_pair_is_a_503_naming_both_and_counts_nothing() -> None:
    prefill, decode = _pool("prefill", [TP2], 8100), _pool("decode", [TP3], 8200)
    with pytest.raises(NoBackendAvailable) as err:
        choose_pair(prefill, decode)
    assert err.value.status == 503
    assert "prefill p0 / decode d0: P tp_size=2 and D tp_size=3" in err.value.message
    assert prefill.backends[0].in_flight == 0 and decode.backends[0].in_flight == 0


def test_the_only_served_d_excluded_strictly_gives_ps_count_back() -> None:
    prefill, decode = _pool("prefill", [TP2], 8100), _pool("decode", [TP3, TP1], 8200)
    with pytest.raises(NoBackendAvailable):
        choose_pair(prefill, decode, avoid={"d1"}, strict=True)
    assert prefill.backends[0].in_flight == 0


def test_unknown_shapes_pair_with_everything() -> None:
    prefill, decode = _pool("prefill", [None], 8100), _pool("decode", [TP3], 8200)
    assert [b.label for b in choose_pair(prefill, decode)] == ["p0", "d0"]
    assert refused_pairs(prefill.backends, decode.backends) == []


def test_refused_pairs_name_both_and_the_reason() -> None:
    big_blocks = EngineShape(1, 1, 32)
    prefill = _pool("prefill", [TP2, big_blocks], 8100)
    decode = _pool("decode", [TP3, TP1], 8200)
    assert refused_pairs(prefill.backends, decode.backends) == [
        RefusedPair("p0", "d0", "P tp_size=2 and D tp_size=3: neither divides the other"),
        RefusedPair("p1", "d0", "P block_size=32 and D block_size=16 differ"),
        RefusedPair("p1", "d1", "P block_size=32 and D block_size=16 differ"),
    ]


def _backend(role: str = "decode") -> BackendState:
    return BackendState(InstanceConfig(url="http://127.0.0.1:8200", name="x"), role=role)  # type: ignore[arg-type]


def test_learn_shape_records_changes_and_logs_a_missing_shape_once(
    caplog: pytest.LogCaptureFixture,
) -> None:
    backend = _backend()
    caplog.set_level("INFO", logger="disagg_router.router.health.shapes")
    assert learn_shape(backend, engine_shape_params(TP2)) is True
    assert backend.shape == TP2
    assert learn_shape(backend, engine_shape_params(TP2)) is False
    assert learn_shape(backend, {"tp_size": 2}) is True  # vLLM's NIXL answer: no shape
    assert learn_shape(backend, None) is False
    assert backend.shape is None
    assert sum("without an engine shape" in r.message for r in caplog.records) == 1
    with pytest.raises(ValueError, match="block_size"):
        learn_shape(backend, {"block_size": "big"})


def _settings(p: int, d: int) -> RouterSettings:
    def pool(port: int, n: int, role: str) -> dict[str, object]:
        urls = [{"url": f"http://127.0.0.1:{port + i}", "name": f"{role}{i}"} for i in range(n)]
        return {"instances": urls}

    return RouterSettings.model_validate(
        {"models": ["m"], "prefill": pool(8100, p, "p"), "decode": pool(8200, d, "d")}
    )


def test_decodes_are_probed_only_once_a_paired_p_speaks_shapes() -> None:
    table = LiveRouting(_settings(1, 2)).table
    found = table.models["m"]
    d0, d1 = found.decode.backends
    assert not speaks_shapes(table, d0)
    found.prefill.backends[0].shape = TP1
    assert speaks_shapes(table, d0)
    d1.identity_learned_at = 1.0
    assert unprobed_decodes(table, found.prefill.backends[0]) == [d0]


def test_the_gauge_counts_refused_pairs_per_model_and_forgets_gone_models() -> None:
    registry = CollectorRegistry()
    metrics = RouterMetrics(registry)
    table = LiveRouting(_settings(2, 2)).table
    found = table.models["m"]
    found.prefill.backends[0].shape = TP2
    found.decode.backends[0].shape, found.decode.backends[1].shape = TP3, TP1
    metrics.refused_pairs.labels("gone").set(3)  # a model an earlier config served
    shown = count_refused(table, metrics.refused_pairs, {"gone"})
    assert shown == {"m"}
    assert registry.get_sample_value("disagg_router_refused_pairs", {"model": "m"}) == 1
    assert registry.get_sample_value("disagg_router_refused_pairs", {"model": "gone"}) is None
