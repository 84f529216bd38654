"""vLLM's KV event messages, decoded into typed events; what makes a message or an event bad.

Who calls it: :class:`disagg_router.router.routing.kv_events.EventStream` decodes every received
payload with :func:`decode_batch` and each of its events with :func:`decode_event`, and slices large
stores with :func:`stored_slices`; :class:`disagg_router.router.routing.kv_index.KvIndex` applies
the typed events. Nothing here does I/O, and nothing raises for any input but :class:`BadBatch`.

The wire format is vLLM's (``vllm.distributed.kv_events``, msgspec): a payload is the msgpack
of a ``KVEventBatch`` encoded as an array, ``[ts, events, data_parallel_rank]`` (the rank is
omitted when None); each event is a map tagged by ``"type"`` (``BlockStored``, ``BlockRemoved``,
``AllBlocksCleared``) whose fields at their default value are omitted. A block hash is
``bytes`` (sha256) or, by default (``VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES=1``), an unsigned 64-bit
int; token ids are vocabulary ids. Every field is checked for its type and range; fields the
router does not use and fields added by later vLLM versions are ignored.

A payload that is not such an array (not msgpack, the wrong shape, nested past msgspec's depth
limit) is a :class:`BadBatch` and skipped whole. Inside a good batch, each event is decoded on
its own: an event of an unknown type, one with a field of the wrong type or out of range, or a
store or removal of more than ``max_blocks`` blocks (refused before its hashes are decoded) is
skipped alone, with its reason (:data:`EventReason`).
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from typing import Annotated, Any, Literal

import msgspec
from msgspec import Meta

TOKEN_ID_LIMIT = 2**31
"""Token ids are in ``0 .. 2**31 - 1`` (vocabulary ids; the router keys them as uint32)."""
MAX_HASH_BYTES = 64
"""The longest bytes block hash accepted (vLLM's sha256 hashes have 32)."""
MAX_BLOCK_SIZE = 2**20
"""The largest block size accepted (tokens per block)."""

TokenId = Annotated[int, Meta(ge=0, lt=TOKEN_ID_LIMIT)]
# msgpack ints are within int64 .. uint64 by construction, and msgspec decodes exactly those.
BlockHash = Annotated[bytes, Meta(min_length=1, max_length=MAX_HASH_BYTES)] | int
BadReason = Literal["frames", "sequence", "too_large", "undecodable"]
EventReason = Literal["invalid", "unknown_type", "too_many_blocks"]


class BlockStored(msgspec.Struct, tag=True, frozen=True, forbid_unknown_fields=False):
    """Blocks vLLM cached: ``token_ids`` are the tokens of the blocks, ``block_size`` each."""

    block_hashes: list[BlockHash]
    token_ids: list[TokenId]
    block_size: Annotated[int, Meta(ge=1, le=MAX_BLOCK_SIZE)]
    parent_block_hash: BlockHash | None = None
    lora_id: int | None = None
    lora_name: str | None = None
    medium: str | None = None
    extra_keys: list[Any] | None = None
    group_idx: Annotated[int, Meta(ge=0)] | None = None


class BlockRemoved(msgspec.Struct, tag=True, frozen=True, forbid_unknown_fields=False):
    """Blocks vLLM evicted."""

    block_hashes: list[BlockHash]
    medium: str | None = None
    group_idx: Annotated[int, Meta(ge=0)] | None = None


class AllBlocksCleared(msgspec.Struct, tag=True, frozen=True, forbid_unknown_fields=False):
    """vLLM dropped its whole prefix cache."""


KvEvent = BlockStored | BlockRemoved | AllBlocksCleared


class _Batch(msgspec.Struct, array_like=True, frozen=True):
    ts: Annotated[float, Meta(ge=0)]
    events: list[msgspec.Raw]
    data_parallel_rank: int | None = None


class _Shape(msgspec.Struct, frozen=True):
    """What is read of an event before it is decoded: its type and its hash array, undecoded."""

    type: str
    block_hashes: msgspec.Raw = msgspec.Raw(b"\x90")


class BadBatch(ValueError):
    """A payload that is not a KVEventBatch; ``reason`` is the metric label."""

    def __init__(self, reason: BadReason, detail: str) -> None:
        super().__init__(f"{reason}: {detail}")
        self.reason: BadReason = reason


@dataclass(frozen=True)
class RawBatch:
    """A batch whose events are still undecoded (each is decoded when it is applied)."""

    ts: float
    events: list[msgspec.Raw]


@dataclass(frozen=True)
class Rejected:
    """An event skipped, and why (``detail`` says which field)."""

    reason: EventReason
    detail: str


_BATCH = msgspec.msgpack.Decoder(_Batch)
_SHAPE = msgspec.msgpack.Decoder(_Shape)
_EVENT: msgspec.msgpack.Decoder[KvEvent] = msgspec.msgpack.Decoder(KvEvent)
_TYPES = frozenset({"BlockStored", "BlockRemoved", "AllBlocksCleared"})


def decode_batch(payload: bytes) -> RawBatch:
    """The batch in ``payload``, its events undecoded; raises :class:`BadBatch` otherwise."""
    try:
        batch = _BATCH.decode(payload)
    except (msgspec.DecodeError, RecursionError) as exc:  # ValidationError is a DecodeError
        raise BadBatch("undecodable", str(exc)) from exc
    return RawBatch(batch.ts, batch.events)


def decode_event(raw: msgspec.Raw, max_blocks: int) -> KvEvent | Rejected:
    """One event of a batch, typed and range-checked, or why it is skipped."""
    try:
        shape = _SHAPE.decode(raw)
        if shape.type not in _TYPES:
            return Rejected("unknown_type", shape.type[:64])
        if _array_length(shape.block_hashes) > max_blocks:
            return Rejected("too_many_blocks", f"more than {max_blocks} block hashes")
        return _EVENT.decode(raw)
    except (msgspec.DecodeError, RecursionError) as exc:
        return Rejected("invalid", str(exc)[:200])


def _array_length(raw: msgspec.Raw) -> int:
    """The length a msgpack array header announces (0 when it is no array: the typed decode
    then rejects the field)."""
    head = bytes(memoryview(raw)[:5])
    if not head:
        return 0
    if 0x90 <= head[0] <= 0x9F:
        return head[0] & 0x0F
    if head[0] == 0xDC:
        return int.from_bytes(head[1:3], "big")
    if head[0] == 0xDD:
        return int.from_bytes(head[1:5], "big")
    return 0


def stored_slices(event: BlockStored, blocks: int) -> Iterator[BlockStored]:
    """``event`` as stores of at most ``blocks`` blocks each, each chained to the previous one's
    last hash (so each can be applied alone, with the event loop free in between). An event
    whose tokens do not fill its blocks exactly is left whole (the index skips it)."""
    hashes, size = event.block_hashes, event.block_size
    if len(hashes) <= blocks or len(event.token_ids) != len(hashes) * size:
        yield event
        return
    parent = event.parent_block_hash
    for start in range(0, len(hashes), blocks):
        part = hashes[start : start + blocks]
        tokens = event.token_ids[start * size : (start + len(part)) * size]
        yield msgspec.structs.replace(
            event, block_hashes=part, token_ids=tokens, parent_block_hash=parent
        )
        parent = part[-1]


def typed_events(payload: bytes, max_blocks: int) -> list[KvEvent]:
    """Every good event of ``payload``, decoded at once (for tools and tests reading recorded
    batches; the stream decodes event by event). Raises :class:`BadBatch`."""
    found = (decode_event(raw, max_blocks) for raw in decode_batch(payload).events)
    return [event for event in found if not isinstance(event, Rejected)]
