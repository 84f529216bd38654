"""Transfer core against real NIXL across two OS processes on DRAM (marked ``nixl``).

P runs in a subprocess (``nixl_producer_proc.py``) with its own NIXL agent and side channel;
this process is D (a real :class:`PushConsumer`). Data checks compare D's memory byte for byte
with P's known pattern.
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from disagg_router.connector.config import ConnectorConfig
from disagg_router.connector.consumer import PushConsumer
from disagg_router.connector.nixl_backend import NixlEndpoint, nixl_available
from disagg_router.connector.records import TransferRecord
from disagg_router.connector.specs import RecvSpec
from tests.support.wait import wait_until

pytestmark = [pytest.mark.nixl, pytest.mark.skipif(not nixl_available(), reason="no NIXL")]

HERE = Path(__file__).parent
P_BLOCKS = 64
D_BLOCKS = 96
BLOCK_FLOATS = 1024  # 4 KiB per block per region


class ProducerProcess:
    def __init__(self, lease_s: float = 30.0) -> None:
        self.proc = subprocess.Popen(
            [
                sys.executable,
                str(HERE / "nixl_producer_proc.py"),
                str(P_BLOCKS),
                str(BLOCK_FLOATS),
                str(lease_s),
            ],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
            cwd=HERE,
            env={**__import__("os").environ, "PYTHONPATH": f"{HERE}:{HERE.parents[2]}"},
        )
        self.port = int(self._read()["port"])
        self._released: set[str] = set()

    def _read(self) -> dict[str, Any]:
        assert self.proc.stdout is not None
        line = self.proc.stdout.readline()
        while line and not line.startswith("{"):  # NIXL logs to stdout too
            line = self.proc.stdout.readline()
        assert line, "producer process died"
        out: dict[str, Any] = json.loads(line)
        return out

    def call(self, **cmd: Any) -> dict[str, Any]:
        assert self.proc.stdin is not None
        self.proc.stdin.write(json.dumps(cmd) + "\n")
        self.proc.stdin.flush()
        return self._read()

    def released(self) -> set[str]:
        """Every P request id released so far (P reports each one once; this keeps them)."""
        self._released |= set(self.call(cmd="released")["released"])
        return set(self._released)

    def wait_released(self, p_request_id: str) -> None:
        wait_until(lambda: p_request_id in self.released(), what=f"P to release {p_request_id}")

    def close(self) -> None:
        if self.proc.poll() is None:
            assert self.proc.stdin is not None
            self.proc.stdin.write('{"cmd": "exit"}\n')
            self.proc.stdin.flush()
            try:
                self.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.proc.kill()


@pytest.fixture(scope="module")
def producer() -> Iterator[ProducerProcess]:
    p = ProducerProcess()
    yield p
    p.close()


class Consumer:
    def __init__(self, **cfg: Any) -> None:
        from tests.integration.connector.nixl_layouts import make_regions

        self.arrays, layout = make_regions(D_BLOCKS, BLOCK_FLOATS)
        for arr in self.arrays:
            arr[:] = -1.0
        self.endpoint = NixlEndpoint(f"d-agent-{time.monotonic_ns()}", layout)
        self.cfg = ConnectorConfig(**cfg)
        self.consumer = PushConsumer(self.endpoint, self.cfg)
        self.finished: set[str] = set()
        self.failed: set[str] = set()
        self.records: list[TransferRecord] = []

    def register(self, spec: RecvSpec) -> None:
        """Register ``spec`` and wait until P has answered (accepted or refused) it."""
        self.consumer.register(spec).result(timeout=10.0)

    def done(self, rid: str) -> bool:
        """Whether ``rid`` finished (collects the results D reported since the last call)."""
        fin, fail = self.consumer.take_results()
        self.finished |= fin
        self.failed |= fail
        return rid in self.finished

    def wait(self, rid: str) -> TransferRecord:
        """Wait until ``rid`` finished (ok or failed); its receiver record."""
        wait_until(lambda: self.done(rid), what=f"transfer of {rid} to finish")
        self.records += self.consumer.take_records()
        return next(r for r in self.records if r.request_id == rid)

    def close(self) -> None:
        self.consumer.close()
        self.endpoint.close()


@pytest.fixture
def consumer() -> Iterator[Consumer]:
    c = Consumer(transfer_timeout_s=5.0, liveness_interval_s=0.2)
    yield c
    c.close()


def _expect_blocks(c: Consumer, d_blocks: list[int], p_blocks: list[int]) -> None:
    for r, arr in enumerate(c.arrays):
        for d, p in zip(d_blocks, p_blocks, strict=True):
            assert np.all(arr[d] == 1000 * r + p), f"region {r} D block {d} != P block {p}"


def test_registration_after_finish_writes_many_blocks(
    producer: ProducerProcess, consumer: Consumer
) -> None:
    p_blocks = list(range(10, 50))
    producer.call(cmd="finish", key="k1", request_id="p-req-1", blocks=p_blocks)
    d_blocks = list(range(95, 55, -1))  # reversed, non-contiguous destination
    consumer.consumer.register(
        RecvSpec(
            "d-req-1", "k1", "p-engine", "127.0.0.1", producer.port, tuple(d_blocks), first_block=0
        )
    )
    drec = consumer.wait("d-req-1")
    assert "d-req-1" not in consumer.failed
    _expect_blocks(consumer, d_blocks, p_blocks)
    untouched = sorted(set(range(D_BLOCKS)) - set(d_blocks))
    assert all(np.all(a[untouched] == -1.0) for a in consumer.arrays)
    producer.wait_released("p-req-1")
    rec = next(r for r in producer.call(cmd="records")["records"] if r["transfer_key"] == "k1")
    assert rec["ok"] and rec["num_blocks"] == 40 and rec["num_bytes"] == 40 * 2 * 4096
    assert drec.ok and drec.num_blocks == 40


def test_registration_before_finish_and_prefix_hit(
    producer: ProducerProcess, consumer: Consumer
) -> None:
    # D already has the first 3 blocks cached: it asks only for the tail.
    consumer.register(
        RecvSpec("d-req-2", "k2", "p-engine", "127.0.0.1", producer.port, (7, 8), first_block=3)
    )
    # P accepted the registration and holds no prefill for it yet: D is still waiting.
    assert consumer.consumer.pending_count() == 1
    assert not consumer.done("d-req-2")
    producer.call(cmd="finish", key="k2", request_id="p-req-2", blocks=[20, 21, 22, 23, 24])
    consumer.wait("d-req-2")
    assert "d-req-2" not in consumer.failed
    _expect_blocks(consumer, [7, 8], [23, 24])
    producer.wait_released("p-req-2")


def test_abort_on_p_sends_fail_notification(producer: ProducerProcess, consumer: Consumer) -> None:
    consumer.register(
        RecvSpec("d-req-3", "k3", "p-engine", "127.0.0.1", producer.port, (1, 2), first_block=0)
    )
    producer.call(cmd="abort", key="k3", reason="prefill failed")
    # Ended by P's fail notification (its reason), not by D's 5 s timeout.
    assert consumer.wait("d-req-3").reason == "P failed: prefill failed"
    assert "d-req-3" in consumer.failed
    # A registration arriving after the abort is refused at once, with P's reason.
    consumer.register(
        RecvSpec("d-req-4", "k3", "p-engine", "127.0.0.1", producer.port, (3,), first_block=0)
    )
    assert consumer.wait("d-req-4").reason == "P refused: prefill failed"
    assert "d-req-4" in consumer.failed


def test_unregistered_prefill_is_freed_after_lease() -> None:
    lease_s = 2.0
    p = ProducerProcess(lease_s=lease_s)
    try:
        finished_at = time.monotonic()
        p.call(cmd="finish", key="k5", request_id="p-req-5", blocks=[1, 2])
        assert p.released() == set()  # a lease never ends early
        p.wait_released("p-req-5")
        assert time.monotonic() - finished_at >= lease_s  # held for the whole lease
        assert p.released() == {"p-req-5"}
    finally:
        p.close()


def test_timeout_when_p_never_finishes(producer: ProducerProcess) -> None:
    before = producer.released()  # the shared P: what earlier tests released is not ours
    c = Consumer(transfer_timeout_s=1.0, liveness_interval_s=0.2)
    try:
        c.register(
            RecvSpec("d-req-6", "k6", "p-engine", "127.0.0.1", producer.port, (1,), first_block=0)
        )
        rec = c.wait("d-req-6")
        assert "d-req-6" in c.failed
        # D's budget ran out (D's own timeout, or P's matching expiry of the registration).
        assert rec.reason in (
            "timed out waiting for P",
            "P failed: P never finished a prefill for this transfer",
        )
        assert rec.registration_to_write_s >= 1.0  # never before the budget
        # P was told (cancel) and will not WRITE later even if the prefill finishes now.
        producer.call(cmd="finish", key="k6", request_id="p-req-6", blocks=[4])
        producer.wait_released("p-req-6")
        assert producer.released() - before == {"p-req-6"}
        records = producer.call(cmd="records")["records"]
        assert not [r for r in records if r["transfer_key"] == "k6"]
        assert np.all(c.arrays[0][1] == -1.0)
    finally:
        c.close()


def test_p_death_fails_waiting_transfer_fast(consumer: Consumer) -> None:
    p = ProducerProcess()
    consumer.register(
        RecvSpec("d-req-7", "k7", "p-engine", "127.0.0.1", p.port, (1,), first_block=0)
    )
    p.proc.kill()
    p.proc.wait()
    rec = consumer.wait("d-req-7")
    assert "d-req-7" in consumer.failed
    # D's pings found P gone (not D's 5 s transfer timeout).
    assert rec.reason == f"P at 127.0.0.1:{p.port} is gone"


def test_d_cancel_before_write_releases_both_sides(
    producer: ProducerProcess, consumer: Consumer
) -> None:
    consumer.register(
        RecvSpec("d-req-8", "k8", "p-engine", "127.0.0.1", producer.port, (1, 2), first_block=0)
    )
    consumer.consumer.cancel("d-req-8")
    consumer.wait("d-req-8")
    producer.call(cmd="finish", key="k8", request_id="p-req-8", blocks=[5, 6])
    producer.wait_released("p-req-8")
    assert not [r for r in producer.call(cmd="records")["records"] if r["transfer_key"] == "k8"]
    assert np.all(consumer.arrays[0][[1, 2]] == -1.0)


def test_wrong_engine_and_unreachable_p_fail_registration(
    producer: ProducerProcess, consumer: Consumer
) -> None:
    consumer.consumer.register(
        RecvSpec("d-req-9", "k9", "other-engine", "127.0.0.1", producer.port, (1,), first_block=0)
    )
    assert consumer.wait("d-req-9").reason.startswith("P refused: engine id 'other-engine'")
    assert "d-req-9" in consumer.failed
    consumer.consumer.register(
        RecvSpec("d-req-10", "k10", "p-engine", "127.0.0.1", 1, (1,), first_block=0)
    )
    assert consumer.wait("d-req-10").reason.startswith("P unreachable")
    assert "d-req-10" in consumer.failed
