"""D's half of the transfer core: register destination blocks with P, wait boundedly, report.

vLLM-independent. Who calls it: the D worker (``register``/``cancel`` from vLLM's engine thread,
``take_results`` once per step). Side-channel calls run on a small thread pool and NIXL
notifications are drained by the ``dpc-receiver`` thread, so the engine thread never blocks.

Contract of :meth:`take_results`: every registered D request id comes back exactly once, in
``finished``; the failed ones also in ``failed``. A request id is only returned once no WRITE into
its blocks can still land (P said so, P finished, or P is unreachable), except after the hard
bound ``transfer_timeout_s + max_inflight_s``, which is logged as an error.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

from connector.config import ConnectorConfig
from connector.layout import transfer_bytes
from connector.nixl_backend import NixlEndpoint
from connector.protocol import (
    ProtocolError,
    Registration,
    Reply,
    decode_notification,
    decode_reply,
    encode_registration,
    encode_request,
)
from connector.records import TransferRecord
from connector.side_channel import SideChannelError, request

logger = logging.getLogger(__name__)


@dataclass
class _Pending:
    key: str
    host: str
    port: int
    num_blocks: int
    sent_at: float
    deadline: float
    cancelling: bool = False
    aborted: bool = False
    """vLLM already finished the request (abort): report it, but not as a failed load."""


class PushConsumer:
    """Owns D's registrations and the receiver thread; see the module docstring."""

    def __init__(
        self,
        endpoint: NixlEndpoint,
        config: ConnectorConfig,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._ep = endpoint
        self._cfg = config
        self._clock = clock
        self._metadata = endpoint.metadata()
        self._lock = threading.Lock()
        self._pending: dict[str, _Pending] = {}
        self._finished: set[str] = set()
        self._failed: set[str] = set()
        self._records: list[TransferRecord] = []
        self._ping_failures: dict[tuple[str, int], int] = {}
        self._pool = ThreadPoolExecutor(max_workers=4, thread_name_prefix="dpc-sidechan")
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="dpc-receiver", daemon=True)
        self._thread.start()

    # ---- engine thread -------------------------------------------------------------------
    def register(
        self,
        d_request_id: str,
        transfer_key: str,
        p_engine_id: str,
        host: str,
        port: int,
        block_ids: tuple[int, ...],
        first_block: int,
    ) -> None:
        """Ask P to write into ``block_ids`` (non-blocking; the answer arrives via results)."""
        now = self._clock()
        reg = Registration(
            transfer_key=transfer_key,
            d_request_id=d_request_id,
            p_engine_id=p_engine_id,
            d_agent_name=self._ep.name,
            d_agent_metadata=self._metadata,
            d_layout=self._ep.layout,
            block_ids=(tuple(block_ids),),
            first_block=first_block,
            budget_s=self._cfg.transfer_timeout_s,
        )
        with self._lock:
            self._pending[d_request_id] = _Pending(
                transfer_key, host, port, len(block_ids), now, now + self._cfg.transfer_timeout_s
            )
        self._pool.submit(self._send_registration, reg, host, port)

    def cancel(self, d_request_id: str) -> None:
        """D aborted the request: release its blocks once no WRITE can still land."""
        with self._lock:
            pending = self._pending.get(d_request_id)
            if pending is None:
                return
            pending.aborted = True
            if pending.cancelling:  # a cancel is already under way (timeout)
                return
            pending.cancelling = True
        self._pool.submit(self._send_cancel, d_request_id, pending, "aborted by D")

    def cancel_key(self, transfer_key: str, host: str, port: int) -> None:
        """Tell P that ``transfer_key`` will never be registered (best effort, non-blocking)."""
        self._pool.submit(self._send_key_cancel, transfer_key, host, port)

    def _send_key_cancel(self, transfer_key: str, host: str, port: int) -> None:
        try:
            self._ask(host, port, encode_request("cancel", {"transfer_key": transfer_key}))
        except (SideChannelError, ProtocolError) as exc:
            logger.info("cancel of unregistered %s not delivered: %s", transfer_key, exc)

    def take_results(self) -> tuple[set[str], set[str]]:
        """``(finished, failed)`` since the last call; ``failed`` is a subset of ``finished``."""
        with self._lock:
            finished, failed = self._finished, self._failed
            self._finished, self._failed = set(), set()
        return finished, failed

    def take_records(self) -> list[TransferRecord]:
        with self._lock:
            out, self._records = self._records, []
        return out

    def pending_count(self) -> int:
        with self._lock:
            return len(self._pending)

    def close(self) -> None:
        self._stop.set()
        self._thread.join(timeout=5)
        self._pool.shutdown(wait=False, cancel_futures=True)

    # ---- completion ----------------------------------------------------------------------
    def _complete(self, d_request_id: str, ok: bool, reason: str = "") -> None:
        now = self._clock()
        with self._lock:
            pending = self._pending.pop(d_request_id, None)
            if pending is None:
                return
            self._finished.add(d_request_id)
            if not ok and not pending.aborted:
                self._failed.add(d_request_id)
            nbytes = transfer_bytes(self._ep.layout, pending.num_blocks) if ok else 0
            self._records.append(
                TransferRecord(
                    side="receiver",
                    transfer_key=pending.key,
                    request_id=d_request_id,
                    ok=ok,
                    num_blocks=pending.num_blocks if ok else 0,
                    num_bytes=nbytes,
                    registration_to_write_s=now - pending.sent_at,
                    reason=reason,
                )
            )
        if ok:
            logger.debug("transfer %s for %s received", pending.key, d_request_id)
        elif pending.aborted:
            logger.info("transfer %s for %s released after abort", pending.key, d_request_id)
        else:
            logger.warning("transfer %s for %s failed: %s", pending.key, d_request_id, reason)

    # ---- side-channel pool ---------------------------------------------------------------
    def _ask(self, host: str, port: int, payload: bytes) -> Reply:
        return decode_reply(request(host, port, payload, self._cfg.connect_timeout_s))

    def _send_registration(self, reg: Registration, host: str, port: int) -> None:
        try:
            reply = self._ask(host, port, encode_registration(reg))
        except (SideChannelError, ProtocolError) as exc:
            if isinstance(exc.__cause__, ConnectionRefusedError):
                # Nothing was registered, so no WRITE can land: fail now.
                self._complete(reg.d_request_id, ok=False, reason=f"P unreachable: {exc}")
                return
            # P may have accepted it before the reply got lost: release only through a cancel.
            with self._lock:
                pending = self._pending.get(reg.d_request_id)
                if pending is None or pending.cancelling:
                    return
                pending.cancelling = True
            self._send_cancel(reg.d_request_id, pending, f"registration unconfirmed: {exc}")
            return
        if reply.status != "accepted":
            self._complete(reg.d_request_id, ok=False, reason=f"P refused: {reply.reason}")

    def _send_cancel(self, d_request_id: str, pending: _Pending, reason: str) -> None:
        payload = encode_request("cancel", {"transfer_key": pending.key})
        try:
            reply = self._ask(pending.host, pending.port, payload)
        except SideChannelError as exc:
            if isinstance(exc.__cause__, ConnectionRefusedError):
                self._complete(d_request_id, ok=False, reason=f"{reason}; P is gone")
            else:  # P may be alive but slow: wait until the hard bound
                logger.warning("cancel of %s not answered: %s", pending.key, exc)
            return
        except ProtocolError as exc:
            logger.warning("cancel of %s: bad reply: %s", pending.key, exc)
            return
        if reply.status == "in_flight":
            with self._lock:  # a WRITE is landing: wait for its notification (bounded)
                pending.deadline = self._clock() + self._cfg.max_inflight_s
            return
        self._complete(d_request_id, ok=False, reason=reason)

    # ---- receiver thread -----------------------------------------------------------------
    def _run(self) -> None:
        next_ping = self._clock()
        while not self._stop.is_set():
            self._drain_notifications()
            now = self._clock()
            self._expire(now)
            if now >= next_ping:
                next_ping = now + self._cfg.liveness_interval_s
                self._ping_producers()
            with self._lock:
                idle = not self._pending
            self._stop.wait(0.05 if idle else self._cfg.receiver_poll_s)

    def _drain_notifications(self) -> None:
        for raw in self._ep.take_notifs():
            try:
                note = decode_notification(raw)
            except ProtocolError as exc:
                logger.warning("ignoring notification: %s", exc)
                continue
            if note.kind == "done":
                self._complete(note.d_request_id, ok=True)
            else:
                self._complete(note.d_request_id, ok=False, reason=f"P failed: {note.reason}")

    def _expire(self, now: float) -> None:
        hard = self._cfg.transfer_timeout_s + self._cfg.max_inflight_s
        to_cancel: list[tuple[str, _Pending]] = []
        to_fail: list[tuple[str, _Pending]] = []
        with self._lock:
            for rid, pending in self._pending.items():
                if now < pending.deadline:
                    continue
                if now >= pending.sent_at + hard:
                    to_fail.append((rid, pending))
                elif not pending.cancelling:
                    pending.cancelling = True
                    to_cancel.append((rid, pending))
        for rid, pending in to_fail:
            logger.error("transfer %s for %s: hard bound passed, releasing", pending.key, rid)
            self._complete(rid, ok=False, reason="timed out (hard bound)")
        for rid, pending in to_cancel:
            self._pool.submit(self._send_cancel, rid, pending, "timed out waiting for P")

    def _ping_producers(self) -> None:
        with self._lock:
            targets = {(p.host, p.port) for p in self._pending.values() if not p.cancelling}
        for target in targets:
            self._pool.submit(self._ping, target)

    def _ping(self, target: tuple[str, int]) -> None:
        try:
            self._ask(target[0], target[1], encode_request("ping", {}))
        except (SideChannelError, ProtocolError) as exc:
            refused = isinstance(exc.__cause__, ConnectionRefusedError)
            with self._lock:
                count = self._ping_failures.get(target, 0) + 1
                self._ping_failures[target] = count
                victims = (
                    [rid for rid, p in self._pending.items() if (p.host, p.port) == target]
                    if refused and count >= 2
                    else []
                )
            for rid in victims:  # P's process is gone: no WRITE can land any more
                self._complete(rid, ok=False, reason=f"P at {target[0]}:{target[1]} is gone")
            return
        with self._lock:
            self._ping_failures.pop(target, None)
