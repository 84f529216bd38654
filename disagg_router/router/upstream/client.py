"""The router's one upstream client: its connections, timeouts and request heads.

Who builds it: :func:`disagg_router.router.runtime.http_client`, once per runtime; every call to an
instance (:mod:`disagg_router.router.upstream.calls`: legs, health checks, probes, scrapes,
pass-through requests) goes out through it, on its pool of keep-alive connections
(:mod:`disagg_router.router.upstream.h1`). Tests reach the network the way production does: the
instances they configure are real HTTP servers.

It keeps no cookies (a proxy must not carry one answer's ``Set-Cookie`` into the next
request), follows no redirect and asks for no compression. :attr:`UpstreamClient.targets` keeps,
per instance, method and path, what every request there shares (the origin and the head up to
the per-request headers), so a leg writes its head by joining bytes.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from types import TracebackType
from typing import Protocol

from disagg_router.router.upstream.h1 import Call, ConnectionPool, Origin

USER_AGENT = "disagg-router"
"""The ``User-Agent`` of every upstream request."""


class Answer(Protocol):
    """An upstream answer whose body the caller reads (once, one way), inside the block of
    :meth:`UpstreamClient.request`; both methods raise
    :class:`disagg_router.router.upstream.h1.TransportError`."""

    @property
    def status(self) -> int: ...

    @property
    def content_type(self) -> str: ...

    async def read(self) -> bytes:
        """The whole body."""
        ...

    async def read_chunk(self) -> bytes:
        """The body's next bytes as they arrive (never empty), ``b""`` once it has ended."""
        ...

    def splice(self, sink: Callable[[bytes], None] | None) -> bool:
        """Hand the body's next bytes to ``sink`` as they arrive instead of to ``read_chunk``
        (see :meth:`disagg_router.router.upstream.h1._Connection.splice`); False: not taken."""
        ...


@dataclass(frozen=True)
class ClientLimits:
    """How the client waits and how many connections it keeps (see
    :mod:`disagg_router.router.upstream.h1`).

    ``connect_s`` bounds opening a connection (and waiting for room under ``max_connections``);
    ``read_s`` bounds each wait for the answer's next bytes (``None``: unbounded, the caller
    bounds the whole call); an idle connection is kept ``keepalive_s`` at most."""

    connect_s: float
    read_s: float | None
    keepalive_s: float
    max_connections: int


@dataclass(frozen=True)
class Target:
    """What every request to one instance, method and path shares: where it goes, and its
    head up to the per-request headers (request line, ``Host``, ``Accept``, ``User-Agent``,
    ``Content-Type`` for a body, the instance's API key)."""

    origin: Origin
    head: bytes


class UpstreamClient:
    """Keep-alive connections to the instances, one request at a time on each.

    Used on the event loop that made it; closed once, at the runtime's end (``async with``).
    :meth:`request` is the one way out; nothing here decides what a failure means."""

    def __init__(self, limits: ClientLimits) -> None:
        self.targets: dict[tuple[str, str | None, str, str], Target] = {}
        """(instance URL, API key, method, path) -> :class:`Target`; kept by
        :mod:`disagg_router.router.upstream.calls`."""
        self._pool = ConnectionPool(
            connect_timeout=limits.connect_s,
            read_timeout=limits.read_s,
            keepalive_s=limits.keepalive_s,
            max_connections=limits.max_connections,
        )

    @property
    def is_closed(self) -> bool:
        """Whether :meth:`aclose` ran (a request then raises ``RuntimeError``)."""
        return self._pool.closed

    def request(self, origin: Origin, head: bytes, body: bytes = b"") -> Call:
        """Send ``body`` to ``origin`` with the request head ``head`` (request line and every
        header, ``Content-Length`` included where there is a body, up to the blank line). Use it
        as ``async with``: entering writes the request and waits for the answer's head; the body
        is read inside the block; on exit the connection goes back to the pool, or is closed if
        the body was not read to its end. Entering raises ``RuntimeError`` once the client is
        closed, and :class:`disagg_router.router.upstream.h1.TransportError`."""
        return self._pool.request(origin, head, body)

    def on_stale_retry(self, hook: Callable[[Origin], None]) -> None:
        """Tell ``hook`` each time a request is sent again after the idle-close race (see
        :mod:`disagg_router.router.upstream.h1`); the runtime counts it. ``hook`` must not raise."""
        self._pool.on_stale_retry = hook

    async def aclose(self) -> None:
        """Close every connection."""
        await self._pool.close()

    async def __aenter__(self) -> UpstreamClient:
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        await self.aclose()
