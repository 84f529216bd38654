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

from connector.config import ConnectorConfig
from connector.consumer import PushConsumer
from connector.nixl_backend import NixlEndpoint, nixl_available
from connector.specs import RecvSpec

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
        return set(self.call(cmd="released")["released"])

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

    def wait(self, rid: str, timeout: float = 10.0) -> float:
        t0 = time.monotonic()
        while time.monotonic() - t0 < timeout:
            fin, fail = self.consumer.take_results()
            self.finished |= fin
            self.failed |= fail
            if rid in self.finished:
                return time.monotonic() - t0
            time.sleep(0.005)
        raise AssertionError(f"{rid} not finished within {timeout}s")

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
    consumer.wait("d-req-1")
    assert "d-req-1" not in consumer.failed
    _expect_blocks(consumer, d_blocks, p_blocks)
    untouched = sorted(set(range(D_BLOCKS)) - set(d_blocks))
    assert all(np.all(a[untouched] == -1.0) for a in consumer.arrays)
    time.sleep(0.1)
    assert "p-req-1" in producer.released()
    rec = next(r for r in producer.call(cmd="records")["records"] if r["transfer_key"] == "k1")
    assert rec["ok"] and rec["num_blocks"] == 40 and rec["num_bytes"] == 40 * 2 * 4096
    drec = consumer.consumer.take_records()[0]
    assert drec.ok and drec.num_blocks == 40


def test_registration_before_finish_and_prefix_hit(
    producer: ProducerProcess, consumer: Consumer
) -> None:
    # D already has the first 3 blocks cached: it asks only for the tail.
    consumer.consumer.register(
        RecvSpec("d-req-2", "k2", "p-engine", "127.0.0.1", producer.port, (7, 8), first_block=3)
    )
    time.sleep(0.2)
    assert consumer.consumer.pending_count() == 1
    producer.call(cmd="finish", key="k2", request_id="p-req-2", blocks=[20, 21, 22, 23, 24])
    consumer.wait("d-req-2")
    assert "d-req-2" not in consumer.failed
    _expect_blocks(consumer, [7, 8], [23, 24])


def test_abort_on_p_sends_fail_notification(producer: ProducerProcess, consumer: Consumer) -> None:
    consumer.consumer.register(
        RecvSpec("d-req-3", "k3", "p-engine", "127.0.0.1", producer.port, (1, 2), first_block=0)
    )
    time.sleep(0.2)
    producer.call(cmd="abort", key="k3", reason="prefill failed")
    took = consumer.wait("d-req-3", timeout=3.0)
    assert "d-req-3" in consumer.failed
    # Ended by P's fail notification, not by D's 5 s timeout.
    assert took < 3.0
    assert consumer.consumer.take_records()[0].reason == "P failed: prefill failed"
    # A registration arriving after the abort is refused at once.
    consumer.consumer.register(
        RecvSpec("d-req-4", "k3", "p-engine", "127.0.0.1", producer.port, (3,), first_block=0)
    )
    consumer.wait("d-req-4", timeout=3.0)
    assert "d-req-4" in consumer.failed


def test_unregistered_prefill_is_freed_after_lease() -> None:
    p = ProducerProcess(lease_s=0.5)
    try:
        p.call(cmd="finish", key="k5", request_id="p-req-5", blocks=[1, 2])
        assert p.released() == set()
        time.sleep(1.0)
        assert p.released() == {"p-req-5"}
    finally:
        p.close()


def test_timeout_when_p_never_finishes() -> None:
    p = ProducerProcess()
    c = Consumer(transfer_timeout_s=1.0, liveness_interval_s=0.2)
    try:
        c.consumer.register(
            RecvSpec("d-req-6", "k6", "p-engine", "127.0.0.1", p.port, (1,), first_block=0)
        )
        took = c.wait("d-req-6", timeout=5.0)
        assert "d-req-6" in c.failed
        assert 0.9 < took < 3.0
        # P was told (cancel) and will not WRITE later even if the prefill finishes now.
        p.call(cmd="finish", key="k6", request_id="p-req-6", blocks=[4])
        time.sleep(0.3)
        assert p.released() == {"p-req-6"}
        assert np.all(c.arrays[0][1] == -1.0)
    finally:
        c.close()
        p.close()


def test_p_death_fails_waiting_transfer_fast(consumer: Consumer) -> None:
    p = ProducerProcess()
    consumer.consumer.register(
        RecvSpec("d-req-7", "k7", "p-engine", "127.0.0.1", p.port, (1,), first_block=0)
    )
    time.sleep(0.3)
    p.proc.kill()
    p.proc.wait()
    took = consumer.wait("d-req-7", timeout=5.0)
    assert "d-req-7" in consumer.failed
    assert took < 2.0


def test_d_cancel_before_write_releases_both_sides(
    producer: ProducerProcess, consumer: Consumer
) -> None:
    consumer.consumer.register(
        RecvSpec("d-req-8", "k8", "p-engine", "127.0.0.1", producer.port, (1, 2), first_block=0)
    )
    time.sleep(0.2)
    consumer.consumer.cancel("d-req-8")
    consumer.wait("d-req-8", timeout=3.0)
    producer.call(cmd="finish", key="k8", request_id="p-req-8", blocks=[5, 6])
    time.sleep(0.2)
    assert "p-req-8" in producer.released()
    assert np.all(consumer.arrays[0][[1, 2]] == -1.0)


def test_wrong_engine_and_unreachable_p_fail_registration(
    producer: ProducerProcess, consumer: Consumer
) -> None:
    consumer.consumer.register(
        RecvSpec("d-req-9", "k9", "other-engine", "127.0.0.1", producer.port, (1,), first_block=0)
    )
    consumer.wait("d-req-9", timeout=3.0)
    assert "d-req-9" in consumer.failed
    consumer.consumer.register(
        RecvSpec("d-req-10", "k10", "p-engine", "127.0.0.1", 1, (1,), first_block=0)
    )
    consumer.wait("d-req-10", timeout=3.0)
    assert "d-req-10" in consumer.failed
