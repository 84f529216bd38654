"""Transfer statistics through vLLM's connector stats and Prometheus hooks.

Who calls it: the facade (:mod:`disagg_router.connector.facade`) records one ``TransferRecord`` per
finished transfer on the worker; vLLM ships :class:`PushTransferStats` to its logger process,
aggregates and either logs ``reduce()`` or feeds :class:`PushPromMetrics.observe` (metrics are
created once, against the metric classes and labels vLLM passes in, i.e. vLLM's own registry).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from vllm.distributed.kv_transfer.kv_connector.v1.metrics import (
    KVConnectorPromMetrics,
    KVConnectorStats,
)

from disagg_router.connector.records import WAIT_FOR_REGISTRATION_BUCKETS, TransferRecord

_FIELDS = (
    "ok",
    "failed",
    "bytes",
    "blocks",
    "errors",
    "write_s",
    "reg_to_write_s",
    "wait_for_reg_s",
    "unwritten_block_seconds",
)


@dataclass
class PushTransferStats(KVConnectorStats):  # type: ignore[misc]
    """Lists of per-transfer observations (``data`` stays plain-serialisable)."""

    def __post_init__(self) -> None:
        for key in _FIELDS:
            self.data.setdefault(key, [] if key.endswith("_s") else 0)
        self.data.setdefault("bytes_list", [])

    def record(self, rec: TransferRecord) -> None:
        if not rec.ok:
            self.data["failed"] += 1
            return
        self.data["ok"] += 1
        self.data["bytes"] += rec.num_bytes
        self.data["blocks"] += rec.num_blocks
        self.data["bytes_list"].append(rec.num_bytes)
        if rec.side == "writer":
            self.data["write_s"].append(rec.write_s)
            self.data["wait_for_reg_s"].append(rec.wait_for_registration_s)
        self.data["reg_to_write_s"].append(rec.registration_to_write_s)
        self.data["unwritten_block_seconds"] += rec.num_blocks * rec.registration_to_write_s

    def record_errors(self, count: int) -> None:
        """Errors the transfer core's threads met (:mod:`disagg_router.connector.supervision`)."""
        self.data["errors"] += count

    def reset(self) -> None:
        self.data = dict[str, Any]()
        self.__post_init__()

    def aggregate(self, other: KVConnectorStats) -> PushTransferStats:
        for key, value in other.data.items():
            if isinstance(value, list):
                self.data.setdefault(key, []).extend(value)
            else:
                self.data[key] = self.data.get(key, 0) + value
        return self

    def reduce(self) -> dict[str, int | float]:
        def avg_ms(xs: list[float]) -> float:
            return round(1e3 * sum(xs) / len(xs), 3) if xs else 0.0

        return {
            "num_transfers": self.data["ok"],
            "num_failed": self.data["failed"],
            "num_thread_errors": self.data["errors"],
            "total_bytes": self.data["bytes"],
            "total_blocks": self.data["blocks"],
            "avg_write_ms": avg_ms(self.data["write_s"]),
            "avg_registration_to_write_ms": avg_ms(self.data["reg_to_write_s"]),
            "avg_wait_for_registration_ms": avg_ms(self.data["wait_for_reg_s"]),
            "unwritten_block_seconds": round(self.data["unwritten_block_seconds"], 3),
        }

    def is_empty(self) -> bool:
        return not (self.data["ok"] or self.data["failed"] or self.data["errors"])


class PushPromMetrics(KVConnectorPromMetrics):  # type: ignore[misc]
    """``disagg_push_*`` counters and histograms, one set per engine label."""

    def __init__(
        self, vllm_config: Any, metric_types: Any, labelnames: Any, per_engine_labelvalues: Any
    ) -> None:
        super().__init__(vllm_config, metric_types, labelnames, per_engine_labelvalues)
        names = list(labelnames)

        def per_engine(metric: Any) -> dict[int, Any]:
            return {idx: metric.labels(*vals) for idx, vals in per_engine_labelvalues.items()}

        self._transfers = per_engine(
            self._counter_cls(
                name="disagg_push_transfers_total",
                documentation="Finished KV transfers.",
                labelnames=names,
            )
        )
        self._failures = per_engine(
            self._counter_cls(
                name="disagg_push_transfer_failures_total",
                documentation="Failed KV transfers.",
                labelnames=names,
            )
        )
        self._bytes = per_engine(
            self._counter_cls(
                name="disagg_push_transfer_bytes_total",
                documentation="KV bytes transferred.",
                labelnames=names,
            )
        )
        self._blocks = per_engine(
            self._counter_cls(
                name="disagg_push_transfer_blocks_total",
                documentation="KV blocks transferred.",
                labelnames=names,
            )
        )
        self._errors = per_engine(
            self._counter_cls(
                name="disagg_push_thread_errors_total",
                documentation="Errors the connector's threads met (survived, or stopped on).",
                labelnames=names,
            )
        )
        buckets = [0.0005, 0.001, 0.005, 0.01, 0.05, 0.1, 0.5, 1.0, 5.0, 30.0]
        self._write = per_engine(
            self._histogram_cls(
                name="disagg_push_write_seconds",
                documentation="P: WRITE post to completion.",
                labelnames=names,
                buckets=buckets,
            )
        )
        self._reg = per_engine(
            self._histogram_cls(
                name="disagg_push_registration_to_write_seconds",
                documentation="Registration to WRITE completion.",
                labelnames=names,
                buckets=buckets,
            )
        )

        self._wait_for_reg = per_engine(
            self._histogram_cls(
                name="disagg_push_wait_for_registration_seconds",
                documentation="P: prefill finished to D's registration (0: D registered first).",
                labelnames=names,
                buckets=list(WAIT_FOR_REGISTRATION_BUCKETS),
            )
        )
        self._unwritten = per_engine(
            self._counter_cls(
                name="disagg_push_unwritten_block_seconds_total",
                documentation="Blocks registered for a transfer times the seconds until their "
                "KV was written (D: registration sent to done; P: received to WRITE done).",
                labelnames=names,
            )
        )

    def observe(self, transfer_stats_data: dict[str, Any], engine_idx: int = 0) -> None:
        d = transfer_stats_data
        self._transfers[engine_idx].inc(d.get("ok", 0))
        self._failures[engine_idx].inc(d.get("failed", 0))
        self._bytes[engine_idx].inc(d.get("bytes", 0))
        self._blocks[engine_idx].inc(d.get("blocks", 0))
        self._errors[engine_idx].inc(d.get("errors", 0))
        for x in d.get("write_s", []):
            self._write[engine_idx].observe(x)
        for x in d.get("reg_to_write_s", []):
            self._reg[engine_idx].observe(x)
        for x in d.get("wait_for_reg_s", []):
            self._wait_for_reg[engine_idx].observe(x)
        self._unwritten[engine_idx].inc(d.get("unwritten_block_seconds", 0.0))
