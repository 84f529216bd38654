"""The upstream client: httpx's API over aiohttp's connections, keeping no cookies.

Who calls it: :func:`router.runtime.http_client` (the router's one upstream client) and the
legs' calls (:mod:`router.upstream.calls`). httpcore's
pool polls every pooled connection on each request; with the connections a loaded router keeps,
that cost more CPU than everything else the router does (docs/benchmarks/README.md, "Upstream
HTTP client"). ``httpx-aiohttp`` runs httpx requests over aiohttp instead; this subclass makes
its errors the ones httpx's own transport raises for the same failure (the package calls a
refused or dropped connection a connect timeout), so callers see no difference.
:class:`UpstreamClient` keeps no cookies (a public cookie policy that accepts none): a proxy
must not carry one upstream answer's ``Set-Cookie`` into the next request, and parsing them was a
few per cent of a loaded router's CPU. The legs, the router's hot path, go out on the client's
own keep-alive connections (:mod:`router.upstream.h1`, :meth:`UpstreamClient.send_direct`) when
the client runs over :class:`AiohttpTransport`: httpx's request and response objects around each
leg cost about as much CPU as aiohttp itself, and aiohttp's client about as much as the rest of
the router's own work (docs/benchmarks/speed/profile.md). Everything else (health checks,
probes, scrapes, pass-through requests) and every client over another transport (the tests'
mock upstreams) keeps httpx's API.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable
from http.cookiejar import CookieJar, DefaultCookiePolicy
from typing import Protocol

import aiohttp
import httpx
import httpx_aiohttp
from aiohttp.http_exceptions import LineTooLong

from router.upstream.h1 import (
    MAX_ANSWER_HEAD_BYTES,
    AnswerHeadersTooLarge,
    Call,
    ConnectionPool,
    Origin,
)

DEFAULT_CONNECT_S = 5.0
"""Connect timeout of the leg connections when the client's has none."""
DEFAULT_MAX_CONNECTIONS = 4096
"""Open leg connections at most when the client's limits set none."""


def httpx_error(exc: BaseException) -> httpx.TransportError | None:
    """The httpx error httpx's own transport raises for the aiohttp failure ``exc`` (or the one
    under an error the package mapped); ``None`` if ``exc`` is no aiohttp failure."""
    cause = exc.__cause__ if isinstance(exc, httpx.TransportError) else exc
    message = str(cause)
    if isinstance(cause, aiohttp.ClientResponseError) and _line_too_long(cause):
        return AnswerHeadersTooLarge()
    if isinstance(cause, aiohttp.ConnectionTimeoutError):
        return httpx.ConnectTimeout(message)
    if isinstance(cause, aiohttp.ClientConnectorError):
        return httpx.ConnectError(message)
    if isinstance(cause, aiohttp.ServerTimeoutError):
        return httpx.ReadTimeout(message)
    if isinstance(cause, aiohttp.ServerDisconnectedError | aiohttp.ClientPayloadError):
        return httpx.RemoteProtocolError(message)
    if isinstance(cause, aiohttp.ClientError):
        return httpx.ReadError(message)
    return None


def _line_too_long(exc: BaseException) -> bool:
    """Whether aiohttp's parser refused ``exc``'s answer for a header past its bound (aiohttp
    chains its ``LineTooLong`` under the error it raises)."""
    found: BaseException | None = exc
    for _ in range(4):
        if found is None:
            return False
        if isinstance(found, LineTooLong):
            return True
        found = found.__cause__ or found.__context__
    return False


class _Stream(httpx.AsyncByteStream):
    """A response body whose transport errors are :func:`httpx_error`'s."""

    def __init__(self, inner: httpx.AsyncByteStream) -> None:
        self._inner = inner

    async def __aiter__(self) -> AsyncIterator[bytes]:
        try:
            async for chunk in self._inner:
                yield chunk
        except (httpx.TransportError, aiohttp.ClientError) as exc:
            raise (httpx_error(exc) or exc) from exc

    async def aclose(self) -> None:
        try:
            await self._inner.aclose()
        except (httpx.TransportError, aiohttp.ClientError) as exc:
            raise (httpx_error(exc) or exc) from exc


class AiohttpTransport(httpx_aiohttp.AiohttpTransport):
    """``httpx_aiohttp.AiohttpTransport`` raising httpx's own errors (see the module doc), over
    an aiohttp session that keeps no cookies."""

    def get_client(self) -> aiohttp.ClientSession:
        """The session the transport makes on first use (the package's own connector settings:
        keep-alive expiry, TLS context, connection limit) with a cookie jar that keeps nothing
        (a proxy must not carry one answer's ``Set-Cookie`` into the next request) and the
        legs' bound on an answer's headers (:data:`router.upstream.h1.MAX_ANSWER_HEAD_BYTES`,
        here per line: aiohttp bounds lines, not their sum)."""
        if self.client is not None:
            return super().get_client()
        limit = self.limits.max_connections or 0
        connector = aiohttp.TCPConnector(
            keepalive_timeout=self.limits.keepalive_expiry, ssl=self.ssl_context, limit=limit
        )
        return aiohttp.ClientSession(
            connector=connector,
            cookie_jar=aiohttp.DummyCookieJar(),
            max_line_size=MAX_ANSWER_HEAD_BYTES,
            max_field_size=MAX_ANSWER_HEAD_BYTES,
        )

    async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
        try:
            response = await super().handle_async_request(request)
        except (httpx.TransportError, aiohttp.ClientError) as exc:
            raise (httpx_error(exc) or exc) from exc
        assert isinstance(response.stream, httpx.AsyncByteStream)
        response.stream = _Stream(response.stream)
        return response


class LegAnswer(Protocol):
    """An upstream answer whose body the caller reads (once, one way); both methods raise
    httpx's transport errors. Made by :meth:`UpstreamClient.send_direct` or, for any other
    client, over an ``httpx.Response`` (:mod:`router.upstream.calls`)."""

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


LegTarget = tuple[httpx.Headers, Origin | None, bytes]
"""What every direct leg to one instance and path shares: the client's headers it was made
from, the instance's (host, port) and the request head up to the per-leg headers; the origin is
``None`` where legs cannot go direct (an ``https`` instance)."""


def no_cookies() -> CookieJar:
    """A cookie jar whose policy accepts and sends no cookie (neither Netscape nor RFC 2965
    cookies are enabled), so an answer's ``Set-Cookie`` is not even parsed."""
    return CookieJar(policy=DefaultCookiePolicy(netscape=False, rfc2965=False))


class UpstreamClient(httpx.AsyncClient):
    """The router's upstream client: ``httpx.AsyncClient`` over one transport, keeping no cookies.

    Who builds it: :func:`router.runtime.http_client`, with the transport, timeouts and limits.
    It connects to every URL through that transport (no proxies, no mounts, nothing read from
    the environment). Its httpx API (``get``, ``send``, ``stream``) is httpx's, unchanged; a leg
    (:mod:`router.upstream.calls`) goes out through :meth:`send_leg` instead, which hands the
    request straight to the transport's public ``handle_async_request``: a leg needs none of
    httpx's redirect, auth, cookie and event-hook machinery, which was about 6 % of a loaded
    router's CPU (docs/benchmarks/README.md, "Router overhead").
    """

    def __init__(
        self, transport: httpx.AsyncBaseTransport, timeout: httpx.Timeout, limits: httpx.Limits
    ) -> None:
        jar = no_cookies()
        super().__init__(
            transport=transport, timeout=timeout, limits=limits, trust_env=False, cookies=jar
        )
        self._leg_transport = transport
        self._direct = transport if isinstance(transport, AiohttpTransport) else None
        self.leg_targets: dict[tuple[str, str | None, str], LegTarget] = {}
        """(instance URL, API key, path) -> what every direct leg there shares (the client's
        headers it was made from, the origin, the head); kept by :mod:`router.upstream.calls`."""
        self._pool = ConnectionPool(
            connect_timeout=timeout.connect or DEFAULT_CONNECT_S,
            read_timeout=timeout.read,
            keepalive_s=limits.keepalive_expiry or 0.0,
            max_connections=limits.max_connections or DEFAULT_MAX_CONNECTIONS,
        )

    @property
    def direct(self) -> bool:
        """Whether :meth:`send_direct` can be used: the transport is :class:`AiohttpTransport`."""
        return self._direct is not None

    def send_direct(self, origin: Origin, head: bytes, content: bytes) -> Call:
        """POST ``content`` to ``origin`` with the request head ``head`` (request line and every
        header, ``Content-Length`` included, up to the blank line) on the client's own leg
        connections (:mod:`router.upstream.h1`; only when :attr:`direct`): what
        :meth:`send_leg` sends, without httpx's request and response objects. The client's
        connect and read timeouts apply; no redirect is followed, no cookie kept, no encoding
        asked for. Use it as ``async with``: the answer's body is read inside the block; on exit
        the connection goes back to the pool, or is closed if the body was not read to its end.
        Entering raises ``RuntimeError`` once the client is closed, and httpx's transport
        errors."""
        if self._direct is None:
            raise RuntimeError("send_direct needs the client's transport to be AiohttpTransport")
        if self.is_closed:
            raise RuntimeError("Cannot send a request, as the client has been closed.")
        return self._pool.post(origin, head, content)

    def on_stale_retry(self, hook: Callable[[Origin], None]) -> None:
        """Tell ``hook`` each time a leg is sent again after the idle-close race (see
        :mod:`router.upstream.h1`); the runtime counts it. ``hook`` must not raise."""
        self._pool.on_stale_retry = hook

    async def aclose(self) -> None:
        """Close the leg connections, then httpx's client and its transport."""
        await self._pool.close()
        await super().aclose()

    async def send_leg(self, request: httpx.Request, *, stream: bool = False) -> httpx.Response:
        """Send a leg's ``request`` as httpx's ``send`` would for this client: the client's
        timeouts unless the request has its own, the answer's body read unless ``stream``; no
        redirect followed, no cookie read. Raises ``RuntimeError`` once the client is closed,
        and httpx's transport errors."""
        if self.is_closed:
            raise RuntimeError("Cannot send a request, as the client has been closed.")
        request.extensions.setdefault("timeout", self.timeout.as_dict())
        response = await self._leg_transport.handle_async_request(request)
        response.request = request
        if not stream:
            try:
                await response.aread()
            except BaseException:
                await response.aclose()
                raise
        return response


async def send_leg(
    client: httpx.AsyncClient, request: httpx.Request, *, stream: bool = False
) -> httpx.Response:
    """Send a leg through ``client``: :meth:`UpstreamClient.send_leg` for the router's client,
    httpx's own ``send`` for any other (tests hand a plain ``httpx.AsyncClient``)."""
    if isinstance(client, UpstreamClient):
        return await client.send_leg(request, stream=stream)
    return await client.send(request, stream=stream)
