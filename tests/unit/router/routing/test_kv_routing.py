"""KvRouting follows the routing table: streams for the instances in force (discovery, reload),
none for those gone (their blocks forgotten), a model whose kv_events changed starts over, and a
failed stream task is counted and restarted, degraded in /ready and the gauge alike."""

from __future__ import annotations

import asyncio
from typing import Any

import zmq.asyncio
from prometheus_client import CollectorRegistry

from disagg_router.router.config import InstanceConfig, settings_from_mapping
from disagg_router.router.health.readiness import readiness
from disagg_router.router.observability.metrics import RouterMetrics
from disagg_router.router.routing.kv_routing import KvRouting, stream_target
from disagg_router.router.runtime import Runtime, http_client


def _settings(prefills: list[str], **kv: Any) -> Any:
    return settings_from_mapping(
        {
            "models": ["tiny"],
            "prefill": {
                "policy": "kv_aware",
                "instances": [
                    {"url": f"http://127.0.0.1:{8100 + i}", "name": n}
                    for i, n in enumerate(prefills)
                ],
            },
            "decode": {"instances": [{"url": "http://127.0.0.1:8200", "name": "d0"}]},
            "kv_events": {"enabled": True, "tokenizer": "/nonexistent", "probe_timeout": 0.2, **kv},
        }
    )


async def test_streams_follow_reloads_and_a_changed_config_starts_over() -> None:
    registry = CollectorRegistry()
    settings = _settings(["p0", "p1"])
    async with http_client(settings) as client:
        runtime = Runtime.create(settings, client, RouterMetrics(registry))
        kv = KvRouting()
        ctx = zmq.asyncio.Context()
        try:
            kv.reconcile(runtime.routing, runtime.metrics.kv, ctx)
            model = kv.models["tiny"]
            assert set(model.streams) == {"p0", "p1", "d0"}
            model.index.apply("p1", [])  # p1 known to the index
            runtime.routing.apply(_settings(["p0"]))  # p1 leaves (reload or discovery)
            kv.reconcile(runtime.routing, runtime.metrics.kv, ctx)
            assert set(model.streams) == {"p0", "d0"} and "p1" not in model.index.labels()
            runtime.routing.apply(_settings(["p0"], topic="other"))
            kv.reconcile(runtime.routing, runtime.metrics.kv, ctx)
            assert kv.models["tiny"] is not model and kv.models["tiny"].config.topic == "other"
            runtime.routing.apply(_settings(["p0"], enabled=False, tokenizer=None))
            kv.reconcile(runtime.routing, runtime.metrics.kv, ctx)
            assert kv.models == {} and kv.request("tiny", {}, False) is None
        finally:
            tasks = [t for m in kv.models.values() for t in m.tasks.values()]
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
            ctx.destroy(linger=0)


async def test_a_failed_stream_task_is_counted_and_restarted() -> None:
    registry = CollectorRegistry()
    settings = _settings(["p0"])
    async with http_client(settings) as client:
        runtime = Runtime.create(settings, client, RouterMetrics(registry))
        kv = runtime.kv  # the one /ready reads
        ctx = zmq.asyncio.Context()
        try:
            kv.reconcile(runtime.routing, runtime.metrics.kv, ctx)
            model = kv.models["tiny"]
            first = model.tasks["p0"]

            async def broken() -> None:
                raise RuntimeError("subscriber broke")

            failed = asyncio.ensure_future(broken())
            await asyncio.gather(failed, return_exceptions=True)
            model.tasks["p0"] = failed
            first.cancel()
            kv.reconcile(runtime.routing, runtime.metrics.kv, ctx)
            assert model.tasks["p0"] is not failed and not model.tasks["p0"].done()
            labels = {"model": "tiny", "instance": "p0"}
            assert registry.get_sample_value("disagg_router_kv_stream_failures_total", labels) == 1
            # the new stream starts degraded; /ready's list and the gauge say so from that state
            assert model.streams["p0"].state == "degraded"
            listed = readiness(runtime, {}, {}).body["degraded"]
            assert isinstance(listed, list)
            assert [e for e in listed if "kv events tiny/p0" in e and "subscriber broke" in e]
            assert registry.get_sample_value("disagg_router_kv_stream_degraded", labels) == 1
        finally:
            for task in model.tasks.values():
                task.cancel()
            await asyncio.gather(*model.tasks.values(), return_exceptions=True)
            ctx.destroy(linger=0)


def test_endpoints_default_to_the_instance_host_and_the_ports() -> None:
    config = _settings(["p0"]).kv_events
    target = stream_target("tiny", InstanceConfig(url="http://[::1]:8100", name="p0"), config)
    assert (target.endpoint, target.replay_endpoint) == ("tcp://[::1]:5557", "tcp://[::1]:5558")
    given = InstanceConfig(
        url="http://h:1", kv_events_endpoint="ipc:///x", kv_replay_endpoint="tcp://h:9"
    )
    target = stream_target("tiny", given, config)
    assert (target.endpoint, target.replay_endpoint) == ("ipc:///x", "tcp://h:9")
