"""The router's upstream client over real loopback sockets: httpx's errors for each failure."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager

import httpx
import pytest

from devstack.ports import free_port
from router.transport import AiohttpTransport

Handler = Callable[[asyncio.StreamReader, asyncio.StreamWriter], Awaitable[None]]


@asynccontextmanager
async def _server(handler: Handler) -> AsyncIterator[str]:
    server = await asyncio.start_server(handler, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        server.close()


def _client(read_s: float = 5.0) -> httpx.AsyncClient:
    return httpx.AsyncClient(transport=AiohttpTransport(), timeout=httpx.Timeout(5.0, read=read_s))


async def _read_request(reader: asyncio.StreamReader) -> None:
    await reader.readuntil(b"\r\n\r\n")


async def test_a_refused_connection_is_a_connect_error() -> None:
    async with _client() as client:
        with pytest.raises(httpx.ConnectError):
            await client.get(f"http://127.0.0.1:{free_port()}/health")


async def test_a_body_cut_short_is_a_remote_protocol_error() -> None:
    async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await _read_request(reader)
        writer.write(b"HTTP/1.1 200 OK\r\nContent-Length: 100\r\n\r\nonly ten b")
        await writer.drain()
        writer.close()

    async with (
        _server(handler) as url,
        _client() as client,
        client.stream("GET", url + "/x") as resp,
    ):
        assert resp.status_code == 200
        with pytest.raises(httpx.RemoteProtocolError):
            await resp.aread()


async def test_no_answer_is_a_read_timeout() -> None:
    release = asyncio.Event()

    async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await _read_request(reader)
        await release.wait()
        writer.close()

    async with _server(handler) as url, _client(read_s=0.2) as client:
        try:
            with pytest.raises(httpx.ReadTimeout):
                await client.get(url + "/x")
        finally:
            release.set()


async def test_an_answer_passes_through() -> None:
    async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await _read_request(reader)
        writer.write(b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\nok")
        await writer.drain()
        writer.close()

    async with _server(handler) as url, _client() as client:
        resp = await client.get(url + "/x")
        assert (resp.status_code, resp.text) == (200, "ok")
