"""The router's upstream HTTP/1.1 connections (:mod:`disagg_router.router.upstream.h1`) over real
loopback sockets: answers, keep-alive reuse, and the transport error for each failure."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager

import pytest

from devstack.ports import free_port
from disagg_router.router.upstream.h1 import (
    MAX_ANSWER_HEAD_BYTES,
    AnswerHeadersTooLarge,
    ConnectError,
    ConnectionPool,
    Origin,
    ReadTimeout,
    RemoteProtocolError,
    keepalive_timeout,
)

Handler = Callable[[asyncio.StreamReader, asyncio.StreamWriter], Awaitable[None]]
BODY = b'{"prompt": [1, 2]}'


@asynccontextmanager
async def _server(handler: Handler) -> AsyncIterator[tuple[Origin, list[int]]]:
    """A loopback server running ``handler`` per connection; yields its origin and a list that
    counts the connections it accepted."""
    accepted: list[int] = []

    async def counted(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        accepted.append(1)
        await handler(reader, writer)

    server = await asyncio.start_server(counted, "127.0.0.1", 0)
    try:
        yield ("127.0.0.1", server.sockets[0].getsockname()[1], False), accepted
    finally:
        server.close()


def _head(origin: Origin, path: str = "/v1/completions") -> bytes:
    return (
        f"POST {path} HTTP/1.1\r\nHost: {origin[0]}:{origin[1]}\r\n"
        f"Content-Length: {len(BODY)}\r\n\r\n"
    ).encode()


def _pool(
    read_s: float = 5.0, keepalive_s: float = 5.0, max_connections: int = 8
) -> ConnectionPool:
    return ConnectionPool(1.0, read_s, keepalive_s, max_connections)


async def _request(reader: asyncio.StreamReader) -> bytes:
    head = await reader.readuntil(b"\r\n\r\n")
    length = int(head.lower().split(b"content-length: ")[1].split(b"\r\n")[0])
    return await reader.readexactly(length)


def _serving(answer: bytes, requests: list[bytes] | None = None) -> Handler:
    """Answers every request on a connection with ``answer`` (keep-alive), recording bodies."""

    async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        while True:
            try:
                body = await _request(reader)
            except (asyncio.IncompleteReadError, ConnectionError):
                break
            if requests is not None:
                requests.append(body)
            writer.write(answer)
            await writer.drain()
        writer.close()

    return handler


OK = b'HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: 11\r\n\r\n{"ok":true}'
CHUNKED = (
    b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nTransfer-Encoding: chunked\r\n\r\n"
    b"9\r\ndata: a\n\n\r\n9\r\ndata: b\n\n\r\n0\r\n\r\n"
)


async def test_an_answer_is_read_and_the_connection_kept_for_the_next_request() -> None:
    seen: list[bytes] = []
    async with _server(_serving(OK, seen)) as (origin, accepted):
        pool = _pool()
        for _ in range(3):
            async with pool.request(origin, _head(origin), BODY) as answer:
                assert (answer.status, answer.content_type) == (200, "application/json")
                assert await answer.read() == b'{"ok":true}'
        await pool.close()
    assert seen == [BODY] * 3
    assert len(accepted) == 1


async def test_a_chunked_answer_is_read_chunk_by_chunk_then_ends() -> None:
    async with _server(_serving(CHUNKED)) as (origin, _):
        pool = _pool()
        async with pool.request(origin, _head(origin), BODY) as answer:
            assert answer.content_type == "text/event-stream"
            parts = []
            while chunk := await answer.read_chunk():
                parts.append(chunk)
            assert b"".join(parts) == b"data: a\n\ndata: b\n\n"
            assert await answer.read_chunk() == b""
        await pool.close()


async def test_a_large_body_arrives_whole_though_reading_pauses_on_the_way() -> None:
    big = bytes(range(256)) * (12 * 1024)  # 3 MiB: the reader pauses the socket at 1 MiB
    answer_bytes = b"HTTP/1.1 200 OK\r\nContent-Length: %d\r\n\r\n" % len(big) + big
    async with _server(_serving(answer_bytes)) as (origin, accepted):
        pool = _pool()
        for _ in range(2):
            async with pool.request(origin, _head(origin), BODY) as answer:
                assert await answer.read() == big
        await pool.close()
    assert len(accepted) == 1


CLOSING = b"HTTP/1.1 200 OK\r\nConnection: close\r\nContent-Length: 2\r\n\r\nok"


@pytest.mark.parametrize(
    ("answer", "keepalive_s", "body"),
    [
        (CHUNKED, 5.0, None),  # the answer left unread
        (OK, 0.0, b'{"ok":true}'),  # idle past keep-alive
        (CLOSING, 5.0, b"ok"),  # the instance closes the connection after its answer
        (OK + OK, 5.0, b'{"ok":true}'),  # bytes past the answer (a second, unasked answer)
    ],
    ids=["unread", "idle-past-keepalive", "connection-close", "bytes-past-the-answer"],
)
async def test_the_next_request_gets_a_new_connection_when(
    answer: bytes, keepalive_s: float, body: bytes | None
) -> None:
    """The connection of an answer not read to its end, idle too long, closed by the instance
    or carrying stray bytes is not reused: the instance accepts a second connection."""
    async with _server(_serving(answer)) as (origin, accepted):
        pool = _pool(keepalive_s=keepalive_s)
        for _ in range(2):
            async with pool.request(origin, _head(origin), BODY) as got:
                assert got.status == 200
                if body is not None:
                    assert await got.read() == body
        await pool.close()
    assert len(accepted) == 2


async def test_a_refused_connection_is_a_connect_error() -> None:
    origin = ("127.0.0.1", free_port(), False)
    pool = _pool()
    with pytest.raises(ConnectError):
        async with pool.request(origin, _head(origin), BODY):
            pass


async def test_a_body_cut_short_is_a_remote_protocol_error() -> None:
    async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await _request(reader)
        writer.write(b"HTTP/1.1 200 OK\r\nContent-Length: 100\r\n\r\nonly ten b")
        await writer.drain()
        writer.close()

    async with _server(handler) as (origin, _):
        pool = _pool()
        async with pool.request(origin, _head(origin), BODY) as answer:
            assert answer.status == 200
            with pytest.raises(RemoteProtocolError):
                await answer.read()
        await pool.close()


async def _closes_unanswered(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    await _request(reader)
    writer.close()


async def _answers_not_http(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    await _request(reader)
    writer.write(b"SSH-2.0-OpenSSH\r\n\r\n")
    await writer.drain()
    await reader.read()  # until the client closes


@pytest.mark.parametrize(
    "handler", [_closes_unanswered, _answers_not_http], ids=["closed-unanswered", "not-http"]
)
async def test_no_http_answer_is_a_remote_protocol_error(handler: Handler) -> None:
    """The instance closes the connection before any answer, or answers what is not HTTP."""
    async with _server(handler) as (origin, _):
        pool = _pool()
        with pytest.raises(RemoteProtocolError):
            async with pool.request(origin, _head(origin), BODY):
                pass
        await pool.close()


async def test_no_answer_is_a_read_timeout_and_no_chunk_in_time_too() -> None:
    release = asyncio.Event()

    async def silent(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        body = await _request(reader)
        if body == b"head":  # answer the head, then nothing
            writer.write(b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n")
            await writer.drain()
        await release.wait()
        writer.close()

    async with _server(silent) as (origin, _):
        pool = _pool(read_s=0.1)
        try:
            with pytest.raises(ReadTimeout):
                async with pool.request(origin, _head(origin), BODY):
                    pass
            head = _head(origin).replace(b"Length: %d" % len(BODY), b"Length: 4")
            async with pool.request(origin, head, b"head") as answer:
                with pytest.raises(ReadTimeout):
                    await answer.read_chunk()
        finally:
            release.set()
            await pool.close()


async def test_the_read_timeout_bounds_each_silence_not_the_whole_answer() -> None:
    """A body whose chunks keep coming outlasts the read timeout in all and is read to its end;
    the timeout is one timer re-armed for what is left of each wait, not one per wait."""
    chunks = 12

    async def steady(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await _request(reader)
        writer.write(b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n")
        for _ in range(chunks):
            await asyncio.sleep(0.1)  # the server's pace: each silence well under 1 s
            writer.write(b"1\r\nx\r\n")
            await writer.drain()
        writer.write(b"0\r\n\r\n")
        await writer.drain()

    async with _server(steady) as (origin, _):
        pool = _pool(read_s=1.0)
        try:
            started = asyncio.get_running_loop().time()
            async with pool.request(origin, _head(origin), BODY) as answer:
                body = await answer.read()
            took = asyncio.get_running_loop().time() - started
        finally:
            await pool.close()
    assert body == b"x" * chunks
    assert took > 1.0  # longer than the read timeout in all, so a timer per request would fire


async def test_past_max_connections_a_request_waits_for_one_to_come_back() -> None:
    """With one connection allowed, a second request is sent once the first ended (on the same
    connection), not on a second one."""
    async with _server(_serving(OK)) as (origin, accepted):
        pool = _pool(max_connections=1)
        first = pool.request(origin, _head(origin), BODY)
        answer = await first.__aenter__()
        second = asyncio.create_task(_read_all(pool, origin))
        while pool.waiting == 0:  # until the second request waits in the pool
            await asyncio.sleep(0)
        assert not second.done()
        await answer.read()
        await first.__aexit__(None, None, None)
        assert await second == b'{"ok":true}'
        await pool.close()
    assert len(accepted) == 1


async def _read_all(pool: ConnectionPool, origin: Origin) -> bytes:
    async with pool.request(origin, _head(origin), BODY) as answer:
        return await answer.read()


async def test_a_closed_pool_refuses_requests() -> None:
    pool = _pool()
    await pool.close()
    origin = ("127.0.0.1", free_port(), False)
    with pytest.raises(RuntimeError, match="closed"):
        async with pool.request(origin, _head(origin), BODY):
            pass


def _closing_on_second_request(answer: bytes) -> Handler:
    """Answers a connection's first request, then closes it unanswered as the next request
    arrives (the idle close landing as the request is written), every connection alike."""

    async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            await _request(reader)
            writer.write(answer)
            await writer.drain()
            await reader.read(1)  # the next request's first byte: close without reading on
        except (asyncio.IncompleteReadError, ConnectionError):
            pass
        writer.close()

    return handler


@pytest.mark.parametrize("answer", [OK, CHUNKED], ids=["json", "chunked"])
async def test_a_request_on_a_connection_closed_as_it_is_written_goes_out_once_more(
    answer: bytes,
) -> None:
    retried: list[Origin] = []
    async with _server(_closing_on_second_request(answer)) as (origin, accepted):
        pool = _pool()
        pool.on_stale_retry = retried.append
        bodies = [await _read_all(pool, origin) for _ in range(60)]
        await pool.close()
    assert all(body == bodies[0] and body for body in bodies)
    assert len(retried) == 59 and set(retried) == {origin}  # every reused one, once each
    assert len(accepted) == 60


async def test_a_new_connection_closed_unanswered_is_not_sent_again() -> None:
    retried: list[Origin] = []
    async with _server(_closes_unanswered) as (origin, accepted):
        pool = _pool()
        pool.on_stale_retry = retried.append
        with pytest.raises(RemoteProtocolError):
            await _read_all(pool, origin)
        await pool.close()
    assert retried == [] and len(accepted) == 1


async def test_a_reused_connection_failing_after_the_answer_began_is_not_sent_again() -> None:
    cut = b'HTTP/1.1 200 OK\r\nContent-Length: 11\r\n\r\n{"ok"'

    async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await _request(reader)
        writer.write(OK)
        await _request(reader)
        writer.write(cut)  # the second answer begins, then the connection ends
        await writer.drain()
        writer.close()

    retried: list[Origin] = []
    async with _server(handler) as (origin, accepted):
        pool = _pool()
        pool.on_stale_retry = retried.append
        assert await _read_all(pool, origin) == b'{"ok":true}'
        with pytest.raises(RemoteProtocolError):
            await _read_all(pool, origin)
        await pool.close()
    assert retried == [] and len(accepted) == 1


@pytest.mark.parametrize(("announced", "reused"), [(b"timeout=0", False), (b"timeout=60", True)])
async def test_an_instances_keep_alive_timeout_bounds_reuse(announced: bytes, reused: bool) -> None:
    answer = OK.replace(b"\r\n\r\n", b"\r\nKeep-Alive: " + announced + b"\r\n\r\n", 1)
    async with _server(_serving(answer)) as (origin, accepted):
        pool = _pool(keepalive_s=30.0)
        await _read_all(pool, origin)
        await _read_all(pool, origin)
        await pool.close()
    assert len(accepted) == (1 if reused else 2)


def test_a_keep_alive_header_is_read_for_its_timeout() -> None:
    assert keepalive_timeout(b"timeout=5, max=100") == 5.0
    assert keepalive_timeout(b"max=100") is None
    assert keepalive_timeout(b"timeout=soon") is None


@pytest.mark.parametrize("answer", [OK, CHUNKED], ids=["json", "chunked"])
async def test_answer_headers_over_the_bound_fail_the_call_naming_it(answer: bytes) -> None:
    huge = b"X-Big: " + b"a" * MAX_ANSWER_HEAD_BYTES + b"\r\n"
    async with _server(_serving(answer.replace(b"\r\n", b"\r\n" + huge, 1))) as (origin, _):
        pool = _pool()
        with pytest.raises(AnswerHeadersTooLarge, match=str(MAX_ANSWER_HEAD_BYTES)):
            await _read_all(pool, origin)
        await pool.close()


async def test_a_spliced_body_goes_to_the_sink_as_read_and_the_reader_still_sees_its_end() -> None:
    """Each piece the server sends after the splice reaches the sink, in order, from the
    protocol's callback; the reader, which waited meanwhile, then reads the body's end."""
    go: asyncio.Queue[bytes] = asyncio.Queue()
    got: asyncio.Queue[bytes] = asyncio.Queue()

    async def paced(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await _request(reader)
        writer.write(b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n4\r\nhead\r\n")
        while piece := await go.get():
            writer.write(b"%x\r\n%b\r\n" % (len(piece), piece))
        writer.write(b"0\r\n\r\n")
        await writer.drain()
        writer.close()

    async with _server(paced) as (origin, _):
        pool = _pool()
        async with pool.request(origin, _head(origin), BODY) as answer:
            assert await answer.read_chunk() == b"head"
            assert answer.splice(got.put_nowait)
            ending = asyncio.ensure_future(answer.read_chunk())  # the reader waits meanwhile
            for piece in (b"one", b"two"):
                go.put_nowait(piece)
                assert await got.get() == piece
            assert not ending.done()
            go.put_nowait(b"")
            assert await ending == b""
            assert not answer.splice(got.put_nowait)  # the body has ended: nothing to splice
        await pool.close()
