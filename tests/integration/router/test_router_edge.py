"""The serving edge of ``disagg-router serve`` (a real process on loopback): malformed HTTP,
slow and silent clients, and the bound on client connections."""

from __future__ import annotations

import json
import os
import socket
import sys
import threading
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager, suppress
from pathlib import Path
from typing import Any

import httpx
import pytest
import yaml

from devstack.fake_vllm import FakeBehavior, FakeVllmServer
from devstack.ports import free_port
from devstack.process import ChildProcess, ProcessSpec
from tests.integration.router.router_fixtures import MODEL
from tests.support.wait import wait_until


def _ready(url: str) -> bool:
    try:
        return httpx.get(f"{url}/ready", timeout=2).status_code == 200
    except httpx.TransportError:
        return False


@contextmanager
def _router(
    tmp_path: Path, fake: dict[str, FakeVllmServer], limits: dict[str, Any]
) -> Iterator[tuple[ChildProcess, tuple[str, int]]]:
    """``disagg-router serve`` with ``limits`` in front of p0 and d0; (process, address)."""
    p, d = fake["p0"], fake["d0"]
    ident = p.state.identity
    identity = {"engine_id": ident.engine_id, "host": ident.host, "port": ident.port}
    config = {
        "models": [MODEL],
        "prefill": {"instances": [{"url": p.url, "identity": identity}]},
        "decode": {"instances": [{"url": d.url}]},
        "health": {"interval": 3600},
        "limits": limits,
    }
    path = tmp_path / "router.yaml"
    path.write_text(yaml.safe_dump(config))
    port = free_port()
    argv = (
        sys.executable,
        "-m",
        "disagg_router.router.cli",
        "serve",
        "--config",
        str(path),
        "--port",
        str(port),
    )
    with ChildProcess(ProcessSpec("router", argv, tmp_path / "router.log")) as proc:
        wait_until(lambda: _ready(f"http://127.0.0.1:{port}"), 30, "the router to be ready")
        yield proc, ("127.0.0.1", port)


@pytest.fixture(scope="module")
def quick(
    fakes: dict[str, FakeVllmServer], tmp_path_factory: pytest.TempPathFactory
) -> Iterator[tuple[str, int]]:
    """One router for the tests below: header and idle timeouts of 0.5 s."""
    limits = {"header_timeout": 0.5, "idle_connection_timeout": 0.5}
    with _router(tmp_path_factory.mktemp("edge"), fakes, limits) as (_, addr):
        yield addr


def _answer(sock: socket.socket) -> bytes:
    """Everything the router sends until it closes the connection (10 s bound per read)."""
    sock.settimeout(10)
    chunks = []
    try:
        while chunk := sock.recv(65536):
            chunks.append(chunk)
    except ConnectionResetError:  # closed while our request was still arriving
        pass
    return b"".join(chunks)


def _parse(raw: bytes) -> tuple[int, dict[str, str], Any]:
    head, _, body = raw.partition(b"\r\n\r\n")
    lines = head.decode().split("\r\n")
    headers = dict(line.lower().split(": ", 1) for line in lines[1:])
    return int(lines[0].split(" ")[1]), headers, json.loads(body)


def _send(addr: tuple[str, int], raw: bytes) -> tuple[int, dict[str, str], Any]:
    with socket.create_connection(addr, timeout=10) as sock:
        sock.sendall(raw)
        return _parse(_answer(sock))


def test_malformed_http_gets_an_openai_error_with_a_request_id(quick: tuple[str, int]) -> None:
    head = "POST /v1/completions HTTP/1.1\r\nHost: r\r\nContent-Length: {}\r\n\r\n{{}}"
    answers = [_send(quick, head.format(length).encode()) for length in ("-1", "abc")]
    answers.append(_send(quick, b"GET /health HTTP/1.1 extra\r\n\r\n"))
    for status, headers, body in answers:
        assert status == 400
        assert headers["content-type"] == "application/json"
        assert len(headers["x-request-id"]) == 32
        assert body["error"]["type"] == "invalid_request_error"
        assert body["error"]["message"].startswith("malformed HTTP request")


def test_slow_headers_get_408_and_a_silent_connection_is_closed(quick: tuple[str, int]) -> None:
    # One header line each time the router has said nothing for 0.1 s: a slow client.
    with socket.create_connection(quick) as sock:
        sock.sendall(b"POST /v1/completions HTTP/1.1\r\n")
        sock.settimeout(0.1)
        sent = 0
        while sent < 200:
            try:
                raw = sock.recv(65536)
                break
            except TimeoutError:
                sock.sendall(b"X-Slow-%d: x\r\n" % sent)
                sent += 1
        status, headers, body = _parse(raw + _answer(sock))
    with socket.create_connection(quick) as silent:
        silent.sendall(b"\r\n")  # an empty line is no request
        closed = _answer(silent)
    after = httpx.post(
        f"http://{quick[0]}:{quick[1]}/v1/completions",
        json={"model": MODEL, "prompt": "x", "max_tokens": 2},
    )
    assert sent < 200
    assert (status, headers["connection"]) == (408, "close")
    assert "x-request-id" in headers
    assert body["error"]["message"] == "request headers not received within 0.5s"
    assert closed == b""
    assert after.status_code == 200, after.text


def test_headers_growing_past_the_bound_get_431_before_they_end(quick: tuple[str, int]) -> None:
    """Headers still incomplete past ``limits.max_header_bytes`` (32 KiB) are not buffered on."""
    line = b"X-Big: " + b"y" * 1000 + b"\r\n"
    with socket.create_connection(quick, timeout=10) as sock:
        sock.sendall(b"POST /v1/completions HTTP/1.1\r\n" + line * 40)  # no blank line
        status, headers, body = _parse(_answer(sock))
    assert status == 431 and "x-request-id" in headers
    assert body["error"]["message"] == "request headers exceed 32768 bytes"


def _open_fds(pid: int) -> int:
    return len(os.listdir(f"/proc/{pid}/fd"))


def test_a_thousand_slow_and_silent_connections_leave_the_router_serving(
    fake: dict[str, FakeVllmServer], tmp_path: Path
) -> None:
    limits = {"header_timeout": 3, "idle_connection_timeout": 3, "max_connections": 100}
    with _router(tmp_path, fake, limits) as (proc, addr), ExitStack() as stack:
        assert proc.pid is not None
        before = _open_fds(proc.pid)
        socks = [stack.enter_context(socket.create_connection(addr)) for _ in range(1000)]
        for sock in socks[::2]:
            sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: r\r\n")  # never finished
        answers = [_answer(sock) for sock in socks]
        wait_until(lambda: _open_fds(proc.pid) <= before, 10, "the router to close them all")
        after = httpx.post(
            f"http://{addr[0]}:{addr[1]}/v1/completions",
            json={"model": MODEL, "prompt": "x", "max_tokens": 2},
        )
    refused = [_parse(a) for a in answers if a.startswith(b"HTTP/1.1 503")]
    timed_out = [a for a in answers if a.startswith(b"HTTP/1.1 408")]
    assert refused  # beyond the bound
    assert all(h["retry-after"] == "1" and "x-request-id" in h for _, h, _ in refused)
    assert len(refused) + len(timed_out) + answers.count(b"") == 1000
    assert after.status_code == 200, after.text


def _post(body: dict[str, Any]) -> bytes:
    data = json.dumps(body).encode()
    head = "POST /v1/completions HTTP/1.1\r\nHost: r\r\nContent-Type: application/json\r\n"
    return f"{head}Content-Length: {len(data)}\r\n\r\n".encode() + data


def test_a_client_leaving_a_kept_alive_connection_cancels_both_legs(
    fake: dict[str, FakeVllmServer], tmp_path: Path
) -> None:
    """The served router hears of a departure from its connection (no watcher task): the
    second request of a kept-alive connection, left before its first token, has P's and D's
    legs cancelled, and the router goes on serving."""
    p, d = fake["p0"], fake["d0"]
    with _router(tmp_path, fake, {}) as (_, addr):
        with socket.create_connection(addr, timeout=10) as sock:
            sock.sendall(_post({"model": MODEL, "prompt": "x", "max_tokens": 2, "stream": True}))
            first = b""
            while not first.endswith(b"0\r\n\r\n"):  # the first answer, chunked, to its end
                first += sock.recv(65536)
            p.state.behavior = FakeBehavior(prefill_delay_s=30)
            d.state.behavior = FakeBehavior(prefill_delay_s=30)
            sock.sendall(_post({"model": MODEL, "prompt": "y", "max_tokens": 2, "stream": True}))
            assert p.state.wait_for(lambda s: s.in_flight == 1)
            assert d.state.wait_for(lambda s: s.in_flight == 1)
        assert p.state.wait_for(lambda s: s.cancelled == 1 and s.in_flight == 0)
        assert d.state.wait_for(lambda s: s.cancelled == 1 and s.in_flight == 0)
        p.state.reset()
        d.state.reset()
        after = httpx.post(
            f"http://{addr[0]}:{addr[1]}/v1/completions",
            json={"model": MODEL, "prompt": "z", "max_tokens": 2},
            timeout=10,
        )
    assert first.startswith(b"HTTP/1.1 200")
    assert after.status_code == 200, after.text


@pytest.fixture(scope="module")
def strict(
    fakes: dict[str, FakeVllmServer], tmp_path_factory: pytest.TempPathFactory
) -> Iterator[tuple[str, int]]:
    """One router with small bounds (1 KiB body and headers, 0.5 s to send them) and at most 8
    client connections; the default keep-alive (75 s), so a closed connection was closed for its
    answer, not for being idle."""
    limits = {
        "max_body_bytes": 1024,
        "max_header_bytes": 1024,
        "body_timeout": 0.5,
        "header_timeout": 0.5,
        "max_connections": 8,
    }
    with _router(tmp_path_factory.mktemp("strict"), fakes, limits) as (_, addr):
        yield addr


def _head(length: int | None, extra: bytes = b"") -> bytes:
    size = b"" if length is None else b"Content-Length: %d\r\n" % length
    return b"POST /v1/completions HTTP/1.1\r\nHost: r\r\n" + size + extra + b"\r\n"


def _until_closed(sock: socket.socket) -> bytes:
    """Everything the router sends until it closes the connection; a connection still open 5 s
    after the request fails the test (a bound on the wait, the router's keep-alive is 75 s)."""
    sock.settimeout(5)
    chunks = []
    try:
        while chunk := sock.recv(65536):
            chunks.append(chunk)
    except TimeoutError:
        pytest.fail(f"the router kept the connection open after {b''.join(chunks)[:80]!r}")
    return b"".join(chunks)


def _one_answer(sock: socket.socket) -> tuple[int, dict[str, str], Any]:
    """The first answer on ``sock``, read to the end of its body (the connection left open)."""
    sock.settimeout(10)
    raw = b""
    while b"\r\n\r\n" not in raw or len(raw.partition(b"\r\n\r\n")[2]) < _length(raw):
        chunk = sock.recv(65536)
        assert chunk, f"closed before a whole answer: {raw!r}"
        raw += chunk
    return _parse(raw)


def _length(raw: bytes) -> int:
    head = raw.partition(b"\r\n\r\n")[0].lower()
    return int(head.partition(b"content-length: ")[2].partition(b"\r\n")[0] or 0)


_CHUNKED = b"Transfer-Encoding: chunked\r\n"
_UNTRUSTED_STREAM = {
    "400 unparsable request": (400, _head(None, b"Content-Length: -1\r\n")),
    "400 malformed chunked body": (400, _head(None, _CHUNKED) + b"2\r\n{}\r\nzz\r\n"),
    "408 stalled body": (408, _head(100) + b"{}"),
    "408 stalled headers": (408, b"POST /v1/completions HTTP/1.1\r\nHost: r\r\n"),
    "413 declared body sent in full": (413, _head(2048) + b"x" * 2048),
    "413 declared body still being sent": (413, _head(1 << 20) + b"x" * 512),
    "413 chunked body sent in full": (413, _head(None, _CHUNKED) + b"800\r\n" + b"x" * 2048),
    "431 complete headers": (431, _head(2, b"X-Big: " + b"y" * 1100 + b"\r\n") + b"{}"),
    "431 incomplete headers": (431, b"POST /v1/completions HTTP/1.1\r\nX-Big: " + b"y" * 2000),
}


@pytest.mark.parametrize("case", list(_UNTRUSTED_STREAM))
def test_an_answer_after_which_the_stream_is_untrusted_closes_the_connection(
    strict: tuple[str, int], case: str
) -> None:
    """The client keeps its socket open; the router says ``Connection: close`` and closes it
    (its keep-alive of 75 s would not)."""
    status, raw = _UNTRUSTED_STREAM[case]
    with socket.create_connection(strict, timeout=10) as sock:
        sock.sendall(raw)
        got, headers, body = _parse(_until_closed(sock))
    assert (got, headers.get("connection")) == (status, "close"), body
    assert body["error"]["type"] == "invalid_request_error"
    assert "x-request-id" in headers


def test_a_client_still_sending_its_body_gets_413_and_the_connection_ends(
    strict: tuple[str, int],
) -> None:
    """A client that goes on sending a body over the bound (16 MiB declared, sent in 64 KiB
    writes) while it reads gets the 413 with ``Connection: close``, then the connection ends:
    the router stops reading (the unread rest resets it), so its sends fail."""
    failed: list[OSError] = []
    with socket.create_connection(strict, timeout=10) as sock:

        def send_body() -> None:
            try:
                sock.sendall(_head(1 << 24))
                for _ in range(256):
                    sock.sendall(b"x" * 65536)
            except OSError as exc:
                failed.append(exc)

        sender = threading.Thread(target=send_body)
        sender.start()
        sock.settimeout(5)
        raw = b""
        try:
            while chunk := sock.recv(65536):
                raw += chunk
        except ConnectionResetError:  # the unread rest of the body resets the connection
            pass
        except TimeoutError:
            pytest.fail(f"the router kept the connection open after {raw[:80]!r}")
        finally:
            with suppress(OSError):  # ends a sender still blocked on a full buffer
                sock.shutdown(socket.SHUT_RDWR)
            sender.join(10)
    status, headers, body = _parse(raw)
    assert (status, headers.get("connection")) == (413, "close"), body
    assert failed, "the router read the whole 16 MiB body after answering 413"


def test_eight_clients_refused_for_their_body_leave_room_for_a_ninth(
    strict: tuple[str, int],
) -> None:
    """``max_connections: 8``: eight clients each get 413 and keep their sockets open; the
    router has closed them, so a ninth client is served, not refused with 503."""
    with ExitStack() as stack:
        socks = [stack.enter_context(socket.create_connection(strict)) for _ in range(8)]
        for sock in socks:
            sock.sendall(_head(2048) + b"x" * 2048)
        refused = [_one_answer(sock) for sock in socks]
        ninth = httpx.get(f"http://{strict[0]}:{strict[1]}/health", timeout=10)
    assert [status for status, _, _ in refused] == [413] * 8
    assert ninth.status_code == 200, ninth.text


def test_a_kept_alive_connection_is_closed_after_keep_alive_whatever_trails_the_answer(
    fake: dict[str, FakeVllmServer], tmp_path: Path
) -> None:
    """After an answer, neither the rest of the answered request's body (sent after its 404)
    nor empty lines keep an idle connection open beyond ``limits.keep_alive`` (1 s here)."""
    with _router(tmp_path, fake, {"keep_alive": 1}) as (_, addr):
        closed = []
        for after_answer in (b"{}", b"\r\n"):
            with socket.create_connection(addr, timeout=10) as sock:
                head = b"POST /v1/nowhere HTTP/1.1\r\nHost: r\r\nContent-Length: 2\r\n\r\n"
                sock.sendall(head)
                status, _, _ = _one_answer(sock)
                sock.sendall(after_answer)
                closed.append((status, _until_closed(sock)))
    assert closed == [(404, b""), (404, b"")]
