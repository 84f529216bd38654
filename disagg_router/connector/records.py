"""Per-transfer observations shared by both sides of the transfer core (pure Python)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

WAIT_FOR_REGISTRATION_BUCKETS = (
    0.0,
    0.001,
    0.0025,
    0.005,
    0.01,
    0.025,
    0.05,
    0.1,
    0.25,
    0.5,
    1.0,
    2.5,
    5.0,
    10.0,
    30.0,
    60.0,
)
"""Bucket edges (seconds) of P's ``disagg_push_wait_for_registration_seconds`` histogram: the
first, 0, counts the prefills D had registered for before they ended."""


@dataclass(frozen=True)
class TransferRecord:
    """One finished (or failed) transfer as seen by P (``writer``) or D (``receiver``)."""

    side: Literal["writer", "receiver"]
    transfer_key: str
    request_id: str
    ok: bool
    num_blocks: int = 0
    num_bytes: int = 0
    write_s: float = 0.0
    """P: WRITE post -> completion. D: 0."""
    registration_to_write_s: float = 0.0
    """P: registration received -> WRITE completed. D: registration sent -> done notification."""
    wait_for_registration_s: float = 0.0
    """P: prefill finished -> D's registration received (0 when D registered first: the usual
    case in push mode, where D's blocks then wait for P instead). D: 0."""
    reason: str = ""
