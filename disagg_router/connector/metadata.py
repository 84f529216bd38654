"""Scheduler -> worker metadata for one engine step."""

from __future__ import annotations

from dataclasses import dataclass, field

from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorMetadata

from disagg_router.connector.specs import KeyCancel, RecvSpec, SendAbort, SendSpec


@dataclass
class PushConnectorMetadata(KVConnectorMetadata):  # type: ignore[misc]
    """Work the worker starts this step; built (and drained) by the scheduler side."""

    registrations: list[RecvSpec] = field(default_factory=list)
    cancels: list[str] = field(default_factory=list)
    key_cancels: list[KeyCancel] = field(default_factory=list)
    finished_prefills: list[SendSpec] = field(default_factory=list)
    failed_prefills: list[SendAbort] = field(default_factory=list)
