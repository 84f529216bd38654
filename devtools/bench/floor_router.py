"""The floor: the least a push-mode P/D proxy built on the router's libraries does per request.

Who runs it: the overhead benchmark (``--routers floor``), as its own process
(``python -m bench.floor_router``). It is not a router: one P and one D, streamed completions
only, no validation, routing, admission, metrics, tracing, commit point or usage merge, and no
error handling beyond closing what it opened. Per request it does only what any push-mode
router must: read the client's body, send the P leg (the router's own ``prefill_body``) and the
D leg with P's identity (``decode_body_push``) at once, and relay D's bytes as they arrive,
unparsed. It runs on the router's stack (uvicorn with httptools and uvloop, a bare ASGI app,
the router's own upstream connections, :mod:`disagg_router.router.upstream.h1`), so its CPU per
request bounds from below what the router could reach by trimming its own work without changing
those libraries.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import uuid
from typing import Any

import httpx
import uvicorn

from disagg_router.router.config import PushIdentity
from disagg_router.router.upstream import codec
from disagg_router.router.upstream.h1 import ConnectionPool, Origin
from disagg_router.router.upstream.rewrite import decode_body_push, prefill_body

Scope = dict[str, Any]
Message = dict[str, Any]


class FloorApp:
    """The ASGI app: ``/health`` answers 200; a POST elsewhere is relayed as described above."""

    def __init__(self, prefill_url: str, decode_url: str, identity: PushIdentity) -> None:
        self.prefill = origin_of(prefill_url)
        self.decode = origin_of(decode_url)
        self.identity = identity
        self.pool: ConnectionPool | None = None

    async def __call__(self, scope: Scope, receive: Any, send: Any) -> None:
        if scope["type"] == "lifespan":
            await self._lifespan(receive, send)
        elif scope["path"] == "/health":
            await send({"type": "http.response.start", "status": 200, "headers": []})
            await send({"type": "http.response.body", "body": b""})
        else:
            await self._relay(scope["path"], await _body(receive), send)

    async def _lifespan(self, receive: Any, send: Any) -> None:
        while True:
            message = await receive()
            if message["type"] == "lifespan.startup":
                self.pool = ConnectionPool(5.0, 600.0, 4.0, 4096)
                await send({"type": "lifespan.startup.complete"})
            elif message["type"] == "lifespan.shutdown":
                if self.pool is not None:
                    await self.pool.close()
                await send({"type": "lifespan.shutdown.complete"})
                return

    async def _relay(self, path: str, raw: bytes, send: Any) -> None:
        assert self.pool is not None
        body = codec.loads(raw)
        rid = f"floor-{uuid.uuid4().hex}"
        p_body = codec.dumps(prefill_body(body, False, rid))
        d_body = codec.dumps(decode_body_push(body, self.identity, rid, rid))
        prefill = asyncio.create_task(self._prefill(path, p_body))
        try:
            d_head = post_head(self.decode, path, d_body)
            async with self.pool.request(self.decode, d_head, d_body) as resp:
                headers = [(b"content-type", resp.content_type.encode())]
                start = {"type": "http.response.start", "status": resp.status, "headers": headers}
                await send(start)
                while chunk := await resp.read_chunk():
                    await send({"type": "http.response.body", "body": chunk, "more_body": True})
            await send({"type": "http.response.body", "body": b""})
        finally:
            await prefill

    async def _prefill(self, path: str, body: bytes) -> None:
        assert self.pool is not None
        async with self.pool.request(
            self.prefill, post_head(self.prefill, path, body), body
        ) as resp:
            await resp.read()


def origin_of(url: str) -> Origin:
    """``url``'s (host, port, TLS)."""
    parsed = httpx.URL(url)
    tls = parsed.scheme == "https"
    return parsed.host, parsed.port or (443 if tls else 80), tls


def post_head(origin: Origin, path: str, body: bytes) -> bytes:
    """A POST's request head: what the router's legs send, less the ids and trace context."""
    return (
        f"POST {path} HTTP/1.1\r\nHost: {origin[0]}:{origin[1]}\r\n"
        f"Content-Type: application/json\r\nContent-Length: {len(body)}\r\n\r\n"
    ).encode("latin-1")


async def _body(receive: Any) -> bytes:
    chunks: list[bytes] = []
    more = True
    while more:
        message: Message = await receive()
        chunks.append(message.get("body", b""))
        more = message.get("more_body", False)
    return b"".join(chunks)


def main() -> None:
    """``python -m bench.floor_router --prefill URL --decode URL --identity JSON --port N``."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--prefill", required=True)
    parser.add_argument("--decode", required=True)
    parser.add_argument("--identity", required=True, help="P's push identity as JSON")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, required=True)
    args = parser.parse_args()
    identity = PushIdentity.model_validate(json.loads(args.identity))
    app = FloorApp(args.prefill, args.decode, identity)
    uvicorn.run(
        app,
        host=args.host,
        port=args.port,
        log_level="warning",
        access_log=False,
        proxy_headers=False,
        log_config=None,
    )


if __name__ == "__main__":
    main()
