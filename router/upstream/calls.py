"""HTTP calls to one upstream vLLM instance, with httpx errors translated into ours.

Who calls it: the dispatch (:mod:`router.dispatch.legs`, P and D legs), the pass-through routes
(:mod:`router.dispatch.forward`: :func:`send_raw` and its helpers), the health monitor
(:mod:`router.health.monitor`, :mod:`router.health.model_info`) and the load-signal scraper
(:mod:`router.health.load_signals`). Uses the app's one shared ``httpx.AsyncClient``: the router's
:class:`UpstreamClient` sends a leg on its own connections (:meth:`UpstreamClient.send_direct`), any
other client (tests' mock upstreams) through httpx; both go out with the same headers and body and
end the same way. Streams are always closed (context manager, or :func:`close_quietly` for
:func:`send_raw`'s answers). Translating an error has no side effect: what a failure means for the
instance's health is decided by the caller (the error's ``unreachable`` / ``instance_fault`` say
what happened). Raises only :class:`router.errors.UpstreamError` subclasses.
"""

from __future__ import annotations

import json
from collections.abc import AsyncGenerator, AsyncIterator, Mapping
from contextlib import AbstractAsyncContextManager, asynccontextmanager
from types import TracebackType
from typing import Any, Protocol

import httpx
from httpx_sse import SSEError

from router.errors import (
    UpstreamConnectTimeout,
    UpstreamError,
    UpstreamHTTPError,
    UpstreamProtocolError,
    UpstreamTimeout,
    UpstreamUnavailable,
    UpstreamUnreachable,
)
from router.upstream import codec
from router.upstream.client import LegAnswer, LegTarget, UpstreamClient, send_leg
from router.upstream.h1 import AnswerHeadersTooLarge
from router.upstream.sse import EventReader, StreamEndedEarly


class Instance(Protocol):
    """What a call needs of the instance it goes to; the router's
    :class:`router.instances.state.BackendState` is one. ``leg_headers_cache`` belongs to
    :func:`leg_headers` (None until its first call)."""

    leg_headers_cache: tuple[httpx.Headers, httpx.Headers] | None

    @property
    def url(self) -> str: ...

    @property
    def label(self) -> str: ...

    @property
    def api_key(self) -> str | None: ...

    def endpoint(self, path: str) -> httpx.URL: ...


def leg_headers(
    client: httpx.AsyncClient,
    backend: Instance,
    request_id: str,
    extra: Mapping[str, str] | None = None,
) -> httpx.Headers:
    """Every header a request to ``backend`` carries (legs, probes, health checks, scrapes): the
    client's defaults, ``Host``, ``Content-Type``, the instance's API key, ``extra`` (trace
    context) and the dispatch id as ``X-Request-Id``; a fresh object the caller may add to.

    The part all requests to ``backend`` share is built once per client and kept in
    ``backend.leg_headers_cache`` (never mutated), so a leg copies it instead of merging and
    normalising every header again."""
    cached = backend.leg_headers_cache
    if cached is None or cached[0] is not client.headers:
        base = httpx.Headers(client.headers)
        base["Host"] = httpx.URL(backend.url).netloc.decode("ascii")
        base["Content-Type"] = "application/json"
        if backend.api_key:
            base["Authorization"] = f"Bearer {backend.api_key}"
        cached = backend.leg_headers_cache = (client.headers, base)
    fields = httpx.Headers(cached[1])
    for name, value in (extra or {}).items():
        fields[name] = value
    fields["X-Request-Id"] = request_id
    return fields


def _leg_request(
    client: httpx.AsyncClient,
    backend: Instance,
    path: str,
    content: bytes,
    request_id: str,
    headers: Mapping[str, str] | None,
) -> httpx.Request:
    """The POST of one leg, with the headers and timeouts ``client.build_request`` would give it
    (:func:`leg_headers` and ``Content-Length``), built from the backend's prepared headers
    instead of merging and normalising every header again: 14 us per leg instead of httpx's 45
    (``timeit``)."""
    fields = leg_headers(client, backend, request_id, headers)
    fields["Content-Length"] = str(len(content))
    request = httpx.Request(
        "POST",
        backend.endpoint(path),
        headers=fields,
        stream=httpx.ByteStream(content),
        extensions={"timeout": client.timeout.as_dict()},
    )
    request.read()  # the body is in memory: ``request.content`` is set, as with ``content=``
    return request


def _translate(exc: httpx.HTTPError, leg: str, backend: Instance) -> UpstreamError:
    """Our error for an httpx one (pure: the backend is only named)."""
    if isinstance(exc, httpx.ConnectTimeout):
        return UpstreamConnectTimeout(leg, backend.label, "connect timed out")
    if isinstance(exc, httpx.ConnectError):
        return UpstreamUnreachable(leg, backend.label, "connection refused or unreachable")
    if isinstance(exc, AnswerHeadersTooLarge):
        return UpstreamProtocolError(leg, backend.label, str(exc))
    if isinstance(exc, httpx.TimeoutException):
        return UpstreamTimeout(leg, backend.label, f"timed out ({type(exc).__name__})")
    return UpstreamUnavailable(leg, backend.label, f"connection lost ({type(exc).__name__})")


class _HttpxAnswer:
    """A :class:`LegAnswer` over an httpx response (any client but the router's own)."""

    def __init__(self, response: httpx.Response) -> None:
        self.status = response.status_code
        self.content_type = response.headers.get("content-type", "")
        self._response = response
        self._chunks: AsyncIterator[bytes] | None = None

    async def read(self) -> bytes:
        return await self._response.aread()

    async def read_chunk(self) -> bytes:
        if self._chunks is None:
            self._chunks = self._response.aiter_bytes()
        return await anext(self._chunks, b"")


def _leg_target(client: UpstreamClient, backend: Instance, path: str) -> LegTarget:
    """What every direct leg to ``backend`` at ``path`` shares (see :data:`LegTarget`), kept in
    ``client.leg_targets``: the request line and the headers of :func:`_leg_request` but the
    per-leg ones and ``Accept-Encoding`` (the leg connections decode no compression, so none is
    asked for). Its origin is ``None`` for an ``https`` instance: its legs go through httpx."""
    key = (backend.url, backend.api_key, path)
    found = client.leg_targets.get(key)
    if found is not None and found[0] is client.headers:
        return found
    url = backend.endpoint(path)
    if url.scheme != "http":
        target: LegTarget = (client.headers, None, b"")
        client.leg_targets[key] = target
        return target
    fields = leg_headers(client, backend, "")
    del fields["X-Request-Id"]
    del fields["Accept-Encoding"]
    lines = [f"POST {url.raw_path.decode('ascii')} HTTP/1.1\r\n"]
    lines += [f"{name}: {value}\r\n" for name, value in fields.multi_items()]
    target = (client.headers, (url.host, url.port or 80), "".join(lines).encode("latin-1"))
    client.leg_targets[key] = target
    return target


def _direct_head(
    shared: bytes, request_id: str, extra: Mapping[str, str] | None, length: int
) -> bytes:
    """A direct leg's request head: ``shared`` (:func:`_leg_target`), then ``extra`` (trace
    context), ``X-Request-Id`` and ``Content-Length``. Raises ``ValueError`` for a header with a
    line break (it would end the head early or add a header)."""
    lines = len(extra) + 3 if extra else 3
    tail = "".join(f"{name}: {value}\r\n" for name, value in extra.items()) if extra else ""
    tail += f"X-Request-Id: {request_id}\r\nContent-Length: {length}\r\n\r\n"
    if tail.count("\n") != lines or tail.count("\r") != lines:
        raise ValueError("a leg header holds a line break")
    return shared + tail.encode("latin-1")


def _call(
    client: httpx.AsyncClient,
    backend: Instance,
    path: str,
    body: dict[str, Any],
    request_id: str,
    headers: Mapping[str, str] | None,
) -> AbstractAsyncContextManager[LegAnswer]:
    """POST ``body``; the answer (status, body unread) inside the block. Raises httpx's errors
    (the caller translates them), ``RuntimeError`` once the client is closed."""
    content = codec.dumps(body)
    if isinstance(client, UpstreamClient) and client.direct:
        _, origin, shared = _leg_target(client, backend, path)
        if origin is not None:
            head = _direct_head(shared, request_id, headers, len(content))
            return client.send_direct(origin, head, content)
    return _httpx_call(client, backend, path, content, request_id, headers)


@asynccontextmanager
async def _httpx_call(
    client: httpx.AsyncClient,
    backend: Instance,
    path: str,
    content: bytes,
    request_id: str,
    headers: Mapping[str, str] | None,
) -> AsyncIterator[LegAnswer]:
    """:func:`_call` through httpx's ``send`` (any client but the router's own)."""
    request = _leg_request(client, backend, path, content, request_id, headers)
    resp = await send_leg(client, request, stream=True)
    try:
        yield _HttpxAnswer(resp)
    finally:
        await resp.aclose()


def _detail(raw: bytes) -> Any:
    """An error answer's body: its JSON, else its text (as ``httpx.Response`` reads them)."""
    try:
        return json.loads(raw)
    except ValueError:
        return raw.decode("utf-8", "replace")


async def post_json(
    client: httpx.AsyncClient,
    backend: Instance,
    leg: str,
    path: str,
    body: dict[str, Any],
    request_id: str,
    headers: Mapping[str, str] | None = None,
) -> dict[str, Any]:
    """POST ``body`` and return the JSON object answered; HTTP errors raise."""
    try:
        async with _call(client, backend, path, body, request_id, headers) as answer:
            status, raw = answer.status, await answer.read()
    except httpx.HTTPError as exc:
        raise _translate(exc, leg, backend) from exc
    if status >= 400:
        raise UpstreamHTTPError(leg, backend.label, status, _detail(raw))
    try:
        data = codec.loads(raw)
    except ValueError as exc:
        raise UpstreamProtocolError(leg, backend.label, "answer is not JSON") from exc
    if not isinstance(data, dict):
        raise UpstreamProtocolError(leg, backend.label, "answer is not a JSON object")
    return data


def open_sse(
    client: httpx.AsyncClient,
    backend: Instance,
    leg: str,
    path: str,
    body: dict[str, Any],
    request_id: str,
    headers: Mapping[str, str] | None = None,
) -> AbstractAsyncContextManager[AsyncIterator[bytes]]:
    """POST a streamed request; yields an iterator over its events as the client gets them
    (closed on exit): batches of ``data: ...\n\n`` events, each batch what one read completed
    (:class:`router.upstream.sse.EventReader`).

    The iterator stops after ``[DONE]`` (not yielded); a stream that ends without it, or breaks,
    raises an :class:`UpstreamError`.
    """
    return _SseCall(_call(client, backend, path, body, request_id, headers), leg, backend)


class _SseCall:
    """:func:`open_sse`'s context manager and its events: classes, not an async generator and
    a generator context manager, as the decode leg makes one per streamed request. Every
    httpx error, entering, reading or leaving, becomes our :class:`UpstreamError`."""

    def __init__(
        self, call: AbstractAsyncContextManager[LegAnswer], leg: str, backend: Instance
    ) -> None:
        self._call = call
        self._leg = leg
        self._backend = backend
        self._events: EventReader | None = None

    async def __aenter__(self) -> _SseCall:
        try:
            answer = await self._call.__aenter__()
        except httpx.HTTPError as exc:
            raise _translate(exc, self._leg, self._backend) from exc
        try:
            if answer.status >= 400:
                try:
                    detail = _detail(await answer.read())
                except httpx.HTTPError as exc:
                    raise _translate(exc, self._leg, self._backend) from exc
                raise UpstreamHTTPError(self._leg, self._backend.label, answer.status, detail)
        except BaseException as exc:
            await self.__aexit__(type(exc), exc, exc.__traceback__)
            raise
        self._events = EventReader(answer.read_chunk, answer.content_type)
        return self

    async def __aexit__(
        self, kind: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        try:
            await self._call.__aexit__(kind, exc, tb)
        except httpx.HTTPError as error:
            raise _translate(error, self._leg, self._backend) from error

    def __aiter__(self) -> _SseCall:
        return self

    async def __anext__(self) -> bytes:
        assert self._events is not None, "iterated outside its block"
        leg, backend = self._leg, self._backend
        try:
            return await self._events.__anext__()
        except httpx.HTTPError as exc:
            raise _translate(exc, leg, backend) from exc
        except StreamEndedEarly as exc:
            raise UpstreamUnavailable(leg, backend.label, "stream ended before [DONE]") from exc
        except SSEError as exc:
            raise UpstreamProtocolError(
                leg, backend.label, "answer is not an event stream"
            ) from exc


async def send_raw(
    client: httpx.AsyncClient,
    backend: Instance,
    leg: str,
    path: str,
    body: dict[str, Any],
    request_id: str,
) -> httpx.Response:
    """POST ``body`` and return the answer, whatever its status, with its body not read yet
    (a pass-through reads or relays it as it is); the caller must :func:`close_quietly` it.
    Transport errors raise our :class:`UpstreamError`."""
    request = _leg_request(client, backend, path, codec.dumps(body), request_id, None)
    try:
        return await send_leg(client, request, stream=True)
    except httpx.HTTPError as exc:
        raise _translate(exc, leg, backend) from exc


async def read_raw(resp: httpx.Response, leg: str, backend: Instance) -> bytes:
    """The whole body of a :func:`send_raw` answer; transport errors raise ours."""
    try:
        return await resp.aread()
    except httpx.HTTPError as exc:
        raise _translate(exc, leg, backend) from exc


async def raw_chunks(
    resp: httpx.Response, leg: str, backend: Instance
) -> AsyncGenerator[bytes, None]:
    """The body of a :func:`send_raw` answer as it arrives; transport errors raise ours."""
    try:
        async for chunk in resp.aiter_raw():
            yield chunk
    except httpx.HTTPError as exc:
        raise _translate(exc, leg, backend) from exc


def http_error(resp: httpx.Response, leg: str, backend: Instance) -> UpstreamHTTPError:
    """Our error for a :func:`send_raw` answer with an HTTP error status (its body read)."""
    return UpstreamHTTPError(leg, backend.label, resp.status_code, _detail(resp.content))


async def close_quietly(resp: httpx.Response) -> None:
    """Close a :func:`send_raw` answer; a connection that breaks while closing is no error."""
    try:
        await resp.aclose()
    except httpx.HTTPError:
        return
