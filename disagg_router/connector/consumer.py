"""D's half of the transfer core: side-channel requests on a small pool and the ``dpc-receiver``
thread around :class:`~disagg_router.connector.consumer_state.ConsumerState` (which holds every
decision).

vLLM-independent. Who calls it: the D worker (``register``/``cancel``/``cancel_key`` from vLLM's
engine thread, ``take_results`` once per step); the engine thread never blocks on the network.
See :mod:`disagg_router.connector.consumer_state` for the contract of
:meth:`PushConsumer.take_results`.

Errors (:mod:`disagg_router.connector.supervision`): side-channel errors are answers the state
handles (the transfer fails or waits within its bounds); a NIXL error reading notifications is
counted and the receiver goes on (the deadlines and pings still bound every wait). A side-channel
task that raises anything else is counted and logged (its transfer ends by its bounds; the pool goes
on); anything else ending the receiver makes the instance unhealthy.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor

from disagg_router.connector.config import ConnectorConfig
from disagg_router.connector.consumer_state import Answer, Ask, ConsumerState
from disagg_router.connector.endpoint import Endpoint
from disagg_router.connector.errors import ProtocolError, SideChannelError, TransferError
from disagg_router.connector.protocol import decode_reply
from disagg_router.connector.records import TransferRecord
from disagg_router.connector.side_channel import request
from disagg_router.connector.specs import KeyCancel, RecvSpec
from disagg_router.connector.supervision import CoreHealth

Transport = Callable[[str, int, bytes, float], bytes]
"""``(host, port, request frame, timeout_s) -> reply frame``; raises
:class:`~disagg_router.connector.errors.SideChannelError` (see
:func:`disagg_router.connector.side_channel.request`)."""


def _all_done(futures: list[Future[None]]) -> Future[None]:
    """A future done when all of ``futures`` are, with the first one's error if any raised."""
    if len(futures) == 1:
        return futures[0]
    out: Future[None] = Future()
    left = [len(futures)]
    lock = threading.Lock()

    def one_done(_: Future[None]) -> None:
        with lock:
            left[0] -= 1
            if left[0]:
                return
        errors = [f.exception() for f in futures if not f.cancelled() and f.exception()]
        if errors and errors[0] is not None:
            out.set_exception(errors[0])
        else:
            out.set_result(None)

    if not futures:
        out.set_result(None)
    for future in futures:
        future.add_done_callback(one_done)
    return out


class PushConsumer:
    """Owns D's side-channel pool and receiver thread; see the module docstring."""

    def __init__(
        self,
        endpoint: Endpoint,
        config: ConnectorConfig,
        clock: Callable[[], float] = time.monotonic,
        transport: Transport = request,
        health: CoreHealth | None = None,
    ) -> None:
        self.health = health or CoreHealth()
        self._ep = endpoint
        self._cfg = config
        self._clock = clock
        self._transport = transport
        self._state = ConsumerState(
            config, endpoint.layout, endpoint.name, endpoint.metadata(), clock
        )
        self._pool = ThreadPoolExecutor(max_workers=4, thread_name_prefix="dpc-sidechan")
        self._stop = threading.Event()
        self._wake = threading.Event()  # a registration ends the receiver's idle wait
        self._thread = threading.Thread(
            target=self.health.run,
            args=("dpc-receiver", self._run),
            name="dpc-receiver",
            daemon=True,
        )
        self._thread.start()

    # ---- engine thread -------------------------------------------------------------------
    def register(self, spec: RecvSpec) -> Future[None]:
        """Ask each P rank this D rank takes heads from to write into ``spec.block_ids``
        (non-blocking; the outcome comes through :meth:`take_results`). The future is done
        once every P rank has answered (or could not)."""
        future = _all_done([self._submit(ask) for ask in self._state.register(spec)])
        self._wake.set()
        return future

    def cancel(self, d_request_id: str) -> None:
        """D aborted the request: release its blocks once no WRITE can still land."""
        for ask in self._state.cancel(d_request_id):
            self._submit(ask)

    def cancel_key(self, cancel: KeyCancel) -> None:
        """Tell P that a key will never be registered (best effort, non-blocking)."""
        for ask in self._state.forget(cancel):
            self._submit(ask)

    def take_results(self) -> tuple[set[str], set[str]]:
        """``(finished, failed)`` since the last call; ``failed`` is a subset of ``finished``.

        While a transfer is pending this first reads NIXL's notifications itself (a local,
        non-blocking call), so a WRITE that landed counts at the engine's next step instead of
        at the receiver's next poll; the receiver still reads them when the engine is idle.
        """
        if not self._state.idle():
            self._read_notifs()
        return self._state.take_results()

    def take_records(self) -> list[TransferRecord]:
        return self._state.take_records()

    def pending_count(self) -> int:
        return self._state.pending_count()

    def close(self) -> None:
        self._stop.set()
        self._wake.set()
        self._thread.join(timeout=5)
        self._pool.shutdown(wait=False, cancel_futures=True)

    # ---- side-channel pool ---------------------------------------------------------------
    def _submit(self, ask: Ask) -> Future[None]:
        future = self._pool.submit(self._send, ask)
        future.add_done_callback(self._sent)
        return future

    def _sent(self, future: Future[None]) -> None:
        """Notice a side-channel task that raised (its own errors are answers, see ``_send``)."""
        exc = None if future.cancelled() else future.exception()
        if exc is not None:
            self.health.survived("dpc-sidechan: side-channel task", exc)

    def _send(self, ask: Ask) -> None:
        result: Answer
        try:
            reply = self._transport(ask.host, ask.port, ask.payload, self._cfg.connect_timeout_s)
            result = decode_reply(reply)
        except (SideChannelError, ProtocolError) as exc:
            result = exc
        for follow_up in self._state.answer(ask, result):
            self._send(follow_up)

    # ---- receiver thread -----------------------------------------------------------------
    def _read_notifs(self) -> None:
        """Apply the notifications NIXL received (receiver thread; engine thread while busy)."""
        try:
            self._state.notifications(self._ep.take_notifs())
        except TransferError as exc:  # the deadlines and pings still bound every wait
            self.health.survived("dpc-receiver: reading NIXL notifications", exc)

    def _run(self) -> None:
        while not self._stop.is_set():
            self._read_notifs()
            for ask in self._state.tick(self._clock()):
                self._submit(ask)
            self._wake.wait(0.05 if self._state.idle() else self._cfg.receiver_poll_s)
            self._wake.clear()
