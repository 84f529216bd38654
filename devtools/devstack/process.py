"""A managed child process: its own process group, a log file, a parent-death signal, a clean stop.

Who calls it: :class:`devstack.vllm_server.VllmServer` (vLLM API servers, whose engine
core runs as a grandchild) and :class:`devstack.managed_process.ManagedProcess` (fake
backends and routers of the benchmarks and the demo). The caller owns the
:class:`ChildProcess`: it calls :meth:`ChildProcess.start` once, and must call
:meth:`ChildProcess.stop` (or use it as a context manager) on every path, error paths included.

Contract:
- the child starts in a new session, so it leads its own process group and everything it forks
  (and does not move out of the group) belongs to that group; stdin is ``/dev/null``, stdout and
  stderr go to ``spec.log_file``, which starts with the command line;
- the child gets SIGTERM when the *thread* that launched it exits (Linux ``PR_SET_PDEATHSIG``), so
  it cannot outlive a crashed caller. Call :meth:`ChildProcess.start` from a long-lived thread
  (normally the main thread), never from a short-lived worker thread, or the child dies with it;
- :meth:`ChildProcess.stop` sends SIGTERM to the whole group, waits up to ``grace_s`` for the
  group to empty, then sends SIGKILL to the group and reaps the child. It also cleans up the group
  when the child itself already exited but left grandchildren behind. It is idempotent;
- this module does no readiness checks (HTTP or otherwise) and never signals anything outside the
  group it created. The parent-death signal needs Linux (``prctl`` via libc); elsewhere it is
  skipped and the rest works on any POSIX system.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import shlex
import signal
import subprocess
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from types import TracebackType

_PR_SET_PDEATHSIG = 1
_TAIL_BYTES = 64 * 1024
_POLL_S = 0.05
_PROC = Path("/proc")


class ProcessStateError(RuntimeError):
    """A :class:`ChildProcess` was used out of order (started twice, queried before start)."""


@dataclass(frozen=True)
class ProcessSpec:
    """What to run and where its output goes.

    ``env`` is the child's whole environment (``None``: inherit ours). ``append_log`` keeps an
    existing log file (several runs of one server in one file); otherwise it is truncated.
    """

    name: str
    argv: tuple[str, ...]
    log_file: Path
    env: Mapping[str, str] | None = None
    append_log: bool = False


@dataclass(frozen=True)
class StopOutcome:
    """How a stop ended: the child's exit status and whether SIGKILL was needed."""

    returncode: int | None
    killed: bool


def _parent_death_signal(parent_pid: int) -> Callable[[], None]:
    """A ``preexec_fn``: ask for SIGTERM on the launcher's death, and honour an earlier death."""

    def arm() -> None:
        with contextlib.suppress(OSError, AttributeError):
            libc = ctypes.CDLL("libc.so.6", use_errno=True)
            libc.prctl(_PR_SET_PDEATHSIG, signal.SIGTERM)
        # The launcher may have died between fork and prctl; then no signal would ever come.
        if os.getppid() != parent_pid:
            os.kill(os.getpid(), signal.SIGTERM)

    return arm


def group_alive(pgid: int) -> bool:
    """Whether a live (non-zombie) process is still in process group ``pgid``.

    Zombies do not count: an orphaned grandchild that has exited stays a zombie until init reaps
    it, which in some containers never happens, and it holds no resources worth waiting for.
    Without ``/proc`` any member, zombie or not, counts.
    """
    try:
        os.killpg(pgid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    try:
        entries = os.listdir(_PROC)
    except OSError:
        return True
    return any(_live_member(entry, pgid) for entry in entries if entry.isdigit())


def _stat_fields(pid: str) -> list[str]:
    """``/proc/<pid>/stat`` after the command name (state, ppid, pgrp, ...); [] if gone."""
    try:
        stat = (_PROC / pid / "stat").read_text()
    except OSError:
        return []
    # "pid (comm) state ppid pgrp ...": comm may hold spaces and parentheses.
    return stat[stat.rfind(")") + 2 :].split()


def _live_member(pid: str, pgid: int) -> bool:
    fields = _stat_fields(pid)
    return len(fields) > 2 and fields[2] == str(pgid) and fields[0] not in ("Z", "X")


def group_cpu_seconds(pgid: int) -> float:
    """CPU time (user + system, seconds) used so far by the live processes of group ``pgid``
    (a child started here and the processes it forked, e.g. uvicorn's workers)."""
    total = 0
    for entry in os.listdir(_PROC):
        fields = _stat_fields(entry) if entry.isdigit() else []
        if len(fields) > 12 and fields[2] == str(pgid):
            total += int(fields[11]) + int(fields[12])  # utime, stime (clock ticks)
    return total / os.sysconf("SC_CLK_TCK")


def read_log_tail(path: Path, lines: int = 40) -> str:
    """The last ``lines`` lines of ``path`` (reads at most the last 64 KiB); "" if unreadable."""
    try:
        with path.open("rb") as handle:
            size = handle.seek(0, os.SEEK_END)
            handle.seek(max(0, size - _TAIL_BYTES))
            data = handle.read()
    except OSError:
        return ""
    return "\n".join(data.decode(errors="replace").splitlines()[-lines:])


class ChildProcess:
    """One child process in its own process group; started once, stopped idempotently."""

    def __init__(self, spec: ProcessSpec) -> None:
        self.spec = spec
        self._proc: subprocess.Popen[bytes] | None = None
        self._stopped: StopOutcome | None = None

    @property
    def name(self) -> str:
        return self.spec.name

    @property
    def log_path(self) -> Path:
        return self.spec.log_file

    @property
    def pid(self) -> int | None:
        """The child's pid, which is also its process group id; ``None`` before start."""
        return None if self._proc is None else self._proc.pid

    def start(self) -> ChildProcess:
        """Launch the child (non-blocking). Raises :class:`ProcessStateError` if already started."""
        if self._proc is not None:
            raise ProcessStateError(f"{self.name}: already started")
        log_file = self.spec.log_file
        log_file.parent.mkdir(parents=True, exist_ok=True)
        with log_file.open("ab" if self.spec.append_log else "wb") as log:
            log.write(f"$ {shlex.join(self.spec.argv)}\n".encode())
            log.flush()
            self._proc = subprocess.Popen(
                self.spec.argv,
                env=None if self.spec.env is None else dict(self.spec.env),
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
                start_new_session=True,
                preexec_fn=_parent_death_signal(os.getpid()),
            )
        return self

    def poll(self) -> int | None:
        """The child's exit status, or ``None`` while it runs. Raises if not started."""
        if self._proc is None:
            raise ProcessStateError(f"{self.name}: not started")
        return self._proc.poll()

    def is_alive(self) -> bool:
        return self._proc is not None and self._proc.poll() is None

    def log_tail(self, lines: int = 40) -> str:
        return read_log_tail(self.spec.log_file, lines)

    def stop(self, grace_s: float = 10.0) -> StopOutcome | None:
        """SIGTERM the group, wait up to ``grace_s`` for it to empty, then SIGKILL the group.

        Returns ``None`` if never started; a repeated call returns the first call's outcome.
        """
        proc = self._proc
        if proc is None:
            return None
        if self._stopped is not None:
            return self._stopped
        pgid = proc.pid  # start_new_session: the child leads its own group
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(pgid, signal.SIGTERM)
        deadline = time.monotonic() + grace_s
        # The leader's exit status is the outcome; the rest of the group may take a little longer.
        with contextlib.suppress(subprocess.TimeoutExpired):
            proc.wait(timeout=grace_s)
        while group_alive(pgid) and time.monotonic() < deadline:
            time.sleep(_POLL_S)
        killed = group_alive(pgid)
        if killed:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(pgid, signal.SIGKILL)
        with contextlib.suppress(subprocess.TimeoutExpired):
            proc.wait(timeout=5.0)
        self._stopped = StopOutcome(returncode=proc.poll(), killed=killed)
        return self._stopped

    def __enter__(self) -> ChildProcess:
        return self.start()

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.stop()
