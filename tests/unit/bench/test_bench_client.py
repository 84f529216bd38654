"""The client against the fake vLLM on loopback, emitting tokens at scripted times."""

from __future__ import annotations

import math
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass

import httpx
import pytest

from bench.client import Target, send_request
from bench.dataset import BenchRequest, SyntheticSpec, make_token_prompts
from bench.loadgen import LoadSpec, make_client, run_load
from bench.metrics import compute_metrics
from devstack.fake_vllm import FakeBehavior, FakeVllmServer, FakeVllmState, TokenScript
from devstack.ports import free_port

# asyncio.sleep may wake up to one clock tick early; lower bounds allow for it.
SLACK_S = 0.002


@dataclass
class BackendLog:
    """What the fake received: request bodies and, per streamed request, token send times."""

    state: FakeVllmState

    @property
    def bodies(self) -> list[object]:
        return [r.body for r in self.state.generation_requests()]

    @property
    def send_times(self) -> list[list[float]]:
        return [r.token_times for r in self.state.generation_requests()]


@dataclass
class Backend:
    url: str
    log: BackendLog


@contextmanager
def _serve(scripts: Sequence[TokenScript]) -> Iterator[Backend]:
    state = FakeVllmState(behavior=FakeBehavior(scripts=tuple(scripts)))
    with FakeVllmServer(state) as server:
        yield Backend(server.url, BackendLog(state))


SCRIPT = TokenScript(ttft_s=0.15, gaps_s=(0.05, 0.10, 0.02))


@pytest.fixture
def backend() -> Iterator[Backend]:
    with _serve([SCRIPT]) as b:
        yield b


def _request(output_len: int) -> BenchRequest:
    return BenchRequest(prompt=(20, 21, 22, 23), prompt_len=4, output_len=output_len)


async def test_single_request_timings_follow_script(backend: Backend) -> None:
    async with make_client() as client:
        rec = await send_request(client, Target(backend.url, "m"), _request(4))
    assert rec.success, rec.error
    assert rec.output_tokens == 4  # from the usage chunk
    assert rec.prompt_len == 4
    assert len(rec.itl) == 3
    # Causal lower bounds: the client cannot see a token before the server sent it.
    # The server schedules tokens on absolute times, so the bound holds cumulatively.
    assert rec.ttft >= SCRIPT.ttft_s - SLACK_S
    arrived, due = rec.ttft, SCRIPT.ttft_s
    for measured, scripted in zip(rec.itl, SCRIPT.gaps_s, strict=True):
        arrived, due = arrived + measured, due + scripted
        assert arrived >= due - SLACK_S
    assert rec.latency == pytest.approx(rec.ttft + sum(rec.itl))
    # The request body asks for the exact output length.
    body = backend.log.bodies[0]
    assert body["max_tokens"] == 4 and body["ignore_eos"] is True and body["stream"] is True
    assert body["prompt"] == [20, 21, 22, 23]


async def test_client_timings_bracket_server_send_times(backend: Backend) -> None:
    async with make_client() as client:
        rec = await send_request(client, Target(backend.url, "m"), _request(4))
    sent = backend.log.send_times[0]
    # Same process, same clock: every token was received after it was sent.
    received = [rec.start_time + rec.ttft]
    for gap in rec.itl:
        received.append(received[-1] + gap)
    assert all(r >= s for r, s in zip(received, sent, strict=True))


async def test_run_metrics_agree_with_definitions(backend: Backend) -> None:
    requests = [_request(5) for _ in range(6)]
    async with make_client() as client:
        result = await run_load(
            client,
            Target(backend.url, "m"),
            requests,
            LoadSpec(request_rate=math.inf, max_concurrency=2, show_progress=False),
        )
    m = result.metrics
    assert (m.completed, m.failed) == (6, 0)
    assert m.total_output_tokens == 30 and m.total_input_tokens == 24
    # TPOT by definition from the same records.
    tpots = [(r.latency - r.ttft) / 4 for r in result.records]
    assert m.tpot.mean_ms == pytest.approx(1000 * sum(tpots) / 6)
    assert len([g for r in result.records for g in r.itl]) == 6 * 4
    # Scripted: last token due 0.15 + 0.19 s after the server got the request.
    assert min(r.latency for r in result.records) >= 0.15 + 0.19 - SLACK_S
    assert m == compute_metrics(result.records, m.duration_s)


async def test_warmups_are_sent_but_not_counted(backend: Backend) -> None:
    requests = make_token_prompts(SyntheticSpec(num_requests=3, input_len=8, output_len=1))
    fast = Target(backend.url, "m")
    async with make_client() as client:
        result = await run_load(
            client, fast, requests, LoadSpec(num_warmups=2, show_progress=False)
        )
    assert len(backend.log.bodies) == 5
    assert len(result.records) == 3


async def test_errors_become_failed_records() -> None:
    with _serve([TokenScript()]) as b:
        async with make_client() as client:
            bad = BenchRequest(prompt=(1,), prompt_len=1, output_len=1)
            payload_target = Target(b.url, "m", extra_body=(("max_tokens", 0),))
            rec = await send_request(client, payload_target, bad)
    assert not rec.success
    assert "HTTP 400" in rec.error and "max_tokens" in rec.error


async def test_connection_refused_is_a_failed_record() -> None:
    port = free_port()
    async with httpx.AsyncClient(timeout=httpx.Timeout(2.0)) as client:
        rec = await send_request(client, Target(f"http://127.0.0.1:{port}", "m"), _request(2))
    assert not rec.success and "ConnectError" in rec.error


async def test_chat_endpoint_needs_text() -> None:
    with _serve([TokenScript()]) as b:
        async with make_client() as client:
            with pytest.raises(ValueError, match="chat"):
                await send_request(client, Target(b.url, "m", "chat"), _request(2))
            rec = await send_request(
                client, Target(b.url, "m", "chat"), BenchRequest("w1 w2", 2, 3)
            )
    assert rec.success and rec.output_tokens == 3
