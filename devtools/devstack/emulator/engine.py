"""One emulated engine: the scheduler stepped in (scaled) real time, KV hand-over between
engines, and each request's token outlet.

Who uses it: :mod:`devstack.emulator.app` (one engine behind each HTTP app: it submits requests
and reads their outlets) and :class:`devstack.emulator.fleet.Fleet`, which runs every engine's
:meth:`Engine.run` on its event loop. Everything runs on that one loop; nothing here blocks.

Time: every duration the engine waits (a step, a transfer, a lease) is the profile's figure
times ``scale``, so a fleet too large for real time runs slower as a whole and every ratio
between its times holds. Steps follow :class:`StepClock`: a step that follows another starts
where that one ended, not when the loop woke the engine (the loop's timers wake up to a
millisecond late, which would otherwise add to every step). An engine given a
:class:`~devstack.burner.Burner` spends each step as CPU time on its core instead of
sleeping, so whatever else runs on that core stretches its steps (and no clock makes up for it).

KV hand-over (:class:`Fabric`, shared by the engines of one process): a finished P leg is held
under its key (the router's ``transfer_id``, else the request id); a D leg registers under the
same key once its blocks are allocated. Whichever comes second starts the transfer (the profile's
:class:`~devstack.emulator.profile.Transfer` time, with a handshake the first time the pair
meets); at its end P frees its blocks and D decodes. This is push when D registers before P
finishes and pull when after: the same matching as our connector's. A P whose KV nobody took
within ``kv_lease_s`` frees it; a D that waited that long for its P fails its request, as vLLM's
connectors time out.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from dataclasses import dataclass, field

from prometheus_client import CollectorRegistry, Histogram

from devstack.burner import Burner, BurnerGone
from devstack.emulator.blocks import BlockPool
from devstack.emulator.profile import Profile
from devstack.emulator.scheduler import Limits, Phase, Scheduler, Seq, Step
from disagg_router.connector.records import WAIT_FOR_REGISTRATION_BUCKETS
from disagg_router.router.routing.kv_wire import KvEvent

log = logging.getLogger(__name__)

EventSink = Callable[[list[KvEvent]], None]


KILLED = "the engine was killed"
"""The error of every request of an engine that :meth:`Engine.kill` ended."""


@dataclass
class Outlet:
    """What a request's HTTP handler reads: token indexes as they are produced, then the end."""

    queue: asyncio.Queue[int | None] = field(default_factory=asyncio.Queue)
    error: str | None = None


@dataclass
class Counters:
    """Lifetime totals, for ``/metrics`` (vLLM's counters of the same meaning)."""

    prompt_tokens: int = 0
    generation_tokens: int = 0
    success: int = 0
    steps: int = 0
    busy_s: float = 0.0  # emulated seconds spent in steps
    lost_s: float = 0.0  # loop seconds the engine woke later than its step clock could make up
    burner_failures: int = 0  # its burner ended under it (its steps sleep from then on)


MAX_LAG_S = 0.005
"""How late (loop seconds) the loop may wake an engine after a step's end and the next step still
starts at that end: more than the loop's timer lateness (up to a millisecond), less than what a
busy loop loses; beyond it the time is lost (:attr:`Counters.lost_s`)."""


@dataclass
class StepClock:
    """When each step of one engine ends, on the loop's clock (loop seconds).

    Who uses it: :meth:`Engine.run`, once per step; pure arithmetic, no waiting. A step right
    after another starts where that one ended, so a wake-up up to ``max_lag_s`` late is made up by
    the next step and the steps keep the profile's pace; later than that, the step starts
    ``max_lag_s`` before ``now`` and the rest is counted as lost. A step after the engine was
    idle starts ``now``."""

    max_lag_s: float = MAX_LAG_S
    _end: float | None = field(default=None, init=False, repr=False)

    def step_end(self, now: float, seconds: float, after_idle: bool) -> tuple[float, float]:
        """The end of a step of ``seconds`` that the engine starts at ``now``, and the loop
        seconds lost before it (0 unless the loop woke the engine more than ``max_lag_s``
        late)."""
        start, lost = now, 0.0
        if not after_idle and self._end is not None:
            start = max(self._end, now - self.max_lag_s)
            lost = max(0.0, now - self.max_lag_s - self._end)
        self._end = start + seconds
        return self._end, lost


WAIT_FOR_REGISTRATION = "disagg_push_wait_for_registration_seconds"


class Handovers:
    """Our connector's figures of the KV hand-overs an engine took part in, for its
    ``disagg_push_*`` metrics (emulated seconds): finished transfers (either side); as D, its
    blocks times the seconds from their registration to the KV's arrival; as P, how long each
    finished prefill waited for D's registration (0 when D registered first), a histogram in
    :data:`~disagg_router.connector.records.WAIT_FOR_REGISTRATION_BUCKETS` kept in
    ``registry`` (the engine's own, labelled with ``model``)."""

    def __init__(self, model: str) -> None:
        self.transfers = 0
        self.unwritten_block_s = 0.0
        self.registry = CollectorRegistry()
        self._waits = Histogram(
            WAIT_FOR_REGISTRATION,
            "P: prefill finished to D's registration (0: D registered first).",
            ["model_name"],
            buckets=WAIT_FOR_REGISTRATION_BUCKETS,
            registry=self.registry,
        ).labels(model)

    def waited(self, seconds: float) -> None:
        self._waits.observe(seconds)


class Engine:
    """One engine: its block pool, scheduler and step loop; ``engine_id`` names it to the
    fabric and in P's answers."""

    def __init__(
        self,
        profile: Profile,
        engine_id: str,
        fabric: Fabric,
        scale: float = 1.0,
        events: EventSink | None = None,
        burner: Burner | None = None,
    ) -> None:
        self.profile = profile
        self.burner = burner
        self.engine_id = engine_id
        self.scale = scale
        self.fabric = fabric
        self.pool = BlockPool(profile.num_blocks, profile.block_size)
        limits = Limits(profile.max_num_batched_tokens, profile.max_num_seqs)
        self.scheduler = Scheduler(self.pool, limits)
        self.counters = Counters()
        self.handovers = Handovers(profile.model)
        self._events = events
        self._outlets: dict[Seq, Outlet] = {}
        self._wake = asyncio.Event()
        self._clock = StepClock()
        self.dead = False
        fabric.join(self)

    def submit(self, seq: Seq) -> Outlet:
        """Queue ``seq``; its tokens arrive on the returned outlet."""
        outlet = Outlet()
        self._outlets[seq] = outlet
        self.counters.prompt_tokens += seq.prompt_len
        delay = self.profile.request_overhead_s * self.scale
        if delay > 0:
            asyncio.get_running_loop().call_later(delay, self._admit, seq)
        else:
            self._admit(seq)
        return outlet

    def _admit(self, seq: Seq) -> None:
        if seq in self._outlets:  # not aborted during the API server's part
            self.scheduler.add(seq)
            self._wake.set()

    def abort(self, seq: Seq) -> None:
        """The client left: drop ``seq`` and its blocks (also a held P leg's)."""
        self.fabric.forget(self, seq)
        self.scheduler.abort(seq)
        self._outlets.pop(seq, None)
        self._wake.set()

    def release(self, seq: Seq) -> None:
        """A held P leg's KV left (or its lease passed): free its blocks."""
        self.scheduler.release(seq)
        self._wake.set()

    def kv_arrived(self, seq: Seq) -> None:
        """D leg ``seq`` has its KV: it decodes from the next step."""
        self.scheduler.kv_arrived(seq)
        self._wake.set()

    def kill(self) -> list[str]:
        """The engine's process died: every request here ends at once with :data:`KILLED` (its
        handler drops the connection) and none is taken any more; their request ids."""
        self.dead = True
        seqs = list(self._outlets)
        for seq in seqs:
            self.fabric.forget(self, seq)
            self.fail(seq, KILLED)
        return sorted({seq.rid for seq in seqs})

    def fail(self, seq: Seq, reason: str) -> None:
        """End ``seq`` with an error its handler answers."""
        outlet = self._outlets.pop(seq, None)
        self.scheduler.abort(seq)
        if outlet is not None:
            outlet.error = reason
            outlet.queue.put_nowait(None)
        self._wake.set()

    async def sleep(self, seconds: float) -> None:
        """Wait ``seconds`` of emulated time."""
        await asyncio.sleep(seconds * self.scale)

    def now(self) -> float:
        """The event loop's clock in this engine's emulated seconds."""
        return asyncio.get_running_loop().time() / self.scale

    async def run(self) -> None:
        """The step loop; runs until cancelled."""
        idle = True
        while True:
            step = self.scheduler.schedule()
            for seq in self.scheduler.drain_registered():
                self.fabric.register(self, seq)
            if not step.items:
                self._wake.clear()
                await self._wake.wait()
                idle = True
                continue
            seconds = self.step_seconds(step)
            await self._pass_step(seconds * self.scale, idle)
            idle = False
            self.counters.steps += 1
            self.counters.busy_s += seconds
            self._deliver(self.scheduler.finish(step))
            events = self.pool.drain_events()
            if events and self._events is not None:
                self._events(events)

    async def _pass_step(self, seconds: float, after_idle: bool) -> None:
        """Let one step of ``seconds`` (loop seconds) pass: spent on the burner's core, else
        slept on the step clock. A burner that is gone is logged and counted, and the engine's
        steps sleep from then on."""
        if self.burner is not None:
            try:
                await self.burner.burn(seconds)
                return
            except BurnerGone as exc:
                log.error("engine %s: %s; its steps sleep from now on", self.engine_id, exc)
                self.burner = None
                self.counters.burner_failures += 1
        loop = asyncio.get_running_loop()
        end, lost = self._clock.step_end(loop.time(), seconds, after_idle)
        await asyncio.sleep(max(0.0, end - loop.time()))
        self.counters.lost_s += lost

    def step_seconds(self, step: Step) -> float:
        """The profile's duration of ``step``."""
        return self.profile.step.seconds(step.tokens, len(step.items), step.context, step.pairs)

    def _deliver(self, produced: list[Seq]) -> None:
        for seq in produced:
            self.counters.generation_tokens += 1
            outlet = self._outlets.get(seq)
            if outlet is None:
                continue
            outlet.queue.put_nowait(seq.generated - 1)
            if seq.phase in (Phase.DONE, Phase.HELD):
                outlet.queue.put_nowait(None)
                self.counters.success += 1
                del self._outlets[seq]
            if seq.phase is Phase.HELD:
                self.fabric.prefill_held(self, seq)


@dataclass(eq=False)
class _Side:
    engine: Engine
    seq: Seq
    since: float  # when it came to the fabric (the engine's emulated seconds)
    expiry: asyncio.TimerHandle | None = None


class Fabric:
    """Matches finished P legs with registered D legs by key and moves their KV."""

    def __init__(self) -> None:
        self._engines: dict[str, Engine] = {}
        self._held: dict[str, _Side] = {}
        self._waiting: dict[str, _Side] = {}
        self._keys: dict[Seq, str] = {}
        self._met: set[tuple[str, str]] = set()
        self._tasks: set[asyncio.Task[None]] = set()
        self.transfers = 0
        self.failures = 0

    def join(self, engine: Engine) -> None:
        self._engines[engine.engine_id] = engine

    def knows(self, engine_id: str) -> bool:
        return engine_id in self._engines

    def expect(self, seq: Seq, key: str) -> None:
        """``seq`` (a P leg or a D leg) hands over its KV under ``key``."""
        self._keys[seq] = key

    def prefill_held(self, engine: Engine, seq: Seq) -> None:
        key = self._keys.get(seq)
        if key is None:
            engine.release(seq)
            return
        side = _Side(engine, seq, engine.now())
        peer = self._waiting.pop(key, None)
        if peer is not None:
            self._start(side, peer, waited=0.0)  # D registered first
            return
        self._held[key] = side
        side.expiry = self._expire_later(key, self._held, engine)

    def register(self, engine: Engine, seq: Seq) -> None:
        key = self._keys.get(seq)
        if key is None:
            engine.fail(seq, "no KV transfer key")
            return
        side = _Side(engine, seq, engine.now())
        held = self._held.pop(key, None)
        if held is not None:
            self._start(held, side, waited=held.engine.now() - held.since)
            return
        self._waiting[key] = side
        side.expiry = self._expire_later(key, self._waiting, engine)

    def forget(self, engine: Engine, seq: Seq) -> None:
        """``seq`` ended early (aborted): drop what waits for it."""
        key = self._keys.pop(seq, None)
        for table in (self._held, self._waiting):
            side = table.get(key) if key is not None else None
            if side is not None and side.seq is seq:
                del table[key]  # type: ignore[arg-type]
                if side.expiry is not None:
                    side.expiry.cancel()

    def _expire_later(
        self, key: str, table: dict[str, _Side], engine: Engine
    ) -> asyncio.TimerHandle:
        loop = asyncio.get_running_loop()
        delay = engine.profile.kv_lease_s * engine.scale
        return loop.call_later(delay, self._expire, key, table)

    def _expire(self, key: str, table: dict[str, _Side]) -> None:
        side = table.pop(key, None)
        if side is None:
            return
        self._keys.pop(side.seq, None)
        self.failures += 1
        if side.seq.role == "prefill":
            side.engine.release(side.seq)
        else:
            side.engine.fail(side.seq, f"no KV from the prefill instance for {key}")

    def _start(self, p: _Side, d: _Side, waited: float) -> None:
        """Move ``p``'s KV to ``d``; P's prefill ``waited`` that long for D's registration."""
        p.engine.handovers.waited(waited)
        for side in (p, d):
            if side.expiry is not None:
                side.expiry.cancel()
            self._keys.pop(side.seq, None)
        task = asyncio.get_running_loop().create_task(self._transfer(p, d))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _transfer(self, p: _Side, d: _Side) -> None:
        pair = (p.engine.engine_id, d.engine.engine_id)
        first = pair not in self._met
        self._met.add(pair)
        await d.engine.sleep(d.engine.profile.transfer.seconds(p.seq.prompt_len, first))
        self.transfers += 1
        p.engine.handovers.transfers += 1
        d.engine.handovers.transfers += 1
        d.engine.handovers.unwritten_block_s += len(d.seq.blocks) * (d.engine.now() - d.since)
        p.engine.release(p.seq)
        d.engine.kv_arrived(d.seq)
