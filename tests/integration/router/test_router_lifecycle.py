"""Start, stop and transport bounds on real loopback HTTP: SIGTERM drains a running
``disagg-router serve`` process (requests in flight finish, or are aborted after the drain time
with both legs cancelled); slow, truncated, oversized bodies and oversized headers get a 4xx and
reach no instance."""

from __future__ import annotations

import os
import signal
import socket
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import httpx
import yaml

from devstack.fake_vllm import FakeBehavior, FakeVllmServer
from devstack.ports import free_port
from devstack.process import ChildProcess, ProcessSpec
from tests.integration.router.router_fixtures import (
    MODEL,
    make_settings,
    running_router,
    sse_payloads,
)
from tests.support.wait import wait_until


def _config(p: FakeVllmServer, d: FakeVllmServer, drain: float) -> dict[str, Any]:
    ident = p.state.identity
    identity = {"engine_id": ident.engine_id, "host": ident.host, "port": ident.port}
    return {
        "models": [MODEL],
        "prefill": {"instances": [{"url": p.url, "identity": identity}]},
        "decode": {"instances": [{"url": d.url}]},
        "health": {"interval": 3600},
        "drain": {"timeout": drain},
    }


def _ready(url: str) -> int | None:
    try:
        return httpx.get(f"{url}/ready", timeout=2).status_code
    except httpx.TransportError:
        return None


@contextmanager
def _router_process(tmp_path: Path, config: dict[str, Any]) -> Iterator[tuple[ChildProcess, str]]:
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
    spec = ProcessSpec("router", argv, tmp_path / "router.log")
    with ChildProcess(spec) as proc:
        url = f"http://127.0.0.1:{port}"
        wait_until(lambda: _ready(url) == 200, 30, "the router process to be ready")
        yield proc, url


def _stream(url: str, max_tokens: int) -> Any:
    body = {"model": MODEL, "prompt": "a b c", "max_tokens": max_tokens, "stream": True}
    return httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=30)


def test_sigterm_drains_requests_in_flight_and_refuses_new_ones(
    fake: dict[str, FakeVllmServer], tmp_path: Path
) -> None:
    p, d = fake["p0"], fake["d0"]
    d.state.behavior = FakeBehavior(token_delay_s=0.02)
    with _router_process(tmp_path, _config(p, d, drain=30)) as (proc, url):
        assert proc.pid is not None
        with _stream(url, max_tokens=150) as resp:
            lines = resp.iter_lines()
            first = next(lines)
            os.kill(proc.pid, signal.SIGTERM)
            wait_until(lambda: _ready(url) == 503, 10, "/ready to answer 503 while draining")
            ready = httpx.get(f"{url}/ready").json()
            refused = httpx.post(f"{url}/v1/completions", json={"model": MODEL, "prompt": "x"})
            rest = "\n".join(lines)
        wait_until(lambda: proc.poll() is not None, 20, "the router to exit after the drain")
    assert ready["draining"] is True and ready["ready"] is False
    assert refused.status_code == 503 and refused.headers["retry-after"] == "1"
    assert refused.json()["error"]["type"] == "service_unavailable"
    assert sse_payloads(first + "\n\n" + rest + "\n\n")[-1] == "[DONE]"
    assert d.state.wait_for(lambda s: s.completed >= 1 and s.in_flight == 0)


def test_drain_time_over_aborts_the_rest_and_releases_both_legs(
    fake: dict[str, FakeVllmServer], tmp_path: Path
) -> None:
    p, d = fake["p0"], fake["d0"]
    d.state.behavior = FakeBehavior(token_delay_s=0.02)
    with _router_process(tmp_path, _config(p, d, drain=0.5)) as (proc, url):
        assert proc.pid is not None
        with _stream(url, max_tokens=5000) as resp:
            lines = resp.iter_lines()
            first = next(lines)
            os.kill(proc.pid, signal.SIGTERM)
            rest = "\n".join(lines)  # ends when the router aborts the stream
        wait_until(lambda: proc.poll() is not None, 20, "the router to exit after the drain")
    events = sse_payloads(first + "\n\n" + rest + "\n\n")
    assert "shutting down" in events[-1] and '"error"' in events[-1]
    assert d.state.wait_for(lambda s: s.cancelled == 1 and s.in_flight == 0)
    assert p.state.wait_for(lambda s: s.in_flight == 0)


def _raw(url: str, head: bytes, body: bytes = b"", close_write: bool = False) -> bytes:
    """Send raw bytes to the router; return what it answers (up to 64 KiB, 10 s bound)."""
    host, port = url.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port)), timeout=10) as sock:
        sock.sendall(head + body)
        if close_write:
            sock.shutdown(socket.SHUT_WR)
        chunks = []
        while True:
            try:
                chunk = sock.recv(65536)
            except (TimeoutError, ConnectionResetError):
                break
            if not chunk:
                break
            chunks.append(chunk)
            if b"\r\n\r\n" in b"".join(chunks) and b'"error"' in b"".join(chunks):
                break
        return b"".join(chunks)


def _head(length: int, extra: str = "") -> bytes:
    return (
        "POST /v1/completions HTTP/1.1\r\nHost: router\r\nContent-Type: application/json\r\n"
        f"Content-Length: {length}\r\n{extra}\r\n"
    ).encode()


def test_slow_truncated_oversized_bodies_and_huge_headers(fake: dict[str, FakeVllmServer]) -> None:
    p, d = fake["p0"], fake["d0"]
    limits = {"body_timeout": 0.3, "max_body_bytes": 4096, "max_header_bytes": 8192}
    settings = make_settings([p.url], [d.url], limits=limits)
    with running_router(settings) as router:
        slow = _raw(router.url, _head(100), b'{"model": ')
        truncated = _raw(router.url, _head(100), b'{"model": ', close_write=True)
        declared = _raw(router.url, _head(10_000_000))
        chunked_head = (
            b"POST /v1/completions HTTP/1.1\r\nHost: router\r\nTransfer-Encoding: chunked\r\n\r\n"
        )
        chunk = b"x" * 3000
        chunked = _raw(router.url, chunked_head, (b"bb8\r\n" + chunk + b"\r\n") * 2 + b"0\r\n\r\n")
        headers = _raw(router.url, _head(2, "X-Big: " + "y" * 10_000 + "\r\n"), b"{}")
        after = httpx.post(
            f"{router.url}/v1/completions", json={"model": MODEL, "prompt": "x", "max_tokens": 2}
        )
    assert slow.startswith(b"HTTP/1.1 408"), slow[:200]
    assert b"not received within 0.3s" in slow
    assert not truncated.startswith(b"HTTP/1.1 5"), truncated[:200]
    assert declared.startswith(b"HTTP/1.1 413"), declared[:200]
    assert chunked.startswith(b"HTTP/1.1 413"), chunked[:200]
    assert headers.startswith(b"HTTP/1.1 431"), headers[:200]
    assert b"x-request-id" in headers.lower()
    assert after.status_code == 200, after.text
    prompts = [r.body.get("prompt") for r in p.state.generation_requests()]
    assert [x for x in prompts if x != "ping"] == ["x"]  # only the valid one (probes aside)
