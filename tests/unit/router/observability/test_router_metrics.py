"""RouterMetrics: the series child keeps are the registry's, a forgotten backend's go, the
process's own metrics are there, and several processes on one shared directory render as one."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from prometheus_client import CollectorRegistry
from prometheus_client.parser import text_string_to_metric_families

from disagg_router.router.observability.metrics import MULTIPROC_ENV, RouterMetrics

REPO = Path(__file__).parents[4]


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


_WORKER = """
import os, sys
from prometheus_client import CollectorRegistry
from prometheus_client.multiprocess import mark_process_dead
from disagg_router.router.observability.metrics import RouterMetrics

class Instance:
    role, label = "decode", "d0"

m = RouterMetrics(CollectorRegistry())
m.child(m.requests, "push", "completions", "m", "ok").inc(int(sys.argv[1]))
m.child(m.in_flight, "decode", "d0").set(int(sys.argv[2]))
m.child(m.in_flight, "decode", "gone").set(7)
m.forget_backend("decode", "gone")  # shared values cannot go: the scrape leaves them out
m.child(m.healthy, "decode", "d0").set(1)
if len(sys.argv) > 3:
    print(m.render([Instance()]).decode())
    mark_process_dead(int(sys.argv[3]))
    print("----")
    print(m.render([Instance()]).decode())
else:
    print(os.getpid())
"""


def _worker(shared: Path, *args: str) -> str:
    env = {**os.environ, MULTIPROC_ENV: str(shared)}
    env["PYTHONPATH"] = os.pathsep.join([str(REPO), env.get("PYTHONPATH", "")])
    argv = [sys.executable, "-c", _WORKER, *args]
    done = subprocess.run(argv, env=env, capture_output=True, text=True, timeout=60, check=True)
    return done.stdout


def _samples(text: str) -> dict[str, list[tuple[dict[str, str], float]]]:
    out: dict[str, list[tuple[dict[str, str], float]]] = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            out.setdefault(s.name, []).append((s.labels, s.value))
    return out


def test_workers_render_one_router(tmp_path: Path) -> None:
    """Two processes on one shared directory: either one's scrape shows the sum of both
    workers' counters and live gauges, without instances it no longer has, and a worker marked
    dead keeps its counts but not its gauges; ``process_*`` is the scraping process's own."""
    first = _worker(tmp_path, "2", "1").strip()
    before, after = _worker(tmp_path, "3", "2", first).split("----")
    for text, in_flight in ((before, 3.0), (after, 2.0)):
        samples = _samples(text)
        assert [v for _, v in samples["disagg_router_requests_total"]] == [5.0]
        assert samples["disagg_router_backend_in_flight"] == [
            ({"role": "decode", "backend": "d0"}, in_flight)
        ]
        assert samples["disagg_router_backend_healthy"][0][1] == 1.0
        assert len(samples["process_cpu_seconds_total"]) == 1
