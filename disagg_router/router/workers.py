"""``serve --workers N``: N router processes accepting on one listening socket.

Who calls it: :func:`disagg_router.router.cli.main` for ``serve --workers N`` (N > 1). The
supervisor (this process) binds the socket, starts N workers and waits. Each worker is a process of
its own group (a terminal's Ctrl-C reaches the supervisor only) that loads the config file, logs as
``serve`` does and runs :func:`disagg_router.router.server.serve` on the inherited socket, so every
worker drains on SIGTERM exactly as the single-process server does: new requests get 503 with
``Retry-After`` while it keeps accepting, requests in flight get ``drain.timeout``.

Signals to the supervisor: SIGTERM or SIGINT closes its copy of the socket and sends SIGTERM
to every worker (a second one stops them at once); SIGHUP is passed on to every worker, which
reloads the file as ``serve`` does. A worker that dies is replaced, unless it failed at start
(exit status 3, uvicorn's start-up failure, or the config file invalid by then), which stops them
all (each draining) and exits with status 1. A worker whose supervisor dies drains and stops.

Metrics: the supervisor creates a temporary directory, names it in ``PROMETHEUS_MULTIPROC_DIR``
before the first worker starts (so every worker's metrics are prometheus_client's shared-file
kind, and ``/metrics`` from any worker shows the sum over all of them), marks each exited
worker's files dead (its live gauges stop counting; its counters keep their totals) and removes
the directory when it exits.
"""

from __future__ import annotations

import logging
import multiprocessing
import os
import shutil
import signal
import socket
import sys
import tempfile
import threading
from multiprocessing.connection import Connection, wait
from multiprocessing.process import BaseProcess
from pathlib import Path

from prometheus_client.multiprocess import mark_process_dead
from uvicorn.config import STARTUP_FAILURE

from disagg_router.router.errors import ConfigError
from disagg_router.router.observability.metrics import MULTIPROC_ENV

log = logging.getLogger(__name__)

_STOP = (signal.SIGTERM, signal.SIGINT)
_SPAWN = multiprocessing.get_context("spawn")


def _watch_parent(alive: Connection) -> None:
    """In a worker: wait until the supervisor is gone (its end of the pipe closes), then stop."""
    try:
        alive.recv()
    except EOFError:
        os.kill(os.getpid(), signal.SIGTERM)


def worker_main(
    sock: socket.socket, config_path: str, host: str, port: int, log_level: str, alive: Connection
) -> None:
    """One worker process: ``serve`` on ``sock`` from the file at ``config_path``."""
    from disagg_router.router.config import load_config
    from disagg_router.router.observability.reqlog import configure_logging
    from disagg_router.router.server import serve

    os.setpgid(0, 0)
    try:
        settings = load_config(config_path, on_deprecated=lambda _: None)  # ``serve`` logged
    except ConfigError as exc:  # the file turned invalid since the supervisor checked it
        print(f"invalid config {config_path}: {exc.message}", file=sys.stderr)
        sys.exit(STARTUP_FAILURE)
    configure_logging(settings.logging, log_level)
    threading.Thread(target=_watch_parent, args=(alive,), daemon=True).start()
    serve(settings, host, port, log_level, config_path=Path(config_path), sockets=[sock])


class Supervisor:
    """Starts, replaces and stops the workers (see the module doc); runs on the main thread."""

    def __init__(
        self,
        sock: socket.socket,
        config_path: Path,
        host: str,
        port: int,
        level: str,
        metrics_dir: str,
    ):
        """``metrics_dir``: the workers' shared metrics directory, already in the environment."""
        self._sock = sock
        self._args = (str(config_path), host, port, level)
        self._metrics_dir = metrics_dir
        self._workers: dict[int, tuple[BaseProcess, Connection]] = {}
        self._wake_r, self._wake_w = socket.socketpair()
        self._signals: list[int] = []

    def _start_worker(self) -> None:
        reader, writer = _SPAWN.Pipe(duplex=False)  # the worker's: closed when we are gone
        process = _SPAWN.Process(target=worker_main, args=(self._sock, *self._args, reader))
        process.start()
        reader.close()
        self._workers[process.sentinel] = (process, writer)

    def _on_signal(self, sig: int, frame: object) -> None:
        self._signals.append(sig)

    def _send(self, sig: int) -> None:
        for process, _ in self._workers.values():
            if process.pid is not None and process.exitcode is None:
                os.kill(process.pid, sig)

    def run(self, workers: int) -> int:
        """Serve until stopped; the exit status (1 when a worker failed at start)."""
        self._wake_w.setblocking(False)
        previous = signal.set_wakeup_fd(self._wake_w.fileno())
        for sig in (*_STOP, signal.SIGHUP):
            signal.signal(sig, self._on_signal)
        try:
            for _ in range(workers):
                self._start_worker()
            return self._loop()
        finally:
            signal.set_wakeup_fd(previous)

    def _loop(self) -> int:
        stopping = failed = False
        while self._workers:
            ready = wait([self._wake_r, *self._workers], timeout=60)
            if self._wake_r in ready:
                self._wake_r.recv(4096)
            while self._signals:
                sig = self._signals.pop(0)
                if sig == signal.SIGHUP:
                    self._send(signal.SIGHUP)
                    continue
                log.info("%s: stopping %d worker(s)", signal.Signals(sig).name, len(self._workers))
                stopping = True
                self._sock.close()
                self._send(signal.SIGTERM)
            for sentinel in [s for s in ready if s in self._workers]:
                failed |= self._reap(sentinel, stopping or failed)
            if failed and not stopping:
                stopping = True
                self._sock.close()
                self._send(signal.SIGTERM)
        return 1 if failed else 0

    def _reap(self, sentinel: object, stopping: bool) -> bool:
        """A worker has exited: replace it unless stopping; True when it failed at start."""
        assert isinstance(sentinel, int)
        process, writer = self._workers.pop(sentinel)
        process.join()
        writer.close()
        mark_process_dead(process.pid, self._metrics_dir)  # type: ignore[no-untyped-call]
        if process.exitcode == STARTUP_FAILURE:
            log.error("worker %s failed to start; stopping", process.pid)
            return True
        if not stopping:
            log.warning("worker %s exited (%s); starting another", process.pid, process.exitcode)
            self._start_worker()
        return False


def run_workers(config_path: Path, host: str, port: int, level: str, workers: int) -> int:
    """Bind ``host:port`` and serve it with ``workers`` worker processes until stopped."""
    from disagg_router.router.server import listening_socket

    try:
        sock = listening_socket(host, port)
    except OSError as exc:
        log.error("cannot listen on %s:%d: %s", host, port, exc)
        return STARTUP_FAILURE
    metrics_dir = tempfile.mkdtemp(prefix="disagg-router-metrics-")
    os.environ[MULTIPROC_ENV] = metrics_dir  # before any worker (and its metrics) exists
    try:
        supervisor = Supervisor(sock, config_path.resolve(), host, port, level, metrics_dir)
        return supervisor.run(workers)
    finally:
        del os.environ[MULTIPROC_ENV]
        shutil.rmtree(metrics_dir, ignore_errors=True)
