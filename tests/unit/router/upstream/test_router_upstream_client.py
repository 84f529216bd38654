"""The router's upstream calls (:mod:`disagg_router.router.upstream.calls`) through its one client
over real loopback sockets: the request each call writes, and our error for each failure."""

from __future__ import annotations

import asyncio
import ssl
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from pathlib import Path

import pytest
import trustme

from devstack.ports import free_port
from disagg_router.router.config import InstanceConfig
from disagg_router.router.errors import (
    UpstreamHTTPError,
    UpstreamProtocolError,
    UpstreamTimeout,
    UpstreamUnavailable,
    UpstreamUnreachable,
)
from disagg_router.router.instances.state import BackendState
from disagg_router.router.upstream import codec
from disagg_router.router.upstream.calls import _head, _target, get_ok, open_raw, post_json
from disagg_router.router.upstream.client import ClientLimits, Target, UpstreamClient
from disagg_router.router.upstream.h1 import MAX_ANSWER_HEAD_BYTES

Handler = Callable[[asyncio.StreamReader, asyncio.StreamWriter], Awaitable[None]]
OK_JSON = b'HTTP/1.1 200 OK\r\nContent-Length: 11\r\n\r\n{"ok":true}'


@asynccontextmanager
async def _server(handler: Handler, tls: ssl.SSLContext | None = None) -> AsyncIterator[str]:
    server = await asyncio.start_server(handler, "127.0.0.1", 0, ssl=tls)
    port = server.sockets[0].getsockname()[1]
    try:
        yield f"{'https' if tls else 'http'}://127.0.0.1:{port}"
    finally:
        server.close()


def _client(read_s: float = 5.0) -> UpstreamClient:
    return UpstreamClient(ClientLimits(5.0, read_s, 5.0, 8))


def _backend(url: str, api_key: str | None = None) -> BackendState:
    return BackendState(InstanceConfig(url=url, api_key=api_key), "decode")


def _recording(heads: list[bytes], answer: bytes = OK_JSON) -> Handler:
    """A keep-alive server answering every request with ``answer``; each request (head and
    body) appended to ``heads``."""

    async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        while not reader.at_eof():
            try:
                head = await reader.readuntil(b"\r\n\r\n")
            except asyncio.IncompleteReadError:
                break
            length = head.lower().split(b"content-length: ")
            size = int(length[1].split(b"\r\n")[0]) if len(length) > 1 else 0
            heads.append(head + await reader.readexactly(size))
            writer.write(answer)
            await writer.drain()
        writer.close()

    return handler


def _headers(request: bytes) -> tuple[str, dict[str, str], bytes]:
    """A request's line, its headers (lower-case names; each must appear once) and body."""
    head, _, body = request.partition(b"\r\n\r\n")
    lines = head.decode("latin-1").split("\r\n")
    names = [line.split(":", 1)[0].lower() for line in lines[1:]]
    assert len(names) == len(set(names)), names  # no header twice
    return lines[0], dict((n.lower(), v) for n, v in (x.split(": ", 1) for x in lines[1:])), body


async def test_a_leg_goes_out_with_its_headers_and_body() -> None:
    """Host, Accept, User-Agent, Content-Type and -Length, the API key, the trace context and
    the request id; the body as the codec writes it; the connection reused for the next."""
    heads: list[bytes] = []
    trace = {"traceparent": "00-" + "a" * 32 + "-" + "b" * 16 + "-01"}
    body = {"model": "m", "prompt": [1, 2], "max_tokens": 1}
    async with _server(_recording(heads)) as url, _client() as client:
        backend = _backend(url, api_key="sk-1")
        for rid in ("r-1", "r-2"):
            answer = await post_json(client, backend, "decode", "/v1/completions", body, rid, trace)
            assert answer == {"ok": True}
    line, sent, sent_body = _headers(heads[1])
    assert line == "POST /v1/completions HTTP/1.1"
    assert sent == {
        "host": url.removeprefix("http://"),
        "accept": "*/*",
        "user-agent": "disagg-router",
        "content-type": "application/json",
        "authorization": "Bearer sk-1",
        "traceparent": trace["traceparent"],
        "x-request-id": "r-2",
        "content-length": str(len(codec.dumps(body))),
    }
    assert sent_body == codec.dumps(body)


async def test_a_get_has_no_body_and_no_content_headers() -> None:
    heads: list[bytes] = []
    answer = b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\nup"
    async with _server(_recording(heads, answer)) as url, _client() as client:
        assert await get_ok(client, _backend(url), "decode", "/health", "r-1") == b"up"
    line, sent, sent_body = _headers(heads[0])
    assert line == "GET /health HTTP/1.1"
    assert set(sent) == {"host", "accept", "user-agent", "x-request-id"}
    assert sent_body == b""


async def test_a_refused_connection_is_unreachable() -> None:
    async with _client() as client:
        backend = _backend(f"http://127.0.0.1:{free_port()}")
        with pytest.raises(UpstreamUnreachable):
            await get_ok(client, backend, "decode", "/health", "r-1")


async def test_a_body_cut_short_is_unavailable() -> None:
    async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await reader.readuntil(b"\r\n\r\n")
        writer.write(b"HTTP/1.1 200 OK\r\nContent-Length: 100\r\n\r\nonly ten b")
        await writer.drain()
        writer.close()

    async with _server(handler) as url, _client() as client:
        with pytest.raises(UpstreamUnavailable):
            await get_ok(client, _backend(url), "decode", "/x", "r-1")


async def test_no_answer_is_a_timeout() -> None:
    release = asyncio.Event()

    async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await reader.readuntil(b"\r\n\r\n")
        await release.wait()
        writer.close()

    async with _server(handler) as url, _client(read_s=0.2) as client:
        try:
            with pytest.raises(UpstreamTimeout):
                await get_ok(client, _backend(url), "decode", "/x", "r-1")
        finally:
            release.set()


async def test_a_redirect_is_not_followed() -> None:
    heads: list[bytes] = []
    moved = b"HTTP/1.1 302 Found\r\nLocation: /to\r\nContent-Length: 0\r\n\r\n"
    async with _server(_recording(heads, moved)) as url, _client() as client:
        with pytest.raises(UpstreamHTTPError) as err:
            await get_ok(client, _backend(url), "decode", "/from", "r-1")
    assert err.value.upstream_status == 302
    assert [_headers(h)[0] for h in heads] == ["GET /from HTTP/1.1"]


async def test_no_cookie_is_kept() -> None:
    """Every answer sets a cookie; no later request carries one, by IP or by host name."""
    heads: list[bytes] = []
    answer = b"HTTP/1.1 200 OK\r\nSet-Cookie: session=1; Path=/\r\n" + OK_JSON.split(b"\r\n", 1)[1]
    body = {"model": "m", "prompt": [1], "max_tokens": 1}
    async with _server(_recording(heads, answer)) as url, _client() as client:
        for base in (url, url.replace("127.0.0.1", "localhost")):
            backend = _backend(base)
            await get_ok(client, backend, "decode", "/health", "r-1")
            await post_json(client, backend, "decode", "/v1/completions", body, "r-2")
            await post_json(client, backend, "decode", "/v1/completions", body, "r-3")
    assert len(heads) == 6
    assert not [head for head in heads if b"\r\ncookie:" in head.lower()]


async def test_a_pass_through_answer_is_handed_over_whatever_its_status() -> None:
    heads: list[bytes] = []
    answer = b"HTTP/1.1 404 Not Found\r\nContent-Type: text/plain\r\nContent-Length: 4\r\n\r\nnope"
    async with _server(_recording(heads, answer)) as url, _client() as client:
        raw = await open_raw(client, _backend(url), "decode", "/v1/x", {"model": "m"}, "r-1")
        try:
            assert (raw.status, raw.content_type) == (404, "text/plain")
            assert await raw.read() == b"nope"
            assert raw.error(b"nope").upstream_status == 404
        finally:
            await raw.close()


async def test_a_call_on_a_closed_client_is_refused() -> None:
    client = _client()
    async with client:
        pass
    assert client.is_closed
    backend = _backend(f"http://127.0.0.1:{free_port()}")
    with pytest.raises(RuntimeError, match="closed"):
        await post_json(client, backend, "decode", "/v1/completions", {"model": "m"}, "r-1")


@pytest.mark.parametrize("extra", [-100, 1], ids=["under_the_bound", "over_it"])
async def test_an_answer_header_over_the_bound_fails_the_call_naming_it(extra: int) -> None:
    value = b"a" * (MAX_ANSWER_HEAD_BYTES + extra)

    async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await reader.readuntil(b"\r\n\r\n")
        writer.write(b"HTTP/1.1 200 OK\r\nX-Big: " + value + b"\r\nContent-Length: 2\r\n\r\n{}")
        await writer.drain()
        writer.close()

    async with _server(handler) as url, _client() as client:
        call = get_ok(client, _backend(url), "decode", "/x", "r-1")
        if extra > 0:
            with pytest.raises(UpstreamProtocolError, match=str(MAX_ANSWER_HEAD_BYTES)):
                await call
        else:
            assert await call == b"{}"


def _tls_server(ca: trustme.CA) -> ssl.SSLContext:
    """A server's TLS settings with a certificate for 127.0.0.1 that ``ca`` issued."""
    context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    ca.issue_cert("127.0.0.1").configure_cert(context)
    return context


async def test_an_https_instance_is_reached_over_tls_checking_its_certificate(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """The system's certificate store (here: ``SSL_CERT_FILE`` naming a test CA) decides: a
    certificate it trusts for the instance's address carries the call; one from another CA
    fails it as a connection that could not be opened."""
    trusted, stranger = trustme.CA(), trustme.CA()
    store = tmp_path / "ca.pem"
    trusted.cert_pem.write_to_path(str(store))
    monkeypatch.setenv("SSL_CERT_FILE", str(store))
    heads: list[bytes] = []
    answer = b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\nup"
    async with _server(_recording(heads, answer), _tls_server(trusted)) as url, _client() as client:
        assert await get_ok(client, _backend(url), "decode", "/health", "r-1") == b"up"
        assert await get_ok(client, _backend(url), "decode", "/health", "r-2") == b"up"
    assert [_headers(h)[0] for h in heads] == ["GET /health HTTP/1.1"] * 2
    async with _server(_recording([]), _tls_server(stranger)) as url, _client() as client:
        with pytest.raises(UpstreamUnreachable):
            await get_ok(client, _backend(url), "decode", "/health", "r-3")


def test_an_https_instance_is_reached_over_tls_on_its_port() -> None:
    client = _client()
    assert _target(client, _backend("https://vllm.example"), "GET", "/health").origin == (
        "vllm.example",
        443,
        True,
    )
    target = _target(client, _backend("http://[::1]:8000"), "POST", "/v1/completions?x=1")
    assert target.origin == ("::1", 8000, False)
    assert target.head.startswith(b"POST /v1/completions?x=1 HTTP/1.1\r\nHost: [::1]:8000\r\n")


@pytest.mark.parametrize(
    ("request_id", "extra"),
    [("r-1\r\nX-Evil: 1", None), ("r-1", {"traceparent": "00-a\nb"}), ("r\r", None)],
)
def test_a_header_with_a_line_break_is_refused(
    request_id: str, extra: dict[str, str] | None
) -> None:
    with pytest.raises(ValueError, match="line break"):
        _head(Target(("h", 80, False), b"POST / HTTP/1.1\r\n"), request_id, extra, 2)


def test_a_head_ends_with_the_per_request_headers() -> None:
    target = Target(("h", 80, False), b"POST /x HTTP/1.1\r\nHost: h\r\n")
    assert _head(target, "r-1", {"traceparent": "t"}, 7) == (
        b"POST /x HTTP/1.1\r\nHost: h\r\ntraceparent: t\r\nX-Request-Id: r-1\r\n"
        b"Content-Length: 7\r\n\r\n"
    )
