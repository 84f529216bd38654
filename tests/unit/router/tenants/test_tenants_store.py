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
from disagg_router.router.tenants.bucket import Bucket, Rate
from disagg_router.router.tenants.store import SharedBuckets, StoreUnavailable
from tests.support.redis_server import RedisServer, running_redis

# Generous: a loaded 2-core machine; only a failing call waits this long.
TIMEOUT_S = 1.0
BOUND_S = 30.0
KEY = "disagg-router:acme:tokens"

T = TypeVar("T")


@pytest.fixture
def redis_server() -> Iterator[RedisServer]:
    with running_redis() as server:
        yield server


def _store(url: str, prefix: str = "disagg-router") -> SharedBuckets:
    return SharedBuckets(StoreConfig(url=url, timeout=TIMEOUT_S, prefix=prefix))


@pytest.fixture
async def store(redis_server: RedisServer) -> AsyncIterator[SharedBuckets]:
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


# 10 per minute, the whole minute's worth at once: a unit comes back every 6 s, so the few
# milliseconds a test takes change no whole count.
RATE = Rate(limit=10, burst_s=60.0)


async def test_a_take_within_the_limit_is_counted(store: SharedBuckets) -> None:
    counted, usage = await store.take("acme:tokens", RATE, 3, False)
    assert counted and usage.remaining == 7 and usage.limit == 10
    counted, usage = await store.take("acme:tokens", RATE, 2, False)
    assert counted and usage.remaining == 5
    assert usage.reset_s == pytest.approx(30.0, abs=1.0)


async def test_a_take_over_the_limit_is_refused_and_not_counted(store: SharedBuckets) -> None:
    await store.take("acme:tokens", RATE, 8, False)
    counted, usage = await store.take("acme:tokens", RATE, 3, False)
    assert not counted and usage.remaining == 2
    assert usage.wait_for(3) == pytest.approx(6.0, abs=1.0)
    counted, usage = await store.take("acme:tokens", RATE, 2, False)
    assert counted and usage.remaining == 0


async def test_forced_amounts_count_beyond_the_limit_and_correct_down(
    store: SharedBuckets,
) -> None:
    await store.take("acme:tokens", RATE, 10, False)
    counted, usage = await store.take("acme:tokens", RATE, 5, True)
    assert counted and usage.remaining == 0 and usage.reset_s == pytest.approx(90.0, abs=1.0)
    counted, usage = await store.take("acme:tokens", RATE, -7, True)
    assert counted and usage.remaining == 2


async def test_two_replicas_share_one_bucket(redis_server: RedisServer) -> None:
    first, second = _store(redis_server.url), _store(redis_server.url)
    try:
        assert (await first.take("acme:requests", RATE, 6, False))[0]
        counted, usage = await second.take("acme:requests", RATE, 4, False)
        assert counted and usage.remaining == 0
        counted, _ = await first.take("acme:requests", RATE, 1, False)
        assert not counted
    finally:
        await first.close()
        await second.close()


async def test_keys_and_prefixes_are_independent(redis_server: RedisServer) -> None:
    one, other = _store(redis_server.url), _store(redis_server.url, prefix="other")
    try:
        await one.take("acme:tokens", RATE, 10, False)
        counted, usage = await one.take("globex:tokens", RATE, 4, False)
        assert counted and usage.remaining == 6
        counted, usage = await other.take("acme:tokens", RATE, 10, False)
        assert counted and usage.remaining == 0
    finally:
        await one.close()
        await other.close()


async def test_the_key_holds_what_is_owed_on_the_store_clock_and_expires_when_full(
    store: SharedBuckets, client: redis.asyncio.Redis
) -> None:
    _, usage = await store.take("acme:tokens", RATE, 3, False)
    seconds, micros = await client.time()
    owed, since = (await _read(client.get(KEY))).split()
    assert float(owed) == pytest.approx(3.0, abs=0.2)
    assert float(since) == pytest.approx(seconds + micros / 1e6, abs=1.0)
    ttl_ms = await _read(client.pttl(KEY))
    assert 0 < ttl_ms <= 1000 * (usage.reset_s + 1) + 1


async def test_a_full_bucket_leaves_no_key(
    store: SharedBuckets, client: redis.asyncio.Redis
) -> None:
    await store.take("acme:tokens", RATE, 2, False)
    counted, usage = await store.take("acme:tokens", RATE, -2, True)
    assert counted and usage.reset_s == 0.0 and usage.remaining == 10
    assert await _read(client.exists(KEY)) == 0


async def test_a_stopped_server_makes_take_raise(
    redis_server: RedisServer, store: SharedBuckets
) -> None:
    assert (await store.take("acme:tokens", RATE, 1, False))[0]
    redis_server.stop()
    async with asyncio.timeout(BOUND_S):
        with pytest.raises(StoreUnavailable):
            await store.take("acme:tokens", RATE, 1, False)
        with pytest.raises(StoreUnavailable):  # and again: no connection left to reuse
            await store.take("acme:tokens", RATE, 1, False)


async def test_a_server_that_does_not_answer_makes_take_raise(redis_server: RedisServer) -> None:
    impatient = SharedBuckets(StoreConfig(url=redis_server.url, timeout=0.2))
    try:
        assert (await impatient.take("acme:tokens", RATE, 1, False))[0]
        with redis_server.paused():
            async with asyncio.timeout(BOUND_S):
                with pytest.raises(StoreUnavailable):
                    await impatient.take("acme:tokens", RATE, 1, False)
        # It answers again once the server does (the timed-out take may have been counted).
        counted, usage = await impatient.take("acme:tokens", RATE, 1, False)
        assert counted and usage.remaining in (7, 8)
    finally:
        await impatient.close()


async def test_a_socket_that_does_not_exist_makes_take_raise(tmp_path: Path) -> None:
    absent = _store(f"unix://{tmp_path}/absent.sock")
    try:
        async with asyncio.timeout(BOUND_S):
            with pytest.raises(StoreUnavailable, match=r"absent\.sock"):
                await absent.take("acme:tokens", RATE, 1, False)
    finally:
        await absent.close()


async def test_the_store_takes_as_the_in_memory_bucket_does(store: SharedBuckets) -> None:
    bucket, now = Bucket(), 1000.0  # the local clock stands still; the store's moves by ms
    steps = [(12, False), (1, False), (-5, True), (3, False), (4, False), (0, False)]
    steps += [(2, False), (9, True), (-20, True), (10, False), (11, False)]
    for amount, force in steps:
        counted, usage = await store.take("acme:tokens", RATE, amount, force)
        local_counted, local = bucket.take(RATE, amount, now, force)
        assert counted == local_counted
        assert usage.reset_s == pytest.approx(local.reset_s, abs=1.0)
