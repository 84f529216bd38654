"""Transport bounds on what a client sends: body size and time, header size.

Who calls it: the app (:mod:`disagg_router.router.http.app`, :func:`read_body` for generation
requests) and :class:`disagg_router.router.http.guard.RequestGuard` (every HTTP request). Every
limit comes from ``limits`` in the config; nothing is read without a size and a time bound.
Violations are :class:`~disagg_router.router.errors.RouterError` (413, 408, 431).
"""

from __future__ import annotations

import asyncio
from itertools import chain

from starlette.requests import Request

from disagg_router.router.config import LimitsConfig
from disagg_router.router.errors import (
    BodyTimeout,
    ClientDisconnected,
    PayloadTooLarge,
    RouterError,
)


class HeadersTooLarge(RouterError):
    status = 431
    error_type = "invalid_request_error"
    closes_connection = True


def check_headers(headers: list[tuple[bytes, bytes]], limits: LimitsConfig) -> None:
    """:class:`HeadersTooLarge` when the headers exceed ``limits.max_header_bytes``."""
    size = sum(map(len, chain.from_iterable(headers))) + 4 * len(headers)  # in C, no genexpr
    if size > limits.max_header_bytes:
        raise HeadersTooLarge(f"request headers exceed {limits.max_header_bytes} bytes")


async def _read(request: Request, limit: int) -> bytes:
    """The body from the ASGI messages themselves (``request.stream()`` is an async generator
    per request for what is, nearly always, one message)."""
    declared = request.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > limit:
        raise PayloadTooLarge(f"request body exceeds {limit} bytes")
    chunks: list[bytes] = []
    size = 0
    receive = request.receive
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            raise ClientDisconnected("client disconnected while sending the body")
        if message["type"] != "http.request":
            continue
        chunk = message.get("body", b"")
        size += len(chunk)
        if size > limit:
            raise PayloadTooLarge(f"request body exceeds {limit} bytes")
        chunks.append(chunk)
        if not message.get("more_body", False):
            return b"".join(chunks)


async def read_body(request: Request, limits: LimitsConfig) -> bytes:
    """The whole body, at most ``max_body_bytes`` (413), within ``body_timeout`` seconds (408);
    :class:`ClientDisconnected` if the client goes away (or stops short) meanwhile."""
    try:
        async with asyncio.timeout(limits.body_timeout):
            return await _read(request, limits.max_body_bytes)
    except TimeoutError as exc:
        raise BodyTimeout(f"request body not received within {limits.body_timeout:g}s") from exc
