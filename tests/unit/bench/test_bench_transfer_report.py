"""The transfer harness's wait for a round's report: a dead child fails it at once."""

from __future__ import annotations

import multiprocessing as mp
import os
import time
from collections.abc import Iterator
from multiprocessing.process import BaseProcess

import pytest

from bench.transfer_spec import await_report

CTX = mp.get_context("spawn")


@pytest.fixture
def stuck_peer() -> Iterator[BaseProcess]:
    """A child that never reports (like a peer blocked on the one that died)."""
    proc = CTX.Process(target=time.sleep, args=(120.0,), name="peer")
    proc.start()
    yield proc
    proc.kill()
    proc.join()


def test_child_death_fails_with_its_exit_code(stuck_peer: BaseProcess) -> None:
    report_recv, _report_send = CTX.Pipe(duplex=False)
    dying = CTX.Process(target=os._exit, args=(3,), name="initiator")
    dying.start()
    with pytest.raises(RuntimeError, match="bare: initiator exited with code 3"):
        await_report("bare", report_recv, (dying, stuck_peer))


def test_report_is_returned_after_a_clean_exit() -> None:
    report_recv, report_send = CTX.Pipe(duplex=False)
    done = CTX.Process(target=os._exit, args=(0,), name="P")
    done.start()
    done.join()
    report_send.send([0.5, 0.25])
    assert await_report("connector-path", report_recv, (done,)) == [0.5, 0.25]


def test_no_report_when_every_child_exited_cleanly() -> None:
    report_recv, _report_send = CTX.Pipe(duplex=False)
    done = CTX.Process(target=os._exit, args=(0,), name="D")
    done.start()
    with pytest.raises(RuntimeError, match="every process exited without a result"):
        await_report("bare-notify", report_recv, (done,))


def test_no_report_within_the_bound(stuck_peer: BaseProcess) -> None:
    report_recv, _report_send = CTX.Pipe(duplex=False)
    with pytest.raises(RuntimeError, match=r"no result within 0\.2 s"):
        await_report("bare", report_recv, (stuck_peer,), timeout_s=0.2)
