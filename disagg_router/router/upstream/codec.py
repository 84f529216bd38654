"""JSON on the request path: msgspec first, the standard library for what msgspec refuses.

Who calls it: the client body's parse (:mod:`disagg_router.router.http.validation`), the legs'
bodies and P's answer (:mod:`disagg_router.router.upstream.calls`), the one rewritten usage chunk
(:mod:`disagg_router.router.dispatch.relay`). msgspec is several times faster than ``json`` for
these bodies (docs/benchmarks/README.md, "Router overhead"); where it refuses an input the standard
library accepts (a lone UTF-16 surrogate, a byte-order mark), the standard library decides, so what
is accepted and how is unchanged. Pure functions; no state beyond the two reusable codec objects.
"""

from __future__ import annotations

import json
from typing import Any

import msgspec

_encoder = msgspec.json.Encoder()
_decoder = msgspec.json.Decoder()


def dumps(value: Any) -> bytes:
    """Compact JSON bytes of ``value`` (dicts, lists, strings, numbers, booleans, None)."""
    try:
        return _encoder.encode(value)
    except (msgspec.EncodeError, UnicodeEncodeError):
        return json.dumps(value, separators=(",", ":")).encode()


def loads_fast(raw: bytes | str) -> Any:
    """``raw`` parsed by msgspec; raises :class:`msgspec.DecodeError` (a ``ValueError``), or
    ``RecursionError`` for deep nesting, where msgspec refuses it, so the caller can let ``json``
    decide (see the module doc)."""
    return _decoder.decode(raw)


def loads(raw: bytes | str) -> Any:
    """``raw`` parsed as ``json.loads`` would; raises ``ValueError`` when it is not JSON."""
    try:
        return loads_fast(raw)
    except (msgspec.DecodeError, RecursionError):
        return json.loads(raw)
