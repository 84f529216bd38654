"""P's transfer decisions, without threads, sockets or NIXL (driven by
:mod:`disagg_router.connector.producer`).

:class:`ProducerState` (one per P rank) matches finished prefills with D ranks' registrations,
plans the WRITEs (their descriptors over the bytes this rank sends that D rank, and the
notification), judges posted WRITEs, runs the leases and says whom to notify of a failure.
Every method is thread-safe and takes its time from the injected clock, so the unit tests drive
it step by step with a fake clock.

Invariants: P's blocks for a request are reported released exactly once: when the WRITE of
every D rank this P rank serves is done or failed, when its lease runs out (and no WRITE is
open), at once when P failed it or D cancelled it (once no WRITE is open), or at once on a rank
that only holds replicas of heads another rank sends. A WRITE is never *planned* after D's
budget for it has passed, and D's ``cancel`` is answered ``cancelled`` only when no WRITE into
that D rank has been planned.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from dataclasses import dataclass, field

from disagg_router.connector.config import ConnectorConfig
from disagg_router.connector.endpoint import XferState
from disagg_router.connector.errors import ProtocolError
from disagg_router.connector.layout import (
    DescriptorIndex,
    HeadTransfer,
    LayoutSpec,
    descriptor_index,
    head_transfer,
    is_source_rank,
    transfer_bytes,
)
from disagg_router.connector.protocol import (
    Notification,
    Registration,
    Reply,
    cancel_from_body,
    decode_request,
    encode_notification,
    encode_reply,
    registration_from_body,
)
from disagg_router.connector.records import TransferRecord
from disagg_router.connector.specs import SendAbort, SendSpec

logger = logging.getLogger(__name__)


Slot = tuple[str, int]
"""``(transfer key, D rank)``: one WRITE of one P rank into one D rank's blocks."""


@dataclass
class _Registered:
    reg: Registration
    received_at: float
    start_by: float
    remote_ids: DescriptorIndex
    """D's descriptor ids, computed on arrival while P still prefills (off the WRITE's path);
    empty when they do not fit D's layout (``remote_error`` says why)."""
    notif: bytes
    """The ``done`` notification, also encoded on arrival."""
    transfer: HeadTransfer
    """Which bytes of each block move, and the D ranks this P rank serves for the request."""
    remote_error: str = ""
    """Why D's block ids do not fit D's own layout (the WRITE then fails when planned)."""

    @property
    def d_rank(self) -> int:
        return self.reg.d_layout.tp_rank


def _registered(reg: Registration, now: float, transfer: HeadTransfer, p_rank: int) -> _Registered:
    """A registration with its WRITE's D-side half prepared: D's descriptor ids over the view
    of D's layout this P worker (vLLM rank ``p_rank``) writes (:meth:`HeadTransfer.d_view`)."""
    note = Notification("done", reg.transfer_key, reg.d_request_id, p_rank=p_rank)
    notif = encode_notification(note)
    start_by = now + reg.budget_s
    d_view = transfer.d_view(reg.d_layout)
    try:
        remote_ids = descriptor_index(d_view, reg.block_ids[0])
    except ValueError as exc:
        no_ids = descriptor_index(d_view, ())
        return _Registered(reg, now, start_by, no_ids, notif, transfer, str(exc))
    return _Registered(reg, now, start_by, remote_ids, notif, transfer)


@dataclass
class _Hold:
    """A finished prefill whose blocks this P rank keeps for the D ranks it serves."""

    spec: SendSpec
    lease_end: float
    finished_at: float
    """When the prefill finished (the engine thread's clock)."""
    expected: frozenset[int] | None = None
    """The D ranks that will register (known with the first registration)."""
    open: set[int] = field(default_factory=set)
    """D ranks whose WRITE is planned or posted."""
    served: set[int] = field(default_factory=set)
    """D ranks whose WRITE is over (done or failed)."""
    closed: bool = False
    """No more WRITEs start (D cancelled, or the lease ran out): freed once none is open."""


@dataclass
class Write:
    """One WRITE of P's blocks into one D rank's: prepared by the state once both halves are
    known (:func:`_write`), posted by the writer thread."""

    key: str
    fin: SendSpec
    entry: _Registered
    local_ids: DescriptorIndex | None = None
    """P's descriptor ids; ``None`` when ``error`` says why there are none."""
    num_blocks: int = 0
    num_bytes: int = 0
    error: str = ""
    """Why this WRITE may not be posted (it then fails when planned)."""
    handle: object | None = None
    posted_at: float = 0.0
    finished_at: float = 0.0
    """When P's prefill finished (the registration may have come before or after)."""

    @property
    def reg(self) -> Registration:
        return self.entry.reg

    @property
    def slot(self) -> Slot:
        return self.key, self.entry.d_rank

    @property
    def remote_ids(self) -> DescriptorIndex:
        """D's descriptor ids (prepared when the registration arrived)."""
        return self.entry.remote_ids

    @property
    def notif(self) -> bytes:
        """The ``done`` notification the WRITE carries."""
        return self.entry.notif


def _write(key: str, fin: SendSpec, entry: _Registered, layout: LayoutSpec) -> Write:
    """The WRITE of ``fin``'s blocks into ``entry``'s, with P's descriptor ids computed.

    Who calls it: the state, under its lock, when the second of the two halves arrives: the
    engine thread's :meth:`ProducerState.add_finished` (D registered during the prefill, the
    usual case) or the side channel's registration (the prefill finished first). So the
    writer thread, woken to post, finds the descriptors ready.
    """
    reg = entry.reg
    num_blocks = len(reg.block_ids[0])
    p_blocks = fin.block_ids[reg.first_block : reg.first_block + num_blocks]
    if len(p_blocks) != num_blocks:
        why = f"P has {len(fin.block_ids)} blocks, D asked for {reg.first_block}+{num_blocks}"
        return Write(key, fin, entry, error=why)
    try:
        local_ids = descriptor_index(layout, p_blocks)
    except ValueError as exc:
        return Write(key, fin, entry, error=f"WRITE could not be posted: {exc}")
    if entry.remote_error:
        return Write(key, fin, entry, error=f"WRITE could not be posted: {entry.remote_error}")
    num_bytes = transfer_bytes(entry.transfer.d_view(reg.d_layout), num_blocks)
    return Write(key, fin, entry, local_ids, num_blocks, num_bytes)


@dataclass(frozen=True)
class WriterWork:
    """What the writer thread does with the endpoint in one step."""

    connect: list[Registration]
    """D agents to load and connect to ahead of their first WRITE."""
    writes: list[Write]
    """WRITEs to post: budget and block counts checked, descriptors computed."""


class ProducerState:
    """P's bookkeeping and decisions for one P rank; see the module docstring."""

    def __init__(
        self,
        engine_id: str,
        layout: LayoutSpec,
        config: ConnectorConfig,
        clock: Callable[[], float],
    ) -> None:
        self._engine_id = engine_id
        self._layout = layout
        self._cfg = config
        self._clock = clock
        self._lock = threading.Lock()
        self._source = is_source_rank(layout.total_kv_heads, layout.tp_size, layout.tp_rank)
        self._holds: dict[str, _Hold] = {}  # key -> finished prefill kept for D
        self._registered: dict[str, dict[int, _Registered]] = {}  # key -> D rank -> waiting
        self._failed: dict[str, tuple[str, float]] = {}  # key -> (reason, forget_at)
        self._cancelled: dict[str, float] = {}  # key -> forget_at
        self._ready: dict[Slot, Write] = {}
        self._inflight: dict[Slot, Write] = {}
        self._released: set[str] = set()
        self._records: list[TransferRecord] = []
        self._outbox: list[tuple[Registration, str]] = []  # fail notifications to send
        self._warm: dict[str, Registration] = {}  # D agents to connect to ahead of the WRITE
        self._known_agents: set[str] = set()

    # ---- engine thread -------------------------------------------------------------------
    def add_finished(self, spec: SendSpec) -> None:
        """P finished this prefill; its blocks stay pinned until released. When D registered
        already, P's descriptor ids for the WRITE are computed here, on the calling (engine)
        thread: tens of microseconds, so the writer only checks and posts. A P rank that holds
        only replicas of heads another rank sends (:func:`is_source_rank`) frees at once."""
        key = spec.transfer_key
        now = self._clock()
        with self._lock:
            if key in self._cancelled or key in self._failed or not self._source:
                self._released.add(spec.p_request_id)
                return
            hold = self._holds[key] = _Hold(spec, now + self._cfg.lease_s, now)
            for entry in self._registered.pop(key, {}).values():
                self._match(key, hold, entry)

    def _match(self, key: str, hold: _Hold, entry: _Registered) -> None:
        """Pair a registration with the finished prefill (caller holds the lock)."""
        if hold.expected is None:
            hold.expected = entry.transfer.d_ranks
        hold.open.add(entry.d_rank)
        write = _write(key, hold.spec, entry, self._layout)
        write.finished_at = hold.finished_at
        self._ready[(key, entry.d_rank)] = write

    def _maybe_release(self, key: str) -> None:
        """Free the prefill once no WRITE is open and every D rank was served, or no more
        WRITEs may start (caller holds the lock)."""
        hold = self._holds.get(key)
        if hold is None or hold.open:
            return
        if hold.closed or (hold.expected is not None and hold.served >= hold.expected):
            del self._holds[key]
            self._released.add(hold.spec.p_request_id)

    def abort(self, spec: SendAbort) -> None:
        """P failed or aborted this prefill: tell registered D ranks now, later ones on arrival."""
        with self._lock:
            forget_at = self._clock() + self._cfg.registration_ttl_s
            self._failed[spec.transfer_key] = (spec.reason, forget_at)
            entries = self._registered.pop(spec.transfer_key, {})
            for entry in entries.values():
                self._outbox.append((entry.reg, spec.reason))
        logger.info(
            "prefill for %s failed (%s): telling D rank(s) %s now, refusing later registrations",
            spec.transfer_key,
            spec.reason,
            sorted(entries),
        )

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
        """Prefills whose blocks P still holds for a D."""
        with self._lock:
            return len(self._holds)

    # ---- side channel ----------------------------------------------------------------------
    def handle_request(self, data: bytes) -> bytes:
        """Answer one side-channel request frame (register / cancel / ping)."""
        try:
            kind, body = decode_request(data)
            if kind == "ping":
                return encode_reply(Reply("pong"))
            if kind == "cancel":
                return encode_reply(self.cancel(*cancel_from_body(body)))
            if kind == "register":
                return encode_reply(self.register(registration_from_body(body)))
            raise ProtocolError(f"unknown request type {kind!r}")
        except (ProtocolError, KeyError) as exc:
            logger.warning("side channel: rejected request: %s", exc)
            return encode_reply(Reply("failed", f"protocol error: {exc}"))

    def register(self, reg: Registration) -> Reply:
        """D rank ``reg.d_layout.tp_rank`` asks for its share of the KV of
        ``reg.transfer_key``: accept it, or refuse with the reason."""
        transfer = self.transfer_for(reg)
        reason = transfer if isinstance(transfer, str) else self._refusal(reg)
        if reason is None and not isinstance(transfer, str):
            reason = self._accept(reg, transfer)
        if reason is not None:
            logger.warning(
                "refused registration of %s from D agent %s: %s",
                reg.transfer_key,
                reg.d_agent_name,
                reason,
            )
            return Reply("failed", reason)
        logger.debug("registration for %s (D request %s)", reg.transfer_key, reg.d_request_id)
        return Reply("accepted")

    def transfer_for(self, reg: Registration) -> HeadTransfer | str:
        """What this P rank writes into ``reg``'s D rank (:func:`head_transfer`), or why not."""
        why = head_transfer(self._layout, reg.d_layout)
        return f"incompatible KV layout: {why}" if isinstance(why, str) else why

    def views(self, reg: Registration) -> tuple[LayoutSpec, LayoutSpec]:
        """``(P's, D's)`` layouts narrowed to the bytes moved for an accepted ``reg``: what the
        writer prepares NIXL's descriptor lists over."""
        transfer = self.transfer_for(reg)
        if isinstance(transfer, str):  # never accepted; a notification needs no descriptors
            return self._layout, reg.d_layout
        return transfer.views(self._layout, reg.d_layout)

    def _refusal(self, reg: Registration) -> str | None:
        if reg.p_engine_id != self._engine_id:
            return f"engine id {reg.p_engine_id!r} is not {self._engine_id!r}"
        if len(reg.block_ids) != 1:
            return "only one KV cache group is supported"
        return None

    def _accept(self, reg: Registration, transfer: HeadTransfer) -> str | None:
        entry = _registered(reg, self._clock(), transfer, self._layout.global_rank)
        key, d_rank = reg.transfer_key, entry.d_rank
        with self._lock:
            if key in self._failed:
                return self._failed[key][0]
            if key in self._cancelled:  # D's cancel overtook its registration
                return "transfer was cancelled by D"
            hold = self._holds.get(key)
            waiting = self._registered.get(key, {})
            if d_rank in waiting or (hold and d_rank in hold.open | hold.served):
                return f"D rank {d_rank} registered {key} twice"
            if reg.d_agent_name not in self._known_agents:
                self._warm[reg.d_agent_name] = reg
            if hold is None:
                self._registered.setdefault(key, {})[d_rank] = entry
            else:
                self._match(key, hold, entry)
        return None

    def cancel(self, key: str, d_rank: int = 0) -> Reply:
        """D rank ``d_rank`` gives up on ``key``: ``in_flight`` if its WRITE is planned or
        posted; else forget the key for every D rank (the request fails on D as a whole; the
        others get ``failed``) and answer ``cancelled``, or ``unknown`` if P held nothing."""
        with self._lock:
            if (key, d_rank) in self._inflight:
                return Reply("in_flight")
            self._cancelled[key] = self._clock() + self._cfg.registration_ttl_s
            entries = self._registered.pop(key, {})
            hold = self._holds.get(key)
            held = bool(entries) or hold is not None
            for rank, entry in entries.items():
                if rank != d_rank:
                    self._outbox.append((entry.reg, "transfer was cancelled by another D rank"))
            if hold is not None:
                hold.closed = True
                for rank in list(hold.open):
                    write = self._ready.pop((key, rank), None)
                    if write is not None:
                        hold.open.discard(rank)
                        if rank != d_rank:
                            self._outbox.append((write.reg, "transfer was cancelled by D"))
                self._maybe_release(key)
        return Reply("cancelled" if held else "unknown")

    # ---- writer thread ---------------------------------------------------------------------
    def plan(self, now: float) -> WriterWork:
        """Take the agents to connect and the WRITEs to post now; a WRITE that may not start
        (D's budget passed, P lacks the blocks D asked for) fails here instead."""
        with self._lock:
            warm = list(self._warm.values())
            self._warm.clear()
            ready = self._take_ready(list(self._ready.values()))
        writes = [w for w in ready if self._prepare(w, now)]
        return WriterWork(connect=warm, writes=writes)

    def plan_connected(self, now: float) -> list[Write]:
        """Take the ready WRITEs whose D agent is already connected (what the thread finishing
        a prefill may post at once); the others stay for :meth:`plan` on the writer thread."""
        with self._lock:
            ready = self._take_ready(
                [w for w in self._ready.values() if w.reg.d_agent_name in self._known_agents]
            )
        return [w for w in ready if self._prepare(w, now)]

    def _take_ready(self, writes: list[Write]) -> list[Write]:
        """Move ``writes`` from ready to in flight (caller holds the lock): visible to cancel
        before the post."""
        for write in writes:
            del self._ready[write.slot]
            self._inflight[write.slot] = write
        return writes

    def _prepare(self, write: Write, now: float) -> bool:
        """Whether ``write`` may be posted now; fails it here if not."""
        if now > write.entry.start_by:
            self.finish(write, ok=False, reason="D's budget passed before the prefill")
            return False
        if write.error:
            self.finish(write, ok=False, reason=write.error)
            return False
        return True

    def connected(self, agent_name: str) -> None:
        """The writer loaded and connected to this D agent."""
        with self._lock:
            self._known_agents.add(agent_name)

    def posted(self, write: Write, handle: object) -> None:
        """The writer posted ``write``; its handle is polled from now on."""
        write.posted_at = self._clock()
        write.handle = handle

    def to_poll(self) -> list[Write]:
        """Posted WRITEs not finished yet."""
        with self._lock:
            return [w for w in self._inflight.values() if w.handle is not None]

    def judge(self, write: Write, state: XferState) -> tuple[bool, str] | None:
        """``(ok, reason)`` once a posted WRITE is over (done, failed, or out of time), else
        ``None``. The caller releases the handle, then calls :meth:`finish`."""
        if state == "DONE":
            return True, ""
        if state == "ERR":
            return False, "NIXL reported the WRITE failed"
        if self._clock() - write.posted_at > self._cfg.max_inflight_s:
            return False, "WRITE did not complete in time"
        return None

    def finish(self, write: Write, ok: bool, reason: str = "") -> None:
        """Record the outcome, release P's blocks once every D rank it serves is done and, on
        failure, queue D's notification."""
        now = self._clock()
        if not ok:
            logger.warning(
                "transfer %s (P request %s) failed: %s", write.key, write.fin.p_request_id, reason
            )
        record = TransferRecord(
            side="writer",
            transfer_key=write.key,
            request_id=write.fin.p_request_id,
            ok=ok,
            num_blocks=write.num_blocks if ok else 0,
            num_bytes=write.num_bytes if ok else 0,
            write_s=(now - write.posted_at) if write.posted_at else 0.0,
            registration_to_write_s=now - write.entry.received_at,
            wait_for_registration_s=max(0.0, write.entry.received_at - write.finished_at),
            reason=reason,
        )
        with self._lock:
            self._inflight.pop(write.slot, None)
            hold = self._holds.get(write.key)
            if hold is not None:
                hold.open.discard(write.entry.d_rank)
                hold.served.add(write.entry.d_rank)
                self._maybe_release(write.key)
            self._records.append(record)
            if not ok:
                self._outbox.append((write.reg, reason))

    def take_notifications(self) -> list[tuple[Registration, bytes]]:
        """``failed`` notifications to send now, with the registration naming their D."""
        with self._lock:
            outbox, self._outbox = self._outbox, []
        rank = self._layout.global_rank
        return [
            (
                reg,
                encode_notification(
                    Notification("failed", reg.transfer_key, reg.d_request_id, why, p_rank=rank)
                ),
            )
            for reg, why in outbox
        ]

    def busy(self) -> bool:
        """Whether WRITEs are planned or in flight (the writer then polls at its fast cadence)."""
        with self._lock:
            return bool(self._inflight or self._ready)

    def expire(self, now: float) -> None:
        """Free prefills whose lease ran out before every D rank registered (a late one is
        refused), fail registrations whose prefill never came."""
        with self._lock:
            for key, hold in list(self._holds.items()):
                served = hold.expected is not None and hold.served >= hold.expected
                if now >= hold.lease_end and not hold.closed and not served:
                    logger.warning(
                        "lease of %s (P request %s) ran out without a registration from D "
                        "rank(s) %s",
                        key,
                        hold.spec.p_request_id,
                        sorted(set(hold.expected or {0}) - hold.served - hold.open),
                    )
                    hold.closed = True
                    self._failed[key] = (
                        "P's lease on the prefill ran out",
                        now + self._cfg.registration_ttl_s,
                    )
                    self._maybe_release(key)
            for key, entries in list(self._registered.items()):
                self._expire_registrations(key, entries, now)
            for key, (_, forget_at) in list(self._failed.items()):
                if now >= forget_at:
                    del self._failed[key]
            for key, forget_at in list(self._cancelled.items()):
                if now >= forget_at:
                    del self._cancelled[key]

    def _expire_registrations(self, key: str, entries: dict[int, _Registered], now: float) -> None:
        """Fail the registrations of ``key`` whose prefill never came (caller holds the lock)."""
        ttl = self._cfg.registration_ttl_s
        for rank, entry in list(entries.items()):
            if now >= entry.received_at + ttl or now > entry.start_by:
                del entries[rank]
                self._outbox.append((entry.reg, "P never finished a prefill for this transfer"))
                # A prefill finishing later is freed at once instead of after its lease.
                self._cancelled[key] = now + ttl
        if not entries:
            del self._registered[key]
