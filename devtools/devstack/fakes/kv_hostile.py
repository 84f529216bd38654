"""KV event batches from a broken or hostile publisher, beside good ones, as vLLM frames them.

Who uses it: the router's KV event tests (tests/unit/router/routing/test_kv_hostile.py,
tests/integration/router/test_router_kv_routing.py) and the benchmark ``python -m
bench.kv_hostile``, which publish :func:`hostile` payloads among :func:`good` ones through
:class:`devstack.fakes.kv_publisher.FakeKvPublisher`. Each hostile payload, were it applied,
would crash a subscriber, stall it, or plant blocks of :data:`HOSTILE_TOKENS` (a prompt no good
event stores) or remove good blocks; a correct subscriber ends exactly as with the good ones
alone.
"""

from __future__ import annotations

import time
from collections.abc import Callable

import msgspec

BLOCK = 16
HOSTILE_TOKENS = [70_000 + i for i in range(BLOCK * 3)]
"""The prompt the hostile stores claim: three blocks no good event stores."""
TEN_MILLION = 10_000_000


def _batch(*events: dict[str, object]) -> bytes:
    return msgspec.msgpack.encode([time.time(), list(events), 0])


def _stored(hashes: object, tokens: object, parent: object = None) -> dict[str, object]:
    return {
        "type": "BlockStored",
        "block_hashes": hashes,
        "parent_block_hash": parent,
        "token_ids": tokens,
        "block_size": BLOCK,
        "lora_id": None,
        "medium": "GPU",
        "lora_name": None,
    }


def good_tokens(n: int) -> list[int]:
    """The two-block prompt the ``n``-th good batch stores."""
    return [1 + (n * 2 * BLOCK + i) % 60_000 for i in range(2 * BLOCK)]


def good(n: int) -> bytes:
    """The ``n``-th good batch: a store of :func:`good_tokens` (hashes ``n*10``, ``n*10+1``),
    and every third one also removes the previous batch's second block."""
    events = [_stored([n * 10, n * 10 + 1], good_tokens(n))]
    if n % 3 == 2:
        events.append({"type": "BlockRemoved", "block_hashes": [(n - 1) * 10 + 1], "medium": "GPU"})
    return _batch(*events)


def _deep(depth: int) -> bytes:
    """A batch whose one store's ``block_hashes`` is an array nested ``depth`` deep."""
    marker = msgspec.msgpack.encode("deep-array-goes-here")
    head = msgspec.msgpack.encode([time.time(), [_stored("deep-array-goes-here", [])], 0])
    return head.replace(marker, b"\x91" * depth + b"\x01", 1)


def _oversize(limit: int) -> bytes:
    """A well-formed store of the hostile prompt, padded with whole blocks past ``limit``
    bytes (token ids of 5 bytes each)."""
    blocks = limit // (5 * BLOCK) + 2
    tokens = HOSTILE_TOKENS[:BLOCK] * blocks
    return _batch(_stored(list(range(9_000_000, 9_000_000 + blocks)), tokens))


HOSTILE: dict[str, Callable[[int], bytes]] = {
    "nested list in block_hashes": lambda _: _batch(_stored([1, [[2]], 3], HOSTILE_TOKENS)),
    "string token_ids": lambda _: _batch(_stored([1, 2, 3], "x" * len(HOSTILE_TOKENS))),
    "token id -2^63": lambda _: _batch(_stored([1, 2, 3], [-(2**63), *HOSTILE_TOKENS[1:]])),
    "bad hashes in BlockRemoved": lambda _: _batch(
        {"type": "BlockRemoved", "block_hashes": [0, 1, [300], {"k": 1}], "medium": "GPU"}
    ),
    "block_hashes: 5": lambda _: _batch(_stored(5, HOSTILE_TOKENS)),
    "msgpack nested 100,000 deep": lambda _: _deep(100_000),
    'hashes "zzzzzz"': lambda _: _batch(_stored(["zzzzzz", "zzzzzy", "zzzzzx"], HOSTILE_TOKENS)),
    "hashes null": lambda _: _batch(_stored([None, None, None], HOSTILE_TOKENS)),
    "hashes floats": lambda _: _batch(_stored([0.5, 1.5, 2.5], HOSTILE_TOKENS)),
    "10 million hashes": lambda _: _batch(_stored(list(range(TEN_MILLION)), HOSTILE_TOKENS)),
}
"""Each hostile shape by name: its payload (the argument: the message size limit in force)."""


def hostile(name: str, max_message_bytes: int) -> bytes:
    """The payload of hostile shape ``name`` (a :data:`HOSTILE` key or ``"over-size message"``,
    a message one block over ``max_message_bytes``)."""
    if name == "over-size message":
        return _oversize(max_message_bytes)
    return HOSTILE[name](max_message_bytes)


SHAPES = (*HOSTILE, "over-size message")


LARGEST_LEGAL = "largest legal store"


def largest_legal(max_message_bytes: int, max_blocks: int) -> bytes:
    """A good batch as large as the limits allow: one store of at most ``max_blocks`` blocks
    of 3-byte token ids, under ``max_message_bytes`` (what a long prefill may publish)."""
    blocks = min(max_blocks, max_message_bytes // (3 * BLOCK + 9) - 1)
    tokens = [200 + i % 60_000 for i in range(blocks * BLOCK)]
    return _batch(_stored(list(range(1 << 40, (1 << 40) + blocks)), tokens))
