"""What every transfer benchmark kind shares: the memory shape and WRITE size
(:class:`TransferSpec`), the bare loops' descriptor positions, a round's report and its
statistics.

Who calls it: :mod:`bench.transfer` (the ``disagg-bench transfer`` command and its kinds),
:mod:`bench.transfer_path` and :mod:`bench.transfer_tp` (the kinds run in their own modules),
:mod:`bench.transfer_cmd`, :mod:`bench.report` and :mod:`bench.device_check`.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Sequence
from dataclasses import dataclass
from multiprocessing.connection import Connection, wait
from multiprocessing.process import BaseProcess
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from bench.bare_nixl import Positions

REPORT_TIMEOUT_S = 900.0


def await_report(
    kind: str,
    report: Connection,
    procs: Sequence[BaseProcess],
    timeout_s: float = REPORT_TIMEOUT_S,
) -> Any:
    """The one object a round's children send on ``report``, watching their liveness meanwhile.

    Raises ``RuntimeError`` at once when a child exits with a non-zero code (naming it and the
    code), when every child has exited without a report, or after ``timeout_s``.
    """
    deadline = time.monotonic() + timeout_s
    running = list(procs)
    while True:
        left = deadline - time.monotonic()
        ready = wait([report, *(p.sentinel for p in running)], timeout=max(left, 0.0))
        if report in ready or report.poll(0):
            return report.recv()
        if not ready:
            raise RuntimeError(f"{kind}: no result within {timeout_s:g} s")
        for proc in [p for p in running if p.sentinel in ready]:
            proc.join()
            if proc.exitcode != 0:
                raise RuntimeError(f"{kind}: {proc.name} exited with code {proc.exitcode}")
            running.remove(proc)
        if not running:
            raise RuntimeError(f"{kind}: every process exited without a result")


@dataclass(frozen=True)
class TransferSpec:
    """Memory shape (like a KV cache: regions x blocks) and how much one WRITE moves."""

    regions: int = 4
    blocks_per_region: int = 512
    block_bytes: int = 2048
    blocks_per_write: int = 256
    iterations: int = 50
    warmups: int = 5
    rounds: int = 2
    #: ``connector-path`` only: the connector's poll cadences (``ConnectorConfig.writer_poll_s``
    #: and ``receiver_poll_s``); ``None`` keeps the connector's defaults. Set them to the bare
    #: loop's (P spins, D polls every 0.1 ms) to separate the connector's own work from the
    #: cadence it chooses to save CPU.
    writer_poll_s: float | None = None
    receiver_poll_s: float | None = None
    #: ``connector-path`` only: ``ConnectorConfig.post_on_finish`` (True: the thread finishing
    #: the prefill posts the WRITE; the A/B for the writer's wake-up).
    post_on_finish: bool = False
    #: ``bare`` and ``connector`` only: P's tensor-parallel size. ``p_tp`` initiator processes
    #: (P ranks) WRITE concurrently into one target (D at TP 1), each its ``1/p_tp`` share of
    #: every block (its KV heads at their offset in D's block; :mod:`bench.transfer_tp`).
    p_tp: int = 1

    @property
    def bytes_per_write(self) -> int:
        return self.regions * self.blocks_per_write * self.block_bytes

    @property
    def descs_per_write(self) -> int:
        """Descriptors in one rank's WRITE (every rank posts this many per iteration)."""
        return self.regions * self.blocks_per_write

    @property
    def share_bytes(self) -> int:
        """Bytes of one P rank's share of one block (the whole block at ``p_tp`` 1)."""
        return self.block_bytes // self.p_tp

    def validate(self) -> None:
        if not 0 < self.blocks_per_write <= self.blocks_per_region:
            raise ValueError("blocks_per_write must be in [1, blocks_per_region]")
        if min(self.regions, self.block_bytes, self.iterations) < 1 or self.warmups < 0:
            raise ValueError("regions, block_bytes and iterations must be >= 1")
        if self.p_tp < 1 or self.block_bytes % self.p_tp:
            raise ValueError("p_tp must be >= 1 and divide block_bytes")


def key_suffix(p_tp: int) -> str:
    """What every ratio key of a result names its TP with: ``""`` at P TP 1 (today's keys),
    ``_p_tp<N>`` otherwise (``connector_over_bare_throughput_p_tp2``)."""
    return "" if p_tp == 1 else f"_p_tp{p_tp}"


def bare_positions(spec: TransferSpec) -> Positions:
    """The bare loops' WRITE: the first ``blocks_per_write`` descriptors of every region, as
    the int32 array NIXL posts without converting (what the connector's arithmetic gives)."""
    from bench.bare_nixl import positions

    return positions(
        [
            r * spec.blocks_per_region + b
            for r in range(spec.regions)
            for b in range(spec.blocks_per_write)
        ]
    )


def write_stats(spec: TransferSpec, times: Sequence[float]) -> dict[str, float]:
    """Throughput and latency of ``times`` (seconds per iteration), each moving
    ``spec.bytes_per_write`` bytes."""
    total = sum(times)
    return {
        "throughput_gbps": spec.bytes_per_write * len(times) / total / 1e9,
        "median_throughput_gbps": spec.bytes_per_write / statistics.median(times) / 1e9,
        "median_write_ms": statistics.median(times) * 1000,
        "p99_write_ms": sorted(times)[max(0, int(len(times) * 0.99) - 1)] * 1000,
    }
