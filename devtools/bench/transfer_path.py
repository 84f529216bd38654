"""Transfer latency from "prefill done" to "D knows the KV landed": connector path vs bare NIXL.

Who calls it: :mod:`bench.transfer` (``bench transfer --path``). Two processes, P and D,
DRAM buffers shaped like a KV cache (``TransferSpec``). D drives: for each iteration it tells P
"go" and waits until it sees the transfer complete; P stamps ``t0`` (``time.monotonic``, the
system-wide CLOCK_MONOTONIC) right before it starts, D stamps ``t1`` when it sees completion.

- ``bare-notify``: P posts one prepped NIXL WRITE carrying a notification; D polls
  ``get_new_notifs`` until it arrives. D waits the connector path's registration lead (50 ms)
  before each "go" too, so both kinds start a WRITE from the same idle machine: back to back,
  the buffers stay in the CPU caches and the copy takes about half as long.
- ``connector-path``: D registers its blocks with
  :class:`disagg_router.connector.consumer.PushConsumer` (side channel to P) and waits 50 ms so the
  registration is in place, as it is in push mode while P prefills; P calls
  :meth:`disagg_router.connector.producer.PushProducer.add_finished`; the producer's writer thread
  WRITEs and notifies; D polls ``take_results``. This is the connector's whole WRITE path.
"""

from __future__ import annotations

import ctypes
import multiprocessing as mp
import statistics
import time
from dataclasses import replace
from multiprocessing.connection import Connection
from typing import Any, Literal

from bench.transfer_spec import TransferSpec, await_report, bare_positions

PathKind = Literal["bare-notify", "connector-path"]
_REGISTRATION_LEAD_S = 0.05
_P_ENGINE = "bench-p-engine"
_POLL_S = 0.0001


def _buffer(spec: TransferSpec) -> Any:
    return (ctypes.c_uint8 * (spec.regions * spec.blocks_per_region * spec.block_bytes))()


def _layout(spec: TransferSpec, addr: int) -> Any:
    from disagg_router.connector.layout import LayoutSpec, RegionSpec

    region_bytes = spec.blocks_per_region * spec.block_bytes
    return LayoutSpec(
        tuple(
            RegionSpec(
                addr + r * region_bytes, spec.block_bytes, spec.block_bytes, spec.blocks_per_region
            )
            for r in range(spec.regions)
        )
    )


def _descs(spec: TransferSpec, addr: int) -> list[tuple[int, int, int]]:
    from bench.bare_nixl import contiguous_descs

    return contiguous_descs(addr, spec.block_bytes, spec.regions * spec.blocks_per_region)


def _bare(name: str, spec: TransferSpec, addr: int) -> Any:
    from bench.bare_nixl import BareNixlEndpoint

    total = spec.regions * spec.blocks_per_region * spec.block_bytes
    return BareNixlEndpoint(name, _descs(spec, addr), spans=[(addr, total, 0)])


def _p_process(kind: PathKind, spec: TransferSpec, d: Connection) -> None:
    buf = _buffer(spec)
    addr = ctypes.addressof(buf)
    blocks = tuple(range(spec.blocks_per_write))
    if kind == "bare-notify":
        bare = _bare("bench-p", spec, addr)
        d.send({"metadata": bare.metadata(), "addr": addr})
        bare_hello = d.recv()
        bare.connect(bare_hello["metadata"], _descs(spec, bare_hello["addr"]))
        ids = bare_positions(spec)
        while (msg := d.recv()) != "stop":
            t0 = time.monotonic()
            d.send(t0)  # before the post, as add_finished returns before the writer posts
            handle = bare.write(ids, f"it-{msg}".encode())
            while bare.state(handle) == "PROC":
                pass
            bare.release(handle)
        bare.close()
        return
    from disagg_router.connector.config import ConnectorConfig
    from disagg_router.connector.nixl_backend import NixlEndpoint
    from disagg_router.connector.producer import PushProducer
    from disagg_router.connector.specs import SendSpec

    ep = NixlEndpoint("bench-p", _layout(spec, addr))
    cfg = ConnectorConfig(side_channel_port=0, lease_s=300.0, registration_ttl_s=300.0)
    if spec.writer_poll_s is not None:
        cfg = replace(cfg, writer_poll_s=spec.writer_poll_s)
    cfg = replace(cfg, post_on_finish=spec.post_on_finish)
    producer = PushProducer(ep, _P_ENGINE, cfg)
    d.send({"port": producer.port})
    while (msg := d.recv()) != "stop":
        t0 = time.monotonic()
        producer.add_finished(SendSpec(f"p{msg}", f"k{msg}", blocks))
        d.send(t0)
        producer.take_released()
    producer.close()
    ep.close()


def _d_process(kind: PathKind, spec: TransferSpec, p: Connection, report: Connection) -> None:
    buf = _buffer(spec)
    addr = ctypes.addressof(buf)
    total = spec.warmups + spec.iterations
    latencies: list[float] = []
    if kind == "bare-notify":
        bare = _bare("bench-d", spec, addr)
        hello = p.recv()
        p.send({"metadata": bare.metadata(), "addr": addr})
        bare.connect(hello["metadata"], _descs(spec, hello["addr"]))
        for i in range(total):
            time.sleep(_REGISTRATION_LEAD_S)  # the connector path's lead: same cache state
            p.send(i)
            t0 = p.recv()
            want = f"it-{i}".encode()
            while want not in bare.notifs():
                time.sleep(_POLL_S)
            latencies.append(time.monotonic() - t0)
        p.send("stop")
        bare.close()
    else:
        from disagg_router.connector.config import ConnectorConfig
        from disagg_router.connector.consumer import PushConsumer
        from disagg_router.connector.nixl_backend import NixlEndpoint
        from disagg_router.connector.specs import RecvSpec

        ep = NixlEndpoint("bench-d", _layout(spec, addr))
        cfg = ConnectorConfig(transfer_timeout_s=120.0)
        if spec.receiver_poll_s is not None:
            cfg = replace(cfg, receiver_poll_s=spec.receiver_poll_s)
        consumer = PushConsumer(ep, cfg)
        port = p.recv()["port"]
        blocks = tuple(range(spec.blocks_per_write))
        for i in range(total):
            consumer.register(RecvSpec(f"r{i}", f"k{i}", _P_ENGINE, "127.0.0.1", port, blocks, 0))
            time.sleep(_REGISTRATION_LEAD_S)
            p.send(i)
            t0 = p.recv()
            while True:
                finished, failed = consumer.take_results()
                if f"r{i}" in failed:
                    raise RuntimeError(f"transfer r{i} failed")
                if f"r{i}" in finished:
                    break
                time.sleep(_POLL_S)  # let the receiver thread run (no GIL-hogging spin)
            latencies.append(time.monotonic() - t0)
        p.send("stop")
        consumer.close()
        ep.close()
    report.send(latencies[spec.warmups :])


def run_path_kind(kind: PathKind, spec: TransferSpec) -> dict[str, Any]:
    """One round of one kind in two fresh processes."""
    ctx = mp.get_context("spawn")
    a, b = ctx.Pipe()
    report_recv, report_send = ctx.Pipe(duplex=False)
    p_proc = ctx.Process(target=_p_process, args=(kind, spec, a), name="P")
    d_proc = ctx.Process(target=_d_process, args=(kind, spec, b, report_send), name="D")
    p_proc.start()
    d_proc.start()
    try:
        times: list[float] = await_report(kind, report_recv, (d_proc, p_proc))
    finally:
        for proc in (d_proc, p_proc):
            proc.join(timeout=30.0)
            if proc.is_alive():
                proc.kill()
                proc.join()
    median = statistics.median(times)
    return {
        "kind": kind,
        "median_latency_ms": median * 1000,
        "p90_latency_ms": sorted(times)[int(0.9 * (len(times) - 1))] * 1000,
        "median_throughput_gbps": spec.bytes_per_write / median / 1e9,
    }
