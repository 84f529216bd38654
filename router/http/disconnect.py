"""Noticing a client that goes away while its request is being answered.

Who uses it: the generation endpoints (:mod:`router.http.generate`, and the stream it returns,
:mod:`router.http.stream`), from the moment the request body has been read (the watcher then
owns every later ``receive()``) until the answer has been sent. One task per request watches
``receive()`` for ``http.disconnect`` and cancels the request's own task; the handler turns that
cancellation into :class:`~router.errors.ClientDisconnected` and closes the dispatch as for any
other ending, so a leaving client never strands a leg.

Why a cancel is always delivered inside the watched section: the watcher runs only while the
request's task is suspended at one of its awaits, and the handler calls :meth:`ClientWatch.stop`
synchronously before its cleanup awaits anything. So no cancellation can reach the cleanup
(``Dispatch.close`` releases slots after awaiting the legs; it must run to its end).
"""

from __future__ import annotations

import asyncio

from starlette.types import Receive


class ClientWatch:
    """Cancels the current task when the client disconnects, until :meth:`stop`."""

    def __init__(self, receive: Receive) -> None:
        task = asyncio.current_task()
        assert task is not None, "ClientWatch must be created inside a task"
        self._task = task
        self._armed = True
        self._cancelled = False
        self._watcher = asyncio.get_running_loop().create_task(self._watch(receive))

    async def _watch(self, receive: Receive) -> None:
        while (await receive())["type"] != "http.disconnect":
            pass
        if self._armed:
            self._armed = False
            self._cancelled = True
            self._task.cancel()

    def stop(self) -> None:
        """Stop watching (idempotent); call before any cleanup that awaits."""
        self._armed = False
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
