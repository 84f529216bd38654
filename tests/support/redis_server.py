"""A real ``redis-server`` for a test, on a Unix socket in a temporary directory of its own.

``running_redis()`` starts ``redis-server`` (no TCP port, no persistence, in the
foreground), waits until its socket answers PING (bounded), yields a :class:`RedisServer` whose
``url`` is ``unix://...``, and stops it on the way out, also when the test failed. A test can
stop it earlier with :meth:`RedisServer.stop` (the store going away), or freeze it for a while
with :meth:`RedisServer.paused` (a store that accepts but never answers). Without
``redis-server`` on PATH the test fails: ``deploy/ci/install-tools.sh`` installs it, and CI runs
that first.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest
import redis
import redis.exceptions

from tests.support.wait import wait_until

START_TIMEOUT_S = 10.0
STOP_TIMEOUT_S = 5.0
_PING_TIMEOUT_S = 0.2


class RedisServer:
    """One ``redis-server`` process serving ``socket``; :meth:`stop` ends it (idempotent)."""

    def __init__(self, binary: str, directory: Path) -> None:
        self.socket = directory / "redis.sock"
        self.log = directory / "redis.log"
        command = [binary, "--port", "0", "--unixsocket", str(self.socket)]
        command += ["--unixsocketperm", "700", "--save", "", "--appendonly", "no"]
        command += ["--daemonize", "no", "--dir", str(directory)]
        with self.log.open("wb") as log:
            self._process = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT)

    @property
    def url(self) -> str:
        return f"unix://{self.socket}"

    def wait_ready(self) -> None:
        wait_until(self._answers, timeout=START_TIMEOUT_S, what=f"redis-server on {self.socket}")

    @contextmanager
    def paused(self) -> Iterator[None]:
        """The server stopped (SIGSTOP) for the ``with`` block: it takes connections and
        commands into its socket buffers but answers nothing until it continues."""
        os.kill(self._process.pid, signal.SIGSTOP)
        try:
            yield
        finally:
            if self._process.poll() is None:
                os.kill(self._process.pid, signal.SIGCONT)

    def stop(self) -> None:
        """Terminate the server and wait for it; killed if it has not ended in 5 s."""
        if self._process.poll() is None:
            os.kill(self._process.pid, signal.SIGCONT)  # a paused server takes SIGTERM too
            self._process.terminate()
            try:
                self._process.wait(timeout=STOP_TIMEOUT_S)
            except subprocess.TimeoutExpired:
                self._process.kill()
        self._process.wait()

    def _answers(self) -> bool:
        if self._process.poll() is not None:
            raise AssertionError(
                f"redis-server exited with {self._process.returncode}: {self.log.read_text()}"
            )
        client = redis.Redis(
            unix_socket_path=str(self.socket),
            socket_timeout=_PING_TIMEOUT_S,
            socket_connect_timeout=_PING_TIMEOUT_S,
        )
        try:
            return bool(client.ping())
        except (redis.exceptions.RedisError, OSError):
            return False
        finally:
            client.connection_pool.disconnect()


@contextmanager
def running_redis() -> Iterator[RedisServer]:
    """A ready ``redis-server`` for the ``with`` block, stopped (and its directory removed)
    after it. Its directory is a fresh one under ``$TMPDIR``, not the test's ``tmp_path``: a Unix
    socket's path must stay under 108 bytes, which a long test name's ``tmp_path`` exceeds."""
    binary = shutil.which("redis-server")
    if binary is None:
        pytest.fail("redis-server is not on PATH: run deploy/ci/install-tools.sh (as root)")
    with tempfile.TemporaryDirectory(prefix="redis-") as directory:
        server = RedisServer(binary, Path(directory))
        try:
            server.wait_ready()
            yield server
        finally:
            server.stop()
