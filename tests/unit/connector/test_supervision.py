"""Every transfer-core thread survives the errors it expects and reports the ones it cannot.

With the in-memory endpoint and a fake clock: a NIXL error (``TransferError``) fails the
transfers it belongs to, is counted, and the thread goes on; any other error stops a loop thread
and the worker's next engine step raises, which makes vLLM fail the engine (``/health`` 503).
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from disagg_router.connector.config import ConnectorConfig
from disagg_router.connector.consumer import PushConsumer
from disagg_router.connector.errors import SideChannelError, TransferCoreFailedError, TransferError
from disagg_router.connector.faults import INJECTED, FaultInjectingEndpoint
from disagg_router.connector.producer import PushProducer
from disagg_router.connector.protocol import (
    Notification,
    decode_reply,
    encode_notification,
    encode_request,
)
from disagg_router.connector.side_channel import request
from disagg_router.connector.specs import RecvSpec, SendSpec
from disagg_router.connector.stats import PushTransferStats
from disagg_router.connector.worker import PushWorker, WorkerSetup
from tests.unit.connector.core_support import FakeClock, MemoryEndpoint, until
from tests.unit.connector.test_consumer import Transport
from tests.unit.connector.test_producer import reg

CFG = ConnectorConfig(side_channel_port=0, lease_s=5.0, registration_ttl_s=5.0)
THREAD_DIES = pytest.mark.filterwarnings("ignore::pytest.PytestUnhandledThreadExceptionWarning")


@pytest.fixture
def producer() -> Iterator[tuple[PushProducer, MemoryEndpoint]]:
    ep = MemoryEndpoint()
    p = PushProducer(ep, "p0", CFG, clock=FakeClock())
    yield p, ep
    p.close()


def _transfer(p: PushProducer, ep: MemoryEndpoint, key: str) -> None:
    """Register and finish one transfer, then wait until P released its blocks."""
    p.handle_request(reg(key, (2,)))
    p.add_finished(SendSpec(f"p-{key}", key, (1,)))
    released: set[str] = set()

    def freed() -> bool:
        released.update(p.take_released())
        return f"p-{key}" in released

    until(freed)


def test_a_nixl_error_in_progress_is_counted_and_the_writer_goes_on(
    producer: tuple[PushProducer, MemoryEndpoint],
) -> None:
    p, ep = producer
    ep.progress_errors.append(TransferError("NIXL get_new_notifs failed"))
    until(lambda: not ep.progress_errors)  # the writer's step met it
    _transfer(p, ep, "after")
    assert ep.writes[-1][3] == Notification("done", "after", "d-after")
    assert p.health.take_errors() == 1
    p.health.check()  # still healthy


def test_an_injected_error_mid_write_fails_that_transfer_and_the_writer_goes_on(
    tmp_path: Path,
) -> None:
    trigger = tmp_path / "fault"
    ep = MemoryEndpoint()
    p = PushProducer(FaultInjectingEndpoint(ep, str(trigger)), "p0", CFG, clock=FakeClock())
    try:
        trigger.touch()
        _transfer(p, ep, "hit")
        assert not trigger.exists()  # one file, one fault
        (record,) = p.take_records()
        assert not record.ok and INJECTED in record.reason
        until(lambda: any(n.kind == "failed" and n.transfer_key == "hit" for _, n in ep.notifs))
        _transfer(p, ep, "next")  # the writer went on
        assert [w[3].transfer_key for w in ep.writes] == ["next"]
        assert p.take_records()[0].ok
        assert p.health.take_errors() == 2  # the WRITE's state and the next progress()
    finally:
        p.close()


class _BuggyHandler(PushProducer):
    def handle_request(self, data: bytes) -> bytes:
        if data == b"boom":
            raise ZeroDivisionError("a bug in the handler")
        return super().handle_request(data)


def test_a_side_channel_handler_error_is_counted_and_the_server_goes_on() -> None:
    p = _BuggyHandler(MemoryEndpoint(), "p0", CFG, clock=FakeClock())
    try:
        with pytest.raises(SideChannelError):  # that one D sees its request fail
            request("127.0.0.1", p.port, b"boom", 2.0)
        ping = request("127.0.0.1", p.port, encode_request("ping", {}), 2.0)
        assert decode_reply(ping).status == "pong"
        assert p.health.take_errors() == 1
        p.health.check()
    finally:
        p.close()


def _worker(config: ConnectorConfig = CFG) -> PushWorker:
    setup = WorkerSetup("p0", is_producer=True, is_consumer=True, num_blocks=4, block_size=16,
                        kv_buffer_device="cpu")  # fmt: skip
    return PushWorker(setup, config)


@THREAD_DIES
def test_an_unexpected_error_stops_the_writer_and_the_next_step_fails_the_engine() -> None:
    worker, ep = _worker(), MemoryEndpoint()
    worker.producer = PushProducer(ep, "p0", CFG, clock=FakeClock(), health=worker.health)
    try:
        ep.progress_errors.append(ZeroDivisionError("a bug"))

        def failed() -> bool:
            try:
                worker.collect()
            except TransferCoreFailedError as exc:
                assert "dpc-writer" in str(exc) and "a bug" in str(exc)
                return True
            return False

        until(failed)
        with pytest.raises(TransferCoreFailedError):  # every step after, too
            worker.collect()
    finally:
        worker.producer.close()


D_CFG = ConnectorConfig(transfer_timeout_s=10.0, liveness_interval_s=0.5)


def _spec() -> RecvSpec:
    return RecvSpec("d-1", "k1", "p0", "10.0.0.1", 5601, (7, 8), first_block=0)


def test_a_nixl_error_reading_notifications_is_counted_and_the_receiver_goes_on() -> None:
    ep = MemoryEndpoint("d-agent")
    c = PushConsumer(ep, D_CFG, transport=Transport())
    try:
        ep.notif_errors.append(TransferError("NIXL get_new_notifs failed"))
        until(lambda: not ep.notif_errors)
        c.register(_spec()).result(timeout=3)
        ep.deliver(encode_notification(Notification("done", "k1", "d-1")))
        until(lambda: c.pending_count() == 0)
        assert c.take_results() == ({"d-1"}, set())
        assert c.health.take_errors() == 1
        c.health.check()
    finally:
        c.close()


@THREAD_DIES
def test_an_unexpected_error_stops_the_receiver_and_makes_the_instance_unhealthy() -> None:
    ep = MemoryEndpoint("d-agent")
    c = PushConsumer(ep, D_CFG, transport=Transport())
    try:
        ep.notif_errors.append(ZeroDivisionError("a bug"))
        until(lambda: c.health.take_errors() == 1)
        with pytest.raises(TransferCoreFailedError, match="dpc-receiver"):
            c.health.check()
    finally:
        c.close()


class _BuggyTransport(Transport):
    def __call__(self, host: str, port: int, payload: bytes, timeout_s: float) -> bytes:
        raise ZeroDivisionError("a bug in a side-channel task")


def test_a_side_channel_task_that_raises_is_counted() -> None:
    c = PushConsumer(MemoryEndpoint("d-agent"), D_CFG, transport=_BuggyTransport())
    try:
        future = c.register(_spec())
        with pytest.raises(ZeroDivisionError):
            future.result(timeout=3)
        until(lambda: c.health.take_errors() == 1)
        c.health.check()  # the pool goes on; the transfer ends by its own bounds
    finally:
        c.close()


def test_errors_reach_the_stats() -> None:
    stats = PushTransferStats()
    assert stats.is_empty()
    stats.record_errors(2)
    assert not stats.is_empty()
    assert stats.reduce()["num_thread_errors"] == 2
