"""DiscoveryManager: discovered pools get watchers that feed the pools' membership update; a
reload that changes a pool's discovery restarts its source; joiners are handed to the check."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncGenerator, Sequence
from typing import Any

from disagg_router.router.config import (
    InstanceConfig,
    PoolConfig,
    RouterSettings,
    settings_from_mapping,
)
from disagg_router.router.discovery.manager import DiscoveryManager
from disagg_router.router.discovery.source import Found, Update, found
from disagg_router.router.instances.state import BackendState
from disagg_router.router.runtime import Runtime, http_client
from disagg_router.router.supervisor import Supervisor


def _settings(decode_name: str) -> RouterSettings:
    dns = {"source": "dns", "name": decode_name, "port": 8000}
    return settings_from_mapping(
        {
            "models": ["m"],
            "prefill": {"instances": [{"url": "http://127.0.0.1:1"}]},
            "decode": {"discovery": dns},
        }
    )


class Sources:
    """Scripted sources by DNS name: each yields its sets, then waits."""

    def __init__(self, sets: dict[str, list[Found]]) -> None:
        self.sets = sets
        self.started: list[str] = []

    def make(self, pool: PoolConfig) -> Any:
        name = getattr(pool.discovery, "name")  # noqa: B009 (only dns pools here)
        self.started.append(name)
        sets = self.sets[name]

        class Source:
            kind = "scripted"

            async def updates(self) -> AsyncGenerator[Update, None]:
                for item in sets:
                    yield item
                await asyncio.Event().wait()

        return Source()


def _set(*ports: int) -> Found:
    return found(InstanceConfig(url=f"http://127.0.0.1:{p}") for p in ports)


async def test_sets_feed_the_pool_and_a_changed_source_restarts() -> None:
    joiners: asyncio.Queue[list[str]] = asyncio.Queue()

    async def check(backends: Sequence[BackendState]) -> None:
        await joiners.put([b.label for b in backends])

    async def next_joiners() -> list[str]:
        return await asyncio.wait_for(joiners.get(), 5)

    sources = Sources({"a.test": [_set(2), _set(2, 3)], "b.test": [_set(4)]})
    settings = _settings("a.test")
    async with http_client(settings) as client:
        runtime = Runtime.create(settings, client)
        manager = DiscoveryManager(runtime, check, make=sources.make)
        manager.sync()
        decode = runtime.model("m").decode
        assert await next_joiners() == ["http://127.0.0.1:2"]
        assert await next_joiners() == ["http://127.0.0.1:3"]
        assert [b.label for b in decode.backends] == ["http://127.0.0.1:2", "http://127.0.0.1:3"]
        assert not any(b.healthy for b in decode.backends), "joiners wait for their check"
        manager.sync()  # nothing changed: the watcher keeps running
        assert sources.started == ["a.test"]
        runtime.routing.apply(_settings("b.test"))
        manager.sync()
        assert await next_joiners() == ["http://127.0.0.1:4"]
        assert sources.started == ["a.test", "b.test"]
        assert [b.label for b in decode.backends] == ["http://127.0.0.1:4"]
        status = manager.status()["m"]["decode"]
        assert (status.ok, status.instances) == (True, ("http://127.0.0.1:4",))
        await manager.close()


async def test_a_watcher_that_crashes_is_shown_failing_and_restarted() -> None:
    """A source that raises an unexpected error (as the Kubernetes client may): the pool keeps
    its set, ``status()`` says discovery fails, and the restarted watcher learns the set again."""
    runs: list[int] = []
    crashed = asyncio.Event()
    relearned = asyncio.Event()

    class Crashing:
        kind = "scripted"

        async def updates(self) -> AsyncGenerator[Update, None]:
            runs.append(1)
            yield _set(2)
            if len(runs) == 1:
                crashed.set()
                raise AttributeError("'NoneType' object has no attribute 'get'")
            relearned.set()
            await asyncio.Event().wait()

    async def check(_: Sequence[BackendState]) -> None:
        return None

    settings = _settings("a.test")
    async with http_client(settings) as client:
        runtime = Runtime.create(settings, client)
        manager = DiscoveryManager(runtime, check, make=lambda _: Crashing())
        manager.supervisor = Supervisor(runtime.metrics, backoff=0.05)
        manager.sync()
        await asyncio.wait_for(crashed.wait(), 5)
        status = await _until(lambda: manager.status()["m"]["decode"], lambda s: not s.ok)
        assert status.error is not None and "AttributeError" in status.error
        assert status.instances == ("http://127.0.0.1:2",)  # the last set is kept
        assert manager.supervisor.status()["discovery m/decode"].crashes == 1
        await asyncio.wait_for(relearned.wait(), 5)
        status = await _until(lambda: manager.status()["m"]["decode"], lambda s: s.ok)
        assert [b.label for b in runtime.model("m").decode.backends] == ["http://127.0.0.1:2"]
        await manager.close()
        await manager.supervisor.close()


async def _until(read: Any, done: Any) -> Any:
    """``read()`` once ``done(read())`` holds (yielding to the loop in between; 5 s at most)."""

    async def poll() -> Any:
        while not done(value := read()):
            await asyncio.sleep(0.01)
        return value

    return await asyncio.wait_for(poll(), 5)
