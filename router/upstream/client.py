"""The upstream client: httpx's API over aiohttp's connections, keeping no cookies.

Who calls it: :func:`router.runtime.http_client` (the router's one upstream client). httpcore's
pool polls every pooled connection on each request; with the connections a loaded router keeps,
that cost more CPU than everything else the router does (docs/benchmarks/README.md, "Upstream
HTTP client"). ``httpx-aiohttp`` runs httpx requests over aiohttp instead; this subclass makes
its errors the ones httpx's own transport raises for the same failure (the package calls a
refused or dropped connection a connect timeout), so callers see no difference.
:class:`UpstreamClient` keeps no cookies (a public cookie policy that accepts none): a proxy
must not carry one upstream answer's ``Set-Cookie`` into the next request, and parsing them was a
few per cent of a loaded router's CPU.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from http.cookiejar import CookieJar, DefaultCookiePolicy

import aiohttp
import httpx
import httpx_aiohttp


def httpx_error(exc: BaseException) -> httpx.TransportError | None:
    """The httpx error httpx's own transport raises for the aiohttp failure ``exc`` (or the one
    under an error the package mapped); ``None`` if ``exc`` is no aiohttp failure."""
    cause = exc.__cause__ if isinstance(exc, httpx.TransportError) else exc
    message = str(cause)
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
    """``httpx_aiohttp.AiohttpTransport`` raising httpx's own errors (see the module doc)."""

    async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
        try:
            response = await super().handle_async_request(request)
        except (httpx.TransportError, aiohttp.ClientError) as exc:
            raise (httpx_error(exc) or exc) from exc
        assert isinstance(response.stream, httpx.AsyncByteStream)
        response.stream = _Stream(response.stream)
        return response


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
