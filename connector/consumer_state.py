"""D's transfer decisions, without threads, sockets or NIXL (driven by :mod:`connector.consumer`).

:class:`ConsumerState` turns D's work (register, cancel, forget a key) into side-channel requests
(:class:`Ask`), reads their answers, P's notifications and the clock, and decides when a
transfer is done or failed. Every method is thread-safe and takes its time from the injected
clock, so the unit tests drive it step by step with a fake clock.

Contract of :meth:`ConsumerState.take_results`: every registered D request id comes back exactly
once, in ``finished``; the failed ones also in ``failed``. A request id is only returned once no
WRITE into its blocks can still land (P said so, P finished, or P is unreachable), except after
the hard bound ``transfer_timeout_s + max_inflight_s``, which is logged as an error.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Literal

from connector.config import ConnectorConfig
from connector.errors import ConnectorError, ProtocolError, SideChannelRefusedError
from connector.layout import LayoutSpec, transfer_bytes
from connector.protocol import (
    Registration,
    Reply,
    decode_notification,
    encode_registration,
    encode_request,
)
from connector.records import TransferRecord
from connector.specs import KeyCancel, RecvSpec

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class Ask:
    """One side-channel request to send to the P at ``host:port``, and why."""

    kind: Literal["register", "cancel", "forget", "ping"]
    """``forget``: cancel of a key D never registered (best effort)."""
    host: str
    port: int
    payload: bytes
    transfer_key: str = ""
    d_request_id: str = ""
    reason: str = ""
    """``cancel``: the failure reason reported if P confirms the cancel."""


@dataclass
class _Pending:
    spec: RecvSpec
    sent_at: float
    deadline: float
    cancelling: bool = False
    aborted: bool = False
    """vLLM already finished the request (abort): report it, but not as a failed load."""

    @property
    def target(self) -> tuple[str, int]:
        return self.spec.host, self.spec.port


Answer = Reply | ConnectorError
"""What came back for an :class:`Ask`: P's reply, or why there is none."""


class ConsumerState:
    """D's bookkeeping and decisions; see the module docstring."""

    def __init__(
        self,
        config: ConnectorConfig,
        layout: LayoutSpec,
        agent_name: str,
        agent_metadata: bytes,
        clock: Callable[[], float],
    ) -> None:
        self._cfg = config
        self._layout = layout
        self._agent_name = agent_name
        self._metadata = agent_metadata
        self._clock = clock
        self._lock = threading.Lock()
        self._pending: dict[str, _Pending] = {}
        self._finished: set[str] = set()
        self._failed: set[str] = set()
        self._records: list[TransferRecord] = []
        self._ping_failures: dict[tuple[str, int], int] = {}
        self._next_ping = clock()

    # ---- engine thread -------------------------------------------------------------------
    def register(self, spec: RecvSpec) -> Ask:
        """Start waiting for ``spec``; returns the registration to send to its P."""
        now = self._clock()
        reg = Registration(
            transfer_key=spec.transfer_key,
            d_request_id=spec.d_request_id,
            p_engine_id=spec.p_engine_id,
            d_agent_name=self._agent_name,
            d_agent_metadata=self._metadata,
            d_layout=self._layout,
            block_ids=(tuple(spec.block_ids),),
            first_block=spec.first_block,
            budget_s=self._cfg.transfer_timeout_s,
        )
        with self._lock:
            self._pending[spec.d_request_id] = _Pending(
                spec, now, now + self._cfg.transfer_timeout_s
            )
        return Ask(
            "register",
            spec.host,
            spec.port,
            encode_registration(reg),
            transfer_key=spec.transfer_key,
            d_request_id=spec.d_request_id,
        )

    def cancel(self, d_request_id: str) -> Ask | None:
        """vLLM aborted the request: the cancel to send, unless one is under way already."""
        with self._lock:
            pending = self._pending.get(d_request_id)
            if pending is None:
                return None
            pending.aborted = True
            if pending.cancelling:  # a cancel is already under way (timeout)
                return None
            pending.cancelling = True
        return self._cancel_ask(d_request_id, pending, "aborted by D")

    def forget(self, cancel: KeyCancel) -> Ask:
        """D will never register ``cancel.transfer_key``: tell P so it frees the prefill."""
        payload = encode_request("cancel", {"transfer_key": cancel.transfer_key})
        return Ask("forget", cancel.host, cancel.port, payload, transfer_key=cancel.transfer_key)

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

    # ---- answers from the side channel -----------------------------------------------------
    def answer(self, ask: Ask, result: Answer) -> list[Ask]:
        """Take the outcome of ``ask``; returns follow-up requests to send at once."""
        if ask.kind == "register":
            return self._registration_answer(ask, result)
        if ask.kind == "cancel":
            self._cancel_answer(ask, result)
        elif ask.kind == "ping":
            self._ping_answer((ask.host, ask.port), result)
        elif isinstance(result, ConnectorError):
            logger.info("cancel of unregistered %s not delivered: %s", ask.transfer_key, result)
        return []

    def _registration_answer(self, ask: Ask, result: Answer) -> list[Ask]:
        rid = ask.d_request_id
        if isinstance(result, Reply):
            if result.status != "accepted":
                self._complete(rid, ok=False, reason=f"P refused: {result.reason}")
            return []
        if isinstance(result, SideChannelRefusedError):
            # Nothing was registered, so no WRITE can land: fail now.
            self._complete(rid, ok=False, reason=f"P unreachable: {result}")
            return []
        # P may have accepted it before the reply got lost: release only through a cancel.
        with self._lock:
            pending = self._pending.get(rid)
            if pending is None or pending.cancelling:
                return []
            pending.cancelling = True
        return [self._cancel_ask(rid, pending, f"registration unconfirmed: {result}")]

    def _cancel_answer(self, ask: Ask, result: Answer) -> None:
        rid = ask.d_request_id
        if isinstance(result, SideChannelRefusedError):
            self._complete(rid, ok=False, reason=f"{ask.reason}; P is gone")
        elif isinstance(result, ProtocolError):
            logger.warning("cancel of %s: bad reply: %s", ask.transfer_key, result)
        elif isinstance(result, ConnectorError):  # P may be alive but slow: wait (hard bound)
            logger.warning("cancel of %s not answered: %s", ask.transfer_key, result)
        elif result.status == "in_flight":
            with self._lock:  # a WRITE is landing: wait for its notification (bounded)
                pending = self._pending.get(rid)
                if pending is not None:
                    pending.deadline = self._clock() + self._cfg.max_inflight_s
        else:
            self._complete(rid, ok=False, reason=ask.reason)

    def _ping_answer(self, target: tuple[str, int], result: Answer) -> None:
        if isinstance(result, Reply):
            with self._lock:
                self._ping_failures.pop(target, None)
            return
        with self._lock:
            count = self._ping_failures.get(target, 0) + 1
            self._ping_failures[target] = count
            gone = isinstance(result, SideChannelRefusedError) and count >= 2
            victims = [rid for rid, p in self._pending.items() if gone and p.target == target]
        for rid in victims:  # P's process is gone: no WRITE can land any more
            self._complete(rid, ok=False, reason=f"P at {target[0]}:{target[1]} is gone")

    # ---- receiver thread -----------------------------------------------------------------
    def notifications(self, raw: Iterable[bytes]) -> None:
        """Take NIXL notifications: P's ``done`` (after the data landed) or ``failed``."""
        for data in raw:
            try:
                note = decode_notification(data)
            except ProtocolError as exc:
                logger.warning("ignoring notification: %s", exc)
                continue
            if note.kind == "done":
                self._complete(note.d_request_id, ok=True)
            else:
                self._complete(note.d_request_id, ok=False, reason=f"P failed: {note.reason}")

    def tick(self, now: float) -> list[Ask]:
        """Apply the time bounds; returns cancels for overdue transfers and, every
        ``liveness_interval_s``, a ping to each P that D still waits on, a cancel under way
        included (a P that dies while the cancel travels answers no cancel, only refusals)."""
        asks = self._expire(now)
        if now >= self._next_ping:
            self._next_ping = now + self._cfg.liveness_interval_s
            with self._lock:
                targets = {p.target for p in self._pending.values()}
            ping = encode_request("ping", {})
            asks += [Ask("ping", host, port, ping) for host, port in sorted(targets)]
        return asks

    def idle(self) -> bool:
        """No transfer is pending (the receiver then polls at its slow cadence)."""
        with self._lock:
            return not self._pending

    def _expire(self, now: float) -> list[Ask]:
        hard = self._cfg.transfer_timeout_s + self._cfg.max_inflight_s
        to_cancel: list[Ask] = []
        to_fail: list[str] = []
        with self._lock:
            for rid, pending in self._pending.items():
                if now < pending.deadline:
                    continue
                if now >= pending.sent_at + hard:
                    to_fail.append(rid)
                elif not pending.cancelling:
                    pending.cancelling = True
                    to_cancel.append(self._cancel_ask(rid, pending, "timed out waiting for P"))
        for rid in to_fail:
            logger.error("transfer for %s: hard bound passed, releasing", rid)
            self._complete(rid, ok=False, reason="timed out (hard bound)")
        return to_cancel

    # ---- completion ----------------------------------------------------------------------
    def _cancel_ask(self, rid: str, pending: _Pending, reason: str) -> Ask:
        key = pending.spec.transfer_key
        payload = encode_request("cancel", {"transfer_key": key})
        host, port = pending.target
        return Ask("cancel", host, port, payload, key, d_request_id=rid, reason=reason)

    def _complete(self, d_request_id: str, ok: bool, reason: str = "") -> None:
        now = self._clock()
        with self._lock:
            pending = self._pending.pop(d_request_id, None)
            if pending is None:
                return
            self._finished.add(d_request_id)
            if not ok and not pending.aborted:
                self._failed.add(d_request_id)
            num_blocks = len(pending.spec.block_ids)
            self._records.append(
                TransferRecord(
                    side="receiver",
                    transfer_key=pending.spec.transfer_key,
                    request_id=d_request_id,
                    ok=ok,
                    num_blocks=num_blocks if ok else 0,
                    num_bytes=transfer_bytes(self._layout, num_blocks) if ok else 0,
                    registration_to_write_s=now - pending.sent_at,
                    reason=reason,
                )
            )
        key = pending.spec.transfer_key
        if ok:
            logger.debug("transfer %s for %s received", key, d_request_id)
        elif pending.aborted:
            logger.info("transfer %s for %s released after abort", key, d_request_id)
        else:
            logger.warning("transfer %s for %s failed: %s", key, d_request_id, reason)
