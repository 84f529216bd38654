"""The sliding minutes of every router replica, kept in one Redis.

Who calls it: the tenant limiter (:mod:`disagg_router.router.tenants.limiter`) builds one
:class:`SharedWindows` per ``tenancy.store``, calls :meth:`SharedWindows.take` for each count and
correction, and :meth:`SharedWindows.close` when the store is replaced or the app ends.

Contract: :meth:`SharedWindows.take` does what
:meth:`disagg_router.router.tenants.window.Window.take` does, atomically, in one Lua script on
the hash ``{prefix}:{key}``, whose fields are whole seconds and values counts: one EVALSHA round
trip (the first call on a server that lacks the script loads it: two more). The clock is Redis's
own ``TIME``, so every replica counts in the same seconds. The hash expires ``WINDOW_S + 1``
seconds after its last take. Every call is bounded by ``store.timeout`` (per socket operation,
and twice that in all) and never retried inside redis-py; a call that gets no answer raises
:class:`StoreUnavailable`, and the caller falls back to its local limits. Needs Redis >= 5
(scripts replicated by their effects).
"""

from __future__ import annotations

import asyncio

import redis.asyncio
import redis.exceptions

from disagg_router.router.config.tenants import StoreConfig
from disagg_router.router.tenants.window import WINDOW_S, Usage

# KEYS[1]: the hash. ARGV: limit, amount, force ("1" or "0"), expiry seconds, window seconds.
# Returns {allowed (1 or 0), now ("seconds.micros"), second, amount, second, amount, ...}.
_TAKE = """
local time = redis.call('TIME')
local second = tonumber(time[1])
local now = time[1] .. '.' .. string.format('%06d', tonumber(time[2]))
local limit, amount = tonumber(ARGV[1]), tonumber(ARGV[2])
local start = second - tonumber(ARGV[5])
local fields = redis.call('HGETALL', KEYS[1])
local counts, used = {}, 0
for i = 1, #fields, 2 do
    local s = tonumber(fields[i])
    if s <= start then
        redis.call('HDEL', KEYS[1], fields[i])
    else
        counts[s] = tonumber(fields[i + 1])
        used = used + counts[s]
    end
end
local allowed = 0
if used + math.min(amount, limit) <= limit or ARGV[3] == '1' then
    counts[second] = redis.call('HINCRBY', KEYS[1], time[1], amount)
    allowed = 1
end
redis.call('EXPIRE', KEYS[1], ARGV[4])
local reply = {allowed, now}
for s, a in pairs(counts) do
    reply[#reply + 1] = s
    reply[#reply + 1] = a
end
return reply
"""

_FAILURES = (redis.exceptions.RedisError, OSError, TimeoutError)


class StoreUnavailable(Exception):
    """The store could not answer (refused, timed out, a Redis error); the message says why."""


class SharedWindows:
    """Per-second counts in Redis, one hash per tenant and limit, shared by every replica."""

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

    async def take(self, key: str, limit: int, amount: int, force: bool) -> tuple[bool, Usage]:
        """Count ``amount`` under ``{prefix}:{key}`` if it fits ``limit`` (or always when
        ``force``); whether it was counted and the usage after, at the store's clock."""
        args = [limit, amount, "1" if force else "0", WINDOW_S + 1, WINDOW_S]
        try:
            async with asyncio.timeout(self._config.timeout * 2):
                reply = await self._script(keys=[f"{self._config.prefix}:{key}"], args=args)
        except _FAILURES as exc:
            raise StoreUnavailable(_reason(exc)) from exc
        return _parse(reply, limit)

    async def close(self) -> None:
        """Close the client and its connections."""
        await self._client.aclose()


def _reason(exc: BaseException) -> str:
    return f"{type(exc).__name__}: {exc}" if str(exc) else type(exc).__name__


def _parse(reply: object, limit: int) -> tuple[bool, Usage]:
    """The script's reply as (allowed, usage); a reply of another shape is an unavailable store."""
    if not isinstance(reply, list) or len(reply) < 2 or len(reply) % 2:
        raise StoreUnavailable(f"unexpected reply from the store: {reply!r}")
    allowed, now, *flat = reply
    try:
        slots = sorted(zip((int(s) for s in flat[::2]), (int(a) for a in flat[1::2]), strict=True))
        return allowed == 1, Usage(limit, float(now), tuple(slots))
    except (TypeError, ValueError) as exc:
        raise StoreUnavailable(f"unexpected reply from the store: {reply!r}") from exc
