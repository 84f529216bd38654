"""DNS discovery against a real DNS server (dnsmasq on loopback) whose records change."""

from __future__ import annotations

from pathlib import Path

from prometheus_client import CollectorRegistry

from disagg_router.router.config import DnsDiscovery, InstanceConfig
from disagg_router.router.discovery.dns import DnsSource
from disagg_router.router.discovery.source import Failed, Found
from disagg_router.router.discovery.watcher import PoolDiscovery
from disagg_router.router.observability.metrics import RouterMetrics
from tests.integration.discovery.dns_server import DOMAIN, LISTEN, DnsServer

NAME = f"decode.{DOMAIN}"


def _source(server: DnsServer, **extra: object) -> DnsSource:
    cfg = {"source": "dns", "name": NAME, "port": 8000, "nameservers": [LISTEN]}
    cfg |= {"nameserver_port": server.port, "interval": 0.05, "timeout": 1.0, **extra}
    return DnsSource(DnsDiscovery.model_validate(cfg))


def _urls(update: Found | Failed) -> list[str]:
    assert isinstance(update, Found), update
    return [i.url for i in update.instances]


async def test_every_address_record_is_an_instance_and_changes_are_seen(tmp_path: Path) -> None:
    with DnsServer(tmp_path) as server:
        server.set_hosts({NAME: ["127.0.0.3", "127.0.0.2"], f"other.{DOMAIN}": ["127.0.0.9"]})
        source = _source(server)
        first = await source.resolve_once()
        assert _urls(first) == ["http://127.0.0.2:8000", "http://127.0.0.3:8000"]
        assert isinstance(first, Found)
        assert first.labels == ("127.0.0.2:8000", "127.0.0.3:8000")
        server.set_hosts({NAME: ["127.0.0.3", "127.0.0.4", "::1"]})
        assert _urls(await source.resolve_once()) == [
            "http://127.0.0.3:8000",
            "http://127.0.0.4:8000",
            "http://[::1]:8000",
        ]


async def test_srv_records_give_targets_and_ports(tmp_path: Path) -> None:
    srv_name = f"_http._tcp.prefill.{DOMAIN}"
    srv = [(srv_name, f"p0.{DOMAIN}", 8101), (srv_name, f"p1.{DOMAIN}", 8102)]
    with DnsServer(tmp_path, srv=srv) as server:
        server.set_hosts({f"p0.{DOMAIN}": ["127.0.0.2"], f"p1.{DOMAIN}": ["127.0.0.3"]})
        source = _source(server, name=srv_name, port=None, srv=True)
        assert _urls(await source.resolve_once()) == [
            "http://127.0.0.2:8101",
            "http://127.0.0.3:8102",
        ]


async def test_unknown_name_is_an_empty_set_and_a_dead_server_a_failure(tmp_path: Path) -> None:
    with DnsServer(tmp_path) as server:
        source = _source(server)
        assert await source.resolve_once() == Found(())
        server.stop()
        failed = await source.resolve_once()
        assert isinstance(failed, Failed)
        assert NAME in failed.error


async def test_watcher_keeps_the_last_set_through_empty_answers_and_outages(
    tmp_path: Path,
) -> None:
    applied: list[tuple[InstanceConfig, ...]] = []

    async def apply(instances: tuple[InstanceConfig, ...]) -> None:
        applied.append(instances)

    registry = CollectorRegistry()
    with DnsServer(tmp_path) as server:
        source = _source(server)
        watcher = PoolDiscovery("decode", source, apply, RouterMetrics(registry))
        server.set_hosts({NAME: ["127.0.0.2"]})
        await watcher.handle(await source.resolve_once())
        server.set_hosts({})  # the name vanishes: keep serving the last set
        await watcher.handle(await source.resolve_once())
        assert watcher.known == applied[-1]
        assert not watcher.status().ok
        server.stop()  # the resolver fails: keep it too
        await watcher.handle(await source.resolve_once())
        assert [i.url for i in watcher.known] == ["http://127.0.0.2:8000"]
        assert len(applied) == 1
        status = watcher.status()
        assert (status.ok, status.instances, status.source) == (False, ("127.0.0.2:8000",), "dns")
        assert "decode" in (status.error or "")
    labels = {"pool": "decode", "source": "dns"}
    assert registry.get_sample_value("disagg_router_discovery_failures_total", labels) == 2
    assert registry.get_sample_value("disagg_router_discovery_ok", labels) == 0
    assert registry.get_sample_value("disagg_router_discovery_instances", labels) == 1
