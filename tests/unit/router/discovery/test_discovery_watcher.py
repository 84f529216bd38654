"""PoolDiscovery: changed sets are applied, failures and empty answers keep the last set."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncGenerator

from prometheus_client import CollectorRegistry

from disagg_router.router.config import InstanceConfig
from disagg_router.router.discovery.source import Failed, Found, Update, base_url, found
from disagg_router.router.discovery.watcher import PoolDiscovery
from disagg_router.router.observability.metrics import RouterMetrics


class ScriptedSource:
    """Yields a fixed list of updates, then waits (like a quiet source)."""

    kind = "scripted"

    def __init__(self, updates: list[Update]) -> None:
        self._updates = updates

    async def updates(self) -> AsyncGenerator[Update, None]:
        for update in self._updates:
            yield update
        await asyncio.Event().wait()


def _set(*ports: int) -> Found:
    return found(InstanceConfig(url=f"http://127.0.0.1:{p}") for p in ports)


async def _run(updates: list[Update]) -> tuple[PoolDiscovery, list[list[str]], CollectorRegistry]:
    applied: list[list[str]] = []

    async def apply(instances: tuple[InstanceConfig, ...]) -> None:
        applied.append([i.label for i in instances])

    registry = CollectorRegistry()
    watcher = PoolDiscovery("decode", ScriptedSource(updates), apply, RouterMetrics(registry))
    for update in updates:
        await watcher.handle(update)
    return watcher, applied, registry


async def test_only_changes_are_applied_and_failures_keep_the_last_set() -> None:
    watcher, applied, registry = await _run(
        [_set(2, 1), _set(1, 2), Failed("boom"), _set(), _set(1, 3)]
    )
    assert applied == [
        ["http://127.0.0.1:1", "http://127.0.0.1:2"],
        ["http://127.0.0.1:1", "http://127.0.0.1:3"],
    ]
    assert watcher.status().ok
    labels = {"pool": "decode", "source": "scripted"}
    assert registry.get_sample_value("disagg_router_discovery_failures_total", labels) == 2
    assert registry.get_sample_value("disagg_router_discovery_changes_total", labels) == 2


async def test_failure_is_visible_until_the_next_good_answer() -> None:
    watcher, applied, _ = await _run([_set(1), Failed("resolver timed out")])
    assert len(applied) == 1
    assert watcher.status().as_json() == {
        "source": "scripted",
        "ok": False,
        "instances": ["http://127.0.0.1:1"],
        "error": "resolver timed out",
    }
    assert watcher.synced.is_set()


async def test_nothing_known_yet_is_not_synced() -> None:
    watcher, applied, _ = await _run([Failed("no route"), _set()])
    assert applied == []
    assert not watcher.synced.is_set()
    assert not watcher.status().ok


async def test_run_consumes_a_source_until_cancelled() -> None:
    seen: list[tuple[InstanceConfig, ...]] = []
    done = asyncio.Event()

    async def apply(instances: tuple[InstanceConfig, ...]) -> None:
        seen.append(instances)
        done.set()

    source = ScriptedSource([found([InstanceConfig(url="http://127.0.0.1:9", name="p0")])])
    watcher = PoolDiscovery("prefill", source, apply, RouterMetrics(CollectorRegistry()))
    task = asyncio.create_task(watcher.run())
    await done.wait()
    task.cancel()
    await asyncio.gather(task, return_exceptions=True)
    assert [[i.label for i in s] for s in seen] == [["p0"]]


def test_urls_bracket_ipv6_and_labels_dedupe() -> None:
    assert base_url("http", "::1", 80) == "http://[::1]:80"
    assert base_url("https", "p0.ns", 443) == "https://p0.ns:443"
    twice = [
        InstanceConfig(url="http://127.0.0.1:1", name="pod"),
        InstanceConfig(url="http://[::1]:1", name="pod"),
    ]
    assert [i.url for i in found(twice).instances] == ["http://127.0.0.1:1"]
