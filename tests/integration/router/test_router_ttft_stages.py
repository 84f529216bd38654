"""The router's TTFT stage histogram over real loopback fakes: each stage counted once per
streamed request, and P's injected prefill delay lands in the ``prefill`` stage."""

from __future__ import annotations

import httpx

from devstack.fake_vllm import FakeBehavior, FakeVllmServer
from tests.integration.router.router_fixtures import MODEL, make_settings, running_router

STREAM = {"model": MODEL, "prompt": "a b c", "max_tokens": 3, "stream": True}
PUSH_STAGES = ("accept_to_legs_sent", "prefill", "prefill_done_to_first_token", "relay_to_client")


def _samples(text: str, suffix: str) -> dict[str, float]:
    prefix = f'disagg_router_ttft_stage_seconds_{suffix}{{stage="'
    out = {}
    for line in text.splitlines():
        if line.startswith(prefix):
            stage = line[len(prefix) :].split('"', 1)[0]
            out[stage] = float(line.rsplit(" ", 1)[1])
    return out


def test_streamed_requests_record_every_push_stage(fake: dict[str, FakeVllmServer]) -> None:
    p, d = fake["p0"], fake["d0"]
    p.state.behavior = FakeBehavior(prefill_delay_s=0.2)
    with running_router(make_settings([p.url], [d.url])) as router:
        for _ in range(2):
            assert httpx.post(f"{router.url}/v1/completions", json=STREAM, timeout=10).is_success
        text = httpx.get(f"{router.url}/metrics").text
    counts, sums = _samples(text, "count"), _samples(text, "sum")
    assert {s: counts.get(s) for s in PUSH_STAGES} == dict.fromkeys(PUSH_STAGES, 2.0)
    assert "decode_to_first_token" not in counts
    assert sums["prefill"] >= 2 * 0.2
