"""The serving edge of ``disagg-router serve`` (a real process on loopback): malformed HTTP,
slow and silent clients, and the bound on client connections."""

from __future__ import annotations

import json
import os
import socket
import sys
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
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
    argv = (sys.executable, "-m", "router.cli", "serve", "--config", str(path), "--port", str(port))
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
