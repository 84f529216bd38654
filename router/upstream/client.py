"""The upstream client: httpx's API over aiohttp's connections, keeping no cookies.

Who calls it: :func:`router.runtime.http_client` (the router's one upstream client). httpcore's
pool polls every pooled connection on each request; with the connections a loaded router keeps,
that cost more CPU than everything else the router does (docs/benchmarks/README.md, "Upstream
HTTP client"). ``httpx-aiohttp`` runs httpx requests over aiohttp instead; this subclass makes
its errors the ones httpx's own transport raises for the same failure (the package calls a
refused or dropped connection a connect timeout), so callers see no difference.
:class:`UpstreamClient` keeps no cookies: a proxy must not carry one upstream answer's
``Set-Cookie`` into the next request, and parsing them was a few per cent of a loaded router's CPU.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

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


class _NoCookies(httpx.Cookies):
    """A cookie store that stores nothing (upstream ``Set-Cookie`` headers are not read)."""

    def extract_cookies(self, response: httpx.Response) -> None:
        """Ignore the answer's cookies."""


class UpstreamClient(httpx.AsyncClient):
    """The router's upstream client: ``httpx.AsyncClient`` over one transport, keeping no cookies.

    Who builds it: :func:`router.runtime.http_client`, with the transport, timeouts and limits.
    It connects to every URL through that transport (no proxies, no mounts, nothing read from
    the environment) with no auth and no event hooks, and follows no redirects. So :meth:`send`
    hands a request straight to the transport instead of running httpx's redirect, auth and hook
    machinery for nothing; that machinery was about 6 % of a loaded router's CPU
    (docs/benchmarks/README.md, "Router overhead").
    """

    def __init__(
        self, transport: httpx.AsyncBaseTransport, timeout: httpx.Timeout, limits: httpx.Limits
    ) -> None:
        super().__init__(transport=transport, timeout=timeout, limits=limits, trust_env=False)
        self._cookies = _NoCookies()
        self._upstream = transport

    async def send(
        self, request: httpx.Request, *, stream: bool = False, **options: Any
    ) -> httpx.Response:
        """Send ``request`` as httpx's ``send`` would for this client (the answer's body read
        unless ``stream``; the client's timeouts unless the request has its own). A call that
        sets its own ``auth`` or ``follow_redirects`` goes through httpx's ``send``."""
        if any(value is not httpx.USE_CLIENT_DEFAULT for value in options.values()):
            return await super().send(request, stream=stream, **options)
        if self.is_closed:
            raise RuntimeError("Cannot send a request, as the client has been closed.")
        request.extensions.setdefault("timeout", self.timeout.as_dict())
        response = await self._upstream.handle_async_request(request)
        response.request = request
        if not stream:
            try:
                await response.aread()
            except BaseException:
                await response.aclose()
                raise
        return response
