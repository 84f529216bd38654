"""The floor proxy of the overhead benchmark relays a push-mode stream between two fake vLLMs."""

from __future__ import annotations

from pathlib import Path

import httpx

from bench.overhead import FAKE_PREFILL_IDENTITY, MODEL, PREFILL_ENGINE_ID, fake_process
from bench.routers import floor_router
from devstack.ports import free_ports
from devstack.sse_client import iter_data


def test_the_floor_relays_every_event_of_a_streamed_completion(tmp_path: Path) -> None:
    p_port, d_port, f_port = free_ports(3)
    p_url, d_url = f"http://127.0.0.1:{p_port}", f"http://127.0.0.1:{d_port}"
    body = {"model": MODEL, "prompt": [1] * 16, "max_tokens": 5, "stream": True}
    with (
        fake_process("fake-prefill", p_port, tmp_path, PREFILL_ENGINE_ID),
        fake_process("fake-decode", d_port, tmp_path),
        floor_router(p_url, d_url, FAKE_PREFILL_IDENTITY, f_port, tmp_path),
        httpx.Client(timeout=30) as client,
    ):
        url = f"http://127.0.0.1:{f_port}/v1/completions"
        with client.stream("POST", url, json=body) as resp:
            assert resp.status_code == 200
            assert resp.headers["content-type"].startswith("text/event-stream")
            events = list(iter_data(resp))
        with client.stream("POST", d_url + "/v1/completions", json=body) as direct:
            assert len(events) == len(list(iter_data(direct))) >= 5
