"""A fleet of emulated engines in one process: each with its own HTTP port and KV event
publisher, all on one event loop in one thread, sharing one KV fabric.

Who uses it: the emulator's tests and smoke test, the fleet benchmarks, and ``python -m
devstack.emulator`` (serve a fleet until interrupted). :meth:`Fleet.instances` gives the router's
config entries of each role. ``stop()`` (or leaving the ``with`` block) closes every server,
publisher and task and joins the thread: nothing is left behind.

An engine's step loop that fails (a bug) is logged, counted in ``engine_failures`` and started
again on the same state, so one bad step does not silence an instance for the rest of a run.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import threading
import time
from collections.abc import Callable, Coroutine
from dataclasses import dataclass, replace
from typing import Any, Literal, TypeVar

import anyio
import msgspec
import uvicorn
import zmq.asyncio
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from devstack.burner import Burner
from devstack.emulator.app import Identity, create_app
from devstack.emulator.engine import Engine, Fabric
from devstack.emulator.profile import Profile
from devstack.emulator.tokens import Tokens
from devstack.fakes.kv_publisher import FakeKvPublisher
from disagg_router.router.routing.kv_wire import KvEvent
from disagg_router.router.server import listening_socket

log = logging.getLogger(__name__)
T = TypeVar("T")
Role = Literal["prefill", "decode"]
_EVENT_BUFFER = 10000  # batches kept for replay (vLLM's default buffer_steps)


@dataclass(frozen=True)
class FleetSpec:
    """What to emulate: ``prefill`` P and ``decode`` D engines of ``profile``, every time
    times ``scale``; ``transfer_mode`` is what P's answers report."""

    profile: Profile
    prefill: int
    decode: int
    scale: float = 1.0
    decode_num_blocks: int | None = None
    """D engines' KV cache in blocks when it differs from the profile's (as vLLM's
    ``--num-gpu-blocks-override`` cuts it)."""
    transfer_mode: str = "push"
    tokenizer_dir: str | None = None
    kv_events: bool = True
    control_port: int | None = None
    """Serve the fleet's own routes here: ``/health`` (every engine serving), ``/instances``
    (:meth:`Fleet.instances` of both roles), ``/stats`` (:meth:`Fleet.stats`), ``POST
    /members/{role}`` (:meth:`Fleet.add`) and ``DELETE /members/{name}`` (:meth:`Fleet.kill`)."""
    cpu_cores: tuple[int, ...] = ()
    """The cores of the engines the fleet starts with, in order (its P engines, then its D
    engines): each spends its steps on its core (:mod:`devstack.burner`: as CPU time, or as
    work where the profile has a ``work_rate``), as a vLLM CPU instance pinned there does.
    Engines beyond these, and those added later, sleep through their steps."""


@dataclass
class Member:
    """One engine of the fleet and where it is served."""

    name: str
    role: Role
    engine: Engine
    url: str
    publisher: FakeKvPublisher | None
    server: uvicorn.Server
    queue: asyncio.Queue[list[KvEvent]]


class Fleet:
    """Start with :meth:`start` (or ``with``); read :attr:`members` only through :meth:`call`."""

    def __init__(self, spec: FleetSpec) -> None:
        self.spec = spec
        self.members: list[Member] = []
        self.engine_failures = 0
        self.fabric = Fabric()
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, daemon=True)
        self._tasks: list[asyncio.Task[None]] = []
        self._servers: list[asyncio.Task[None]] = []
        self._ctx: zmq.asyncio.Context | None = None
        self._control: uvicorn.Server | None = None
        self._gone: list[Member] = []  # killed members, closed with the rest at stop()
        self._names: dict[Role, int] = {"prefill": -1, "decode": -1}
        self._tokens = Tokens(None)
        self._burners: list[Burner] = []

    def start(self) -> Fleet:
        self._thread.start()
        try:
            self._run(self._start(), timeout=60.0)
        except BaseException:
            self.stop()
            raise
        return self

    def stop(self) -> None:
        if self._thread.is_alive():
            with contextlib.suppress(TimeoutError):
                self._run(self._stop(), timeout=30.0)
            self._loop.call_soon_threadsafe(self._loop.stop)
            self._thread.join(timeout=10.0)
        if not self._thread.is_alive():
            self._loop.close()

    def __enter__(self) -> Fleet:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def call(self, fn: Callable[[], T]) -> T:
        """Run ``fn`` on the fleet's loop (where engine state may be read) and return its value."""

        async def on_loop() -> T:
            return fn()

        return self._run(on_loop(), timeout=30.0)

    def call_coroutine(self, work: Coroutine[Any, Any, T]) -> T:
        """Await ``work`` on the fleet's loop (e.g. :meth:`add`) and return its value."""
        return self._run(work, timeout=30.0)

    def instances(self, role: Role) -> list[dict[str, Any]]:
        """The router's config entries of ``role``'s instances (with their event endpoints)."""
        out = []
        for m in self.members:
            if m.role != role:
                continue
            entry: dict[str, Any] = {"url": m.url, "name": m.name}
            if m.publisher is not None:
                entry["kv_events_endpoint"] = m.publisher.endpoint
                entry["kv_replay_endpoint"] = m.publisher.replay_endpoint
            out.append(entry)
        return out

    def stats(self) -> dict[str, Any]:
        """Totals of the fleet (call on its loop): transfers, failures, per-engine counters."""
        engines = {
            m.name: {
                "steps": m.engine.counters.steps,
                "busy_s": m.engine.counters.busy_s,
                "lost_s": m.engine.counters.lost_s,
                "burner_failures": m.engine.counters.burner_failures,
                "requests": m.engine.counters.success,
                "prefix_queries": m.engine.pool.queries,
                "prefix_hits": m.engine.pool.hits,
                "preemptions": m.engine.scheduler.preemptions,
                "blocks_in_use": m.engine.pool.num_blocks - m.engine.pool.free_blocks,
            }
            for m in self.members
        }
        return {
            "transfers": self.fabric.transfers,
            "transfer_failures": self.fabric.failures,
            "engine_failures": self.engine_failures,
            "engines": engines,
        }

    def _serve_control(self, port: int) -> None:
        app = Starlette(
            routes=[
                Route("/health", lambda _: Response(status_code=200)),
                Route("/instances", lambda _: JSONResponse(self._both_roles())),
                Route("/stats", lambda _: JSONResponse(self.stats())),
                Route("/members/{role}", self._add_route, methods=["POST"]),
                Route("/members/{name}", self._kill_route, methods=["DELETE"]),
            ]
        )
        config = uvicorn.Config(
            app, host="127.0.0.1", port=port, log_level="warning", access_log=False, lifespan="off"
        )
        server = uvicorn.Server(config)
        self._control = server
        self._servers.append(self._spawn(server.serve, "control http", False))

    async def _add_route(self, request: Request) -> Response:
        role = request.path_params["role"]
        if role not in ("prefill", "decode"):
            return JSONResponse({"error": f"no role {role!r}"}, status_code=404)
        return JSONResponse(await self.add(role))

    async def _kill_route(self, request: Request) -> Response:
        name = request.path_params["name"]
        if not any(m.name == name for m in self.members):
            return JSONResponse({"error": f"no member {name!r}"}, status_code=404)
        return JSONResponse({"in_flight": self.kill(name)})

    async def add(self, role: Role) -> dict[str, Any]:
        """Start one more engine of ``role`` (on the fleet's loop); its router config entry."""
        self._names[role] += 1
        member = await self._member(role, f"{role[0]}{self._names[role]}", self._tokens)
        deadline = time.monotonic() + 30.0
        while not member.server.started:
            if time.monotonic() > deadline:
                raise RuntimeError(f"emulated engine {member.name} did not start")
            await asyncio.sleep(0.01)
        self.members.append(member)
        return next(e for e in self.instances(role) if e["name"] == member.name)

    def kill(self, name: str) -> list[str]:
        """Kill engine ``name`` as a process dies (on the fleet's loop): its requests end with
        their connections dropped, it answers nothing more, and it leaves :attr:`members`; the
        ids of the requests it had."""
        member = next(m for m in self.members if m.name == name)
        self.members.remove(member)
        self._gone.append(member)
        member.server.should_exit = True
        return member.engine.kill()

    def _both_roles(self) -> dict[str, Any]:
        return {"prefill": self.instances("prefill"), "decode": self.instances("decode")}

    def _run(self, work: Coroutine[Any, Any, T], timeout: float) -> T:
        return asyncio.run_coroutine_threadsafe(work, self._loop).result(timeout=timeout)

    async def _start(self) -> None:
        # Starlette's StreamingResponse loads anyio's asyncio backend on its first use: done
        # here, not in the first streamed answer of the process (about 0.1 s).
        await anyio.sleep(0)
        tokens = self._tokens = Tokens(self.spec.tokenizer_dir)
        self._ctx = zmq.asyncio.Context() if self.spec.kv_events else None
        roles: list[tuple[Role, int]] = [
            ("prefill", self.spec.prefill),
            ("decode", self.spec.decode),
        ]
        cores = iter(self.spec.cpu_cores)
        for role, count in roles:
            for i in range(count):
                core = next(cores, None)
                member = await self._member(role, f"{role[0]}{i}", tokens, core)
                self.members.append(member)
            self._names[role] = count - 1
        if self.spec.control_port is not None:
            self._serve_control(self.spec.control_port)
        deadline = time.monotonic() + 30.0
        servers = [m.server for m in self.members] + ([self._control] if self._control else [])
        while not all(server.started for server in servers):
            if time.monotonic() > deadline:
                raise RuntimeError("emulated engines did not start")
            await asyncio.sleep(0.01)

    async def _member(
        self, role: Role, name: str, tokens: Tokens, core: int | None = None
    ) -> Member:
        sock = listening_socket("127.0.0.1", 0)
        port = sock.getsockname()[1]
        publisher = (
            FakeKvPublisher(context=self._ctx, buffer_limit=_EVENT_BUFFER)
            if self._ctx is not None
            else None
        )
        queue: asyncio.Queue[list[KvEvent]] = asyncio.Queue()
        sink = queue.put_nowait if publisher is not None else None
        profile = self.spec.profile
        if role == "decode" and self.spec.decode_num_blocks is not None:
            profile = replace(profile, num_blocks=self.spec.decode_num_blocks)
        burner = None
        if core is not None:
            burner = await Burner(core, profile.work_rate).start()
            self._burners.append(burner)
        engine = Engine(profile, f"emulated-{name}", self.fabric, self.spec.scale, sink, burner)
        identity = Identity(engine.engine_id, "127.0.0.1", port, self.spec.transfer_mode)
        app = create_app(engine, identity, tokens)
        config = uvicorn.Config(
            app, log_level="warning", access_log=False, lifespan="off", timeout_graceful_shutdown=1
        )
        server = uvicorn.Server(config)
        member = Member(name, role, engine, f"http://127.0.0.1:{port}", publisher, server, queue)
        self._servers.append(
            self._spawn(lambda: server.serve(sockets=[sock]), f"{name} http", False)
        )
        self._spawn(engine.run, f"{name} engine", restart=True)
        if publisher is not None:
            self._spawn(lambda: _publish(publisher, queue), f"{name} events", restart=True)
        return member

    def _spawn(self, make: Callable[[], Any], what: str, restart: bool) -> asyncio.Task[None]:
        task = self._loop.create_task(make())
        self._tasks.append(task)

        def done(t: asyncio.Task[None]) -> None:
            if t.cancelled():
                return
            error = t.exception()
            if error is None:
                return
            self.engine_failures += 1
            log.error("emulated %s failed: %r", what, error, exc_info=error)
            if restart:
                self._spawn(make, what, restart)

        task.add_done_callback(done)
        return task

    async def _stop(self) -> None:
        for m in self.members:
            m.server.should_exit = True
        self.members += self._gone
        if self._control is not None:
            self._control.should_exit = True
        if self._servers:
            await asyncio.wait(self._servers, timeout=5.0)
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        for burner in self._burners:
            await burner.close()
        for m in self.members:
            if m.publisher is not None:
                await m.publisher.close()
        if self._ctx is not None:
            self._ctx.term()


async def _publish(publisher: FakeKvPublisher, queue: asyncio.Queue[list[KvEvent]]) -> None:
    """Send the engine's events in order, one batch per step, vLLM's framing."""
    while True:
        events = await queue.get()
        await publisher.publish(msgspec.msgpack.encode([time.time(), events]))
