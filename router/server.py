"""Running the app under uvicorn with a graceful drain on SIGTERM/SIGINT.

Who calls it: ``disagg-router serve`` (:mod:`router.cli`). The first SIGTERM or SIGINT starts
the drain
(:meth:`router.lifecycle.Lifecycle.drain`: ``/ready`` and new requests answer 503, requests in
flight get ``drain.timeout`` seconds, the rest are aborted with both legs cancelled); then the
server stops. A second signal stops it at once. The header-size bound is also given to the HTTP
parser (``limits.max_header_bytes``).
"""

from __future__ import annotations

import asyncio
import gc
import logging
import socket
from pathlib import Path
from types import FrameType

import uvicorn
from fastapi import FastAPI

from router.config import RouterSettings
from router.http.app import create_app
from router.runtime import Runtime

log = logging.getLogger(__name__)


class DrainingServer(uvicorn.Server):
    """A uvicorn server whose first stop signal drains the router before it stops."""

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
        self._captured_signals.append(sig)
        self._loop.call_soon_threadsafe(self._start_drain)

    def _start_drain(self) -> None:
        self._drain_task = asyncio.ensure_future(self.drain())

    async def drain(self) -> None:
        """Drain the running router, then let the server stop."""
        runtime: Runtime | None = getattr(self._app.state, "runtime", None)
        if runtime is not None:
            aborted = await runtime.lifecycle.drain(self._drain_timeout)
            log.info("drained (%d request(s) aborted); stopping", aborted)
        self.should_exit = True


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


def serve(
    settings: RouterSettings,
    host: str,
    port: int,
    log_level: str,
    config_path: Path | None = None,
) -> None:
    """Run the router until a stop signal has drained it (``config_path``: reloaded on SIGHUP)."""
    app = create_app(settings, config_path=config_path)
    settle_heap()
    config = uvicorn.Config(
        app,
        host=host,
        port=port,
        log_level=log_level,
        access_log=False,
        # The router never reads the client's address; uvicorn's X-Forwarded-For handling
        # parsed it on every request (docs/benchmarks/README.md, "Router profile").
        proxy_headers=False,
        log_config=None,  # the process's logging (text or JSON) is set up by the CLI
        timeout_graceful_shutdown=5,
        timeout_keep_alive=int(settings.limits.keep_alive),
        h11_max_incomplete_event_size=settings.limits.max_header_bytes,
    )
    DrainingServer(config, app, settings.drain.timeout).run()
