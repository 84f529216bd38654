"""The e2e lock helper of the docker test: waits for other holders, never for its own ancestors."""

from __future__ import annotations

import fcntl
import subprocess
import threading
from pathlib import Path

from tests.deploy.docker_support import e2e_lock, flock_holders
from tests.support.wait import wait_until


def test_lock_held_by_this_process_is_not_taken_again(tmp_path: Path) -> None:
    """Like a test run under `flock LOCK pytest ...`: taking the lock again would deadlock."""
    lock = tmp_path / "e2e.lock"
    lock.touch()
    with lock.open("a") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        entered = threading.Event()

        def enter() -> None:
            with e2e_lock(lock):
                entered.set()

        # Same process as the holder: must enter at once.
        worker = threading.Thread(target=enter, daemon=True)
        worker.start()
        assert entered.wait(5.0)


def test_lock_held_by_another_process_is_waited_for(tmp_path: Path) -> None:
    lock = tmp_path / "e2e.lock"
    # -o: only flock itself holds the lock (not its `sleep` child), so killing it releases it.
    holder = subprocess.Popen(["flock", "-o", str(lock), "sleep", "30"])
    try:
        wait_until(
            lambda: lock.exists() and flock_holders(lock), timeout=10.0, what="flock takes the lock"
        )
        entered = threading.Event()

        def enter() -> None:
            with e2e_lock(lock):
                entered.set()

        worker = threading.Thread(target=enter, daemon=True)
        worker.start()
        assert not entered.wait(1.0), "entered while another process held the lock"
        holder.kill()
        holder.wait(timeout=10)
        assert entered.wait(10.0), "did not enter after the holder released the lock"
    finally:
        holder.kill()
        holder.wait(timeout=10)
