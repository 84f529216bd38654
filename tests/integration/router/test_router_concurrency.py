"""Many concurrent requests over 2P2D: all answered correctly, all legs paired correctly."""

from __future__ import annotations

import asyncio

import httpx

from devstack.fake_vllm import FakeBehavior, FakeVllmServer
from tests.integration.router.router_fixtures import MODEL, make_settings, running_router, sse_text


async def test_concurrent_streams_over_two_by_two(fake: dict[str, FakeVllmServer]) -> None:
    ps, ds = [fake["p0"], fake["p1"]], [fake["d0"], fake["d1"]]
    for server in ps:
        server.state.behavior = FakeBehavior(prefill_delay_s=0.05)
    for server in ds:
        server.state.behavior = FakeBehavior(token_delay_s=0.01)
    settings = make_settings(
        [p.url for p in ps],
        [d.url for d in ds],
        policy="least_in_flight",
    )
    n = 16
    with running_router(settings) as router:
        async with httpx.AsyncClient(base_url=router.url, timeout=30) as client:

            async def one(i: int) -> str:
                body = {"model": MODEL, "prompt": f"req {i}", "max_tokens": 5, "stream": True}
                resp = await client.post("/v1/completions", json=body)
                assert resp.status_code == 200, resp.text
                return sse_text(resp.text, chat=False)

            texts = await asyncio.gather(*(one(i) for i in range(n)))
    assert texts == [" tok0 tok1 tok2 tok3 tok4"] * n
    d_legs = [r for d in ds for r in d.state.generation_requests()]
    assert len(d_legs) == n
    assert all(d.state.generation_requests() for d in ds)  # both decoders used
    p_legs = [r for p in ps for r in p.state.generation_requests() if r.body["prompt"] != "ping"]
    assert len(p_legs) == n
    assert {r.headers["x-request-id"] for r in p_legs} == {
        r.headers["x-request-id"] for r in d_legs
    }
    assert all(r.outcome == "ok" for r in d_legs + p_legs)
