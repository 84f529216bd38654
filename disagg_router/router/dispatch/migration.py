"""A streamed request that goes on on another D when its D fails after the first token.

Who calls it: the generation endpoints (:mod:`disagg_router.router.http.generate`) open every
streamed request with :func:`open_stream`; the HTTP layer
(:mod:`disagg_router.router.http.stream`) relays and closes what it returns as it would a dispatch.

A request that can be continued (:func:`disagg_router.router.dispatch.joining.ineligible`, and
``migration.enabled``) asks D for token ids, and every event passes through its
:class:`~disagg_router.router.dispatch.joining.StreamJoin`. When D's leg fails mid-stream (D died,
dropped the connection, or went silent past ``timeouts.inter_token``), and the stream is
continuable (ids known, no tool call begun), fewer than ``migration.max_per_request`` migrations
were made and the deadline is not reached, the failed attempt is closed (its holds given back),
and a continuation (prompt and generated ids, limits reduced) is opened like a retry after that
failure (:class:`~disagg_router.router.dispatch.orchestrator.Resume`: same P when it is usable,
never an instance that failed, the same deadline). The client's stream goes on from the new D's
first token; when no D can take it, it ends with the one SSE error event it would have had
without migration. Each outcome is counted (``disagg_router_stream_migrations_total``) and logged.
"""

from __future__ import annotations

import logging
import time
from collections.abc import AsyncGenerator, Callable
from contextlib import aclosing
from dataclasses import replace
from typing import Any

from disagg_router.router.dispatch.attempt import Dispatch
from disagg_router.router.dispatch.joining import JoinRules, StreamJoin, asking_ids, ineligible
from disagg_router.router.dispatch.orchestrator import Resume, open_dispatch
from disagg_router.router.dispatch.relay import StreamBroken, sse_error_event
from disagg_router.router.dispatch.state import Outlet
from disagg_router.router.errors import RouterError, UpstreamError
from disagg_router.router.ids import new_request_id
from disagg_router.router.instances.state import BackendState
from disagg_router.router.request import ClientRequest, RequestContext
from disagg_router.router.runtime import Runtime
from disagg_router.router.upstream import codec
from disagg_router.router.upstream.sse import encode_event

log = logging.getLogger(__name__)


async def open_stream(
    runtime: Runtime, request: ClientRequest, ctx: RequestContext
) -> Dispatch | Migrating:
    """An opened streamed request (first token in hand): a :class:`Migrating` one when it can
    be continued on another D, else a plain dispatch. The caller must ``close()`` it."""
    config = runtime.settings.migration
    if not config.enabled or ineligible(request, JoinRules(config.seeded)) is not None:
        return await open_dispatch(runtime, request, ctx)
    client_ids = request.body.get("return_token_ids") is True
    asked = asking_ids(request)
    deadline = time.monotonic() + runtime.settings.timeouts.total
    dispatch = await open_dispatch(runtime, asked, ctx)
    return Migrating(runtime, asked, ctx, dispatch, StreamJoin(client_ids), deadline)


class Migrating:
    """One client stream over one or more dispatches (see the module docstring). Offers what
    the HTTP layer reads of a dispatch: ``request_id`` (the first one's), the current P, D and
    timings, ``usage``, ``answered``, ``outcome``, ``sse_events()``, ``close()``."""

    def __init__(
        self,
        runtime: Runtime,
        request: ClientRequest,
        ctx: RequestContext,
        dispatch: Dispatch,
        join: StreamJoin,
        deadline: float,
    ) -> None:
        self._runtime = runtime
        self._request = request
        self._ctx = ctx
        self._current = dispatch
        self._join = join
        self._deadline = deadline
        self._failed: set[str] = set()
        self._migrations = 0
        self._outcome: str | None = None  # set when the stream ended here, not in a dispatch
        self.request_id = dispatch.request_id
        dispatch.hand_over(self._may_continue)

    @property
    def prefill(self) -> BackendState | None:
        return self._current.prefill

    @property
    def decode(self) -> BackendState:
        return self._current.decode

    @property
    def timings(self) -> dict[str, float]:
        return self._current.timings

    @property
    def usage(self) -> Any:
        """The usage the client got (joined across the D streams)."""
        return self._join.usage

    @property
    def answered(self) -> float:
        return self._current.answered

    @property
    def outcome(self) -> str:
        return self._outcome or self._current.outcome

    @outcome.setter
    def outcome(self, value: str) -> None:
        self._outcome = value

    def _may_continue(self, failed: UpstreamError) -> bool:
        """Whether the stream goes on after ``failed`` (asked by the relay, once per failure;
        a refusal is counted and logged with its reason)."""
        why = self._join.why_not()
        if why is None and self._migrations >= self._runtime.settings.migration.max_per_request:
            why = "migration.max_per_request reached"
        if why is None and time.monotonic() >= self._deadline:
            why = "timeouts.total reached"
        if why is None and self._join.remaining(self._request) == 0:
            why = "every token sent"
        if why is not None:
            log.warning("stream %s not continued after %s: %s", self.request_id, failed, why)
            m = self._runtime.metrics
            m.child(m.migrations, "refused").inc()
        return why is None

    async def sse_events(self, outlet: Outlet | None = None) -> AsyncGenerator[bytes, None]:
        """The client's SSE bytes, across migrations; ends like a dispatch's stream. Events
        spliced to ``outlet`` (:meth:`disagg_router.router.dispatch.relay.Relay.sse_events`)
        are rewritten on their way as the others are."""
        joined = None if outlet is None else _Rewriting(outlet, self._rewrite)
        while True:
            try:
                async with aclosing(self._current.sse_events(joined)) as events:
                    async for chunk in events:
                        out = self._rewrite(chunk)
                        if out:
                            yield out
                return
            except StreamBroken as broken:
                error = await self._continue(broken.error)
            if error is not None:
                self._outcome = "decode_failed_midstream"
                yield sse_error_event(error)
                return

    def _rewrite(self, chunk: bytes) -> bytes:
        """Each event of ``chunk`` as the client gets it (:meth:`StreamJoin.event`)."""
        out: list[bytes] = []
        for event in chunk.split(b"\n\n"):
            if not event:
                continue
            data = event[6:] if event.startswith(b"data: ") else None
            plain = self._join.plain_event(data) if data is not None else None
            if plain is not None:
                out.append(encode_event(plain))
                continue
            parsed = _json(data) if data is not None and data != b"[DONE]" else None
            if not isinstance(parsed, dict) or "error" in parsed:
                out.append(event + b"\n\n")
                continue
            joined = self._join.event(parsed)
            if joined is not None:
                out.append(encode_event(codec.dumps(joined)))
        return b"".join(out)

    async def _continue(self, failed: UpstreamError) -> RouterError | None:
        """Close the failed attempt and open the continuation; the error that ends the stream
        instead (None: the stream goes on)."""
        old = self._current
        old.outcome = "decode_failed_midstream"
        await old.close()
        self._failed.add(failed.backend)
        self._migrations += 1
        m = self._runtime.metrics
        resume = Resume(failed, frozenset(self._failed), old.prefill, self._deadline)
        ctx = replace(self._ctx, request_id=new_request_id())
        request = self._join.continuation(self._request)
        try:
            dispatch = await open_dispatch(self._runtime, request, ctx, resume)
        except RouterError as exc:
            log.warning("stream %s: no D continues it after %s: %s", self.request_id, failed, exc)
            m.child(m.migrations, "failed").inc()
            return failed
        log.warning(
            "stream %s: D %s failed after %d tokens (%s); continued as %s on %s",
            self.request_id,
            failed.backend,
            len(self._join.generated),
            failed.message,
            dispatch.request_id,
            dispatch.decode.label,
        )
        m.child(m.migrations, "resumed").inc()
        self._join.next_segment()
        dispatch.hand_over(self._may_continue)
        self._current = dispatch
        return None

    async def close(self) -> None:
        """Close the current dispatch (failed ones were closed when the stream left them)."""
        await self._current.close()


class _Rewriting:
    """An outlet that writes each batch of D's events as the client gets it
    (:meth:`Migrating._rewrite`) to the outlet under it."""

    __slots__ = ("_outlet", "_rewrite", "ready")

    def __init__(self, outlet: Outlet, rewrite: Callable[[bytes], bytes]) -> None:
        self._outlet = outlet
        self._rewrite = rewrite
        self.ready = outlet.ready
        """The outlet's own (asked before every spliced write: no call of ours around it)."""

    def write(self, data: bytes) -> None:
        out = self._rewrite(data)
        if out:
            self._outlet.write(out)


def _json(data: bytes) -> Any:
    try:
        return codec.loads(data)
    except ValueError:
        return None
