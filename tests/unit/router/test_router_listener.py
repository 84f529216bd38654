"""``listening_socket``: the socket a server is handed (``serve --workers N``, the development
servers) makes connections that send at once: every accepted connection has ``TCP_NODELAY``."""

from __future__ import annotations

import asyncio
import socket

import pytest

from disagg_router.router.server import listening_socket


async def test_every_connection_accepted_on_it_has_nagle_off() -> None:
    loop = asyncio.get_running_loop()
    nodelay: asyncio.Future[int] = loop.create_future()

    class Accepted(asyncio.Protocol):
        def connection_made(self, transport: asyncio.BaseTransport) -> None:
            sock = transport.get_extra_info("socket")
            nodelay.set_result(sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY))
            transport.close()

    sock = listening_socket("127.0.0.1", 0)
    server = await loop.create_server(Accepted, sock=sock)
    async with server:
        _, writer = await asyncio.open_connection(*sock.getsockname())
        try:
            assert await asyncio.wait_for(nodelay, 10) != 0
        finally:
            writer.close()


def test_an_address_in_use_raises_oserror() -> None:
    with socket.create_server(("127.0.0.1", 0)) as taken:
        port = taken.getsockname()[1]
        with pytest.raises(OSError):
            listening_socket("127.0.0.1", port)
