"""A ChildProcess with a readiness URL: ready on HTTP 200, and every way out stops its whole group.

The stand-in is a real loopback HTTP server that forks a ``sleep 60`` grandchild (as vLLM's API
server forks its engine core, or a router its workers); no vLLM.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from devstack.ports import free_port
from devstack.process import ChildProcess, ProcessStartError, http_process, pid_alive
from tests.support.stand_in import HTTP_STAND_IN, wait_dead


def _grandchild_dead(pid_file: Path) -> bool:
    return wait_dead(int(pid_file.read_text()))


def _stand_in(tmp_path: Path, behaviour: str, ready_timeout_s: float = 30.0) -> ChildProcess:
    port = free_port()
    argv = [sys.executable, "-c", HTTP_STAND_IN, str(port), str(tmp_path / "gc.pid"), behaviour]
    return http_process(
        "stand-in",
        argv,
        f"http://127.0.0.1:{port}/health",
        tmp_path / "stand-in.log",
        ready_timeout_s=ready_timeout_s,
    )


def test_ready_then_stop_kills_the_grandchild(tmp_path: Path) -> None:
    with _stand_in(tmp_path, "serve") as proc:
        assert proc.pid is not None
        assert pid_alive(int((tmp_path / "gc.pid").read_text()))
    assert _grandchild_dead(tmp_path / "gc.pid"), "the grandchild outlived stop()"
    proc.stop()  # idempotent


def test_an_exiting_process_raises_with_its_log_and_leaves_nothing(tmp_path: Path) -> None:
    proc = _stand_in(tmp_path, "die")
    with pytest.raises(ProcessStartError, match=r"(?s)exited with 3:.*failed on purpose"):
        proc.start()
    assert _grandchild_dead(tmp_path / "gc.pid"), "a failed start left the grandchild running"


def test_a_process_never_ready_times_out_and_leaves_nothing(tmp_path: Path) -> None:
    proc = _stand_in(tmp_path, "hang", ready_timeout_s=1.0)
    with pytest.raises(ProcessStartError, match=r"not ready after 1\.0s"):
        proc.start()
    assert _grandchild_dead(tmp_path / "gc.pid"), "a timed-out start left the grandchild running"
