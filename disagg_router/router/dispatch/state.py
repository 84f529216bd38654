"""What the pieces of one dispatch attempt share: its pair, ids, clock, deadline, the queue of
D's payloads and the tasks of both legs.

Who calls it: the orchestrator (:mod:`disagg_router.router.dispatch.orchestrator`) builds one
:class:`Attempt` per attempt for its :class:`disagg_router.router.dispatch.attempt.Dispatch`; the
legs (:mod:`disagg_router.router.dispatch.legs`), the commit point
(:mod:`disagg_router.router.dispatch.commit`) and the relay
(:mod:`disagg_router.router.dispatch.relay`) read and write it. Everything runs on the router's
event loop, so nothing here locks. It does no I/O and starts nothing.
"""

from __future__ import annotations

import asyncio
import time
from collections import deque
from collections.abc import Callable
from typing import Any, Protocol

from disagg_router.router.config import PushIdentity
from disagg_router.router.errors import RouterError, UpstreamError
from disagg_router.router.ids import new_request_id
from disagg_router.router.instances.demand import KvDemand
from disagg_router.router.instances.state import BackendState
from disagg_router.router.request import ClientRequest, RequestContext
from disagg_router.router.runtime import Runtime


class End:
    """Queue sentinel: the D leg finished cleanly."""


END = End()
DecodeItem = bytes | dict[str, Any] | RouterError | End
"""What the D leg queues: SSE events as the client gets them (``data: ...\n\n``, one or more:
what one read of D's stream completed), the one JSON answer, the error that ends it, or END."""


class Mailbox:
    """What the D leg, the relay's timers and a drain hand to the request's task, in order.

    One reader (the request's task: the commit point, then the relay), any number of writers
    on the same loop. The subset of ``asyncio.Queue``'s API the dispatch uses (unbounded:
    ``put_nowait`` never blocks; ``get_nowait`` raises ``asyncio.QueueEmpty``), without the
    queue's event, getter and putter deques and task accounting, built for every request. A
    cancelled ``get`` takes nothing."""

    __slots__ = ("_items", "_waiter")

    def __init__(self) -> None:
        self._items: deque[DecodeItem] = deque()
        self._waiter: asyncio.Future[None] | None = None

    def put_nowait(self, item: DecodeItem) -> None:
        self._items.append(item)
        waiter = self._waiter
        if waiter is not None and not waiter.done():
            waiter.set_result(None)

    def __len__(self) -> int:
        return len(self._items)

    def get_nowait(self) -> DecodeItem:
        if not self._items:
            raise asyncio.QueueEmpty
        return self._items.popleft()

    async def get(self) -> DecodeItem:
        while not self._items:
            self._waiter = asyncio.get_running_loop().create_future()
            try:
                await self._waiter
            finally:
                self._waiter = None
        return self._items.popleft()


class Outlet(Protocol):
    """Where the relay may write the client's stream bytes itself, from the event loop's
    callback that read them from D (:meth:`disagg_router.router.dispatch.relay.SseEvents`'s
    splice): the HTTP server's writer for the streamed answer, or one that rewrites first."""

    def ready(self) -> bool:
        """Whether :meth:`write` would write now (the answer under way, the client there and
        keeping up); when not, the bytes go the usual way, through the request's task."""
        ...

    def write(self, data: bytes) -> None:
        """Write ``data`` as the answer's next bytes (only after :meth:`ready` said so)."""
        ...


class Splicer(Protocol):
    """The D leg's reader, as the relay sees it
    (:meth:`disagg_router.router.upstream.sse.EventReader.splice`)."""

    def splice(self, deliver: Callable[[bytes], None] | None) -> bool: ...


class Attempt:
    """The shared state of one attempt on one (P, D) pair with one fresh request id.

    ``prefill`` None: D alone (conditional disaggregation). ``deadline``: the
    ``time.monotonic()`` by which the client request must end (``timeouts.total`` counted from
    the first attempt; default: from now).
    """

    def __init__(
        self,
        runtime: Runtime,
        request: ClientRequest,
        prefill: BackendState | None,
        decode: BackendState,
        ctx: RequestContext | None = None,
        request_id: str | None = None,
        deadline: float | None = None,
    ) -> None:
        self.runtime = runtime
        self.request = request
        self.prefill = prefill
        self.decode = decode
        self.ctx = ctx or RequestContext()
        self.request_id = request_id or new_request_id()
        self.transfer_id = self.request_id
        self.started = time.monotonic()
        self.deadline = deadline or self.started + runtime.settings.timeouts.total
        self.outcome = "in_progress"
        self.queue = Mailbox()
        self.p_task: asyncio.Task[dict[str, Any]] | None = None
        self.d_task: asyncio.Task[None] | None = None
        self.sent_identity: PushIdentity | None = None  # push mode: the P identity D was given
        self.first: DecodeItem = END  # D's first events (the commit point)
        self.last_token = 0.0  # time.monotonic() of D's last streamed events
        self.reader: Splicer | None = None  # D's stream, while the D leg reads it
        self.timings: dict[str, float] = {}  # stage -> seconds since ``started``
        self.stamps: dict[str, float] = {}  # more moments for the TTFT stages, same clock
        self.usage: Any = None  # the usage the client got (merged), once the relay sent it
        self.answered = 0.0  # time.monotonic() when the answer's last chunk was ready; 0: not
        # After the commit point: asked when D's leg fails mid-stream; True: its owner continues
        # the stream on another D (the relay then raises StreamBroken instead of ending it).
        self.hand_over: Callable[[UpstreamError], bool] | None = None
        # The phase of the D failure this attempt follows (a retry or a stream's continuation).
        self.failover: str | None = None
        # Binding D late (push.bind): chooses D (counted in flight) when its leg is due; None
        # once D is bound, or when D was chosen with P. ``decode`` is a stand-in until then.
        self.choose_decode: Callable[[], BackendState] | None = None
        self.prompt_tokens = 0  # the prompt's estimated tokens (P's pace predicts with them)
        # The D pool's KV demand, which holds prompt_tokens while the attempt runs (None: none).
        self.kv_demand: KvDemand | None = None
        self.p_ticket: int | None = None  # the P leg's prefill in P's pace, while it runs
        self.prefill_answered: bool | None = None  # how the P leg ended; None: it has not

    def mark(self, stage: str) -> None:
        """Note when ``stage`` was reached (once; reported in the request log)."""
        self.timings.setdefault(stage, round(time.monotonic() - self.started, 6))

    def stamp(self, moment: str) -> None:
        """A moment only the TTFT stages use
        (:func:`disagg_router.router.observability.timeline.ttft_stages`)."""
        self.stamps.setdefault(moment, time.monotonic() - self.started)
