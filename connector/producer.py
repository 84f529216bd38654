"""P's half of the transfer core: match finished prefills with D registrations, WRITE, notify.

vLLM-independent. Who calls it: the P worker (``add_finished``/``abort`` from vLLM's engine
thread, ``take_released``/``take_records`` once per step) and the side-channel thread
(registrations and cancels from D). All NIXL calls happen on the ``dpc-writer`` thread.

Invariants: P's blocks for a request are reported released exactly once: when its WRITE is
done or failed, when its lease runs out without a registration, or at once when P failed it.
A WRITE is never *started* after D's budget for it has passed, and D's ``cancel`` is answered
``cancelled`` only when no WRITE for that key has been posted.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

from connector.config import ConnectorConfig
from connector.layout import descriptor_ids, transfer_bytes
from connector.nixl_backend import NixlEndpoint
from connector.protocol import (
    Notification,
    ProtocolError,
    Registration,
    Reply,
    decode_request,
    encode_notification,
    encode_reply,
    registration_from_body,
)
from connector.records import TransferRecord
from connector.side_channel import SideChannelServer

logger = logging.getLogger(__name__)


@dataclass
class _Finished:
    p_request_id: str
    block_ids: tuple[int, ...]
    expires_at: float


@dataclass
class _Registered:
    reg: Registration
    received_at: float
    start_by: float


@dataclass
class _Write:
    fin: _Finished
    reg: _Registered
    handle: object | None = None
    posted_at: float = 0.0
    num_blocks: int = 0
    num_bytes: int = 0


class PushProducer:
    """Owns P's side channel and writer thread; see the module docstring for the contract."""

    def __init__(
        self,
        endpoint: NixlEndpoint,
        engine_id: str,
        config: ConnectorConfig,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._ep = endpoint
        self._engine_id = engine_id
        self._cfg = config
        self._clock = clock
        self._lock = threading.Lock()
        self._wake = threading.Event()
        self._stop = threading.Event()
        self._finished: dict[str, _Finished] = {}
        self._registered: dict[str, _Registered] = {}
        self._failed: dict[str, tuple[str, float]] = {}  # key -> (reason, forget_at)
        self._cancelled: dict[str, float] = {}  # key -> forget_at
        self._ready: dict[str, _Write] = {}
        self._inflight: dict[str, _Write] = {}
        self._released: set[str] = set()
        self._records: list[TransferRecord] = []
        self._outbox: list[tuple[Registration, str]] = []  # fail notifications to send
        self._warm: dict[str, Registration] = {}  # D agents to connect to ahead of the WRITE
        self._known_agents: set[str] = set()
        self._server = SideChannelServer(
            config.side_channel_host, config.side_channel_port, self.handle_request
        )
        self.port = self._server.port
        self._thread = threading.Thread(target=self._run, name="dpc-writer", daemon=True)
        self._thread.start()

    # ---- engine thread -------------------------------------------------------------------
    def add_finished(self, key: str, p_request_id: str, block_ids: tuple[int, ...]) -> None:
        """P finished the prefill of ``key``; its blocks stay pinned until released."""
        now = self._clock()
        with self._lock:
            if key in self._cancelled or key in self._failed:
                self._released.add(p_request_id)
                return
            fin = _Finished(p_request_id, block_ids, now + self._cfg.lease_s)
            reg = self._registered.pop(key, None)
            if reg is None:
                self._finished[key] = fin
            else:
                self._ready[key] = _Write(fin, reg)
        self._wake.set()

    def abort(self, key: str, reason: str) -> None:
        """P failed or aborted ``key``: tell a registered D now, and a later one on arrival."""
        with self._lock:
            self._failed[key] = (reason, self._clock() + self._cfg.registration_ttl_s)
            reg = self._registered.pop(key, None)
            if reg is not None:
                self._outbox.append((reg.reg, reason))
        self._wake.set()

    def take_released(self) -> set[str]:
        """P request ids whose blocks vLLM may free now (each reported once)."""
        with self._lock:
            out, self._released = self._released, set()
        return out

    def take_records(self) -> list[TransferRecord]:
        with self._lock:
            out, self._records = self._records, []
        return out

    def pending_count(self) -> int:
        with self._lock:
            return len(self._finished) + len(self._ready) + len(self._inflight)

    def close(self) -> None:
        self._stop.set()
        self._wake.set()
        self._thread.join(timeout=5)
        self._server.close()

    # ---- side-channel thread -------------------------------------------------------------
    def handle_request(self, data: bytes) -> bytes:
        """Answer one side-channel request (register / cancel / ping)."""
        try:
            kind, body = decode_request(data)
            if kind == "ping":
                return encode_reply(Reply("pong"))
            if kind == "cancel":
                return encode_reply(self._cancel(str(body["transfer_key"])))
            if kind == "register":
                return encode_reply(self._register(registration_from_body(body)))
            raise ProtocolError(f"unknown request type {kind!r}")
        except (ProtocolError, KeyError) as exc:
            logger.warning("side channel: rejected request: %s", exc)
            return encode_reply(Reply("failed", f"protocol error: {exc}"))

    def _register(self, reg: Registration) -> Reply:
        if reg.p_engine_id != self._engine_id:
            return Reply("failed", f"engine id {reg.p_engine_id!r} is not {self._engine_id!r}")
        why = reg.d_layout.compatible_with(self._ep.layout)
        if why is not None:
            return Reply("failed", f"incompatible KV layout: {why}")
        if len(reg.block_ids) != 1:
            return Reply("failed", "only one KV cache group is supported")
        now = self._clock()
        entry = _Registered(reg, now, now + reg.budget_s)
        with self._lock:
            if reg.transfer_key in self._failed:
                return Reply("failed", self._failed[reg.transfer_key][0])
            if reg.transfer_key in self._cancelled:  # D's cancel overtook its registration
                return Reply("failed", "transfer was cancelled by D")
            fin = self._finished.pop(reg.transfer_key, None)
            if reg.d_agent_name not in self._known_agents:
                self._warm[reg.d_agent_name] = reg
            if fin is None:
                self._registered[reg.transfer_key] = entry
            else:
                self._ready[reg.transfer_key] = _Write(fin, entry)
        logger.debug("registration for %s (D request %s)", reg.transfer_key, reg.d_request_id)
        self._wake.set()
        return Reply("accepted")

    def _cancel(self, key: str) -> Reply:
        with self._lock:
            if key in self._inflight:
                return Reply("in_flight")
            self._cancelled[key] = self._clock() + self._cfg.registration_ttl_s
            write = self._ready.pop(key, None)
            reg = self._registered.pop(key, None)
            fin = self._finished.pop(key, None)
            if write is not None:
                fin = write.fin
            if fin is not None:
                self._released.add(fin.p_request_id)
        return Reply("cancelled" if (write or reg or fin) else "unknown")

    # ---- writer thread -------------------------------------------------------------------
    def _run(self) -> None:
        while not self._stop.is_set():
            busy = self._step()
            self._wake.wait(timeout=self._cfg.writer_poll_s if busy else 0.05)
            self._wake.clear()

    def _step(self) -> bool:
        now = self._clock()
        with self._lock:
            warm = list(self._warm.values())
            self._warm.clear()
            outbox, self._outbox = self._outbox, []
        for reg in warm:
            self._connect(reg)
        for reg, reason in outbox:
            self._notify_failed(reg, reason)
        with self._lock:
            ready = list(self._ready.items())
            self._ready.clear()
            for key, write in ready:
                self._inflight[key] = write  # visible to cancel before the post
        for key, write in ready:
            self._post(key, write, now)
        self._poll_inflight()
        self._ep.progress()
        self._expire(now)
        with self._lock:
            return bool(self._inflight or self._ready)

    def _connect(self, reg: Registration) -> None:
        """Load D's agent, prepare its descriptors and open the connection before any WRITE."""
        try:
            self._ep.prepare_remote(reg.d_agent_name, reg.d_agent_metadata, reg.d_layout)
            self._ep.connect(reg.d_agent_name)
        except (RuntimeError, ValueError) as exc:
            logger.warning("could not connect to D agent %s: %s", reg.d_agent_name, exc)
            return
        with self._lock:
            self._known_agents.add(reg.d_agent_name)

    def _post(self, key: str, write: _Write, now: float) -> None:
        reg = write.reg.reg
        if now > write.reg.start_by:
            self._finish(key, write, ok=False, reason="D's budget passed before the prefill")
            return
        d_blocks = list(reg.block_ids[0])
        p_blocks = list(write.fin.block_ids[reg.first_block : reg.first_block + len(d_blocks)])
        if len(p_blocks) != len(d_blocks):
            reason = f"P has {len(write.fin.block_ids)} blocks, D asked for {reg.first_block}+"
            self._finish(key, write, ok=False, reason=reason + str(len(d_blocks)))
            return
        try:
            self._ep.prepare_remote(reg.d_agent_name, reg.d_agent_metadata, reg.d_layout)
            local = descriptor_ids(self._ep.layout, p_blocks)
            remote = descriptor_ids(reg.d_layout, d_blocks)
            done = encode_notification(Notification("done", key, reg.d_request_id))
            write.handle = self._ep.write(reg.d_agent_name, local, remote, done)
        except (RuntimeError, ValueError) as exc:  # NIXL raises RuntimeError subclasses
            self._finish(key, write, ok=False, reason=f"WRITE could not be posted: {exc}")
            return
        write.posted_at = self._clock()
        write.num_blocks = len(d_blocks)
        write.num_bytes = transfer_bytes(reg.d_layout, len(d_blocks))

    def _poll_inflight(self) -> None:
        with self._lock:
            items = [(k, w) for k, w in self._inflight.items() if w.handle is not None]
        for key, write in items:
            state = self._ep.state(write.handle)
            if state == "DONE":
                self._finish(key, write, ok=True)
            elif state == "ERR":
                self._finish(key, write, ok=False, reason="NIXL reported the WRITE failed")
            elif self._clock() - write.posted_at > self._cfg.max_inflight_s:
                self._finish(key, write, ok=False, reason="WRITE did not complete in time")

    def _finish(self, key: str, write: _Write, ok: bool, reason: str = "") -> None:
        now = self._clock()
        if write.handle is not None:
            try:
                self._ep.release(write.handle)
            except RuntimeError as exc:
                logger.warning("release of WRITE handle for %s failed: %s", key, exc)
        reg = write.reg.reg
        if not ok:
            logger.warning(
                "transfer %s (P request %s) failed: %s", key, write.fin.p_request_id, reason
            )
            self._notify_failed(reg, reason)
        record = TransferRecord(
            side="writer",
            transfer_key=key,
            request_id=write.fin.p_request_id,
            ok=ok,
            num_blocks=write.num_blocks if ok else 0,
            num_bytes=write.num_bytes if ok else 0,
            write_s=(now - write.posted_at) if write.posted_at else 0.0,
            registration_to_write_s=now - write.reg.received_at,
            reason=reason,
        )
        with self._lock:
            self._inflight.pop(key, None)
            self._released.add(write.fin.p_request_id)
            self._records.append(record)

    def _notify_failed(self, reg: Registration, reason: str) -> None:
        note = encode_notification(
            Notification("failed", reg.transfer_key, reg.d_request_id, reason)
        )
        try:
            self._ep.prepare_remote(reg.d_agent_name, reg.d_agent_metadata, reg.d_layout)
            self._ep.send_notif(reg.d_agent_name, note)
        except RuntimeError as exc:
            logger.warning("fail notification for %s not sent: %s", reg.transfer_key, exc)

    def _expire(self, now: float) -> None:
        expired_regs: list[_Registered] = []
        with self._lock:
            for key, fin in list(self._finished.items()):
                if now >= fin.expires_at:
                    logger.warning(
                        "lease of %s (P request %s) ran out without a registration",
                        key,
                        fin.p_request_id,
                    )
                    del self._finished[key]
                    self._released.add(fin.p_request_id)
            for key, reg in list(self._registered.items()):
                if now >= reg.received_at + self._cfg.registration_ttl_s or now > reg.start_by:
                    del self._registered[key]
                    expired_regs.append(reg)
                    # A prefill finishing later is freed at once instead of after its lease.
                    self._cancelled[key] = now + self._cfg.registration_ttl_s
            for key, (_, forget_at) in list(self._failed.items()):
                if now >= forget_at:
                    del self._failed[key]
            for key, forget_at in list(self._cancelled.items()):
                if now >= forget_at:
                    del self._cancelled[key]
        with self._lock:
            for reg in expired_regs:
                self._outbox.append((reg.reg, "P never finished a prefill for this transfer"))
