"""HTTP calls to one upstream vLLM instance, with transport errors translated into ours.

Who calls it: the dispatch (:mod:`disagg_router.router.dispatch.legs`, P and D legs), the
pass-through routes (:mod:`disagg_router.router.dispatch.forward`: :func:`open_raw`), the health
monitor (:mod:`disagg_router.router.health.monitor`, :mod:`disagg_router.router.health.model_info`)
and the load-signal scraper (:mod:`disagg_router.router.health.load_signals`). Every call goes out
through the app's one :class:`disagg_router.router.upstream.client.UpstreamClient`, with the same
headers: ``Host``, ``Accept``, ``User-Agent``, the instance's API key, ``X-Request-Id`` (the
dispatch id), the caller's trace context, and ``Content-Type`` / ``Content-Length`` with a body.
Answers are always closed (context managers, or :meth:`RawAnswer.close`). Translating an error has
no side effect: what a failure means for the instance's health is decided by the caller (the error's
``unreachable`` / ``instance_fault`` say what happened). Raises only
:class:`disagg_router.router.errors.UpstreamError` subclasses (and ``RuntimeError`` once the client
is closed).
"""

from __future__ import annotations

import json
from collections.abc import Callable, Mapping
from contextlib import AbstractAsyncContextManager
from types import TracebackType
from typing import Any, Protocol
from urllib.parse import urlsplit

from disagg_router.router.errors import (
    UpstreamConnectTimeout,
    UpstreamError,
    UpstreamHTTPError,
    UpstreamProtocolError,
    UpstreamTimeout,
    UpstreamUnavailable,
    UpstreamUnreachable,
)
from disagg_router.router.upstream import codec
from disagg_router.router.upstream.client import USER_AGENT, Answer, Target, UpstreamClient
from disagg_router.router.upstream.h1 import (
    AnswerHeadersTooLarge,
    Call,
    ConnectError,
    ConnectTimeout,
    ReadTimeout,
    TransportError,
)
from disagg_router.router.upstream.sse import EventReader, NotEventStream, StreamEndedEarly


class Instance(Protocol):
    """What a call needs of the instance it goes to; the router's
    :class:`disagg_router.router.instances.state.BackendState` is one."""

    @property
    def url(self) -> str: ...

    @property
    def label(self) -> str: ...

    @property
    def api_key(self) -> str | None: ...


def _checked(value: str) -> str:
    """``value`` for a header; ``ValueError`` if it holds a line break (it would end the head
    early or add a header)."""
    if "\r" in value or "\n" in value:
        raise ValueError("a header value holds a line break")
    return value


def _target(client: UpstreamClient, backend: Instance, method: str, path: str) -> Target:
    """What every ``method`` request to ``backend`` at ``path`` shares, kept in
    ``client.targets`` (see :class:`disagg_router.router.upstream.client.Target`)."""
    key = (backend.url, backend.api_key, method, path)
    found = client.targets.get(key)
    if found is not None:
        return found
    url = urlsplit(backend.url + path)
    tls = url.scheme == "https"
    host = url.hostname or ""
    origin = (host, url.port or (443 if tls else 80), tls)
    target_path = (url.path or "/") + (f"?{url.query}" if url.query else "")
    fields = [("Host", url.netloc.rpartition("@")[2]), ("Accept", "*/*")]
    fields.append(("User-Agent", USER_AGENT))
    if method == "POST":
        fields.append(("Content-Type", "application/json"))
    if backend.api_key:
        fields.append(("Authorization", f"Bearer {backend.api_key}"))
    lines = [f"{method} {target_path} HTTP/1.1\r\n"]
    lines += [f"{name}: {_checked(value)}\r\n" for name, value in fields]
    found = client.targets[key] = Target(origin, "".join(lines).encode("latin-1"))
    return found


def _head(
    target: Target, request_id: str, extra: Mapping[str, str] | None, length: int | None
) -> bytes:
    """One request's head: ``target``'s, then ``extra`` (trace context), ``X-Request-Id`` and,
    for a request with a body, ``Content-Length``. Raises ``ValueError`` for a header with a
    line break."""
    tail = "".join(f"{name}: {_checked(value)}\r\n" for name, value in (extra or {}).items())
    tail += f"X-Request-Id: {_checked(request_id)}\r\n"
    if length is not None:
        tail += f"Content-Length: {length}\r\n"
    return target.head + tail.encode("latin-1") + b"\r\n"


def _call(
    client: UpstreamClient,
    backend: Instance,
    path: str,
    body: dict[str, Any] | None,
    request_id: str,
    headers: Mapping[str, str] | None = None,
) -> Call:
    """POST ``body`` (GET when it is ``None``) to ``backend``; the answer (status, body unread)
    inside the block. Raises :class:`TransportError` (the caller translates it),
    ``RuntimeError`` once the client is closed."""
    if body is None:
        target = _target(client, backend, "GET", path)
        return client.request(target.origin, _head(target, request_id, headers, None))
    content = codec.dumps(body)
    target = _target(client, backend, "POST", path)
    head = _head(target, request_id, headers, len(content))
    return client.request(target.origin, head, content)


async def _enter(call: Call, leg: str, backend: Instance) -> Answer:
    """Send ``call`` and wait for its answer's head; transport errors raise ours."""
    try:
        return await call.__aenter__()
    except TransportError as exc:
        raise _translate(exc, leg, backend) from exc


def _translate(exc: TransportError, leg: str, backend: Instance) -> UpstreamError:
    """Our error for a transport one (pure: the backend is only named)."""
    if isinstance(exc, ConnectTimeout):
        return UpstreamConnectTimeout(leg, backend.label, "connect timed out")
    if isinstance(exc, ConnectError):
        return UpstreamUnreachable(leg, backend.label, "connection refused or unreachable")
    if isinstance(exc, AnswerHeadersTooLarge):
        return UpstreamProtocolError(leg, backend.label, str(exc))
    if isinstance(exc, ReadTimeout):
        return UpstreamTimeout(leg, backend.label, f"timed out ({type(exc).__name__})")
    return UpstreamUnavailable(leg, backend.label, f"connection lost ({type(exc).__name__})")


def _detail(raw: bytes) -> Any:
    """An error answer's body: its JSON, else its text (undecodable UTF-8 replaced)."""
    try:
        return json.loads(raw)
    except ValueError:
        return raw.decode("utf-8", "replace")


async def _whole(
    client: UpstreamClient,
    backend: Instance,
    leg: str,
    path: str,
    body: dict[str, Any] | None,
    request_id: str,
    headers: Mapping[str, str] | None = None,
) -> tuple[int, bytes]:
    """The status and whole body of :func:`_call`'s answer; transport errors raise ours."""
    try:
        async with _call(client, backend, path, body, request_id, headers) as answer:
            return answer.status, await answer.read()
    except TransportError as exc:
        raise _translate(exc, leg, backend) from exc


async def post_json(
    client: UpstreamClient,
    backend: Instance,
    leg: str,
    path: str,
    body: dict[str, Any],
    request_id: str,
    headers: Mapping[str, str] | None = None,
) -> dict[str, Any]:
    """POST ``body`` and return the JSON object answered; HTTP errors raise."""
    status, raw = await _whole(client, backend, leg, path, body, request_id, headers)
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
    client: UpstreamClient,
    backend: Instance,
    leg: str,
    path: str,
    body: dict[str, Any],
    request_id: str,
    headers: Mapping[str, str] | None = None,
) -> AbstractAsyncContextManager[SseStream]:
    """POST a streamed request; yields an iterator over its events as the client gets them
    (closed on exit): batches of ``data: ...\n\n`` events, each batch what one read completed
    (:class:`disagg_router.router.upstream.sse.EventReader`).

    The iterator stops after ``[DONE]`` (not yielded); a stream that ends without it, or breaks,
    raises an :class:`UpstreamError`.
    """
    return SseStream(_call(client, backend, path, body, request_id, headers), leg, backend)


class SseStream:
    """:func:`open_sse`'s context manager and its events (an async iterator, which the relay
    may also splice: :meth:`splice`): classes, not an async generator and
    a generator context manager, as the decode leg makes one per streamed request. Every
    transport error, entering, reading or leaving, becomes our :class:`UpstreamError`."""

    def __init__(self, call: Call, leg: str, backend: Instance) -> None:
        self._call = call
        self._leg = leg
        self._backend = backend
        self._events: EventReader | None = None

    async def __aenter__(self) -> SseStream:
        answer = await _enter(self._call, self._leg, self._backend)
        try:
            if answer.status >= 400:
                try:
                    detail = _detail(await answer.read())
                except TransportError as exc:
                    raise _translate(exc, self._leg, self._backend) from exc
                raise UpstreamHTTPError(self._leg, self._backend.label, answer.status, detail)
        except BaseException as exc:
            await self.__aexit__(type(exc), exc, exc.__traceback__)
            raise
        self._events = EventReader(answer.read_chunk, answer.content_type, answer.splice)
        return self

    async def __aexit__(
        self, kind: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self._events = None  # the connection is no longer this call's to splice
        await self._call.__aexit__(kind, exc, tb)  # gives the connection back; never raises

    def splice(self, deliver: Callable[[bytes], None] | None) -> bool:
        """:meth:`disagg_router.router.upstream.sse.EventReader.splice` while the block runs;
        outside it, nothing (False, and ``None`` touches no connection)."""
        events = self._events
        return events is not None and events.splice(deliver)

    def __aiter__(self) -> SseStream:
        return self

    async def __anext__(self) -> bytes:
        assert self._events is not None, "iterated outside its block"
        leg, backend = self._leg, self._backend
        try:
            return await self._events.__anext__()
        except TransportError as exc:
            raise _translate(exc, leg, backend) from exc
        except StreamEndedEarly as exc:
            raise UpstreamUnavailable(leg, backend.label, "stream ended before [DONE]") from exc
        except NotEventStream as exc:
            raise UpstreamProtocolError(
                leg, backend.label, "answer is not an event stream"
            ) from exc


async def get_ok(
    client: UpstreamClient, backend: Instance, leg: str, path: str, request_id: str
) -> bytes:
    """GET ``path`` and return the body of its ``200`` answer; any other status raises
    :class:`UpstreamHTTPError` (the health checks, ``/v1/models``, ``/metrics``)."""
    status, raw = await _whole(client, backend, leg, path, None, request_id)
    if status != 200:
        raise UpstreamHTTPError(leg, backend.label, status, _detail(raw))
    return raw


class RawAnswer:
    """A pass-through answer as the instance sent it, whatever its status (:func:`open_raw`):
    its status and content type in hand, its body read once, whole or as it arrives. Every
    transport error raises our :class:`UpstreamError`; :meth:`close` must run however the
    request ends."""

    def __init__(self, call: Call, answer: Answer, leg: str, backend: Instance) -> None:
        self._call = call
        self._answer = answer
        self._leg = leg
        self._backend = backend
        self.status = answer.status
        self.content_type = answer.content_type

    async def read(self) -> bytes:
        """The whole body."""
        try:
            return await self._answer.read()
        except TransportError as exc:
            raise _translate(exc, self._leg, self._backend) from exc

    async def read_chunk(self) -> bytes:
        """The body's next bytes as they arrive, ``b""`` once it has ended."""
        try:
            return await self._answer.read_chunk()
        except TransportError as exc:
            raise _translate(exc, self._leg, self._backend) from exc

    def error(self, body: bytes) -> UpstreamHTTPError:
        """Our error for this answer's HTTP error status, ``body`` being its body."""
        return UpstreamHTTPError(self._leg, self._backend.label, self.status, _detail(body))

    async def close(self) -> None:
        """Give the connection back (closed unless the body was read to its end)."""
        await self._call.__aexit__(None, None, None)


async def open_raw(
    client: UpstreamClient,
    backend: Instance,
    leg: str,
    path: str,
    body: dict[str, Any],
    request_id: str,
) -> RawAnswer:
    """POST ``body`` and return the answer with its body not read yet (a pass-through reads or
    relays it as it is); the caller must :meth:`RawAnswer.close` it."""
    call = _call(client, backend, path, body, request_id)
    return RawAnswer(call, await _enter(call, leg, backend), leg, backend)
