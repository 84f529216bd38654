"""D's transfer decisions, without threads, sockets or NIXL (driven by
:mod:`disagg_router.connector.consumer`).

:class:`ConsumerState` turns D's work (register, cancel, forget a key) into side-channel requests
(:class:`Ask`), reads their answers, P's notifications and the clock, and decides when a
transfer is done or failed. Every method is thread-safe and takes its time from the injected
clock, so the unit tests drive it step by step with a fake clock.

Contract of :meth:`ConsumerState.take_results`: every registered D request id comes back exactly
once, in ``finished``; the failed ones also in ``failed``. A request id is only returned once no
WRITE into its blocks can still land from any P rank it takes KV heads from (each said so,
finished, or is unreachable), except after the hard bound ``transfer_timeout_s +
max_inflight_s``, which is logged as an error. Under tensor parallelism each D rank runs its own
state; vLLM reports a request finished once every D rank has (``KVOutputAggregator``).
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Literal

from disagg_router.connector.config import ConnectorConfig
from disagg_router.connector.errors import (
    ConnectorError,
    LayoutError,
    ProtocolError,
    SideChannelRefusedError,
)
from disagg_router.connector.layout import LayoutSpec, source_ranks, transfer_bytes
from disagg_router.connector.protocol import (
    Registration,
    Reply,
    decode_notification,
    encode_cancel,
    encode_registration,
    encode_request,
)
from disagg_router.connector.records import TransferRecord
from disagg_router.connector.specs import KeyCancel, RecvSpec

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class Ask:
    """One side-channel request to send to the P rank at ``host:port``, and why."""

    kind: Literal["register", "cancel", "forget", "ping"]
    """``forget``: cancel of a key D never registered (best effort)."""
    host: str
    port: int
    payload: bytes
    transfer_key: str = ""
    d_request_id: str = ""
    reason: str = ""
    """``cancel``: the failure reason reported if P confirms the cancel."""
    p_rank: int = 0
    """The P rank asked (its side channel listens on P's base port + rank)."""


@dataclass
class _Pending:
    """One D request waiting for its KV: one leg per P rank it takes heads from."""

    spec: RecvSpec
    sent_at: float
    deadline: float
    legs: dict[int, tuple[str, int]]
    """P rank -> its side channel, for the legs not resolved yet (no WRITE of theirs can land
    any more once resolved)."""
    cancelling: set[int] = field(default_factory=set)
    """P ranks a cancel is under way to."""
    cancel_retries: dict[int, tuple[float, str]] = field(default_factory=dict)
    """P rank -> (when, reason) of the next try of a cancel that got no answer."""
    aborted: bool = False
    """vLLM already finished the request (abort): report it, but not as a failed load."""
    failure: str = ""
    """Why the request failed (the first leg that failed); empty while none has."""


Answer = Reply | ConnectorError
"""What came back for an :class:`Ask`: P's reply, or why there is none."""


class ConsumerState:
    """D's bookkeeping and decisions for one D rank; see the module docstring."""

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
        self._follow_ups: list[Ask] = []  # cancels to the other P ranks of a failed request
        self._ping_failures: dict[tuple[str, int], int] = {}
        self._next_ping = clock()

    # ---- engine thread -------------------------------------------------------------------
    def _sources(self, p_tp_size: int, p_pp_size: int) -> tuple[int, ...]:
        """The P workers (vLLM ranks) this D rank takes its KV from (:func:`source_ranks`)."""
        lay = self._layout
        return source_ranks(lay.total_kv_heads, p_tp_size, p_pp_size, lay.tp_size, lay.tp_rank)

    def register(self, spec: RecvSpec) -> list[Ask]:
        """Start waiting for ``spec``; returns the registration to send to each P worker this
        D rank takes KV from: every pipeline stage's TP ranks holding its heads (P's base port +
        the worker's rank). A P tensor-parallel size that does not fit the model's heads fails
        the request at once."""
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
        pending = _Pending(spec, now, now + self._cfg.transfer_timeout_s, {})
        try:
            ranks = self._sources(spec.p_tp_size, spec.p_pp_size)
            legs = {p: (spec.host, spec.port + p) for p in ranks}
        except LayoutError as exc:  # nothing is asked of any P rank: fails at once
            pending.failure = f"P's tensor-parallel size {spec.p_tp_size} does not fit: {exc}"
            self._complete(pending)
            return []
        pending.legs = dict(legs)
        with self._lock:
            self._pending[spec.d_request_id] = pending
        payload = encode_registration(reg)
        key, rid = spec.transfer_key, spec.d_request_id
        return [
            Ask("register", host, port, payload, key, d_request_id=rid, p_rank=p)
            for p, (host, port) in legs.items()
        ]

    def cancel(self, d_request_id: str) -> list[Ask]:
        """vLLM aborted the request: the cancels to send to the P ranks it still waits on
        (none where one is under way already)."""
        with self._lock:
            pending = self._pending.get(d_request_id)
            if pending is None:
                return []
            pending.aborted = True
            return self._cancel_legs(d_request_id, pending, "aborted by D")

    def forget(self, cancel: KeyCancel) -> list[Ask]:
        """D will never register ``cancel.transfer_key``: tell the P ranks it takes heads from,
        so they free the prefill."""
        payload = encode_cancel(cancel.transfer_key, self._layout.tp_rank)
        try:
            ranks = self._sources(cancel.p_tp_size, cancel.p_pp_size)
        except LayoutError:
            ranks = tuple(range(cancel.p_tp_size * cancel.p_pp_size))
        return [
            Ask("forget", cancel.host, cancel.port + p, payload, cancel.transfer_key, p_rank=p)
            for p in ranks
        ]

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
            self._registration_answer(ask, result)
        elif ask.kind == "cancel":
            self._cancel_answer(ask, result)
        elif ask.kind == "ping":
            self._ping_answer((ask.host, ask.port), result)
        elif isinstance(result, ConnectorError):
            logger.info("cancel of unregistered %s not delivered: %s", ask.transfer_key, result)
        return self._take_follow_ups()

    def _registration_answer(self, ask: Ask, result: Answer) -> None:
        rid, rank = ask.d_request_id, ask.p_rank
        if isinstance(result, Reply):
            if result.status != "accepted":
                self._resolve(rid, rank, ok=False, reason=f"P refused: {result.reason}")
            return
        if isinstance(result, SideChannelRefusedError):
            # Nothing was registered, so no WRITE can land: fail now.
            self._resolve(rid, rank, ok=False, reason=f"P unreachable: {result}")
            return
        # P may have accepted it before the reply got lost: release only through a cancel.
        with self._lock:
            pending = self._pending.get(rid)
            if pending is None or rank not in pending.legs or rank in pending.cancelling:
                return
            pending.cancelling.add(rank)
            why = f"registration unconfirmed: {result}"
            self._follow_ups.append(self._cancel_ask(rid, pending, rank, why))

    def _cancel_answer(self, ask: Ask, result: Answer) -> None:
        rid, rank = ask.d_request_id, ask.p_rank
        if isinstance(result, SideChannelRefusedError):
            self._resolve(rid, rank, ok=False, reason=f"{ask.reason}; P is gone")
        elif isinstance(result, ProtocolError):
            logger.warning("cancel of %s: bad reply: %s", ask.transfer_key, result)
        elif isinstance(result, ConnectorError):  # P may be alive but slow: ask again
            logger.warning("cancel of %s not answered, trying again: %s", ask.transfer_key, result)
            with self._lock:
                pending = self._pending.get(rid)
                if pending is not None and rank in pending.cancelling:
                    when = self._clock() + self._cfg.liveness_interval_s
                    pending.cancel_retries[rank] = (when, ask.reason)
        elif result.status == "in_flight":
            with self._lock:  # a WRITE is landing: wait for its notification (bounded)
                pending = self._pending.get(rid)
                if pending is not None:
                    pending.deadline = self._clock() + self._cfg.max_inflight_s
        else:
            self._resolve(rid, rank, ok=False, reason=ask.reason)

    def _ping_answer(self, target: tuple[str, int], result: Answer) -> None:
        if isinstance(result, Reply):
            with self._lock:
                self._ping_failures.pop(target, None)
            return
        with self._lock:
            count = self._ping_failures.get(target, 0) + 1
            self._ping_failures[target] = count
            gone = isinstance(result, SideChannelRefusedError) and count >= 2
            victims = [
                (rid, rank)
                for rid, p in self._pending.items()
                for rank, where in p.legs.items()
                if gone and where == target
            ]
        for rid, rank in victims:  # P's process is gone: no WRITE can land any more
            self._resolve(rid, rank, ok=False, reason=f"P at {target[0]}:{target[1]} is gone")

    # ---- receiver thread -----------------------------------------------------------------
    def notifications(self, raw: Iterable[bytes]) -> None:
        """Take NIXL notifications: a P rank's ``done`` (after the data landed) or ``failed``."""
        for data in raw:
            try:
                note = decode_notification(data)
            except ProtocolError as exc:
                logger.warning("ignoring notification: %s", exc)
                continue
            if note.kind == "done":
                self._resolve(note.d_request_id, note.p_rank, ok=True)
            else:
                why = f"P failed: {note.reason}"
                self._resolve(note.d_request_id, note.p_rank, ok=False, reason=why)

    def tick(self, now: float) -> list[Ask]:
        """Apply the time bounds; returns cancels for overdue transfers and for the other P
        ranks of a failed one and, every ``liveness_interval_s``, a ping to each P rank that D
        still waits on, a cancel under way included (a P that dies while the cancel travels
        answers no cancel, only refusals). A cancel that got no answer is sent again one
        ``liveness_interval_s`` later, until P answers it or the hard bound passes."""
        asks = self._expire(now) + self._retry_cancels(now) + self._take_follow_ups()
        if now >= self._next_ping:
            self._next_ping = now + self._cfg.liveness_interval_s
            with self._lock:
                targets = {t for p in self._pending.values() for t in p.legs.values()}
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
                else:
                    to_cancel += self._cancel_legs(rid, pending, "timed out waiting for P")
        for rid in to_fail:
            logger.error("transfer for %s: hard bound passed, releasing", rid)
            self._fail_all(rid, "timed out (hard bound)")
        return to_cancel

    def _retry_cancels(self, now: float) -> list[Ask]:
        asks: list[Ask] = []
        with self._lock:
            for rid, pending in self._pending.items():
                due = [r for r, (when, _) in pending.cancel_retries.items() if when <= now]
                for rank in due:
                    _, reason = pending.cancel_retries.pop(rank)
                    asks.append(self._cancel_ask(rid, pending, rank, reason))
        return asks

    # ---- completion ----------------------------------------------------------------------
    def _take_follow_ups(self) -> list[Ask]:
        with self._lock:
            out, self._follow_ups = self._follow_ups, []
        return out

    def _cancel_legs(self, rid: str, pending: _Pending, reason: str) -> list[Ask]:
        """Cancels to every leg without one under way (caller holds the lock)."""
        ranks = [r for r in pending.legs if r not in pending.cancelling]
        pending.cancelling.update(ranks)
        return [self._cancel_ask(rid, pending, r, reason) for r in ranks]

    def _cancel_ask(self, rid: str, pending: _Pending, rank: int, reason: str) -> Ask:
        key = pending.spec.transfer_key
        payload = encode_cancel(key, self._layout.tp_rank)
        host, port = pending.legs[rank]
        return Ask("cancel", host, port, payload, key, rid, reason, p_rank=rank)

    def _fail_all(self, rid: str, reason: str) -> None:
        with self._lock:
            pending = self._pending.get(rid)
            ranks = list(pending.legs) if pending is not None else []
        for rank in ranks:
            self._resolve(rid, rank, ok=False, reason=reason)

    def _resolve(self, d_request_id: str, p_rank: int, ok: bool, reason: str = "") -> None:
        """A P rank's leg is over (no WRITE of its can land any more); the request completes
        when every leg is. The first failure fails the request and cancels the other legs."""
        with self._lock:
            pending = self._pending.get(d_request_id)
            if pending is None or p_rank not in pending.legs:
                return
            del pending.legs[p_rank]
            pending.cancelling.discard(p_rank)
            pending.cancel_retries.pop(p_rank, None)
            if not ok and not pending.failure:
                pending.failure = reason or "failed"
                if pending.legs:
                    why = f"another P rank failed: {reason}"
                    self._follow_ups += self._cancel_legs(d_request_id, pending, why)
            if pending.legs:
                return
            del self._pending[d_request_id]
        self._complete(pending)

    def _complete(self, pending: _Pending) -> None:
        d_request_id = pending.spec.d_request_id
        ok, reason = not pending.failure, pending.failure
        now = self._clock()
        with self._lock:
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
