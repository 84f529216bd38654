"""The one child-process abstraction of the devtools: its own process group, a log file, a
parent-death signal, an optional HTTP readiness URL, a clean stop.

Who calls it: :class:`devstack.vllm_server.VllmServer` (a :class:`ChildProcess` for vLLM API
servers, whose engine core runs as a grandchild), the demo (its router) and the benchmarks (fake
backends and routers, through :func:`http_process`). The caller owns the :class:`ChildProcess`:
it starts it once, and must call :meth:`ChildProcess.stop` (or use it as a context manager) on
every path, error paths included.

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
- readiness: with ``spec.ready_url`` set, :meth:`ChildProcess.start` blocks until that URL
  answers 200, and on an exit or a timeout stops the group and raises :class:`ProcessStartError`
  with the log tail; :meth:`ChildProcess.launch` does not wait, :func:`start_all` launches several
  at once and waits for all (stopping all if any fails);
- it never signals anything outside the group it created. Group membership is read with
  ``psutil``; the parent-death signal needs Linux (``prctl`` via libc); elsewhere it is skipped and
  the rest works on any POSIX system.
"""

from __future__ import annotations

import contextlib
import ctypes
import getpass
import os
import shlex
import shutil
import signal
import subprocess
import tempfile
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from types import TracebackType
from typing import ClassVar

import httpx
import psutil

_PR_SET_PDEATHSIG = 1
_TAIL_BYTES = 64 * 1024
_POLL_S = 0.05
_READY_POLL_S = 0.2
_GONE = (psutil.STATUS_ZOMBIE, psutil.STATUS_DEAD)


class ProcessStateError(RuntimeError):
    """A :class:`ChildProcess` was used out of order (started twice, queried before start)."""


class ProcessStartError(RuntimeError):
    """A child process exited or never became ready; the message holds its log tail."""


@dataclass(frozen=True)
class ProcessSpec:
    """What to run and where its output goes.

    ``env`` is the child's whole environment (``None``: inherit ours). ``append_log`` keeps an
    existing log file (several runs of one server in one file); otherwise it is truncated.
    ``ready_url``: the child is ready once a GET there answers 200 (``None``: at launch).
    ``grace_s``: how long a stop waits after SIGTERM before SIGKILL. ``private_tmp``: the child
    gets a temporary directory of its own (``TMPDIR``), removed when it is stopped, so what it
    leaves there (vLLM's ZMQ sockets and ``vllm_dist_*`` files) goes with it; torch's compile
    cache stays shared (``TORCHINDUCTOR_CACHE_DIR``, where ours would have put it).
    ``shm_prefixes``: shared-memory files (``/dev/shm``) whose name starts with one of these and
    that the group has mapped when it is seen ready or when its stop begins are removed once it
    is stopped (vLLM CPU's ``vllm_dist_*-cpushm_*`` segments of TP/PP workers, which it never
    unlinks).
    """

    name: str
    argv: tuple[str, ...]
    log_file: Path
    env: Mapping[str, str] | None = None
    append_log: bool = False
    ready_url: str | None = None
    ready_timeout_s: float = 60.0
    grace_s: float = 10.0
    private_tmp: bool = False
    shm_prefixes: tuple[str, ...] = ()


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
    """
    try:
        os.killpg(pgid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return bool(group_members(pgid))


_RESOURCE_TRACKER = "multiprocessing.resource_tracker"
"""In the command line of a multiprocessing resource tracker (``python -c "from
multiprocessing.resource_tracker import main; ..."``)."""


def group_members(pgid: int) -> list[psutil.Process]:
    """The live processes of process group ``pgid`` (zombies left out)."""
    found = []
    for proc in psutil.process_iter(["status"]):
        if proc.info["status"] in _GONE:
            continue
        with contextlib.suppress(ProcessLookupError):
            if os.getpgid(proc.pid) == pgid:
                found.append(proc)
    return found


def pid_alive(pid: int) -> bool:
    """Whether ``pid`` runs (a zombie, which an unreaping init may keep, counts as dead)."""
    try:
        return psutil.Process(pid).status() not in _GONE
    except psutil.NoSuchProcess:
        return False


def group_cpu_seconds(pgid: int) -> float:
    """CPU time (user + system, seconds) used so far by the processes of group ``pgid``
    (a child started here and the processes it forked, e.g. uvicorn's workers)."""
    total = 0.0
    for proc in psutil.process_iter():
        with contextlib.suppress(ProcessLookupError, psutil.Error):
            if os.getpgid(proc.pid) == pgid:
                times = proc.cpu_times()
                total += times.user + times.system
    return total


def tree_cpu_seconds(pid: int) -> float:
    """CPU time (user + system, seconds) used so far by ``pid`` and its live descendants, in
    whatever process group they run (``serve --workers N``'s workers each lead one of their own);
    0.0 when ``pid`` is gone."""
    try:
        root = psutil.Process(pid)
        procs = [root, *root.children(recursive=True)]
    except psutil.Error:
        return 0.0
    total = 0.0
    for proc in procs:
        with contextlib.suppress(psutil.Error):
            times = proc.cpu_times()
            total += times.user + times.system
    return total


_SHM_DIR = "/dev/shm"


def group_shared_memory(pgid: int, prefixes: Sequence[str]) -> set[Path]:
    """The files under ``/dev/shm`` that a live process of group ``pgid`` maps and whose name
    starts with one of ``prefixes`` (read from ``/proc/PID/maps``; empty where there is none)."""
    found: set[Path] = set()
    for proc in group_members(pgid):
        with contextlib.suppress(OSError):
            maps = Path(f"/proc/{proc.pid}/maps").read_text()
            for line in maps.splitlines():
                fields = line.split(maxsplit=5)
                path = fields[5] if len(fields) == 6 else ""
                name = path.removeprefix(_SHM_DIR + "/")
                if name != path and "/" not in name and name.startswith(tuple(prefixes)):
                    found.add(Path(path))
    return found


def _wait_group_gone(leader: subprocess.Popen[bytes], timeout_s: float) -> None:
    """Wait up to ``timeout_s`` for the group ``leader`` leads to empty: the leader reaped (its
    exit status is the outcome), the rest of the group may take a little longer."""
    deadline = time.monotonic() + timeout_s
    with contextlib.suppress(subprocess.TimeoutExpired):
        leader.wait(timeout=timeout_s)
    while group_alive(leader.pid) and time.monotonic() < deadline:
        time.sleep(_POLL_S)


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
    """One child process in its own process group; started once, stopped idempotently.

    Subclasses may set :attr:`start_error` to raise a more specific :class:`ProcessStartError`.
    """

    start_error: ClassVar[type[ProcessStartError]] = ProcessStartError

    def __init__(self, process: ProcessSpec) -> None:
        self.process = process
        self._proc: subprocess.Popen[bytes] | None = None
        self._stopped: StopOutcome | None = None
        self._tmp: Path | None = None
        self._shm: set[Path] = set()

    @property
    def name(self) -> str:
        return self.process.name

    @property
    def log_path(self) -> Path:
        return self.process.log_file

    @property
    def pid(self) -> int | None:
        """The child's pid, which is also its process group id; ``None`` before start."""
        return None if self._proc is None else self._proc.pid

    def launch(self) -> ChildProcess:
        """Launch the child (non-blocking). Raises :class:`ProcessStateError` if already started."""
        if self._proc is not None:
            raise ProcessStateError(f"{self.name}: already started")
        spec = self.process
        spec.log_file.parent.mkdir(parents=True, exist_ok=True)
        with spec.log_file.open("ab" if spec.append_log else "wb") as log:
            log.write(f"$ {shlex.join(spec.argv)}\n".encode())
            log.flush()
            self._proc = subprocess.Popen(
                spec.argv,
                env=self._environment(),
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
                start_new_session=True,
                preexec_fn=_parent_death_signal(os.getpid()),
            )
        return self

    def _environment(self) -> dict[str, str] | None:
        """The child's environment: the spec's (``None``: ours), with its own ``TMPDIR`` when
        the spec asks for a private one (made here, removed by :meth:`stop`)."""
        spec = self.process
        if not spec.private_tmp:
            return None if spec.env is None else dict(spec.env)
        env = dict(os.environ if spec.env is None else spec.env)
        shared = Path(tempfile.gettempdir())
        inductor = shared / f"torchinductor_{getpass.getuser()}"  # where torch puts it by default
        env.setdefault("TORCHINDUCTOR_CACHE_DIR", str(inductor))
        self._tmp = Path(tempfile.mkdtemp(prefix=f"{spec.name}-", dir=shared))
        env["TMPDIR"] = str(self._tmp)
        return env

    def start(self) -> ChildProcess:
        """Launch, then (with a ``ready_url``) block until ready; on failure stop and raise
        :class:`ProcessStartError` (or :attr:`start_error`) with the log tail."""
        self.launch()
        try:
            self.wait_ready()
        except BaseException:
            self.stop()
            raise
        return self

    def poll(self) -> int | None:
        """The child's exit status, or ``None`` while it runs. Raises if not started."""
        if self._proc is None:
            raise ProcessStateError(f"{self.name}: not started")
        return self._proc.poll()

    def is_alive(self) -> bool:
        return self._proc is not None and self._proc.poll() is None

    def log_tail(self, lines: int = 40) -> str:
        return read_log_tail(self.process.log_file, lines)

    def check_ready_once(self, client: httpx.Client) -> bool:
        """One readiness poll (True once launched without a ``ready_url``); raises
        :attr:`start_error` if the child is not started or has exited."""
        if self._proc is None:
            raise self.start_error(f"{self.name}: not started")
        if self.process.ready_url is None:
            return True
        code = self._proc.poll()
        if code is not None:
            raise self.start_error(
                f"{self.name} exited with {code}:\n{self.log_tail()}\n(log {self.log_path})"
            )
        try:
            ready = client.get(self.process.ready_url).status_code == 200
        except httpx.TransportError:
            return False
        if ready:
            self._note_shared_memory()
        return ready

    def _note_shared_memory(self) -> None:
        """Remember the group's mapped ``spec.shm_prefixes`` files, for :meth:`stop` to remove
        (noted when ready too: a group killed before its stop maps nothing any more)."""
        if self._proc is not None and self.process.shm_prefixes:
            self._shm |= group_shared_memory(self._proc.pid, self.process.shm_prefixes)

    def wait_ready(self, timeout_s: float | None = None) -> None:
        """Block until ready (default bound: ``ready_timeout_s``); raise on death or timeout."""
        wait_all_ready([self], self.process.ready_timeout_s if timeout_s is None else timeout_s)

    def kill(self, cleanup_s: float = 10.0) -> None:
        """Kill the group as a crash would: SIGKILL to every process of it but multiprocessing's
        resource trackers, which, as after a real crash, outlive the processes they serve and
        unlink what those registered (vLLM's ``sem.mp-*`` semaphores; a SIGKILL to the whole
        group leaves them in ``/dev/shm``); waits up to ``cleanup_s`` for them to finish. The
        caller still calls :meth:`stop` (which reaps the group). A no-op if never started."""
        if self._proc is None:
            return
        pgid = self._proc.pid
        self._note_shared_memory()
        for member in group_members(pgid):
            with contextlib.suppress(psutil.Error, ProcessLookupError):
                if _RESOURCE_TRACKER not in " ".join(member.cmdline()):
                    member.kill()
        _wait_group_gone(self._proc, cleanup_s)

    def stop(self, grace_s: float | None = None) -> StopOutcome | None:
        """SIGTERM the group, wait up to ``grace_s`` (default: the spec's) for it to empty, then
        SIGKILL the group.

        Returns ``None`` if never started; a repeated call returns the first call's outcome.
        """
        proc = self._proc
        if proc is None:
            return None
        if self._stopped is not None:
            return self._stopped
        grace = self.process.grace_s if grace_s is None else grace_s
        pgid = proc.pid  # start_new_session: the child leads its own group
        self._note_shared_memory()
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(pgid, signal.SIGTERM)
        _wait_group_gone(proc, grace)
        killed = group_alive(pgid)
        if killed:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(pgid, signal.SIGKILL)
        with contextlib.suppress(subprocess.TimeoutExpired):
            proc.wait(timeout=5.0)
        if self._tmp is not None:
            shutil.rmtree(self._tmp, ignore_errors=True)
        for path in self._shm:
            path.unlink(missing_ok=True)
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


def http_process(
    name: str,
    argv: Sequence[str],
    ready_url: str,
    log_path: Path,
    env: Mapping[str, str] | None = None,
    ready_timeout_s: float = 60.0,
) -> ChildProcess:
    """An unstarted child, ready once ``ready_url`` answers 200 (a fake backend, a router)."""
    spec = ProcessSpec(
        name,
        tuple(argv),
        log_path,
        env=None if env is None else dict(env),
        ready_url=ready_url,
        ready_timeout_s=ready_timeout_s,
    )
    return ChildProcess(spec)


def wait_all_ready(processes: Sequence[ChildProcess], timeout_s: float) -> None:
    """Poll every process until all are ready; raise on the first death or on timeout."""
    deadline = time.monotonic() + timeout_s
    pending = list(processes)
    with httpx.Client(timeout=httpx.Timeout(2.0)) as client:
        while True:
            pending = [p for p in pending if not p.check_ready_once(client)]
            if not pending:
                return
            if time.monotonic() > deadline:
                names = ", ".join(p.name for p in pending)
                tails = "\n".join(f"--- {p.name}:\n{p.log_tail()}" for p in pending)
                raise pending[0].start_error(f"not ready after {timeout_s}s: {names}\n{tails}")
            time.sleep(_READY_POLL_S)


def start_all(processes: Sequence[ChildProcess], timeout_s: float) -> None:
    """Launch every process at once and wait until all are ready.

    On any failure (including KeyboardInterrupt) every process started here is stopped before the
    exception propagates.
    """
    try:
        for process in processes:
            process.launch()
        wait_all_ready(processes, timeout_s)
    except BaseException:
        stop_all(processes)
        raise


def stop_all(processes: Sequence[ChildProcess]) -> None:
    """Stop processes in reverse order; each stop is independent of the others' failures."""
    for process in reversed(processes):
        process.stop()
