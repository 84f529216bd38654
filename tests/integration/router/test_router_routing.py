"""Routing through a real router on loopback HTTP with fake vLLM instances: several models,
conditional disaggregation, affinity policies, and the routing metrics."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import httpx
import pytest

from devstack.fake_vllm import FakeVllmServer, FakeVllmState, KvFabric, PushIdentity
from disagg_router.router.config import settings_from_mapping
from tests.integration.router.router_fixtures import MODEL, make_settings, running_router

OTHER = "other-model"


@pytest.fixture(scope="module")
def other() -> Iterator[dict[str, FakeVllmServer]]:
    """A second model's P and D (own KV fabric)."""
    fabric = KvFabric()
    servers = {
        "p": FakeVllmServer(
            FakeVllmState(OTHER, identity=PushIdentity(engine_id="other-p"), fabric=fabric)
        ),
        "d": FakeVllmServer(FakeVllmState(OTHER, fabric=fabric)),
    }
    for server in servers.values():
        server.start()
    yield servers
    for server in servers.values():
        server.stop()


def _pool(*urls: str, policy: str = "round_robin") -> dict[str, Any]:
    return {"policy": policy, "instances": [{"url": u} for u in urls]}


def _metric(text: str, name: str, **labels: str) -> float:
    want = ",".join(f'{k}="{v}"' for k, v in sorted(labels.items()))
    for line in text.splitlines():
        if line.startswith(name + "{"):
            got = ",".join(sorted(line[len(name) + 1 : line.index("}")].split(",")))
            if got == want:
                return float(line.rsplit(" ", 1)[1])
    return 0.0


def test_each_model_uses_its_own_pools(
    fake: dict[str, FakeVllmServer], other: dict[str, FakeVllmServer]
) -> None:
    for server in other.values():
        server.state.reset()
    settings = settings_from_mapping(
        {
            "models": {
                MODEL: {"prefill": _pool(fake["p0"].url), "decode": _pool(fake["d0"].url)},
                OTHER: {"prefill": _pool(other["p"].url), "decode": _pool(other["d"].url)},
            },
            "health": {"interval": 3600},
        }
    )
    with running_router(settings) as router:
        listed = httpx.get(f"{router.url}/v1/models").json()
        a = httpx.post(f"{router.url}/v1/completions", json={"model": MODEL, "prompt": "x"})
        b = httpx.post(f"{router.url}/v1/completions", json={"model": OTHER, "prompt": "y"})
        unknown = httpx.post(f"{router.url}/v1/completions", json={"model": "nope", "prompt": "z"})
        ready = httpx.get(f"{router.url}/ready").json()
    assert [m["id"] for m in listed["data"]] == [MODEL, OTHER]
    assert a.status_code == 200 and b.status_code == 200
    assert [r.body["prompt"] for r in fake["d0"].state.generation_requests()] == ["x"]
    assert [r.body["prompt"] for r in other["d"].state.generation_requests()] == ["y"]
    assert [r.body["prompt"] for r in other["p"].state.generation_requests()][-1] == "y"
    assert unknown.status_code == 404
    err = unknown.json()["error"]
    assert err["param"] == "model" and MODEL in err["message"] and OTHER in err["message"]
    assert ready["ready"] is True and set(ready["models"]) == {MODEL, OTHER}


def test_short_prompts_go_to_decode_alone(fake: dict[str, FakeVllmServer]) -> None:
    p, d = fake["p0"], fake["d0"]
    settings = make_settings(
        [p.url], [d.url], disaggregation={"min_prompt_tokens": 100, "chars_per_token": 4}
    )
    short = {"model": MODEL, "prompt": "a" * 396, "max_tokens": 3, "kv_transfer_params": {"x": 1}}
    long = {"model": MODEL, "prompt": "a" * 400, "max_tokens": 3}
    with running_router(settings) as router:
        p.state.reset()
        s = httpx.post(f"{router.url}/v1/completions", json=short, timeout=10)
        s_stream = httpx.post(
            f"{router.url}/v1/completions", json={**short, "stream": True}, timeout=10
        )
        assert p.state.generation_requests() == []
        lg = httpx.post(f"{router.url}/v1/completions", json=long, timeout=10)
        metrics = httpx.get(f"{router.url}/metrics").text
    assert s.status_code == 200 and s_stream.status_code == 200 and lg.status_code == 200
    assert s_stream.text.rstrip().endswith("data: [DONE]")
    assert s.json()["usage"]["completion_tokens"] == 3
    d_bodies = [r.body for r in d.state.generation_requests()]
    assert "kv_transfer_params" not in d_bodies[0]  # D prefills locally; client params dropped
    assert d_bodies[2]["kv_transfer_params"]["do_remote_prefill"] is True
    assert [r.body["prompt"] for r in p.state.generation_requests()] == [long["prompt"]]
    short_count = _metric(
        metrics,
        "disagg_router_routing_decisions_total",
        model=MODEL,
        decision="decode_only_short_prompt",
    )
    disagg = _metric(
        metrics, "disagg_router_routing_decisions_total", model=MODEL, decision="disaggregated"
    )
    assert (short_count, disagg) == (2.0, 1.0)


def test_no_usable_prefill_is_served_by_decode_alone(fake: dict[str, FakeVllmServer]) -> None:
    d = fake["d0"]
    gone = FakeVllmServer()  # port reserved, nothing listening
    settings = make_settings([gone.url], [d.url])
    with running_router(settings) as router:
        resp = httpx.post(
            f"{router.url}/v1/completions", json={"model": MODEL, "prompt": "hi"}, timeout=10
        )
        metrics = httpx.get(f"{router.url}/metrics").text
    assert resp.status_code == 200, resp.text
    assert "kv_transfer_params" not in d.state.generation_requests()[0].body
    assert (
        _metric(
            metrics,
            "disagg_router_routing_decisions_total",
            model=MODEL,
            decision="decode_only_no_prefill",
        )
        == 1.0
    )


def test_prefix_affinity_pins_a_prefix_to_one_prefill(fake: dict[str, FakeVllmServer]) -> None:
    p0, p1, d = fake["p0"], fake["p1"], fake["d0"]
    settings = make_settings([p0.url, p1.url], [d.url])
    data = settings.model_dump()
    data["prefill"]["policy"] = "prefix_affinity"
    data["prefill"]["prefix_chars"] = 64
    # Rendezvous weights hash the instances' labels: fixed names keep the prefixes' placement
    # the same on every run (a URL label carries a random port).
    for i, instance in enumerate(data["prefill"]["instances"]):
        instance["name"] = f"p{i}"
    settings = settings_from_mapping(data)
    systems = [f"system prompt number {i}: " + "be helpful. " * 10 for i in range(8)]
    with running_router(settings) as router:
        for turn in range(3):
            for system in systems:
                chat = {
                    "model": MODEL,
                    "max_tokens": 1,
                    "messages": [
                        {"role": "system", "content": system},
                        {"role": "user", "content": f"turn {turn}"},
                    ],
                }
                assert httpx.post(f"{router.url}/v1/chat/completions", json=chat).is_success
    where: dict[str, set[str]] = {}
    for name, server in (("p0", p0), ("p1", p1)):
        for rec in server.state.generation_requests():
            if "messages" in rec.body:
                where.setdefault(rec.body["messages"][0]["content"], set()).add(name)
    assert len(where) == len(systems)
    assert all(len(places) == 1 for places in where.values())  # every prefix on one P
    assert {p for places in where.values() for p in places} == {"p0", "p1"}  # both used


def test_session_affinity_follows_the_header(fake: dict[str, FakeVllmServer]) -> None:
    p0, p1, d = fake["p0"], fake["p1"], fake["d0"]
    settings = make_settings([p0.url, p1.url], [d.url], policy="session_affinity")
    with running_router(settings) as router:
        for i in range(6):
            req = {"model": MODEL, "prompt": f"question {i}", "max_tokens": 1}
            httpx.post(
                f"{router.url}/v1/completions", json=req, headers={"X-Session-Id": "conv-1"}
            ).raise_for_status()
    counts = sorted(len(s.state.generation_requests()) for s in (p0, p1))
    assert counts[0] <= 1 and counts[1] >= 6  # all six on one P (the other: at most a probe)
