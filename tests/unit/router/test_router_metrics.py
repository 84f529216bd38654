"""RouterMetrics: the series child keeps are the registry's, a forgotten backend's go, and the
process's own metrics are there."""

from __future__ import annotations

from prometheus_client import CollectorRegistry

from router.observability.metrics import RouterMetrics


def _sample(registry: CollectorRegistry, name: str, labels: dict[str, str]) -> float | None:
    return registry.get_sample_value(name, labels)


def test_child_records_into_the_registered_series() -> None:
    registry = CollectorRegistry()
    m = RouterMetrics(registry)
    m.child(m.in_flight, "decode", "d0").set(3)
    assert m.child(m.in_flight, "decode", "d0") is m.child(m.in_flight, "decode", "d0")
    m.child(m.in_flight, "decode", "d0").inc()
    labels = {"role": "decode", "backend": "d0"}
    assert _sample(registry, "disagg_router_backend_in_flight", labels) == 4.0


def test_forgotten_backend_gets_a_fresh_exported_series() -> None:
    registry = CollectorRegistry()
    m = RouterMetrics(registry)
    labels = {"role": "prefill", "backend": "p0"}
    m.child(m.in_flight, "prefill", "p0").set(2)
    m.forget_backend("prefill", "p0")
    assert _sample(registry, "disagg_router_backend_in_flight", labels) is None
    # The instance comes back: what is recorded must be exported again, not go to the old series.
    m.child(m.in_flight, "prefill", "p0").set(1)
    assert _sample(registry, "disagg_router_backend_in_flight", labels) == 1.0


def test_metrics_include_the_router_process_own() -> None:
    """CPU, memory and open descriptors of the router process, beside its own series."""
    text = RouterMetrics(CollectorRegistry()).render().decode()
    samples = {line.split(" ")[0] for line in text.splitlines() if not line.startswith("#")}
    assert {"process_cpu_seconds_total", "process_resident_memory_bytes"} <= samples
    assert "process_open_fds" in samples  # Linux: read from /proc
