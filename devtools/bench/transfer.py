"""Transfer efficiency: the connector's NIXL WRITE path vs a bare NIXL WRITE, two processes.

Who calls it: ``disagg-bench transfer``. For each kind (``bare``: raw agent calls from
:mod:`bench.bare_nixl`; ``connector``: ``disagg_router.connector.nixl_backend.NixlEndpoint`` with a
``disagg_router.connector.protocol.LayoutSpec`` and the connector's block-id -> descriptor
arithmetic) it spawns a target process that registers a DRAM buffer and an initiator process that
WRITEs the same bytes in the same block count into it, ``iterations`` times, each WRITE carrying a
notification and polled to completion. Kinds alternate over ``rounds`` so machine noise hits both
alike. With ``p_tp`` > 1 the ``bare`` and ``connector`` kinds run :mod:`bench.transfer_tp` instead:
that many initiators (P ranks) each WRITE their share of every block into one target.
"""

from __future__ import annotations

import ctypes
import multiprocessing as mp
import statistics
import time
from dataclasses import asdict
from multiprocessing.connection import Connection
from typing import Any, Literal

from bench.transfer_spec import (
    TransferSpec,
    await_report,
    bare_positions,
    key_suffix,
    write_stats,
)

Kind = Literal["bare", "connector"]


class _Endpoint:
    """Both kinds behind one shape: ``write(notif)`` posts the spec's WRITE."""

    def __init__(self, kind: Kind, name: str, spec: TransferSpec) -> None:
        total = spec.regions * spec.blocks_per_region * spec.block_bytes
        self.buffer = (ctypes.c_uint8 * total)()
        self.addr = ctypes.addressof(self.buffer)
        self.kind = kind
        self.spec = spec
        self.impl: Any
        if kind == "bare":
            from bench.bare_nixl import BareNixlEndpoint, contiguous_descs

            n = spec.regions * spec.blocks_per_region
            descs = contiguous_descs(self.addr, spec.block_bytes, n)
            self.impl = BareNixlEndpoint(name, descs, spans=[(self.addr, spec.block_bytes * n, 0)])
            self.ids = bare_positions(spec)
        else:
            from disagg_router.connector.layout import LayoutSpec, RegionSpec, descriptor_index
            from disagg_router.connector.nixl_backend import NixlEndpoint

            region_bytes = spec.blocks_per_region * spec.block_bytes
            self.layout = LayoutSpec(
                tuple(
                    RegionSpec(
                        self.addr + r * region_bytes,
                        spec.block_bytes,
                        spec.block_bytes,
                        spec.blocks_per_region,
                    )
                    for r in range(spec.regions)
                )
            )
            self.impl = NixlEndpoint(name, self.layout)
            self.ids = descriptor_index(self.layout, list(range(spec.blocks_per_write)))
        self.peer = ""

    def hello(self) -> dict[str, Any]:
        out: dict[str, Any] = {"metadata": self.impl.metadata(), "addr": self.addr}
        if self.kind == "connector":
            out["layout"] = self.layout.to_json()
        return out

    def connect(self, peer_name: str, hello: dict[str, Any]) -> None:
        self.peer = peer_name
        if self.kind == "bare":
            from bench.bare_nixl import contiguous_descs

            n = self.spec.regions * self.spec.blocks_per_region
            descs = contiguous_descs(hello["addr"], self.spec.block_bytes, n)
            self.impl.connect(hello["metadata"], descs)
        else:
            from disagg_router.connector.layout import LayoutSpec

            remote = LayoutSpec.from_json(hello["layout"])
            self.impl.prepare_remote(peer_name, hello["metadata"], remote)
            self.impl.connect(peer_name)

    def write_and_wait(self, notif: bytes) -> float:
        start = time.perf_counter()
        if self.kind == "bare":
            handle = self.impl.write(self.ids, notif)
        else:
            handle = self.impl.write(self.peer, self.ids, self.ids, notif)
        while (state := self.impl.state(handle)) == "PROC":
            pass
        elapsed = time.perf_counter() - start
        self.impl.release(handle)
        if state != "DONE":
            raise RuntimeError(f"WRITE ended in state {state}")
        return elapsed

    def notifs(self) -> int:
        if self.kind == "bare":
            return len(self.impl.notifs())
        return len(self.impl.take_notifs())


def _target(kind: Kind, spec: TransferSpec, peer: Connection, expected: int) -> None:
    ep = _Endpoint(kind, f"bench-target-{kind}", spec)
    peer.send(ep.hello())
    received = 0
    deadline = time.monotonic() + 600.0
    while received < expected and time.monotonic() < deadline:
        received += ep.notifs()
        if received < expected:
            time.sleep(0.0005)
    peer.send(received)
    peer.recv()  # wait until the initiator is done before tearing down
    ep.impl.close()


def _initiator(kind: Kind, spec: TransferSpec, peer: Connection, report: Connection) -> None:
    ep = _Endpoint(kind, f"bench-initiator-{kind}", spec)
    ep.connect(f"bench-target-{kind}", peer.recv())
    for i in range(spec.warmups):
        ep.write_and_wait(f"warm-{i}".encode())
    times = [ep.write_and_wait(f"it-{i}".encode()) for i in range(spec.iterations)]
    notified = peer.recv()
    peer.send("bye")
    ep.impl.close()
    report.send({"times": times, "notified": notified})


def run_kind(kind: Kind, spec: TransferSpec) -> dict[str, Any]:
    """One round of one kind in two fresh processes; returns throughput and latency."""
    ctx = mp.get_context("spawn")
    a, b = ctx.Pipe()
    report_recv, report_send = ctx.Pipe(duplex=False)
    expected = spec.warmups + spec.iterations
    target = ctx.Process(target=_target, args=(kind, spec, b, expected), name="target")
    initiator = ctx.Process(target=_initiator, args=(kind, spec, a, report_send), name="initiator")
    target.start()
    initiator.start()
    try:
        result: dict[str, Any] = await_report(kind, report_recv, (initiator, target))
    finally:
        for proc in (initiator, target):
            proc.join(timeout=30.0)
            if proc.is_alive():
                proc.kill()
                proc.join()
    return {
        "kind": kind,
        **write_stats(spec, result["times"]),
        "notifications_received": result["notified"],
        "notifications_expected": expected,
    }


AnyKind = Literal["bare", "connector", "bare-notify", "connector-path"]
ALL_KINDS: tuple[AnyKind, ...] = ("bare", "connector", "bare-notify", "connector-path")


TP_KINDS: tuple[AnyKind, ...] = ("bare", "connector")
"""The kinds that run at ``p_tp`` > 1."""


def _run_any(kind: AnyKind, spec: TransferSpec) -> dict[str, Any]:
    if spec.p_tp > 1:
        from bench.transfer_tp import run_tp_kind

        row = run_tp_kind(kind, spec)  # type: ignore[arg-type]
        if not row["byte_exact"]:
            raise RuntimeError(f"{kind}: D's blocks do not hold every P rank's share")
        return row
    if kind in ("bare", "connector"):
        return run_kind(kind, spec)
    from bench.transfer_path import run_path_kind

    return run_path_kind(kind, spec)  # type: ignore[arg-type]


def _ratio(median: dict[str, float], a: str, b: str) -> float | None:
    return median[a] / median[b] if a in median and b in median and median[b] > 0 else None


def run_transfer(spec: TransferSpec, kinds: tuple[AnyKind, ...] = ALL_KINDS) -> dict[str, Any]:
    """Alternate the kinds over ``spec.rounds``.

    Ratios use the per-round median-WRITE throughput (bytes per WRITE / median time), median over
    rounds, which is robust to the stalls of a shared machine. The headline
    ``connector_over_bare_throughput`` is the whole connector path (``connector-path`` /
    ``bare-notify``) when both ran, else the endpoint-level ratio (``connector`` / ``bare``).
    At ``p_tp`` > 1 only :data:`TP_KINDS` run and every ratio key ends in
    :func:`key_suffix` (``connector_over_bare_throughput_p_tp2``).
    """
    spec.validate()
    if spec.p_tp > 1 and any(k not in TP_KINDS for k in kinds):
        raise ValueError(f"p_tp > 1 runs the kinds {TP_KINDS} only")
    rounds: list[dict[str, Any]] = []
    for r in range(spec.rounds):
        for kind in kinds:
            row = _run_any(kind, spec)
            row["round"] = r
            rounds.append(row)
    median: dict[str, float] = {
        str(k): statistics.median(x["median_throughput_gbps"] for x in rounds if x["kind"] == k)
        for k in kinds
    }
    path_ratio = _ratio(median, "connector-path", "bare-notify")
    endpoint_ratio = _ratio(median, "connector", "bare")
    tp = key_suffix(spec.p_tp)
    return {
        "spec": asdict(spec),
        "bytes_per_write": spec.bytes_per_write,
        "descriptors_per_write": spec.descs_per_write,
        "rounds": rounds,
        "median_throughput_gbps": median,
        f"path_connector_over_bare_throughput{tp}": path_ratio,
        f"endpoint_connector_over_bare_throughput{tp}": endpoint_ratio,
        f"connector_over_bare_throughput{tp}": (
            path_ratio if path_ratio is not None else endpoint_ratio
        ),
    }
