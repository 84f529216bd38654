"""Running the app under uvicorn with a graceful drain on SIGTERM/SIGINT.

Who calls it: ``disagg-router serve`` (:mod:`disagg_router.router.cli`), and each worker of
``serve --workers N`` (:mod:`disagg_router.router.workers`). The first SIGTERM or SIGINT starts the
drain (:meth:`disagg_router.router.lifecycle.Lifecycle.drain`: ``/ready`` and new requests answer
503, requests in flight get ``drain.timeout`` seconds, the rest are aborted with both legs
cancelled); then the server stops. A second signal stops it at once. Client connections are bounded
in time and count by the HTTP protocol class (:mod:`disagg_router.router.http.protocol`).
"""

from __future__ import annotations

import asyncio
import gc
import logging
import math
import resource
import socket
from pathlib import Path
from types import FrameType

import uvicorn
from fastapi import FastAPI

from disagg_router.router.config import RouterSettings
from disagg_router.router.http.app import create_app
from disagg_router.router.http.protocol import protocol_class
from disagg_router.router.runtime import Runtime

log = logging.getLogger(__name__)


class DrainingServer(uvicorn.Server):
    """A uvicorn server whose first stop signal drains the router before it stops.

    Who builds it: :func:`serve`, and each worker of ``serve --workers N``
    (:mod:`disagg_router.router.workers`). The first SIGTERM/SIGINT starts :meth:`drain` on the
    event loop; when the drain is over, uvicorn's own :meth:`uvicorn.Server.handle_exit` is called
    with that signal, so the server stops (and re-raises it on exit) exactly as for an undrained
    signal. A second signal during the drain stops the server at once.
    """

    def __init__(self, config: uvicorn.Config, app: FastAPI, drain_timeout: float) -> None:
        super().__init__(config)
        self._app = app
        self._drain_timeout = drain_timeout
        self._loop: asyncio.AbstractEventLoop | None = None
        self._drain_task: asyncio.Task[None] | None = None

    async def startup(self, sockets: list[socket.socket] | None = None) -> None:
        self._loop = asyncio.get_running_loop()
        await super().startup(sockets)

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        if self._loop is None or self._drain_task is not None or self.should_exit:
            super().handle_exit(sig, frame)  # not started yet, or a second signal: stop now
            if self._drain_task is not None:
                self.force_exit = True
            return
        self._loop.call_soon_threadsafe(self._start_drain, sig)

    def _start_drain(self, sig: int) -> None:
        if self._drain_task is None:
            self._drain_task = asyncio.ensure_future(self.drain(sig))

    async def drain(self, sig: int) -> None:
        """Drain the running router, then stop the server as the signal ``sig`` would."""
        runtime: Runtime | None = getattr(self._app.state, "runtime", None)
        if runtime is not None:
            aborted = await runtime.lifecycle.drain(self._drain_timeout)
            log.info("drained (%d request(s) aborted); stopping", aborted)
        super().handle_exit(sig, None)


def settle_heap() -> None:
    """Collect start-up garbage, then exempt everything left (modules, the app) from the cyclic
    garbage collector's later passes.

    Who calls it: each serving process once, after its app is built and before it serves.
    Without it, each full collection walked the ~120,000 start-up objects: a 40-50 ms pause
    every few seconds at 500 req/s (docs/benchmarks/README.md, "Router overhead"). Objects
    created later are collected as before.
    """
    gc.collect()
    gc.freeze()


GRACEFUL_SHUTDOWN_S = 5
"""What uvicorn waits, after the router's own drain, for connections still answering (the
drain has already aborted every generation request; this covers the rest, e.g. a ``/metrics``
scrape)."""


def uvicorn_config(
    app: FastAPI, settings: RouterSettings, host: str, port: int, log_level: str
) -> uvicorn.Config:
    """The one uvicorn configuration of every serving process (``serve`` and each worker of
    ``serve --workers N``)."""
    return uvicorn.Config(
        app,
        host=host,
        port=port,
        log_level=log_level,
        access_log=False,
        # The router never reads the client's address; uvicorn's X-Forwarded-For handling
        # parsed it on every request (docs/benchmarks/README.md, "Router profile").
        proxy_headers=False,
        log_config=None,  # the process's logging (text or JSON) is set up by the CLI
        timeout_graceful_shutdown=GRACEFUL_SHUTDOWN_S,
        # The protocol closes an idle kept-alive connection after exactly limits.keep_alive;
        # uvicorn's own timer (whole seconds) must not close it earlier (int(0.5) is 0).
        timeout_keep_alive=math.ceil(settings.limits.keep_alive),
        http=protocol_class(settings.limits),
    )


def listening_socket(host: str, port: int) -> socket.socket:
    """A TCP socket bound to ``host:port`` (inheritable, not yet listening) for a server that is
    handed its socket; every connection it accepts under asyncio gets ``TCP_NODELAY``.

    Who calls it: the supervisor of ``serve --workers N`` (its workers accept on it), and the
    development servers that bind before they serve. asyncio turns Nagle's algorithm off only on
    sockets whose protocol reads ``IPPROTO_TCP``, and an accepted socket takes the listener's;
    uvicorn's ``Config.bind_socket`` leaves it 0 (uvicorn issue #3149), so a stream's small
    writes would wait for the client's delayed ACK (about 40 ms on Linux). ``OSError`` when the
    address cannot be bound."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM, socket.IPPROTO_TCP)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((host, port))
    except OSError:
        sock.close()
        raise
    sock.set_inheritable(True)
    return sock


def raise_fd_limit(settings: RouterSettings) -> None:
    """Raise this process's soft descriptor limit towards the hard one when it is below what
    ``limits.max_connections`` client connections plus as many upstream ones need."""
    need = 2 * settings.limits.max_connections + 256
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft != resource.RLIM_INFINITY and soft < need:
        target = need if hard == resource.RLIM_INFINITY else min(need, hard)
        resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
        if target < need:
            log.warning("descriptor limit %d < the %d limits.max_connections needs", hard, need)


def serve(
    settings: RouterSettings,
    host: str,
    port: int,
    log_level: str,
    config_path: Path | None = None,
    sockets: list[socket.socket] | None = None,
) -> None:
    """Run the router until a stop signal has drained it (``config_path``: reloaded on SIGHUP;
    ``sockets``: listen there instead of binding ``host:port``, as a worker does)."""
    raise_fd_limit(settings)
    app = create_app(settings, config_path=config_path)
    settle_heap()
    config = uvicorn_config(app, settings, host, port, log_level)
    DrainingServer(config, app, settings.drain.timeout).run(sockets)
