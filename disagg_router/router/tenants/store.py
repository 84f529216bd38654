"""The limits' buckets of every router replica, kept in one Redis.

Who calls it: the tenant limiter (:mod:`disagg_router.router.tenants.limiter`) builds one
:class:`SharedBuckets` per ``tenancy.store``, calls :meth:`SharedBuckets.take` for each count and
correction, and :meth:`SharedBuckets.close` when the store is replaced or the app ends.

Contract: :meth:`SharedBuckets.take` does what :func:`disagg_router.router.tenants.bucket.take`
does, atomically, in one Lua script on the key ``{prefix}:{key}``, whose value is what the bucket
owes and since when: one EVALSHA round trip (the first call on a server that lacks the script loads
it: two more). The clock is Redis's own ``TIME``, so every replica counts on one clock. The key
expires once the bucket is full again. Every call is bounded by ``store.timeout`` (per socket
operation, and twice that in all) and never retried inside redis-py; a call that gets no answer
raises :class:`StoreUnavailable` and the caller falls back to its local limits (a timed-out take
may still have been counted). Needs Redis >= 5 (scripts replicated by their effects).
"""

from __future__ import annotations

import asyncio

import redis.asyncio
import redis.exceptions

from disagg_router.router.config.tenants import StoreConfig
from disagg_router.router.tenants.bucket import EPSILON, Rate, Usage

# KEYS[1]: the bucket ("owed since": units owed as of a time). ARGV: interval (seconds a unit
# takes to come back), capacity (units), amount, force ("1" or "0"), epsilon.
# Returns {counted (1 or 0), owed after ("units", >= 0)}.
_TAKE = """
local time = redis.call('TIME')
local now = tonumber(time[1]) + tonumber(time[2]) / 1000000
local interval, capacity = tonumber(ARGV[1]), tonumber(ARGV[2])
local amount = tonumber(ARGV[3])
local owed = 0
local state = redis.call('GET', KEYS[1])
if state then
    local was, since = string.match(state, '^(%S+) (%S+)$')
    owed = math.max(tonumber(was) - math.max(now - tonumber(since), 0) / interval, 0)
end
local counted = 0
if ARGV[4] == '1' or owed <= capacity - math.min(amount, capacity) + tonumber(ARGV[5]) then
    counted = 1
    owed = math.max(owed + amount, 0)
end
if owed > 0 then
    local ms = math.ceil(owed * interval * 1000) + 1000
    redis.call('SET', KEYS[1], string.format('%.9f %.6f', owed, now), 'PX', ms)
else
    redis.call('DEL', KEYS[1])
end
return {counted, string.format('%.9f', owed)}
"""

_FAILURES = (redis.exceptions.RedisError, OSError, TimeoutError)


class StoreUnavailable(Exception):
    """The store could not answer (refused, timed out, a Redis error); the message says why."""


class SharedBuckets:
    """The buckets in Redis, one key per tenant and limit, shared by every replica."""

    def __init__(self, config: StoreConfig) -> None:
        self._config = config
        # No retries inside redis-py: retry=None with retry_on_timeout=False gives each
        # connection a Retry of zero attempts, so one call is one try within the timeouts.
        self._client = redis.asyncio.Redis.from_url(
            config.url,
            socket_timeout=config.timeout,
            socket_connect_timeout=config.timeout,
            retry_on_timeout=False,
            retry=None,
        )
        self._script = self._client.register_script(_TAKE)

    async def take(self, key: str, rate: Rate, amount: int, force: bool) -> tuple[bool, Usage]:
        """Count ``amount`` under ``{prefix}:{key}`` if it fits ``rate`` (or always when
        ``force``); whether it was counted and the usage after, at the store's clock."""
        args = [repr(rate.interval), repr(rate.capacity), amount, "1" if force else "0"]
        args.append(repr(EPSILON))
        try:
            async with asyncio.timeout(self._config.timeout * 2):
                reply = await self._script(keys=[f"{self._config.prefix}:{key}"], args=args)
        except _FAILURES as exc:
            raise StoreUnavailable(_reason(exc)) from exc
        return _parse(reply, rate)

    async def close(self) -> None:
        """Close the client and its connections."""
        await self._client.aclose()


def _reason(exc: BaseException) -> str:
    return f"{type(exc).__name__}: {exc}" if str(exc) else type(exc).__name__


def _parse(reply: object, rate: Rate) -> tuple[bool, Usage]:
    """The script's reply as (counted, usage); a reply of another shape is an unavailable
    store."""
    if not isinstance(reply, list) or len(reply) != 2:
        raise StoreUnavailable(f"unexpected reply from the store: {reply!r}")
    counted, owed = reply
    try:
        return counted == 1, Usage(rate, max(float(owed), 0.0))
    except (TypeError, ValueError) as exc:
        raise StoreUnavailable(f"unexpected reply from the store: {reply!r}") from exc
