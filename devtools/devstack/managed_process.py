"""Child processes with an HTTP readiness URL (fake backends, routers): start, wait ready, stop.

Who calls it: the overhead benchmark, the scenario runner and the demo (its router), from the
main thread. Each :class:`ManagedProcess` is a :class:`~devstack.process.ChildProcess` (own
process group, parent-death signal, log file) plus an HTTP readiness URL. Stopping it stops the
whole group it started, grandchildren included, and nothing else. A failed start stops the group
and raises :class:`ProcessStartError` with the log tail, so it can be diagnosed.
"""

from __future__ import annotations

import time
from collections.abc import Mapping, Sequence
from pathlib import Path

import httpx

from devstack.process import ChildProcess, ProcessSpec


class ProcessStartError(RuntimeError):
    """A child process exited or never became ready; the message holds its log tail."""


class ManagedProcess(ChildProcess):
    """A :class:`ChildProcess` that is started only once its readiness URL answers 200.

    Use as a context manager (or call :meth:`start`, then :meth:`~ChildProcess.stop`).
    """

    def __init__(
        self,
        name: str,
        argv: Sequence[str],
        ready_url: str,
        log_path: Path,
        env: Mapping[str, str] | None = None,
        ready_timeout_s: float = 60.0,
    ) -> None:
        super().__init__(
            ProcessSpec(name, tuple(argv), log_path, env=None if env is None else dict(env))
        )
        self._ready_url = ready_url
        self._ready_timeout_s = ready_timeout_s

    def start(self) -> ManagedProcess:
        """Launch and block until ``ready_url`` answers 200; on failure stop and raise."""
        super().start()
        deadline = time.monotonic() + self._ready_timeout_s
        with httpx.Client(timeout=httpx.Timeout(2.0)) as client:
            while time.monotonic() < deadline:
                code = self.poll()
                if code is not None:
                    self.stop()
                    raise ProcessStartError(f"{self.name} exited with {code}:\n{self.log_tail()}")
                try:
                    if client.get(self._ready_url).status_code == 200:
                        return self
                except httpx.HTTPError:
                    pass
                time.sleep(0.2)
        self.stop()
        raise ProcessStartError(
            f"{self.name} not ready after {self._ready_timeout_s}s:\n{self.log_tail()}"
        )

    def __enter__(self) -> ManagedProcess:
        return self.start()
