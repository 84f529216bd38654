"""Fault matrix on real vLLM CPU, 1P1D with our connector, one stack for every case.

For each fault: what the client gets within its bound, P's and D's KV blocks back to their
baseline (read from vLLM's ``/metrics``) within the connector's documented bound for the fault
plus a margin, and the router (or a fresh one, after the router itself was stopped) serving the
next request. The cases run in file order on one shared stack (P runs the connector's
test-only fault injection, dormant until a case creates its file); the three that kill an
instance come last (D is restarted after its kill, and P after its kill before D is bound; P's
kill mid-prefill is the final case, whose next request D serves alone); D's stall (SIGSTOP,
then SIGCONT of its processes) comes before them. The table goes to ``$FAULT_MATRIX_OUT``
(default: the session's work dir); docs/benchmarks/fault-matrix.md is produced by

    FAULT_MATRIX_OUT=docs/benchmarks/fault-matrix.md flock /tmp/vllm-e2e.lock \\
        .venv/bin/python -m pytest -m vllm tests/e2e/test_fault_matrix.py
"""

from __future__ import annotations

import asyncio
import contextlib
import importlib.util
import json
import os
import re
import signal
import socket
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import yaml

from devstack.ports import free_port
from devstack.process import ChildProcess, ProcessSpec
from devstack.stack import Stack, StackInstance, StackOptions
from disagg_router.connector.config import ConnectorConfig
from disagg_router.connector.faults import INJECTED
from tests.e2e.e2e_support import (
    RunningRouter,
    kv_blocks,
    make_prompt,
    module_stack,
    running_router,
)
from tests.e2e.failover_support import restart
from tests.support.wait import wait_until

pytestmark = [
    pytest.mark.vllm,
    pytest.mark.skipif(
        importlib.util.find_spec("disagg_router.connector.facade") is None,
        reason="disagg_router.connector.facade (our vLLM connector) is not in this checkout",
    ),
]

CONNECTOR = ConnectorConfig()  # the stack runs the connector's defaults
MARGIN_S = 5.0  # engine steps that report the release, and /metrics catching up
IMMEDIATE_BOUND_S = (
    MARGIN_S  # disagg_router/connector/README.md: P answers D's cancel, P frees at once
)
P_DEAD_BOUND_S = 2 * CONNECTOR.liveness_interval_s + MARGIN_S  # README: "P dies" (two pings)
LONG_PROMPT_WORDS = 2000  # ~7k tokens of the tiny model: under max_model_len 16384
# Killing P mid-prefill needs a prefill that spans several engine steps (vLLM updates its running
# gauge only when a step ends): on a processor with AMX tiles ~7k tokens went by unseen.
LONGEST_PROMPT_WORDS = 4300  # ~15k tokens
# The SIGTERM case needs a stream that outlives the drain: D decodes the tiny model at about
# 3,000 tokens/s on this machine's core, so 3,000 tokens once finished inside a 1 s drain. 6,000
# tokens (still under max_model_len with the long prompt) against a 0.25 s drain leave a margin
# of about 8x.
SIGTERM_DRAIN_S = 0.25
SIGTERM_MAX_TOKENS = 6000
ROWS: list[dict[str, str]] = []


WRITE_FAULT_FILE = (
    "p-write-fault"  # disagg_router/connector/faults.py: its appearance fails P's next WRITE
)
CONCURRENT_STREAMS = 128


@pytest.fixture(scope="module")
def stack(e2e_dir: Path) -> Iterator[Stack]:
    # Test-only fault injection, dormant until a case creates the file
    # (disagg_router/connector/faults.py).
    extra = {"fault_injection_file": str(e2e_dir / WRITE_FAULT_FILE)}
    options = StackOptions(
        kind="ours", topology="1p1d", connector_extra_config=extra, enforce_eager=True
    )
    with module_stack(options, e2e_dir) as started:
        yield started
    _write_table(e2e_dir)


def _router(
    stack: Stack,
    health_interval_s: float = 30.0,
    overrides: dict[str, dict[str, Any]] | None = None,
    **timeouts: float,
) -> Any:
    all_timeouts = {"prefill": 60.0, "first_token": 75.0, "total": 120.0, **timeouts}
    return running_router(
        stack,
        overrides,
        with_identity=True,
        timeouts=all_timeouts,
        health_interval_s=health_interval_s,
    )


def _running(instance: StackInstance) -> float:
    text = httpx.get(f"{instance.url}/metrics", timeout=10).text
    found = re.findall(r"^vllm:num_requests_running\{[^}]*\} ([0-9.e+-]+)$", text, re.M)
    return sum(float(v) for v in found)


def _back_to_baseline(instances: list[StackInstance], bound_s: float = IMMEDIATE_BOUND_S) -> str:
    """Wait until every instance holds 0 KV blocks and runs nothing, failing the test after
    ``bound_s`` (the connector's documented bound for the case, plus a margin) from the call;
    '<name> 0 (x.x s)' each."""
    out = []
    deadline = time.monotonic() + bound_s
    for inst in instances:
        start = time.monotonic()
        wait_until(
            lambda i=inst: kv_blocks(i) == 0 and _running(i) == 0,  # type: ignore[misc]
            max(deadline - start, 0.0),
            f"{inst.name}'s KV blocks back to 0 within {bound_s:.1f} s",
        )
        out.append(f"{inst.name} {kv_blocks(inst)} ({time.monotonic() - start:.1f} s)")
    return ", ".join(out)


def _next_ok(url: str, model: str) -> str:
    body = {"model": model, "prompt": make_prompt("next"), "max_tokens": 4, "temperature": 0}
    resp = httpx.post(f"{url}/v1/completions", json=body, timeout=120)
    assert resp.status_code == 200, resp.text
    return "200"


def _row(case: str, got: str, took: float, blocks: str, next_status: str) -> None:
    ROWS.append(
        {"case": case, "got": got, "time": f"{took:.2f} s", "kv": blocks, "next": next_status}
    )


def _write_table(e2e_dir: Path) -> None:
    out = Path(os.environ.get("FAULT_MATRIX_OUT", e2e_dir / "fault-matrix.md"))
    lines = [
        "# Fault matrix: real vLLM CPU, 1P1D, our connector",
        "",
        "Produced by `FAULT_MATRIX_OUT=docs/benchmarks/fault-matrix.md flock /tmp/vllm-e2e.lock "
        ".venv/bin/python -m pytest -m vllm tests/e2e/test_fault_matrix.py` (tiny model, one "
        "shared stack; KV blocks from each instance's `vllm:kv_cache_usage_perc` x "
        "`num_gpu_blocks`, with the time until they were back to 0, asserted within the "
        f"connector's documented bound plus {MARGIN_S:g} s: {IMMEDIATE_BOUND_S:g} s, killed P "
        f"{P_DEAD_BOUND_S:g} s; a killed instance has no row of its own).",
        "",
        "| case | what the client got | time to it | KV blocks after | next request |",
        "| --- | --- | --- | --- | --- |",
    ]
    lines += [f"| {r['case']} | {r['got']} | {r['time']} | {r['kv']} | {r['next']} |" for r in ROWS]
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text("\n".join(lines) + "\n" + _other_sections(out))
    print("\n".join(lines))


def _other_sections(out: Path) -> str:
    """The sections of ``out`` that other commands produce (from its first ``## `` heading on,
    each naming its own command), kept when this table is written anew."""
    text = out.read_text() if out.exists() else ""
    start = text.find("\n## ")
    return "" if start < 0 else text[start:]


def _post_raw(url: str, body: dict[str, Any]) -> socket.socket:
    """Send one request on a raw socket (so the test can hang up at any moment)."""
    host, port = url.removeprefix("http://").split(":")
    payload = json.dumps(body).encode()
    sock = socket.create_connection((host, int(port)), timeout=30)
    head = (
        f"POST /v1/completions HTTP/1.1\r\nHost: router\r\nContent-Type: application/json\r\n"
        f"Content-Length: {len(payload)}\r\n\r\n"
    ).encode()
    sock.sendall(head + payload)
    return sock


def _router_metric(url: str, name: str, having: str = "") -> float:
    total = 0.0
    for line in httpx.get(f"{url}/metrics", timeout=10).text.splitlines():
        if line.startswith((name + "{", name + " ")) and having in line:
            total += float(line.rsplit(" ", 1)[1])
    return total


def _legs_gone(url: str) -> bool:
    return _router_metric(url, "disagg_router_backend_in_flight") == 0


def _long(stream: bool, max_tokens: int = 4, words: int = LONG_PROMPT_WORDS) -> dict[str, Any]:
    prompt = make_prompt(f"fault-{time.monotonic()}", words)
    return {"model": "tiny", "prompt": prompt, "max_tokens": max_tokens, "stream": stream}


def _final_event(text: str) -> str:
    events = [line[5:].strip() for line in text.splitlines() if line.startswith("data:")]
    last = events[-1] if events else ""
    if last.startswith("{") and '"error"' in last:
        err = json.loads(last)["error"]
        return f"SSE error event ({err['type']}: {err['message'][:60]})"
    return f"stream ended with {last[:20]!r}"


def test_prefill_slower_than_its_timeout(stack: Stack) -> None:
    with _router(stack, prefill=0.05) as router:
        start = time.monotonic()
        resp = httpx.post(f"{router.url}/v1/completions", json=_long(False), timeout=60)
        took = time.monotonic() - start
        err = resp.json()["error"]
        blocks = _back_to_baseline(stack.prefill + stack.decode)
    with _router(stack) as router:  # the same stack, a router with the default P timeout
        next_status = _next_ok(router.url, stack.model_name) + " (default P timeout)"
    assert resp.status_code == 504 and err["type"] == "timeout", err
    _row("P slower than its timeout (0.05 s)", f"{resp.status_code} {err['type']}", took, blocks,
         next_status)  # fmt: skip


def _hang_up_when(
    router: RunningRouter, ready: Any, what: str, words: int = LONG_PROMPT_WORDS
) -> tuple[float, bytes]:
    """Send a long streamed request (of ``words``), hang up once ``ready()``; (seconds until the
    router's legs are gone after the hang-up, bytes the client had received)."""
    sock = _post_raw(router.url, _long(True, max_tokens=400, words=words))
    sock.setblocking(False)
    received: list[bytes] = []

    def seen() -> bool:
        with contextlib.suppress(BlockingIOError):
            received.append(sock.recv(65536))
        return bool(ready(b"".join(received)))

    wait_until(seen, 60, f"{what} before hanging up", interval=0.005)
    got = b"".join(received)
    sock.close()
    hung_up = time.monotonic()
    wait_until(lambda: _legs_gone(router.url), 30, "the router's legs to end after the hang-up")
    return time.monotonic() - hung_up, got


def test_client_disconnect_before_prefill_ends(stack: Stack) -> None:
    p = stack.prefill[0]
    with _router(stack) as router:
        took, got = _hang_up_when(router, lambda _: _running(p) >= 1, "P running")
        blocks = _back_to_baseline(stack.prefill + stack.decode)
        next_status = _next_ok(router.url, stack.model_name)
    assert got == b""
    _row("client disconnect before P ends", "nothing (hung up); both legs cancelled", took,
         blocks, next_status)  # fmt: skip


def test_client_disconnect_between_prefill_answer_and_first_token(stack: Stack) -> None:
    with _router(stack) as router:

        def p_answered(got: bytes) -> bool:
            ok = 'outcome="ok"'
            return (
                bool(got)
                or _router_metric(router.url, "disagg_router_prefill_leg_seconds_count", ok) >= 1
            )

        took, got = _hang_up_when(router, p_answered, "P's answer")
        blocks = _back_to_baseline(stack.prefill + stack.decode)
        next_status = _next_ok(router.url, stack.model_name)
    seen = "nothing" if not got else "the response head (D's first token had come)"
    _row("client disconnect after P answered, before D's first token", f"{seen}; legs cancelled",
         took, blocks, next_status)  # fmt: skip


def test_client_disconnect_mid_stream(stack: Stack) -> None:
    with _router(stack) as router:
        took, got = _hang_up_when(router, lambda got: got.count(b"data:") >= 3, "3 events")
        blocks = _back_to_baseline(stack.prefill + stack.decode)
        next_status = _next_ok(router.url, stack.model_name)
    assert b"data:" in got
    _row("client disconnect mid-stream", "3+ events, then hung up; D leg cancelled", took,
         blocks, next_status)  # fmt: skip


@contextlib.contextmanager
def _just_in_time(
    stack: Stack, health_interval_s: float = 30.0, **timeouts: float
) -> Iterator[tuple[RunningRouter, float]]:
    """A ``push.bind: just_in_time`` router that has learned P's speed from three prompts as
    long as the case's (so D is due near the end of its prefill, seconds after P's leg went
    out); with its count of D bindings so far."""
    overrides = {"push": {"bind": "just_in_time"}}
    with _router(stack, health_interval_s, overrides, **timeouts) as router:
        for _ in range(3):
            body = _long(False, max_tokens=1, words=LONGEST_PROMPT_WORDS)
            assert httpx.post(f"{router.url}/v1/completions", json=body, timeout=120).is_success
        yield router, _router_metric(router.url, "disagg_router_decode_binds_total")


def _p_out_nothing_bound(url: str, binds: float) -> bool:
    """Whether P's leg is out while no D has been bound since ``binds``; fails the case when D
    was bound first (the window was missed). The router's own count of P's legs in flight, not
    vLLM's running gauge: vLLM publishes that only after an engine step, and on a slow machine
    D's due time can come first."""
    out = _router_metric(url, "disagg_router_backend_in_flight", 'role="prefill"')
    unbound = _router_metric(url, "disagg_router_decode_binds_total") == binds
    assert unbound, "D was bound before P's leg was seen out; the case did not happen"
    return out >= 1


def _sent_while_unbound(router: RunningRouter, binds: float) -> socket.socket:
    """A long unstreamed request sent through ``router``, once its P leg is out and no D is
    bound yet (:func:`_p_out_nothing_bound`); the socket to read the answer from."""
    sock = _post_raw(router.url, _long(False, words=LONGEST_PROMPT_WORDS))
    wait_until(
        lambda: _p_out_nothing_bound(router.url, binds), 60, "P's leg out, D not bound",
        interval=0.005,
    )  # fmt: skip
    return sock


def _answer(sock: socket.socket) -> tuple[str, dict[str, Any]]:
    """Read a JSON answer from ``sock`` (then close it): its status and body."""
    sock.settimeout(120)
    answer = b""
    while b"}" not in answer.split(b"\r\n\r\n", 1)[-1]:
        chunk = sock.recv(65536)
        if not chunk:
            break
        answer += chunk
    sock.close()
    return answer.split(b" ", 2)[1].decode(), json.loads(answer.split(b"\r\n\r\n", 1)[1])


def test_client_disconnect_before_d_is_bound(stack: Stack) -> None:
    """push.bind just_in_time: the client hangs up once P's leg of a ~15k-token prompt is out
    and no D is bound yet. No D leg is ever sent (D's prompt tokens do not move); P's blocks go
    back to 0 like any cancelled prefill's."""
    d = stack.decode[0]
    with _just_in_time(stack) as (router, binds):
        d_tokens = _prompt_tokens(d)
        took, got = _hang_up_when(
            router,
            lambda _: _p_out_nothing_bound(router.url, binds),
            "P's leg out, D not bound",
            LONGEST_PROMPT_WORDS,
        )
        blocks = _back_to_baseline(stack.prefill + stack.decode)
        assert _router_metric(router.url, "disagg_router_decode_binds_total") == binds
        assert _prompt_tokens(d) == d_tokens  # D never saw the request
        next_status = _next_ok(router.url, stack.model_name)
    assert got == b""
    _row("client disconnect before D is bound (push.bind just_in_time)",
         "nothing (hung up); P's leg cancelled, no D leg sent", took, blocks,
         next_status)  # fmt: skip


def _prompt_tokens(instance: StackInstance) -> float:
    text = httpx.get(f"{instance.url}/metrics", timeout=10).text
    found = re.findall(r"^vllm:prompt_tokens_total\{[^}]*\} ([0-9.e+-]+)$", text, re.M)
    return sum(float(v) for v in found)


def test_router_sigterm_with_requests_in_flight(stack: Stack, tmp_path: Path) -> None:
    config = stack.router_config(with_identity=True)
    config["drain"] = {"timeout": SIGTERM_DRAIN_S}
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
    url = f"http://127.0.0.1:{port}"
    with ChildProcess(ProcessSpec("router", argv, tmp_path / "router.log")) as proc:
        wait_until(lambda: _ready(url), 60, "the router process to be ready")
        with httpx.stream(
            "POST",
            f"{url}/v1/completions",
            json=_long(True, max_tokens=SIGTERM_MAX_TOKENS),
            timeout=120,
        ) as resp:
            lines = resp.iter_lines()
            first = next(lines)
            assert proc.pid is not None
            start = time.monotonic()
            os.kill(proc.pid, signal.SIGTERM)
            text = first + "\n" + "\n".join(lines)
            took = time.monotonic() - start
        wait_until(lambda: proc.poll() is not None, 30, "the router to exit")
    blocks = _back_to_baseline(stack.prefill + stack.decode)
    with _router(stack) as router:
        next_status = _next_ok(router.url, stack.model_name) + " (a new router)"
    got = _final_event(text)
    assert "shutting down" in got
    case = f"SIGTERM of the router mid-stream (drain {SIGTERM_DRAIN_S:g} s)"
    _row(case, got, took, blocks, next_status)


STALL_S = 2.0  # the router's timeouts.inter_token in the stall case


def _signal_group(instance: StackInstance, sig: signal.Signals) -> None:
    pid = instance.server.pid
    assert pid is not None
    os.killpg(pid, sig)


def test_decode_stalls_mid_stream(stack: Stack) -> None:
    """D's processes are stopped (SIGSTOP) after its first token: the router ends the stream
    after ``inter_token``; once D runs again (SIGCONT) it sees the cancelled leg and frees its
    blocks."""
    d = stack.decode[0]
    with _router(stack, inter_token=STALL_S) as router:
        with httpx.stream(
            "POST",
            f"{router.url}/v1/completions",
            json=_long(True, max_tokens=SIGTERM_MAX_TOKENS),
            timeout=120,
        ) as resp:
            lines = resp.iter_lines()
            first = next(lines)
            _signal_group(d, signal.SIGSTOP)
            start = time.monotonic()
            try:
                text = first + "\n" + "\n".join(lines)
                took = time.monotonic() - start
                stalls = _router_metric(router.url, "disagg_router_stream_stalls_total")
            finally:
                _signal_group(d, signal.SIGCONT)
        blocks = _back_to_baseline(stack.prefill + stack.decode)
        next_status = _next_ok(router.url, stack.model_name)
    got = _final_event(text)
    assert got.startswith("SSE error event (timeout") and stalls == 1, (got, stalls)
    _row(f"D stalls mid-stream (SIGSTOP, inter_token {STALL_S:g} s; then SIGCONT)", got, took,
         blocks, next_status)  # fmt: skip


def test_d_stopped_before_it_is_bound_never_registers(stack: Stack) -> None:
    """push.bind just_in_time: D's processes are stopped (SIGSTOP) once P's leg of a ~15k-token
    prompt is out and no D is bound yet. The router binds D when it is due; D's leg gets no
    answer, so the client gets a 504 after 45 s (``first_token`` and ``total``: a ~15k-token
    prefill takes seconds here). P's finished prefill is never registered: P frees
    it after the connector's ``lease_s``. Once D runs again (SIGCONT) it frees whatever it took
    for the abandoned leg."""
    d = stack.decode[0]
    with _just_in_time(stack, prefill=30.0, first_token=45.0, total=45.0) as (router, binds):
        sock = _sent_while_unbound(router, binds)
        _signal_group(d, signal.SIGSTOP)
        start = time.monotonic()
        try:
            status, body = _answer(sock)
            took = time.monotonic() - start
            bound = _router_metric(router.url, "disagg_router_decode_binds_total") - binds
        finally:
            _signal_group(d, signal.SIGCONT)
        blocks = _back_to_baseline(stack.prefill + stack.decode, CONNECTOR.lease_s + MARGIN_S)
        next_status = _next_ok(router.url, stack.model_name)
    error = body["error"]
    assert (status, error["type"], bound) == ("504", "timeout", 1), (status, body, bound)
    _row("D stopped before it is bound, never registers (push.bind just_in_time; SIGSTOP, "
         "then SIGCONT)", f"{status} {error['type']} ({error['message'][:70]})", took, blocks,
         next_status)  # fmt: skip


def test_nixl_error_in_ps_writer_mid_transfer(stack: Stack, e2e_dir: Path) -> None:
    p = stack.prefill[0]
    trigger = e2e_dir / WRITE_FAULT_FILE
    with _router(stack) as router:
        trigger.touch()
        start = time.monotonic()
        resp = httpx.post(f"{router.url}/v1/completions", json=_long(False), timeout=120)
        took = time.monotonic() - start
        assert not trigger.exists()  # P's writer consumed it: the fault hit this request's WRITE
        blocks = _back_to_baseline(stack.prefill + stack.decode)
        next_status = _next_ok(router.url, stack.model_name) + " (P's writer went on)"
    p_log = p.server.log_path.read_text(errors="replace")
    assert INJECTED in p_log and "counted; the thread goes on" in p_log
    d_log = stack.decode[0].server.log_path.read_text(errors="replace")
    assert INJECTED in d_log  # D failed the load on P's `failed` notification, naming the cause
    if resp.status_code == 200:
        assert resp.json()["choices"][0]["text"], resp.text
        got = "200 (the router retried on a fresh transfer)"
    else:
        err = resp.json()["error"]  # a clear OpenAI-style error, not a hang
        got = f"{resp.status_code} {err['type']} ({err['message'][:70]})"
    _row("NIXL error in P's writer mid-transfer (injected)", got, took, blocks, next_status)


async def _stream_all(url: str, count: int) -> list[str]:
    """``count`` streamed requests at once; each one's last SSE data line."""
    limits = httpx.Limits(max_connections=count, max_keepalive_connections=count)
    async with httpx.AsyncClient(timeout=300, limits=limits) as client:

        async def one(i: int) -> str:
            body = {"model": "tiny", "prompt": make_prompt(f"c{i}", 40), "max_tokens": 8,
                    "stream": True}  # fmt: skip
            async with client.stream("POST", f"{url}/v1/completions", json=body) as resp:
                lines = [line async for line in resp.aiter_lines() if line.startswith("data:")]
            return f"{resp.status_code} {lines[-1] if lines else ''}"

        return list(await asyncio.gather(*(one(i) for i in range(count))))


def test_concurrent_streams_leave_no_kv_behind(stack: Stack) -> None:
    with _router(stack) as router:
        start = time.monotonic()
        ends = asyncio.run(_stream_all(router.url, CONCURRENT_STREAMS))
        took = time.monotonic() - start
        blocks = _back_to_baseline(stack.prefill + stack.decode)
        next_status = _next_ok(router.url, stack.model_name)
    done = sum(end == "200 data: [DONE]" for end in ends)
    assert done == CONCURRENT_STREAMS, sorted(set(ends))
    case = f"{CONCURRENT_STREAMS} concurrent streams (the lease path at a large batch)"
    _row(case, f"{done}/{CONCURRENT_STREAMS} streams 200, ending [DONE]", took, blocks,
         next_status)  # fmt: skip


def _ready(url: str) -> bool:
    try:
        return httpx.get(f"{url}/ready", timeout=5).status_code == 200
    except httpx.TransportError:
        return False


def _kill(instance: StackInstance) -> None:
    instance.server.kill()
    instance.server.stop()  # reaps the group


def test_kill_decode_mid_stream(stack: Stack) -> None:
    d = stack.decode[0]
    with _router(stack, health_interval_s=2.0) as router:
        with httpx.stream(
            "POST", f"{router.url}/v1/completions", json=_long(True, max_tokens=3000), timeout=120
        ) as resp:
            lines = resp.iter_lines()
            first = next(lines)
            start = time.monotonic()
            _kill(d)
            text = first + "\n" + "\n".join(lines)
            took = time.monotonic() - start
        blocks = _back_to_baseline(stack.prefill)
        restart(stack, d)
        wait_until(lambda: _ready(router.url), 120, "D back in the router's rotation")
        next_status = _next_ok(router.url, stack.model_name) + " (after D's restart)"
    got = _final_event(text)
    assert got.startswith("SSE error event")
    _row("kill D mid-stream", got, took, blocks + "; D killed", next_status)


def test_kill_prefill_before_d_is_bound(stack: Stack) -> None:
    """push.bind just_in_time: P is killed once its leg of a ~15k-token prompt is out and no D
    is bound yet. The client gets a 5xx naming the prefill instance, no D leg is ever sent (D's
    prompt tokens do not move) and D holds nothing. P is restarted for the case after."""
    p, d = stack.prefill[0], stack.decode[0]
    with _just_in_time(stack, health_interval_s=2.0) as (router, binds):
        d_tokens = _prompt_tokens(d)
        sock = _sent_while_unbound(router, binds)
        start = time.monotonic()
        _kill(p)
        status, body = _answer(sock)
        took = time.monotonic() - start
        blocks = _back_to_baseline(stack.decode, P_DEAD_BOUND_S)
        assert _router_metric(router.url, "disagg_router_decode_binds_total") == binds
        assert _prompt_tokens(d) == d_tokens  # D never saw the request
        restart(stack, p)
        wait_until(
            lambda: httpx.get(f"{router.url}/ready", timeout=5).json()["prefill"] != [],
            60,
            "the restarted P back in the router's rotation",
        )
        next_status = _next_ok(router.url, stack.model_name) + " (after P's restart)"
    assert status.startswith("5") and "prefill" in body["error"]["message"], (status, body)
    _row("kill P before D is bound (push.bind just_in_time)",
         f"{status} {body['error']['type']}; no D leg sent", took, blocks + "; P killed",
         next_status)  # fmt: skip


def test_kill_prefill_mid_prefill(stack: Stack) -> None:
    p = stack.prefill[0]
    with _router(stack, health_interval_s=2.0) as router:
        sock = _post_raw(router.url, _long(False, words=LONGEST_PROMPT_WORDS))
        wait_until(lambda: _running(p) >= 1, 60, "P running the prefill")
        start = time.monotonic()
        _kill(p)
        status, body = _answer(sock)
        took = time.monotonic() - start
        blocks = _back_to_baseline(stack.decode, P_DEAD_BOUND_S)
        wait_until(
            lambda: httpx.get(f"{router.url}/ready", timeout=5).json()["prefill"] == [],
            30,
            "the router's health check to take the dead P out",
        )
        next_status = _next_ok(router.url, stack.model_name) + " (D alone: no usable P)"
    assert status.startswith("5") and "prefill" in body["error"]["message"]
    _row("kill P mid-prefill", f"{status} {body['error']['type']}", took, blocks + "; P killed",
         next_status)  # fmt: skip
