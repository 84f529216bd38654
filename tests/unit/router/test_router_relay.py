"""The streamed relay: what D sent together reaches the client together, in order, complete."""

from __future__ import annotations

import json

import httpx

from router import create_app
from router.config import settings_from_mapping
from tests.unit.router.mock_upstream import D, P, Upstream


async def test_events_d_sent_together_reach_the_client_in_one_write() -> None:
    settings = settings_from_mapping(
        {
            "models": ["m"],
            "prefill": {"instances": [{"url": P}]},
            "decode": {"instances": [{"url": D}]},
        }
    )
    app = create_app(settings, transport=httpx.MockTransport(Upstream(tokens=5)))
    body = {"model": "m", "prompt": "hi", "max_tokens": 5, "stream": True}
    async with (
        app.router.lifespan_context(app),
        httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://r") as client,
    ):
        await app.state.runtime.lifecycle.initial_check_done.wait()
        async with client.stream("POST", "/v1/completions", json=body) as resp:
            assert resp.status_code == 200
            writes = [part async for part in resp.aiter_raw() if part]
    assert len(writes) == 1  # one upstream body: one write to the client, not one per event
    events = [e.removeprefix(b"data: ") for e in writes[0].split(b"\n\n") if e]
    assert events[-1] == b"[DONE]"
    assert [json.loads(e)["choices"][0]["text"] for e in events[:-1]] == ["a"] * 5
