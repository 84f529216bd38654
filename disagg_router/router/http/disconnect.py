"""Noticing a client that goes away while its request is being answered.

Who uses it: the generation endpoints (:mod:`disagg_router.router.http.generate`, and the stream it
returns, :mod:`disagg_router.router.http.stream`) and the pass-through routes, from the moment the
request body has been read until the answer has been sent. A :class:`ClientWatch` cancels the
request's own task when the client leaves; the handler turns that cancellation into
:class:`~disagg_router.router.errors.ClientDisconnected` and closes the dispatch as for any other
ending, so a leaving client never strands a leg.

How it hears of the departure: under ``disagg-router serve`` the connection's protocol
(:mod:`disagg_router.router.http.protocol`) puts its :class:`DisconnectNotice` into each request's
scope (``scope["extensions"][NOTICE]``) and calls the watches subscribed to it from its
``connection_lost``: no task per request. Under any other ASGI server (the tests' uvicorn, an
in-process transport) one task per request watches ``receive()`` for ``http.disconnect``.

Why a cancel is always delivered inside the watched section: either way the cancel is made
while the request's task is suspended at one of its awaits (or, for a connection already gone
when the watch starts, lands at its next await), and the handler calls :meth:`ClientWatch.stop`
synchronously before its cleanup awaits anything. So no cancellation can reach the cleanup
(``Dispatch.close`` releases slots after awaiting the legs; it must run to its end).
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from typing import Any, Protocol, TypeVar

from starlette.types import Receive

from disagg_router.router.errors import ClientDisconnected, RouterNotReady

T = TypeVar("T")

NOTICE = "disagg_router.disconnect"
"""The key of a connection's :class:`DisconnectNotice` in a request scope's ``extensions``."""


class DisconnectNotice:
    """One client connection's departure, told to the watches of its requests.

    Made once per connection by its protocol, which calls :meth:`connection_lost` (on the event
    loop) when the connection goes; callbacks must only cancel or set, never block or raise."""

    __slots__ = ("_callbacks", "lost")

    def __init__(self) -> None:
        self.lost = False
        self._callbacks: list[Callable[[], None]] = []

    def subscribe(self, callback: Callable[[], None]) -> None:
        """Call ``callback`` once when the connection is lost (at once if it already is)."""
        if self.lost:
            callback()
        else:
            self._callbacks.append(callback)

    def unsubscribe(self, callback: Callable[[], None]) -> None:
        """Forget ``callback`` (idempotent)."""
        if callback in self._callbacks:
            self._callbacks.remove(callback)

    def connection_lost(self) -> None:
        """The protocol's: the client's connection is gone."""
        self.lost = True
        callbacks, self._callbacks = self._callbacks, []
        for callback in callbacks:
            callback()


def notice_of(scope: Any) -> DisconnectNotice | None:
    """The connection's notice in ``scope`` (None: the server gives none)."""
    extensions = scope.get("extensions")
    notice = extensions.get(NOTICE) if extensions else None
    return notice if isinstance(notice, DisconnectNotice) else None


class ClientWatch:
    """Cancels the current task when the client disconnects, until :meth:`stop`.

    ``notice``: the connection's (:func:`notice_of` the request's scope); without one, a task
    watches ``receive`` (which the watch then owns)."""

    def __init__(self, receive: Receive, notice: DisconnectNotice | None = None) -> None:
        task = asyncio.current_task()
        assert task is not None, "ClientWatch must be created inside a task"
        self._task = task
        self._armed = True
        self._cancelled = False
        self._notice = notice
        self._watcher: asyncio.Task[None] | None = None
        self._on_lost = self._client_left
        if notice is not None:
            notice.subscribe(self._on_lost)
        else:
            self._watcher = asyncio.get_running_loop().create_task(self._watch(receive))

    async def _watch(self, receive: Receive) -> None:
        while (await receive())["type"] != "http.disconnect":
            pass
        self._client_left()

    def _client_left(self) -> None:
        if self._armed:
            self._armed = False
            self._cancelled = True
            self._task.cancel()

    def stop(self) -> None:
        """Stop watching (idempotent); call before any cleanup that awaits."""
        self._armed = False
        if self._notice is not None:
            self._notice.unsubscribe(self._on_lost)
        elif self._watcher is not None:
            self._watcher.cancel()

    def left(self) -> bool:
        """For a cancellation caught in the watched section: True if it was this watch's (the
        client left; the task is then no longer counted as being cancelled), False if someone
        else cancelled the task (re-raise it then). Stops the watch."""
        self.stop()
        if not self._cancelled:
            return False
        self._cancelled = False
        self._task.uncancel()
        return True


class TakesBack(Protocol):
    """What :func:`watched` asks of a drain's handle on a request (the pass-through routes'
    ``disagg_router.router.http.exchange.DrainHandle``)."""

    reason: str | None

    def took_back(self) -> bool: ...


async def watched(watch: ClientWatch, work: Awaitable[T], handle: TakesBack | None = None) -> T:
    """Await ``work`` in this task; :class:`~disagg_router.router.errors.ClientDisconnected` if the
    client left meanwhile, :class:`~disagg_router.router.errors.RouterNotReady` if a drain aborted
    the request through ``handle`` (``work`` was cancelled where it waited and has cleaned up)."""
    try:
        return await work
    except asyncio.CancelledError:
        if watch.left():
            raise ClientDisconnected("client disconnected") from None
        if handle is not None and handle.took_back():
            raise RouterNotReady(handle.reason or "the router is shutting down") from None
        raise
