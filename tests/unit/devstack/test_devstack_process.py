"""ChildProcess: group stop (grandchildren included), SIGKILL escalation, idempotence, log tail,
parent-death signal. Real processes (python and sleep), no vLLM; each test takes about a second.
"""

from __future__ import annotations

import http.server
import os
import signal
import subprocess
import sys
import tempfile
import textwrap
import threading
from pathlib import Path

import pytest

from devstack.process import (
    ChildProcess,
    ProcessSpec,
    ProcessStateError,
    group_alive,
    pid_alive,
    read_log_tail,
)
from tests.support.stand_in import wait_dead
from tests.support.wait import wait_until

# A child that forks a ``sleep 60`` grandchild into its own group, prints the grandchild's pid,
# then waits for it. With "ignore-term" both ignore SIGTERM (SIG_IGN survives exec); with "exit"
# the child exits at once and leaves the grandchild behind.
_PARENT = textwrap.dedent(
    """
    import signal, subprocess, sys
    if sys.argv[1] == "ignore-term":
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
    grandchild = subprocess.Popen(["sleep", "60"])
    print(f"pid-of-grandchild: {grandchild.pid}", flush=True)
    if sys.argv[1] != "exit":
        grandchild.wait()
    """
)


def _logged_grandchild_pid(child: ChildProcess) -> int | None:
    for line in read_log_tail(child.log_path).splitlines():
        if line.startswith("pid-of-grandchild: "):
            return int(line.split()[1])
    return None


def _grandchild_pid(child: ChildProcess, timeout_s: float = 10.0) -> int:
    return wait_until(
        lambda: _logged_grandchild_pid(child),
        timeout=timeout_s,
        what=f"the grandchild pid in {child.log_path}",
    )


def _exit_status(child: ChildProcess) -> int:
    """Wait until ``child`` exits on its own; its exit status."""
    wait_until(lambda: child.poll() is not None, timeout=10.0, what=f"{child.name} to exit")
    status = child.poll()
    assert status is not None
    return status


def _parent(tmp_path: Path, mode: str) -> ChildProcess:
    spec = ProcessSpec("parent", (sys.executable, "-c", _PARENT, mode), tmp_path / "parent.log")
    return ChildProcess(spec)


def test_stop_kills_the_grandchild_with_sigterm(tmp_path: Path) -> None:
    with _parent(tmp_path, "wait") as child:
        grandchild = _grandchild_pid(child)
        assert child.is_alive() and pid_alive(grandchild)
        outcome = child.stop(grace_s=10.0)
    assert outcome is not None
    assert outcome.returncode == -signal.SIGTERM
    assert not outcome.killed, "SIGTERM alone should have emptied the group"
    assert not child.is_alive()
    assert wait_dead(grandchild), "the grandchild outlived stop()"
    assert child.pid is not None and not group_alive(child.pid)


def test_stop_escalates_to_sigkill_for_the_whole_group(tmp_path: Path) -> None:
    with _parent(tmp_path, "ignore-term") as child:
        grandchild = _grandchild_pid(child)
        outcome = child.stop(grace_s=0.5)
    assert outcome is not None
    assert outcome.killed
    assert outcome.returncode == -signal.SIGKILL
    assert wait_dead(grandchild), "the SIGTERM-ignoring grandchild survived SIGKILL"


def test_stop_cleans_up_after_a_child_that_already_exited(tmp_path: Path) -> None:
    with _parent(tmp_path, "exit") as child:
        grandchild = _grandchild_pid(child)
        assert _exit_status(child) == 0
        assert pid_alive(grandchild), "the orphaned grandchild should still run before stop()"
        outcome = child.stop(grace_s=5.0)
    assert outcome is not None and outcome.returncode == 0
    assert wait_dead(grandchild), "stop() left the exited child's grandchild running"


def test_stop_is_idempotent_and_start_is_once(tmp_path: Path) -> None:
    child = _parent(tmp_path, "wait")
    assert child.stop() is None  # never started: nothing to do
    with pytest.raises(ProcessStateError, match="not started"):
        child.poll()
    with child:
        with pytest.raises(ProcessStateError, match="already started"):
            child.start()
        first = child.stop(grace_s=5.0)
        assert first is not None
        assert child.stop(grace_s=5.0) is first  # the recorded outcome: no second stop ran
    assert child.stop() == first  # the context exit in between was a no-op too


def test_log_holds_the_command_and_the_tail_is_the_last_lines(tmp_path: Path) -> None:
    log = tmp_path / "logs" / "counter.log"
    log.parent.mkdir()
    log.write_text("from an earlier run\n")
    code = "import sys\nfor i in range(200): print(f'line {i}')\n"
    code += "sys.stdout.flush()\nprint('oops', file=sys.stderr)"
    argv = (sys.executable, "-c", code)
    with ChildProcess(ProcessSpec("counter", argv, log)) as child:
        assert _exit_status(child) == 0
        assert child.log_tail(3).splitlines() == ["line 198", "line 199", "oops"]
    text = log.read_text()
    assert text.startswith(f"$ {sys.executable} -c ")
    assert "from an earlier run" not in text  # truncated by default

    with ChildProcess(ProcessSpec("again", argv, log, append_log=True)) as child:
        _exit_status(child)
    assert log.read_text().count("line 199") == 2
    assert read_log_tail(tmp_path / "missing.log") == ""


def test_child_gets_sigterm_when_its_launcher_dies(tmp_path: Path) -> None:
    launcher = textwrap.dedent(
        f"""
        import os, sys
        from pathlib import Path
        from devstack.process import ChildProcess, ProcessSpec
        argv = (sys.executable, "-c", "import time; time.sleep(60)")
        child = ChildProcess(ProcessSpec("orphan", argv, Path({str(tmp_path / "o.log")!r})))
        print(child.start().pid, flush=True)
        os._exit(0)  # die without stopping the child
        """
    )
    result = subprocess.run(
        [sys.executable, "-c", launcher], capture_output=True, text=True, timeout=60, check=True
    )
    orphan = int(result.stdout.strip())
    try:
        assert wait_dead(orphan), "the child outlived its launcher"
    finally:
        if pid_alive(orphan):
            os.killpg(orphan, signal.SIGKILL)


def test_a_private_tmp_child_leaves_nothing_in_the_temporary_directory(tmp_path: Path) -> None:
    script = (
        "import os, pathlib, socket, tempfile, time\n"
        "tmp = pathlib.Path(tempfile.gettempdir())\n"
        "(tmp / 'vllm_dist_x').write_text('x')\n"
        "s = socket.socket(socket.AF_UNIX); s.bind(str(tmp / 'ipc'))\n"
        "print('tmp:', tmp, flush=True)\n"
        "time.sleep(60)\n"
    )
    spec = ProcessSpec(
        "private", (sys.executable, "-c", script), tmp_path / "child.log", private_tmp=True
    )
    child = ChildProcess(spec).launch()
    try:
        wait_until(lambda: "tmp: " in read_log_tail(child.log_path), timeout=10)
        tmp = Path(read_log_tail(child.log_path).split("tmp: ")[1].split()[0])
        assert tmp.name.startswith("private-") and tmp.parent == Path(tempfile.gettempdir())
        assert (tmp / "ipc").exists() and (tmp / "vllm_dist_x").exists()
    finally:
        child.stop()
    assert not tmp.exists()


# A child that maps two files it makes in /dev/shm (``<argv[1]>-cpushm`` and ``other-<argv[1]>``),
# the way vLLM CPU's TP/PP workers map their ``vllm_dist_*-cpushm_*`` segments and never unlink.
_SHM_CHILD = textwrap.dedent(
    """
    import mmap, os, sys, time
    maps = []
    for name in (sys.argv[1] + "-cpushm", "other-" + sys.argv[1]):
        fd = os.open("/dev/shm/" + name, os.O_CREAT | os.O_RDWR, 0o600)
        os.ftruncate(fd, 4096)
        maps.append(mmap.mmap(fd, 4096))
    print("mapped", 6 * 7, flush=True)
    time.sleep(60)
    """
)


class _Ok(http.server.BaseHTTPRequestHandler):
    def do_GET(self) -> None:
        self.send_response(200)
        self.send_header("Content-Length", "0")
        self.end_headers()

    def log_message(self, *args: object) -> None:
        pass


@pytest.mark.skipif(not Path("/dev/shm").is_dir(), reason="no /dev/shm")
@pytest.mark.parametrize("killed_before_stop", [False, True])
def test_stop_removes_the_shared_memory_the_group_mapped(
    tmp_path: Path, killed_before_stop: bool
) -> None:
    prefix = f"disagg-test-{os.getpid()}-{int(killed_before_stop)}"
    ours, other = Path(f"/dev/shm/{prefix}-cpushm"), Path(f"/dev/shm/other-{prefix}")
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _Ok)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    spec = ProcessSpec(
        "shm",
        (sys.executable, "-c", _SHM_CHILD, prefix),
        tmp_path / "child.log",
        ready_url=f"http://127.0.0.1:{server.server_address[1]}/",
        shm_prefixes=(prefix,),
    )
    child = ChildProcess(spec).launch()
    try:
        # "mapped 42", not "mapped": the log starts with the command line, which holds the code
        wait_until(lambda: "mapped 42" in read_log_tail(child.log_path), timeout=10)
        child.wait_ready()  # notes what the group maps now
        if killed_before_stop:  # e.g. a fault test's SIGKILL: nothing is mapped at stop time
            pid = child.pid
            assert pid is not None
            os.killpg(pid, signal.SIGKILL)
            wait_until(lambda: child.poll() is not None, timeout=10, what="the child to die")
        assert ours.exists()
        child.stop(grace_s=5.0)
        assert not ours.exists()
        assert other.exists()  # a mapped file without the prefix is not the stop's to remove
    finally:
        child.stop()
        server.shutdown()
        server.server_close()
        ours.unlink(missing_ok=True)
        other.unlink(missing_ok=True)


# A child whose multiprocessing semaphore (spawn context: a named ``sem.mp-*`` in /dev/shm,
# registered with a resource tracker the child starts in its own group) is left for the tracker.
_SEM_CHILD = textwrap.dedent(
    """
    import multiprocessing, time
    lock = multiprocessing.get_context("spawn").Lock()
    print("lock", 6 * 7, flush=True)
    time.sleep(60)
    """
)


@pytest.mark.skipif(not Path("/dev/shm").is_dir(), reason="no /dev/shm")
def test_kill_is_a_crash_whose_semaphores_the_resource_tracker_still_unlinks(
    tmp_path: Path,
) -> None:
    before = set(Path("/dev/shm").glob("sem.mp-*"))
    child = ChildProcess(
        ProcessSpec("sem", (sys.executable, "-c", _SEM_CHILD), tmp_path / "child.log")
    ).launch()
    try:
        # "lock 42": the log starts with the command, which holds the script's text
        wait_until(lambda: "lock 42" in read_log_tail(child.log_path), timeout=30)
        made = set(Path("/dev/shm").glob("sem.mp-*")) - before
        assert made  # the semaphore exists while the child runs
        child.kill()
        outcome = child.stop(grace_s=0.0)
        assert outcome is not None and outcome.returncode == -signal.SIGKILL
        assert not any(path.exists() for path in made)
    finally:
        child.stop()
