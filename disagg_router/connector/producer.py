"""P's half of the transfer core: the side channel and the ``dpc-writer`` thread around
:class:`~disagg_router.connector.producer_state.ProducerState` (which holds every decision).

vLLM-independent. Who calls it: the P worker (``add_finished``/``abort`` from vLLM's engine
thread, ``take_released``/``take_records`` once per step) and the side-channel thread
(registrations and cancels from D). The ``dpc-writer`` thread makes every endpoint call (connect,
post, poll, release, notify, progress) except one: with ``post_on_finish``, ``add_finished``
posts the WRITE to a D that already registered and is connected on the calling thread, saving
the writer's wake-up (off by default: docs/benchmarks/README.md, "Transfer efficiency"); the
writer polls it from then on. The endpoint's lock orders the two threads' calls. See
:mod:`disagg_router.connector.producer_state` for the invariants.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable

from disagg_router.connector.config import ConnectorConfig
from disagg_router.connector.endpoint import Endpoint
from disagg_router.connector.errors import TransferError
from disagg_router.connector.producer_state import ProducerState, Write
from disagg_router.connector.protocol import Registration
from disagg_router.connector.records import TransferRecord
from disagg_router.connector.side_channel import SideChannelServer
from disagg_router.connector.specs import SendAbort, SendSpec
from disagg_router.connector.supervision import CoreHealth


class PushProducer:
    """Owns P's side channel and writer thread; see the module docstring for the contract."""

    def __init__(
        self,
        endpoint: Endpoint,
        engine_id: str,
        config: ConnectorConfig,
        clock: Callable[[], float] = time.monotonic,
        health: CoreHealth | None = None,
    ) -> None:
        self._ep = endpoint
        self._cfg = config
        self._clock = clock
        self.health = health or CoreHealth()
        self._state = ProducerState(engine_id, endpoint.layout, config, clock)
        self._wake = threading.Event()
        self._stop = threading.Event()
        self._server = SideChannelServer(
            config.side_channel_host,
            config.side_channel_port,
            self.handle_request,
            on_error=self._side_channel_error,
            run=self.health.run,
        )
        self.port = self._server.port
        self._thread = threading.Thread(
            target=self.health.run, args=("dpc-writer", self._run), name="dpc-writer", daemon=True
        )
        self._thread.start()

    # ---- engine thread -------------------------------------------------------------------
    def add_finished(self, spec: SendSpec) -> None:
        """P finished this prefill; its blocks stay pinned until released. Posts its WRITE
        here when D is ready for it (``post_on_finish``; see the module doc)."""
        self._state.add_finished(spec)
        if self._cfg.post_on_finish:
            for write in self._state.plan_connected(self._clock()):
                self._post(write)
        self._wake.set()

    def abort(self, spec: SendAbort) -> None:
        """P failed or aborted this prefill: tell a registered D now, a later one on arrival."""
        self._state.abort(spec)
        self._wake.set()

    def take_released(self) -> set[str]:
        """P request ids whose blocks vLLM may free now (each reported once)."""
        return self._state.take_released()

    def take_records(self) -> list[TransferRecord]:
        return self._state.take_records()

    def pending_count(self) -> int:
        return self._state.pending_count()

    def close(self) -> None:
        self._stop.set()
        self._wake.set()
        self._thread.join(timeout=5)
        self._server.close()

    # ---- side-channel thread -------------------------------------------------------------
    def handle_request(self, data: bytes) -> bytes:
        """Answer one side-channel request (register / cancel / ping)."""
        reply = self._state.handle_request(data)
        self._wake.set()
        return reply

    def _side_channel_error(self, exc: BaseException) -> None:
        """A side-channel connection's handler raised: that D sees its request fail and keeps
        its own bounds; the server goes on."""
        self.health.survived("dpc-side-channel: request", exc)

    # ---- writer thread -------------------------------------------------------------------
    def _run(self) -> None:
        while not self._stop.is_set():
            busy = self._step()
            self._wake.wait(timeout=self._cfg.writer_poll_s if busy else 0.05)
            self._wake.clear()

    def _step(self) -> bool:
        now = self._clock()
        work = self._state.plan(now)
        for reg in work.connect:
            self._connect(reg)
        for write in work.writes:
            self._post(write)
        for write in self._state.to_poll():
            self._poll(write)
        self._state.expire(now)
        for reg, note in self._state.take_notifications():
            self._notify(reg, note)
        try:
            self._ep.progress()
        except TransferError as exc:  # WRITEs in flight are still judged by their own state
            self.health.survived("dpc-writer: NIXL progress", exc)
        return self._state.busy()

    def _prepare_remote(self, reg: Registration) -> None:
        """Load D's agent and prepare both sides' descriptor lists over the bytes this P rank
        writes into that D rank (whole blocks, or a head slice when their TP sizes differ)."""
        local, remote = self._state.views(reg)
        self._ep.prepare_remote(reg.d_agent_name, reg.d_agent_metadata, remote, local=local)

    def _connect(self, reg: Registration) -> None:
        """Load D's agent, prepare its descriptors and open the connection before any WRITE."""
        try:
            self._prepare_remote(reg)
            self._ep.connect(reg.d_agent_name)
        except TransferError as exc:  # the WRITE connects (or fails) when it is posted
            self.health.survived(f"dpc-writer: connect to D agent {reg.d_agent_name}", exc)
            return
        self._state.connected(reg.d_agent_name)

    def _post(self, write: Write) -> None:
        reg = write.reg
        assert write.local_ids is not None  # planning set them
        try:
            self._prepare_remote(reg)
            handle = self._ep.write(
                reg.d_agent_name, write.local_ids, write.remote_ids, write.notif
            )
        except TransferError as exc:
            self.health.survived(f"WRITE for {write.key}", exc)
            self._state.finish(write, ok=False, reason=f"WRITE could not be posted: {exc}")
            return
        self._state.posted(write, handle)

    def _poll(self, write: Write) -> None:
        try:
            verdict = self._state.judge(write, self._ep.state(write.handle))
        except TransferError as exc:
            self.health.survived(f"dpc-writer: state of the WRITE for {write.key}", exc)
            verdict = (False, f"WRITE state unknown: {exc}")
        if verdict is None:
            return
        try:
            self._ep.release(write.handle)
        except TransferError as exc:
            self.health.survived(f"dpc-writer: release of the WRITE handle for {write.key}", exc)
        self._state.finish(write, *verdict)

    def _notify(self, reg: Registration, note: bytes) -> None:
        try:
            self._prepare_remote(reg)
            self._ep.send_notif(reg.d_agent_name, note)
        except TransferError as exc:  # D's own bounds (timeout, pings) end its wait
            self.health.survived(f"dpc-writer: fail notification for {reg.transfer_key}", exc)
