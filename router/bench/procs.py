"""Child processes of a benchmark (fake backends, routers): start, wait ready, stop.

Who calls it: the overhead benchmark and the scenario runner. Each :class:`ManagedProcess` stops
only the process it started (SIGTERM, then SIGKILL after a grace period, by pid), and its output
goes to a log file so a failed start can be diagnosed.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from types import TracebackType

import httpx


class ProcessStartError(RuntimeError):
    """A child process exited or never became ready; the message holds its log tail."""


def free_port() -> int:
    """A currently free loopback TCP port."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
        return port


def _log_tail(path: Path, chars: int = 2000) -> str:
    try:
        return path.read_text(errors="replace")[-chars:]
    except OSError:
        return ""


class ManagedProcess:
    """A child process with a readiness URL; use as a context manager."""

    def __init__(
        self,
        name: str,
        argv: Sequence[str],
        ready_url: str,
        log_path: Path,
        env: Mapping[str, str] | None = None,
        ready_timeout_s: float = 60.0,
    ) -> None:
        self.name = name
        self._argv = list(argv)
        self._ready_url = ready_url
        self.log_path = log_path
        self._env = dict(env) if env is not None else None
        self._ready_timeout_s = ready_timeout_s
        self._proc: subprocess.Popen[bytes] | None = None

    @property
    def pid(self) -> int | None:
        return self._proc.pid if self._proc else None

    def start(self) -> ManagedProcess:
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        with self.log_path.open("wb") as log:
            self._proc = subprocess.Popen(
                self._argv, stdout=log, stderr=subprocess.STDOUT, env=self._env
            )
        deadline = time.monotonic() + self._ready_timeout_s
        with httpx.Client(timeout=httpx.Timeout(2.0)) as client:
            while time.monotonic() < deadline:
                if self._proc.poll() is not None:
                    raise ProcessStartError(
                        f"{self.name} exited with {self._proc.returncode}:\n"
                        f"{_log_tail(self.log_path)}"
                    )
                try:
                    if client.get(self._ready_url).status_code == 200:
                        return self
                except httpx.HTTPError:
                    pass
                time.sleep(0.2)
        self.stop()
        raise ProcessStartError(
            f"{self.name} not ready after {self._ready_timeout_s}s:\n{_log_tail(self.log_path)}"
        )

    def stop(self, grace_s: float = 10.0) -> None:
        proc, self._proc = self._proc, None
        if proc is None or proc.poll() is not None:
            return
        os.kill(proc.pid, signal.SIGTERM)
        try:
            proc.wait(timeout=grace_s)
        except subprocess.TimeoutExpired:
            os.kill(proc.pid, signal.SIGKILL)
            proc.wait(timeout=grace_s)

    def __enter__(self) -> ManagedProcess:
        return self.start()

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.stop()
