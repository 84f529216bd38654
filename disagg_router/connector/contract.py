"""The P/D contract that the router, this connector and the fake vLLM share (no vLLM, no torch).

A disaggregated request runs as two legs, each a normal OpenAI request whose body carries a
``kv_transfer_params`` object (the names are vLLM 0.32's NIXL connectors'):

- the P leg asks P to prefill and keep the KV for a remote decode (``do_remote_decode``), with the
  router's ``transfer_id``; :data:`IDENTITY_PROBE_KEY` marks an identity probe, for which our
  connector answers its identity and keeps no blocks (:func:`prefill_leg_params`,
  :func:`read_prefill_leg`);
- P answers with its identity (``remote_engine_id``, ``remote_host``, ``remote_port``, ``tp_size``,
  ``pp_size``), its engine request id and the blocks it keeps (:func:`prefill_answer_params`,
  :func:`read_prefill_answer`);
- the D leg (``do_remote_prefill``) carries P's identity and request id in push mode
  (:func:`decode_leg_params`, :func:`read_decode_leg`), or exactly what P answered in pull mode;
- an engine's shape (``tp_size``, ``pp_size``, ``block_size``, ``num_kv_heads``;
  :func:`engine_shape_params`, :func:`read_engine_shape`) rides in P's answer and in the answer
  to a bare identity probe (:func:`identity_probe_params`, which D answers too); the router pairs
  a P and a D only when :func:`pairing_refusal` has no objection.

One builder and one reader per message: the router, the connector's scheduler and the fake vLLM
build and read ``kv_transfer_params`` only through them, so none of them can drift from the
others. Readers raise :class:`~disagg_router.connector.errors.ContractError` (a ``ValueError``)
naming the field that is missing or bad.

Request ids: vLLM's input processor appends ``-<8 hex>`` to every external request id and push
connectors strip exactly such a suffix to match D's registration with P's prefill
(:func:`base_request_id`); an id that already ends that way could collide after stripping
(:func:`has_engine_suffix`).

Importing this module is cheap and safe anywhere: it imports only the standard library (and
:mod:`disagg_router.connector.errors`, which imports nothing).
"""

from __future__ import annotations

import re
import uuid
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from disagg_router.connector.errors import ContractError

KV_TRANSFER_PARAMS = "kv_transfer_params"
"""The request and response field that carries the P/D parameters."""

DO_REMOTE_DECODE = "do_remote_decode"
DO_REMOTE_PREFILL = "do_remote_prefill"
REMOTE_ENGINE_ID = "remote_engine_id"
REMOTE_HOST = "remote_host"
REMOTE_PORT = "remote_port"
REMOTE_REQUEST_ID = "remote_request_id"
REMOTE_BLOCK_IDS = "remote_block_ids"
REMOTE_NUM_TOKENS = "remote_num_tokens"
REMOTE_PREFILL_CACHED_TOKENS = "remote_prefill_cached_tokens"
TP_SIZE = "tp_size"
PP_SIZE = "pp_size"
TRANSFER_ID = "transfer_id"
TRANSFER_MODE = "transfer_mode"
BLOCK_SIZE = "block_size"
NUM_KV_HEADS = "num_kv_heads"

IDENTITY_PROBE_KEY = "identity_probe"
"""A P-leg key: when true, P answers its identity like any prefill but keeps no blocks for a
decode (the router's identity probes)."""

BLOCK_SIZES_TRANSFERABLE = False
"""Whether KV moves between a P and a D whose ``block_size`` differ."""

_ENGINE_SUFFIX = re.compile(r"-[0-9a-f]{8}$", re.IGNORECASE)


@dataclass(frozen=True)
class PeerIdentity:
    """Who P is, as P's answer and the push-mode D leg carry it."""

    engine_id: str
    host: str
    port: int
    tp_size: int = 1
    pp_size: int = 1


@dataclass(frozen=True)
class PrefillLeg:
    """What a P leg asks (:func:`read_prefill_leg`)."""

    transfer_id: str | None
    probe: bool


@dataclass(frozen=True)
class DecodeLeg:
    """What a D leg carries (:func:`read_decode_leg`)."""

    peer: PeerIdentity
    request_id: str | None
    """P's engine request id (``remote_request_id``), when the sender knew it."""
    transfer_id: str | None


@dataclass(frozen=True)
class PrefillAnswer:
    """What P answered (:func:`read_prefill_answer`); only ``peer`` is required, the rest is
    ``None`` where P's connector does not send it (vLLM's own NIXL connectors)."""

    peer: PeerIdentity
    request_id: str | None
    block_ids: tuple[Any, ...] | None
    num_tokens: int | None
    transfer_mode: str | None
    transfer_id: str | None


@dataclass(frozen=True)
class EngineShape:
    """What pairing a P with a D depends on (:func:`pairing_refusal`): the engine's tensor and
    pipeline parallel sizes, its KV block size in tokens and the model's total number of KV heads
    (``None`` where the engine does not report it)."""

    tp_size: int
    pp_size: int
    block_size: int
    num_kv_heads: int | None = None


def prefill_leg_params(transfer_id: str, *, probe: bool = False) -> dict[str, Any]:
    """``kv_transfer_params`` of a P leg; ``probe`` marks an identity probe."""
    params: dict[str, Any] = {
        DO_REMOTE_DECODE: True,
        DO_REMOTE_PREFILL: False,
        TRANSFER_ID: transfer_id,
    }
    if probe:
        params[IDENTITY_PROBE_KEY] = True
    return params


def _remote_params(
    engine_id: str, host: str, port: int, tp_size: int, pp_size: int, request_id: str
) -> dict[str, Any]:
    """What D needs to reach P's KV: P's identity and P's request id."""
    return {
        DO_REMOTE_PREFILL: True,
        DO_REMOTE_DECODE: False,
        REMOTE_ENGINE_ID: engine_id,
        REMOTE_HOST: host,
        REMOTE_PORT: port,
        TP_SIZE: tp_size,
        PP_SIZE: pp_size,
        REMOTE_REQUEST_ID: request_id,
    }


def decode_leg_params(
    *,
    engine_id: str,
    host: str,
    port: int,
    tp_size: int,
    pp_size: int,
    request_id: str,
    transfer_id: str,
) -> dict[str, Any]:
    """``kv_transfer_params`` of a push-mode D leg: P's identity and the leg's request id."""
    params = _remote_params(engine_id, host, port, tp_size, pp_size, request_id)
    params[TRANSFER_ID] = transfer_id
    return params


def prefill_answer_params(
    *,
    engine_id: str,
    host: str,
    port: int,
    request_id: str,
    block_ids: Sequence[Any],
    num_tokens: int,
    transfer_mode: str = "push",
    tp_size: int = 1,
    pp_size: int = 1,
    transfer_id: str | None = None,
) -> dict[str, Any]:
    """``kv_transfer_params`` of P's answer: who P is and which blocks it keeps for D (the P
    leg's ``transfer_id`` is echoed when it had one)."""
    params = _remote_params(engine_id, host, port, tp_size, pp_size, request_id)
    params[REMOTE_BLOCK_IDS] = list(block_ids)
    params[REMOTE_NUM_TOKENS] = num_tokens
    params[TRANSFER_MODE] = transfer_mode
    if transfer_id:
        params[TRANSFER_ID] = transfer_id
    return params


def _opt_str(params: Mapping[str, Any], key: str) -> str | None:
    value = params.get(key)
    return None if value in (None, "") else str(value)


def _int(params: Mapping[str, Any], key: str, default: int | None = None) -> int | None:
    value = params.get(key)
    if value in (None, ""):
        return default
    if isinstance(value, bool):
        raise ContractError(f"{KV_TRANSFER_PARAMS}.{key}: not an integer: {value!r}")
    try:
        return int(value)
    except (TypeError, ValueError) as exc:
        raise ContractError(f"{KV_TRANSFER_PARAMS}.{key}: not an integer: {value!r}") from exc


def _peer(params: Mapping[str, Any]) -> PeerIdentity:
    """P's identity in ``params``; :class:`ContractError` names what is missing or bad."""
    missing = [
        k for k in (REMOTE_ENGINE_ID, REMOTE_HOST, REMOTE_PORT) if params.get(k) in (None, "")
    ]
    if missing:
        raise ContractError(f"{KV_TRANSFER_PARAMS} lack {', '.join(missing)}")
    port = _int(params, REMOTE_PORT)
    assert port is not None  # checked above
    return PeerIdentity(
        engine_id=str(params[REMOTE_ENGINE_ID]),
        host=str(params[REMOTE_HOST]),
        port=port,
        tp_size=_int(params, TP_SIZE, 1) or 1,
        pp_size=_int(params, PP_SIZE, 1) or 1,
    )


def read_prefill_leg(params: Mapping[str, Any] | None) -> PrefillLeg | None:
    """The P leg in a request's ``params``; ``None`` when they ask for no remote decode."""
    if not is_prefill_leg(params):
        return None
    assert params is not None
    return PrefillLeg(_opt_str(params, TRANSFER_ID), bool(params.get(IDENTITY_PROBE_KEY)))


def read_decode_leg(params: Mapping[str, Any] | None) -> DecodeLeg | None:
    """The D leg in a request's ``params``; ``None`` when they ask for no remote prefill,
    :class:`ContractError` when P's identity is incomplete."""
    if not is_decode_leg(params):
        return None
    assert params is not None
    return DecodeLeg(
        _peer(params), _opt_str(params, REMOTE_REQUEST_ID), _opt_str(params, TRANSFER_ID)
    )


def read_prefill_answer(params: Mapping[str, Any]) -> PrefillAnswer:
    """P's answer (ours, or vLLM's NIXL connectors'); :class:`ContractError` when P's identity
    is incomplete or a field has the wrong type."""
    blocks = params.get(REMOTE_BLOCK_IDS)
    if blocks is not None and not isinstance(blocks, list | tuple):
        raise ContractError(f"{KV_TRANSFER_PARAMS}.{REMOTE_BLOCK_IDS}: not a list: {blocks!r}")
    return PrefillAnswer(
        peer=_peer(params),
        request_id=_opt_str(params, REMOTE_REQUEST_ID),
        block_ids=None if blocks is None else tuple(blocks),
        num_tokens=_int(params, REMOTE_NUM_TOKENS),
        transfer_mode=_opt_str(params, TRANSFER_MODE),
        transfer_id=_opt_str(params, TRANSFER_ID),
    )


def identity_probe_params() -> dict[str, Any]:
    """``kv_transfer_params`` of a bare identity probe (no leg): an engine whose connector
    speaks shapes answers its :class:`EngineShape` (D's identity probe)."""
    return {IDENTITY_PROBE_KEY: True}


def is_identity_probe(params: Mapping[str, Any] | None) -> bool:
    """Whether ``params`` mark an identity probe (of a P leg, or a bare one)."""
    return bool(params and params.get(IDENTITY_PROBE_KEY))


def engine_shape_params(shape: EngineShape) -> dict[str, Any]:
    """The ``kv_transfer_params`` keys that carry ``shape`` (merged into P's answer; the whole
    answer to a bare identity probe)."""
    params: dict[str, Any] = {
        TP_SIZE: shape.tp_size,
        PP_SIZE: shape.pp_size,
        BLOCK_SIZE: shape.block_size,
    }
    if shape.num_kv_heads is not None:
        params[NUM_KV_HEADS] = shape.num_kv_heads
    return params


def _positive(params: Mapping[str, Any], key: str, default: int | None = None) -> int | None:
    value = _int(params, key, default)
    if value is not None and value < 1:
        raise ContractError(f"{KV_TRANSFER_PARAMS}.{key}: must be >= 1: {value!r}")
    return value


def read_engine_shape(params: Mapping[str, Any] | None) -> EngineShape | None:
    """The shape ``params`` carry; ``None`` when they carry none (no ``block_size``: an engine
    whose connector does not speak shapes, e.g. vLLM's NIXL connectors, whose answer has
    ``tp_size`` alone); :class:`ContractError` naming a bad field."""
    if not params or params.get(BLOCK_SIZE) in (None, ""):
        return None
    return EngineShape(
        tp_size=_positive(params, TP_SIZE, 1) or 1,
        pp_size=_positive(params, PP_SIZE, 1) or 1,
        block_size=_positive(params, BLOCK_SIZE) or 1,
        num_kv_heads=_positive(params, NUM_KV_HEADS),
    )


def pairing_refusal(p: EngineShape, d: EngineShape) -> str | None:
    """Why the connector cannot move KV from a P of shape ``p`` to a D of shape ``d``, naming
    both values; ``None`` when it can. The one pairing rule: the router, ``check-config`` and
    the tests all ask it. P may be pipeline parallel (each stage writes its own layers); D
    may not."""
    if d.pp_size > 1:
        return f"D pp_size={d.pp_size} (P pp_size={p.pp_size}): D must have pp_size=1"
    small, large = sorted((p.tp_size, d.tp_size))
    if large % small:
        return f"P tp_size={p.tp_size} and D tp_size={d.tp_size}: neither divides the other"
    if p.block_size != d.block_size and not BLOCK_SIZES_TRANSFERABLE:
        return f"P block_size={p.block_size} and D block_size={d.block_size} differ"
    return _heads_refusal(p, d)


def _heads_refusal(p: EngineShape, d: EngineShape) -> str | None:
    """The KV-head part of :func:`pairing_refusal`: both serve the same model's heads (checked
    only when both report them; TP ranks that replicate heads are served)."""
    if p.num_kv_heads is None or d.num_kv_heads is None or p.num_kv_heads == d.num_kv_heads:
        return None
    return f"P num_kv_heads={p.num_kv_heads} and D num_kv_heads={d.num_kv_heads} differ"


def is_prefill_leg(params: Mapping[str, Any] | None) -> bool:
    """Whether ``params`` ask this instance to prefill for a remote decode."""
    return bool(params and params.get(DO_REMOTE_DECODE))


def is_decode_leg(params: Mapping[str, Any] | None) -> bool:
    """Whether ``params`` ask this instance to decode from a remote prefill."""
    return bool(params and params.get(DO_REMOTE_PREFILL))


def with_engine_suffix(request_id: str) -> str:
    """``request_id`` as vLLM's engine sees it: with a fresh ``-<8 hex>`` suffix."""
    return f"{request_id}-{uuid.uuid4().hex[:8]}"


def base_request_id(request_id: str) -> str:
    """Strip the ``-<8 hex>`` suffix vLLM's input processor appends to every request id."""
    return _ENGINE_SUFFIX.sub("", request_id)


def has_engine_suffix(request_id: str) -> bool:
    """Whether ``request_id`` ends like an engine suffix (stripping would change it)."""
    return _ENGINE_SUFFIX.search(request_id) is not None
