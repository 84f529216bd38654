"""The router's upstream client over real loopback sockets: httpx's errors for each failure."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager

import httpx
import pytest

from devstack.ports import free_port
from router.config import InstanceConfig
from router.instances.state import BackendState
from router.upstream import codec
from router.upstream.calls import leg_headers, post_json
from router.upstream.client import AiohttpTransport, UpstreamClient
from router.upstream.h1 import MAX_ANSWER_HEAD_BYTES, AnswerHeadersTooLarge

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


async def test_a_leg_goes_out_with_the_headers_and_body_httpx_would_send() -> None:
    """A leg's request (built from the backend's prepared headers) reaches the instance as the
    client's own ``build_request`` would have sent it, each header once, with the API key."""
    await _leg_headers_as_httpx_sends_them(_client())


async def test_a_direct_leg_goes_out_with_the_headers_and_body_httpx_would_send() -> None:
    """The same through the router's client, which sends a leg on its own connections."""
    client = _upstream_client()
    assert client.direct
    await _leg_headers_as_httpx_sends_them(client)


async def _leg_headers_as_httpx_sends_them(client: httpx.AsyncClient) -> None:
    seen: list[bytes] = []

    async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        while not reader.at_eof():
            try:
                head = await reader.readuntil(b"\r\n\r\n")
            except asyncio.IncompleteReadError:
                break
            length = int(head.lower().split(b"content-length: ")[1].split(b"\r\n")[0])
            seen.append(head + await reader.readexactly(length))
            writer.write(b'HTTP/1.1 200 OK\r\nContent-Length: 11\r\n\r\n{"ok":true}')
            await writer.drain()
        writer.close()

    trace = {"traceparent": "00-" + "a" * 32 + "-" + "b" * 16 + "-01"}
    async with _server(handler) as url, client:
        backend = BackendState(InstanceConfig(url=url, api_key="sk-1"), "decode")
        body = {"model": "m", "prompt": [1, 2], "max_tokens": 1}
        for rid in ("r-1", "r-2"):
            answer = await post_json(client, backend, "decode", "/v1/completions", body, rid, trace)
            assert answer == {"ok": True}
        expected = client.build_request(
            "POST",
            url + "/v1/completions",
            content=codec.dumps(body),
            headers=leg_headers(client, backend, "r-2", trace),
        )
    head, _, sent_body = seen[1].partition(b"\r\n\r\n")
    lines = head.decode().split("\r\n")
    assert lines[0] == "POST /v1/completions HTTP/1.1"
    names = [line.split(":", 1)[0].lower() for line in lines[1:]]
    assert len(names) == len(set(names))  # no header twice
    sent = dict(line.lower().split(": ", 1) for line in lines[1:])
    for name in ("host", "content-type", "content-length", "x-request-id", "authorization"):
        assert sent[name] == expected.headers[name].lower(), name
    assert sent["traceparent"] == trace["traceparent"]
    assert sent_body == expected.content


def _upstream_client() -> UpstreamClient:
    limits = httpx.Limits(max_connections=8)
    return UpstreamClient(AiohttpTransport(limits=limits), httpx.Timeout(5.0), limits)


def _redirecting(served: list[str]) -> Handler:
    """A server that answers ``/from`` with a redirect to ``/to`` and ``/to`` with ``to``."""

    async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        while head := await reader.readuntil(b"\r\n\r\n"):
            path = head.split(b" ")[1].decode()
            served.append(path)
            if path == "/from":
                writer.write(b"HTTP/1.1 302 Found\r\nLocation: /to\r\nContent-Length: 0\r\n\r\n")
            else:
                writer.write(b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\nto")
            await writer.drain()
            if reader.at_eof():
                break
        writer.close()

    return handler


async def test_the_router_client_reads_the_answer_and_follows_no_redirect() -> None:
    served: list[str] = []
    async with _server(_redirecting(served)) as url, _upstream_client() as client:
        resp = await client.get(url + "/from")
        assert (resp.status_code, resp.headers["location"], resp.content) == (302, "/to", b"")
        assert resp.request.url == url + "/from"
        followed = await client.get(url + "/from", follow_redirects=True)
        assert (followed.status_code, followed.content) == (200, b"to")
    assert served == ["/from", "/from", "/to"]


async def test_the_router_client_raises_httpx_errors_and_refuses_after_close() -> None:
    client = _upstream_client()
    async with client:
        with pytest.raises(httpx.ConnectError):
            await client.get(f"http://127.0.0.1:{free_port()}/health")
    with pytest.raises(RuntimeError, match="closed"):
        await client.get(f"http://127.0.0.1:{free_port()}/health")


async def test_the_router_client_keeps_no_cookies_on_either_path() -> None:
    """Every answer sets a cookie; no later request (httpx's path or a leg) carries one."""
    heads: list[bytes] = []

    async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        while not reader.at_eof():
            try:
                head = await reader.readuntil(b"\r\n\r\n")
            except asyncio.IncompleteReadError:
                break
            heads.append(head.lower())
            length = head.lower().split(b"content-length: ")
            if len(length) > 1:
                await reader.readexactly(int(length[1].split(b"\r\n")[0]))
            writer.write(
                b"HTTP/1.1 200 OK\r\nSet-Cookie: session=1; Path=/\r\n"
                b'Content-Length: 11\r\n\r\n{"ok":true}'
            )
            await writer.drain()
        writer.close()

    async with _server(handler) as url, _upstream_client() as client:
        backend = BackendState(InstanceConfig(url=url), "decode")
        body = {"model": "m", "prompt": [1], "max_tokens": 1}
        await client.get(url + "/health")
        assert await post_json(client, backend, "decode", "/v1/completions", body, "r-1") == {
            "ok": True
        }
        await client.get(url + "/health")
        await post_json(client, backend, "decode", "/v1/completions", body, "r-2")
        assert len(client.cookies.jar) == 0
    assert len(heads) == 4
    assert not [head for head in heads if b"\r\ncookie:" in head]


async def test_the_router_client_keeps_no_cookies_from_a_named_host() -> None:
    """aiohttp's own cookie jar ignores cookies from IP addresses only: an instance reached by
    its host name must not get one answer's cookie back either, on either path."""
    heads: list[bytes] = []

    async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        while not reader.at_eof():
            try:
                head = await reader.readuntil(b"\r\n\r\n")
            except asyncio.IncompleteReadError:
                break
            heads.append(head.lower())
            length = head.lower().split(b"content-length: ")
            if len(length) > 1:
                await reader.readexactly(int(length[1].split(b"\r\n")[0]))
            writer.write(
                b"HTTP/1.1 200 OK\r\nSet-Cookie: session=1; Path=/\r\n"
                b'Content-Length: 11\r\n\r\n{"ok":true}'
            )
            await writer.drain()
        writer.close()

    async with _server(handler) as url, _upstream_client() as client:
        url = url.replace("127.0.0.1", "localhost")
        backend = BackendState(InstanceConfig(url=url), "decode")
        body = {"model": "m", "prompt": [1], "max_tokens": 1}
        for rid in ("r-1", "r-2"):
            await client.get(url + "/health")
            await post_json(client, backend, "decode", "/v1/completions", body, rid)
    assert len(heads) == 4
    assert not [head for head in heads if b"\r\ncookie:" in head]


async def test_a_leg_on_a_closed_router_client_is_refused() -> None:
    client = _upstream_client()
    async with client:
        pass
    backend = BackendState(InstanceConfig(url=f"http://127.0.0.1:{free_port()}"), "decode")
    with pytest.raises(RuntimeError, match="closed"):
        await post_json(client, backend, "decode", "/v1/completions", {"model": "m"}, "r-1")


@pytest.mark.parametrize("extra", [-100, 1], ids=["under_the_bound", "over_it"])
async def test_an_answer_header_over_the_legs_bound_fails_the_call_naming_it(extra: int) -> None:
    value = b"a" * (MAX_ANSWER_HEAD_BYTES + extra)

    async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await _read_request(reader)
        writer.write(b"HTTP/1.1 200 OK\r\nX-Big: " + value + b"\r\nContent-Length: 2\r\n\r\n{}")
        await writer.drain()
        writer.close()

    async with _server(handler) as url, _client() as client:
        if extra > 0:
            with pytest.raises(AnswerHeadersTooLarge, match=str(MAX_ANSWER_HEAD_BYTES)):
                await client.get(url + "/x")
        else:
            assert (await client.get(url + "/x")).status_code == 200
