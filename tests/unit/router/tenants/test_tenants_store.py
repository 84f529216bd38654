"""The shared store of the tenants' sliding minutes, against a real redis-server."""

from __future__ import annotations

import asyncio
import inspect
from collections.abc import AsyncIterator, Awaitable, Iterator
from pathlib import Path
from typing import TypeVar, cast

import pytest
import redis.asyncio

from disagg_router.router.config.tenants import StoreConfig
from disagg_router.router.tenants.store import SharedWindows, StoreUnavailable
from disagg_router.router.tenants.window import WINDOW_S, Window
from tests.support.redis_server import RedisServer, running_redis

# Generous: a loaded 2-core machine; only a failing call waits this long.
TIMEOUT_S = 1.0
BOUND_S = 30.0
KEY = "disagg-router:acme:tokens"

T = TypeVar("T")


@pytest.fixture
def redis_server(tmp_path: Path) -> Iterator[RedisServer]:
    with running_redis(tmp_path) as server:
        yield server


def _store(url: str, prefix: str = "disagg-router") -> SharedWindows:
    return SharedWindows(StoreConfig(url=url, timeout=TIMEOUT_S, prefix=prefix))


@pytest.fixture
async def store(redis_server: RedisServer) -> AsyncIterator[SharedWindows]:
    shared = _store(redis_server.url)
    yield shared
    await shared.close()


@pytest.fixture
async def client(redis_server: RedisServer) -> AsyncIterator[redis.asyncio.Redis]:
    direct = redis.asyncio.Redis.from_url(redis_server.url, socket_timeout=TIMEOUT_S)
    yield direct
    await direct.aclose()


async def _read(reply: Awaitable[T] | T) -> T:
    """A command's reply: redis-py types each command as awaitable or not; asyncio's are."""
    assert inspect.isawaitable(reply)
    return cast(T, await reply)


async def test_a_take_within_the_limit_is_counted(store: SharedWindows) -> None:
    allowed, usage = await store.take("acme:tokens", 10, 3, False)
    assert allowed and usage.used == 3 and usage.remaining == 7 and usage.limit == 10
    allowed, usage = await store.take("acme:tokens", 10, 2, False)
    assert allowed and usage.used == 5 and usage.remaining == 5


async def test_a_take_over_the_limit_is_refused_and_not_counted(store: SharedWindows) -> None:
    await store.take("acme:tokens", 10, 8, False)
    allowed, usage = await store.take("acme:tokens", 10, 3, False)
    assert not allowed and usage.used == 8
    assert usage.wait_for(3) > 0
    allowed, usage = await store.take("acme:tokens", 10, 2, False)
    assert allowed and usage.used == 10


async def test_forced_amounts_count_beyond_the_limit_and_correct_down(
    store: SharedWindows,
) -> None:
    await store.take("acme:tokens", 10, 10, False)
    allowed, usage = await store.take("acme:tokens", 10, 5, True)
    assert allowed and usage.used == 15 and usage.remaining == 0
    allowed, usage = await store.take("acme:tokens", 10, -7, True)
    assert allowed and usage.used == 8


async def test_two_replicas_share_one_count(redis_server: RedisServer) -> None:
    first, second = _store(redis_server.url), _store(redis_server.url)
    try:
        assert (await first.take("acme:requests", 10, 6, False))[0]
        allowed, usage = await second.take("acme:requests", 10, 4, False)
        assert allowed and usage.used == 10
        allowed, usage = await first.take("acme:requests", 10, 1, False)
        assert not allowed and usage.used == 10
    finally:
        await first.close()
        await second.close()


async def test_keys_and_prefixes_are_independent(redis_server: RedisServer) -> None:
    one, other = _store(redis_server.url), _store(redis_server.url, prefix="other")
    try:
        await one.take("acme:tokens", 10, 10, False)
        allowed, usage = await one.take("globex:tokens", 10, 4, False)
        assert allowed and usage.used == 4
        allowed, usage = await other.take("acme:tokens", 10, 10, False)
        assert allowed and usage.used == 10
    finally:
        await one.close()
        await other.close()


async def test_the_hash_counts_whole_seconds_of_the_store_clock_and_expires(
    store: SharedWindows, client: redis.asyncio.Redis
) -> None:
    _, usage = await store.take("acme:tokens", 10, 3, False)
    ((second, amount),) = usage.slots
    assert second == int(usage.now) and amount == 3
    assert await _read(client.hgetall(KEY)) == {str(second).encode(): b"3"}
    ttl = await _read(client.ttl(KEY))
    assert 0 < ttl <= WINDOW_S + 1


async def test_counts_older_than_the_window_are_dropped(
    store: SharedWindows, client: redis.asyncio.Redis
) -> None:
    now, _ = await client.time()
    old, inside = now - WINDOW_S - 5, now - WINDOW_S + 30
    await _read(client.hset(KEY, mapping={old: 9, inside: 4}))
    allowed, usage = await store.take("acme:tokens", 10, 6, False)
    assert allowed and usage.used == 10 and usage.slots[0] == (inside, 4)
    assert str(old).encode() not in await _read(client.hgetall(KEY))


async def test_a_stopped_server_makes_take_raise(
    redis_server: RedisServer, store: SharedWindows
) -> None:
    assert (await store.take("acme:tokens", 10, 1, False))[0]
    redis_server.stop()
    async with asyncio.timeout(BOUND_S):
        with pytest.raises(StoreUnavailable):
            await store.take("acme:tokens", 10, 1, False)
        with pytest.raises(StoreUnavailable):  # and again: no connection left to reuse
            await store.take("acme:tokens", 10, 1, False)


async def test_a_server_that_does_not_answer_makes_take_raise(redis_server: RedisServer) -> None:
    impatient = SharedWindows(StoreConfig(url=redis_server.url, timeout=0.2))
    try:
        assert (await impatient.take("acme:tokens", 10, 1, False))[0]
        with redis_server.paused():
            async with asyncio.timeout(BOUND_S):
                with pytest.raises(StoreUnavailable):
                    await impatient.take("acme:tokens", 10, 1, False)
        # It answers again once the server does (the timed-out take may have been counted).
        allowed, usage = await impatient.take("acme:tokens", 10, 1, False)
        assert allowed and usage.used in (2, 3)
    finally:
        await impatient.close()


async def test_a_socket_that_does_not_exist_makes_take_raise(tmp_path: Path) -> None:
    absent = _store(f"unix://{tmp_path}/absent.sock")
    try:
        async with asyncio.timeout(BOUND_S):
            with pytest.raises(StoreUnavailable, match=r"absent\.sock"):
                await absent.take("acme:tokens", 10, 1, False)
    finally:
        await absent.close()


async def test_the_store_takes_as_the_in_memory_window_does(store: SharedWindows) -> None:
    window = Window(limit=10)
    steps = [(12, False), (1, False), (-5, True), (3, False), (4, False), (0, False)]
    steps += [(2, False), (9, True), (-20, True), (10, False), (11, False)]
    for amount, force in steps:
        allowed, usage = await store.take("acme:tokens", 10, amount, force)
        local_allowed, local = window.take(amount, usage.now, force)
        assert (allowed, usage.used, usage.slots) == (local_allowed, local.used, local.slots)
