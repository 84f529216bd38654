"""Plain work items passed from the scheduler side to the worker side (no vLLM, no NIXL)."""

from __future__ import annotations

from dataclasses import dataclass

from disagg_router.connector.contract import base_request_id


def transfer_key(transfer_id: str | None, request_id: str) -> str:
    """The id P and D match a transfer on.

    ``transfer_id`` (router-chosen, sent on both legs) wins. Without it each side uses the base
    of its *own* engine request id (the ``-<8 hex>`` suffix stripped), which agrees when both legs
    carry the same ``X-Request-Id`` on the same endpoint, as with vLLM's own push connector.
    """
    if transfer_id:
        return f"t:{transfer_id}"
    return f"r:{base_request_id(request_id)}"


@dataclass(frozen=True)
class RecvSpec:
    """D: register ``block_ids`` (group 0) of ``d_request_id`` with the P at ``host:port``
    (its rank 0; the other ranks at the following ports)."""

    d_request_id: str
    transfer_key: str
    p_engine_id: str
    host: str
    port: int
    block_ids: tuple[int, ...]
    first_block: int
    p_tp_size: int = 1
    """P's tensor-parallel size: P rank ``r`` listens on ``port + r``."""
    p_pp_size: int = 1
    """P's pipeline-parallel size: the worker of stage ``s``, TP rank ``c`` listens on
    ``port + s * p_tp_size + c``."""


@dataclass(frozen=True)
class KeyCancel:
    """D: tell the P at ``host:port`` that ``transfer_key`` will never be registered."""

    transfer_key: str
    host: str
    port: int
    p_tp_size: int = 1
    """P's tensor-parallel size: P rank ``r`` listens on ``port + r``."""
    p_pp_size: int = 1
    """P's pipeline-parallel size (see :class:`RecvSpec`)."""


@dataclass(frozen=True)
class SendSpec:
    """P: the prefill of ``transfer_key`` finished; ``block_ids`` (group 0) stay pinned."""

    p_request_id: str
    transfer_key: str
    block_ids: tuple[int, ...]


@dataclass(frozen=True)
class SendAbort:
    """P: the prefill of ``transfer_key`` failed or was aborted; tell D."""

    transfer_key: str
    reason: str
