"""Versioned wire protocol between D and P (vLLM-independent, no NIXL).

Two carriers:

* **Side channel** (TCP to P, length-prefixed JSON frames, one request and one reply per
  connection): ``register`` (D -> P: D's NIXL agent metadata, memory layout, block ids),
  ``cancel`` (D -> P: D gives up; P answers whether a WRITE can still land) and ``ping``.
* **NIXL notifications** (P -> D): ``done`` rides on the WRITE itself (NIXL delivers it only
  after the data has landed), ``failed`` is sent with ``send_notif``.

Every message carries ``"v": PROTOCOL_VERSION``; a peer speaking another version is rejected
with :class:`ProtocolError` naming both versions.

Tensor parallelism extends v1 compatibly (the version stays 1): D's layout states its rank
(``tp_rank``, ``tp_size``, ``total_kv_heads``, ``kv_heads``, ``head_bytes``), a ``cancel``
carries ``d_tp_rank`` and a notification ``p_rank``. A peer that omits them is a TP 1 peer
(rank 0 of 1); a peer that does not know them ignores them. Pipeline parallelism on P adds
``pp_rank``, ``pp_size`` and ``region_layers`` to the layout the same way (absent: stage 0 of 1,
no layer indices), and a notification's ``p_rank`` is then P's vLLM rank
(``pp_rank * tp_size + tp_rank``).
"""

from __future__ import annotations

import base64
import json
from dataclasses import asdict, dataclass
from typing import Any, Literal, cast, get_args

from disagg_router.connector.errors import ProtocolError
from disagg_router.connector.layout import LayoutSpec

PROTOCOL_VERSION = 1
NOTIF_PREFIX = b"DPC1:"
MAX_FRAME_BYTES = 64 * 1024 * 1024


@dataclass(frozen=True)
class Registration:
    """D -> P: "write the prompt KV of ``transfer_key`` into these blocks of mine"."""

    transfer_key: str
    d_request_id: str
    p_engine_id: str
    d_agent_name: str
    d_agent_metadata: bytes
    d_layout: LayoutSpec
    block_ids: tuple[tuple[int, ...], ...]
    """D's destination block ids per KV group (only the blocks D lacks)."""
    first_block: int
    """Index in P's block list of the first block to write (D's prefix-cache hit, in blocks)."""
    budget_s: float
    """How long D will wait; P never *starts* a WRITE after this (from receipt)."""


ReplyStatus = Literal["accepted", "failed", "cancelled", "in_flight", "unknown", "pong"]
_REPLY_STATUSES = get_args(ReplyStatus)


@dataclass(frozen=True)
class Reply:
    """P -> D answer on the side channel.

    ``register``: ``accepted`` or ``failed`` (with the reason, e.g. an incompatible layout).
    ``cancel``: ``cancelled`` (no WRITE was or will be posted), ``in_flight`` (a WRITE is
    landing; wait for its notification) or ``unknown`` (P holds nothing for the key).
    ``ping``: ``pong``.
    """

    status: ReplyStatus
    reason: str = ""


@dataclass(frozen=True)
class Notification:
    """P -> D over NIXL: a transfer finished (``done``) or will never happen (``failed``)."""

    kind: Literal["done", "failed"]
    transfer_key: str
    d_request_id: str
    reason: str = ""
    p_rank: int = 0
    """The tensor-parallel rank of the P worker that sends it (D waits for each P rank)."""


def _check_version(obj: Any) -> dict[str, Any]:
    if not isinstance(obj, dict):
        raise ProtocolError("message is not a JSON object")
    version = obj.get("v")
    if version != PROTOCOL_VERSION:
        raise ProtocolError(
            f"unsupported protocol version {version!r} (this peer speaks {PROTOCOL_VERSION})"
        )
    return obj


def encode_request(kind: str, body: dict[str, Any]) -> bytes:
    """A side-channel request frame of ``kind`` (``register``, ``cancel``, ``ping``)."""
    return json.dumps({"v": PROTOCOL_VERSION, "type": kind, **body}).encode()


def encode_cancel(transfer_key: str, d_tp_rank: int = 0) -> bytes:
    """D rank ``d_tp_rank`` gives up on ``transfer_key`` (or will never register it)."""
    return encode_request("cancel", {"transfer_key": transfer_key, "d_tp_rank": d_tp_rank})


def cancel_from_body(body: dict[str, Any]) -> tuple[str, int]:
    """``(transfer_key, d_tp_rank)`` of a decoded ``cancel`` (rank 0 when a TP 1 peer omits
    it); raises :class:`ProtocolError`."""
    try:
        return str(body["transfer_key"]), int(body.get("d_tp_rank", 0))
    except (KeyError, TypeError, ValueError) as exc:
        raise ProtocolError(f"bad cancel: {exc!r}") from exc


def encode_registration(reg: Registration) -> bytes:
    return encode_request(
        "register",
        {
            "transfer_key": reg.transfer_key,
            "d_request_id": reg.d_request_id,
            "p_engine_id": reg.p_engine_id,
            "d_agent_name": reg.d_agent_name,
            "d_agent_metadata": base64.b64encode(reg.d_agent_metadata).decode(),
            "d_layout": reg.d_layout.to_json(),
            "block_ids": [list(g) for g in reg.block_ids],
            "first_block": reg.first_block,
            "budget_s": reg.budget_s,
        },
    )


def decode_request(data: bytes) -> tuple[str, dict[str, Any]]:
    """Decode a side-channel request into ``(type, body)``; raises :class:`ProtocolError`."""
    try:
        obj = _check_version(json.loads(data))
    except json.JSONDecodeError as exc:
        raise ProtocolError(f"not JSON: {exc}") from exc
    kind = obj.get("type")
    if not isinstance(kind, str):
        raise ProtocolError("missing message type")
    return kind, obj


def registration_from_body(body: dict[str, Any]) -> Registration:
    """The :class:`Registration` in a decoded ``register`` body; raises :class:`ProtocolError`."""
    try:
        return Registration(
            transfer_key=str(body["transfer_key"]),
            d_request_id=str(body["d_request_id"]),
            p_engine_id=str(body["p_engine_id"]),
            d_agent_name=str(body["d_agent_name"]),
            d_agent_metadata=base64.b64decode(body["d_agent_metadata"]),
            d_layout=LayoutSpec.from_json(body["d_layout"]),
            block_ids=tuple(tuple(int(b) for b in g) for g in body["block_ids"]),
            first_block=int(body["first_block"]),
            budget_s=float(body["budget_s"]),
        )
    except (KeyError, TypeError, ValueError) as exc:
        raise ProtocolError(f"bad registration: {exc!r}") from exc


def encode_reply(reply: Reply) -> bytes:
    return json.dumps(
        {"v": PROTOCOL_VERSION, "status": reply.status, "reason": reply.reason}
    ).encode()


def decode_reply(data: bytes) -> Reply:
    """Decode P's answer; raises :class:`ProtocolError` for a bad or foreign one."""
    try:
        obj = _check_version(json.loads(data))
    except json.JSONDecodeError as exc:
        raise ProtocolError(f"reply is not JSON: {exc}") from exc
    status = obj.get("status")
    if status not in _REPLY_STATUSES:
        raise ProtocolError(f"unknown reply status {status!r}")
    return Reply(status=cast(ReplyStatus, status), reason=str(obj.get("reason", "")))


def encode_notification(note: Notification) -> bytes:
    return NOTIF_PREFIX + json.dumps({"v": PROTOCOL_VERSION, **asdict(note)}).encode()


def decode_notification(data: bytes) -> Notification:
    """Decode a NIXL notification; raises :class:`ProtocolError` for foreign or bad ones."""
    if not data.startswith(NOTIF_PREFIX):
        raise ProtocolError(f"not a connector notification: {data[:16]!r}")
    try:
        obj = _check_version(json.loads(data[len(NOTIF_PREFIX) :]))
        kind = obj["kind"]
        if kind not in ("done", "failed"):
            raise ProtocolError(f"unknown notification kind {kind!r}")
        return Notification(
            kind=kind,
            transfer_key=str(obj["transfer_key"]),
            d_request_id=str(obj["d_request_id"]),
            reason=str(obj.get("reason", "")),
            p_rank=int(obj.get("p_rank", 0)),
        )
    except (json.JSONDecodeError, KeyError, TypeError, ValueError) as exc:
        raise ProtocolError(f"bad notification: {exc!r}") from exc
