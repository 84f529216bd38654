"""Push mode against fake vLLM instances on loopback: exact legs, concurrency, usage, pairing."""

from __future__ import annotations

import json
import re

import httpx
import pytest

from devstack.fake_vllm import (
    FakeBehavior,
    FakeVllmServer,
    FakeVllmState,
    PushIdentity,
    RecordedRequest,
)
from tests.integration.router.router_fixtures import (
    MODEL,
    make_settings,
    running_router,
    sse_payloads,
    sse_text,
)
from tests.support.wait import wait_until

HEX_ID = re.compile(r"^[0-9a-f]{32}$")


def _only(server: FakeVllmServer) -> RecordedRequest:
    [rec] = server.state.generation_requests()
    return rec


def _static(server: FakeVllmServer) -> dict[str, dict[str, object]]:
    ident = server.state.identity
    return {server.url: {"engine_id": ident.engine_id, "host": ident.host, "port": ident.port}}


def test_stream_completion_sends_exact_legs(fake: dict[str, FakeVllmServer]) -> None:
    p, d = fake["p0"], fake["d0"]
    settings = make_settings([p.url], [d.url], identities=_static(p))
    body = {
        "model": MODEL,
        "prompt": "one two three",
        "max_tokens": 3,
        "stream": True,
        "temperature": 0,
        "kv_transfer_params": {"do_remote_prefill": True, "remote_engine_id": "evil"},
    }
    with running_router(settings) as router:
        resp = httpx.post(f"{router.url}/v1/completions", json=body, timeout=10)
    assert resp.status_code == 200
    assert resp.headers["content-type"].startswith("text/event-stream")
    assert sse_payloads(resp.text)[-1] == "[DONE]"
    assert sse_text(resp.text, chat=False) == " tok0 tok1 tok2"

    p_rec, d_rec = _only(p), _only(d)
    rid = p_rec.headers["x-request-id"]
    assert HEX_ID.match(rid)
    assert d_rec.headers["x-request-id"] == rid
    assert p_rec.path == d_rec.path == "/v1/completions"
    client_fields = {k: v for k, v in body.items() if k != "kv_transfer_params"}
    assert p_rec.body == {
        **client_fields,
        "max_tokens": 1,
        "stream": False,
        "kv_transfer_params": {
            "do_remote_decode": True,
            "do_remote_prefill": False,
            "transfer_id": rid,
        },
    }
    assert d_rec.body == {
        **client_fields,
        "return_token_ids": True,  # what a stream continued on another D starts from
        "kv_transfer_params": {
            "do_remote_prefill": True,
            "do_remote_decode": False,
            "remote_engine_id": "engine-p0",
            "remote_host": "127.0.0.1",
            "remote_port": 5600,
            "tp_size": 1,
            "pp_size": 1,
            "remote_request_id": rid,
            "transfer_id": rid,
        },
    }


def test_legs_run_concurrently(fake: dict[str, FakeVllmServer]) -> None:
    p, d = fake["p0"], fake["d0"]
    p.state.behavior.prefill_delay_s = 0.4
    settings = make_settings([p.url], [d.url], identities=_static(p))
    with running_router(settings) as router:
        resp = httpx.post(
            f"{router.url}/v1/completions",
            json={"model": MODEL, "prompt": "x", "max_tokens": 2, "stream": True},
            timeout=10,
        )
    assert resp.status_code == 200
    p_rec, d_rec = _only(p), _only(d)
    assert p_rec.finished_at is not None
    # D's leg arrived while P was still prefilling: registration overlaps prefill.
    assert d_rec.received_at < p_rec.finished_at


def test_chat_non_stream_caps_prefill_and_merges_usage(fake: dict[str, FakeVllmServer]) -> None:
    p, d = fake["p0"], fake["d0"]
    p.state.behavior.prompt_cached_tokens = 1
    settings = make_settings([p.url], [d.url], identities=_static(p))
    body = {
        "model": MODEL,
        "messages": [{"role": "user", "content": "hello there friend"}],
        "max_completion_tokens": 4,
        "stream_options": None,
    }
    with running_router(settings) as router:
        resp = httpx.post(f"{router.url}/v1/chat/completions", json=body, timeout=10)
    assert resp.status_code == 200, resp.text
    data = resp.json()
    assert "kv_transfer_params" not in data
    assert data["choices"][0]["message"]["content"] == " tok0 tok1 tok2 tok3"
    # prompt and cached counts come from P (D counts the transferred prompt as cached).
    assert data["usage"]["prompt_tokens"] == 3
    assert data["usage"]["prompt_tokens_details"]["cached_tokens"] == 1
    assert data["usage"]["completion_tokens"] == 4
    assert data["usage"]["total_tokens"] == 7
    p_body = _only(p).body
    assert p_body["max_tokens"] == 1
    assert p_body["max_completion_tokens"] == 1
    assert "stream_options" not in p_body
    assert _only(d).body["max_completion_tokens"] == 4
    assert resp.headers["x-request-id"] == _only(d).headers["x-request-id"]


def test_stream_usage_chunk_is_merged(fake: dict[str, FakeVllmServer]) -> None:
    p, d = fake["p0"], fake["d0"]
    settings = make_settings([p.url], [d.url], identities=_static(p))
    body = {
        "model": MODEL,
        "messages": [{"role": "user", "content": "a b"}],
        "max_tokens": 2,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    with running_router(settings) as router:
        resp = httpx.post(f"{router.url}/v1/chat/completions", json=body, timeout=10)
    chunks = [json.loads(x) for x in sse_payloads(resp.text) if x != "[DONE]"]
    usage = [c["usage"] for c in chunks if c.get("usage")]
    assert usage == [
        {
            "prompt_tokens": 2,
            "total_tokens": 4,
            "completion_tokens": 2,
            "prompt_tokens_details": {"cached_tokens": 0},
        }
    ]
    assert sse_text(resp.text, chat=True) == " tok0 tok1"


def test_two_prefills_each_pair_with_the_right_identity(fake: dict[str, FakeVllmServer]) -> None:
    """2P1D with probed identities: every D leg names the P that prefilled it."""
    p0, p1, d = fake["p0"], fake["p1"], fake["d0"]
    settings = make_settings([p0.url, p1.url], [d.url])
    with running_router(settings) as router:
        for _ in range(6):
            resp = httpx.post(
                f"{router.url}/v1/completions",
                json={"model": MODEL, "prompt": "go", "max_tokens": 1},
                timeout=10,
            )
            assert resp.status_code == 200, resp.text
    engine_of_rid = {}
    for server in (p0, p1):
        for rec in server.state.generation_requests():
            engine_of_rid[rec.headers["x-request-id"]] = server.state.identity.engine_id
    d_legs = d.state.generation_requests()
    assert len(d_legs) == 6
    used = set()
    for rec in d_legs:
        kv = rec.body["kv_transfer_params"]
        assert kv["remote_engine_id"] == engine_of_rid[rec.headers["x-request-id"]]
        used.add(kv["remote_engine_id"])
    assert used == {"engine-p0", "engine-p1"}


def test_periodic_check_reprobes_a_restarted_prefill(fake: dict[str, FakeVllmServer]) -> None:
    p, d = fake["p0"], fake["d0"]
    settings = make_settings([p.url], [d.url], health={"interval": 0.1, "identity_interval": 0.1})
    req = {"model": MODEL, "prompt": "go", "max_tokens": 1}
    with running_router(settings) as router:
        assert httpx.post(f"{router.url}/v1/completions", json=req, timeout=10).is_success
        p.state.identity.engine_id = "engine-p0-restarted"  # reset() restores it
        learned = re.compile(r'identity_changes_total\{backend="[^"]+"\} 2\.0')
        wait_until(
            lambda: learned.search(httpx.get(f"{router.url}/metrics").text),
            what="the router learns the new engine id",
        )
        second = httpx.post(f"{router.url}/v1/completions", json=req, timeout=10)
    assert second.status_code == 200, second.text
    engines = [
        r.body["kv_transfer_params"]["remote_engine_id"] for r in d.state.generation_requests()
    ]
    assert engines == ["engine-p0", "engine-p0-restarted"]


def test_changed_engine_id_seen_on_prefill_answer_fails_fast(
    fake: dict[str, FakeVllmServer],
) -> None:
    """P answers with an engine id other than the one D was paired with: D is cancelled, the
    client gets a clean error at once, and the next request uses the new identity."""
    p, d = fake["p0"], fake["d0"]
    d.state.behavior = FakeBehavior(kv_wait_timeout_s=30)  # no push from the old engine comes
    settings = make_settings([p.url], [d.url])
    req = {"model": MODEL, "prompt": "go", "max_tokens": 1}
    with running_router(settings) as router:
        p.state.identity.engine_id = "engine-p0-new"  # reset() restores it
        first = httpx.post(f"{router.url}/v1/completions", json=req, timeout=30)
        assert d.state.wait_for(lambda s: s.cancelled == 1 and s.in_flight == 0)
        second = httpx.post(f"{router.url}/v1/completions", json=req, timeout=10)
    assert first.status_code == 502
    assert "engine id changed" in first.json()["error"]["message"]
    assert second.status_code == 200
    last = d.state.generation_requests()[-1]
    assert last.body["kv_transfer_params"]["remote_engine_id"] == "engine-p0-new"


def test_cached_tokens_from_prefill_kv_params_without_usage_details(
    fake: dict[str, FakeVllmServer],
) -> None:
    """vLLM without --enable-prompt-tokens-details: P's cached count comes from its kv params."""
    p, d = fake["p0"], fake["d0"]
    for server in (p, d):
        server.state.prompt_tokens_details = False
    p.state.behavior.prompt_cached_tokens = 2
    with running_router(make_settings([p.url], [d.url], identities=_static(p))) as router:
        resp = httpx.post(
            f"{router.url}/v1/completions",
            json={"model": MODEL, "prompt": "a b c d", "max_tokens": 2},
            timeout=10,
        )
    assert resp.status_code == 200
    assert resp.json()["usage"] == {
        "prompt_tokens": 4,
        "completion_tokens": 2,
        "total_tokens": 6,
        "prompt_tokens_details": {"cached_tokens": 2},
    }


def test_identity_probes_are_rationed(fake: dict[str, FakeVllmServer]) -> None:
    """Health checks every 0.05 s, probes at most every identity_interval (here: once)."""
    p, d = fake["p0"], fake["d0"]
    settings = make_settings([p.url], [d.url], health={"interval": 0.05, "identity_interval": 60})
    with running_router(settings) as router:
        assert p.state.wait_for(lambda s: s.health_checks >= 10), "fewer than 10 health checks"
        assert httpx.get(f"{router.url}/ready").status_code == 200
    probes = [r for r in p.state.generation_requests() if r.body["prompt"] == "ping"]
    assert len(probes) == 1
    assert probes[0].body["kv_transfer_params"]["do_remote_decode"] is True
    assert probes[0].body["max_tokens"] == 1
    assert probes[0].body["kv_transfer_params"]["identity_probe"] is True


def test_upstream_connections_are_reused(fake: dict[str, FakeVllmServer]) -> None:
    """Sequential requests reuse keep-alive connections to P and D (streams are read to EOF)."""
    p, d = fake["p0"], fake["d0"]
    with running_router(make_settings([p.url], [d.url], identities=_static(p))) as router:
        for stream in (True, False, True, True, False, True):
            resp = httpx.post(
                f"{router.url}/v1/completions",
                json={"model": MODEL, "prompt": "x", "max_tokens": 2, "stream": stream},
                timeout=10,
            )
            assert resp.status_code == 200
    assert len({r.client_port for r in d.state.generation_requests()}) == 1
    # P's answer may race D's last token (then it is drained after the client's answer).
    assert len({r.client_port for r in p.state.generation_requests()}) <= 2


def test_restarted_prefill_is_relearned_on_rejoin_without_periodic_probes(
    fake: dict[str, FakeVllmServer],
) -> None:
    """identity_interval null: a P that goes down and comes back with a new engine id is
    probed again when it rejoins, and D legs name the new id."""
    d = fake["d0"]
    fabric = d.state.fabric
    old = FakeVllmServer(
        FakeVllmState(identity=PushIdentity(engine_id="before-restart"), fabric=fabric)
    )
    old.start()
    settings = make_settings(
        [old.url],
        [d.url],
        health={"interval": 0.1, "unhealthy_interval": 0.05, "identity_interval": None},
        disaggregation={"when_no_prefill": "fail"},  # without P it cannot serve: not ready
    )
    req = {"model": MODEL, "prompt": "go", "max_tokens": 1}
    new = None
    try:
        with running_router(settings) as router:
            assert httpx.post(f"{router.url}/v1/completions", json=req, timeout=10).is_success
            old.stop()
            _wait_status(f"{router.url}/ready", 503)
            state = FakeVllmState(identity=PushIdentity(engine_id="after-restart"), fabric=fabric)
            new = FakeVllmServer(state, port=old.port).start()
            _wait_status(f"{router.url}/ready", 200)
            second = httpx.post(f"{router.url}/v1/completions", json=req, timeout=10)
    finally:
        if new is not None:
            new.stop()
    assert second.status_code == 200, second.text
    engines = [
        r.body["kv_transfer_params"]["remote_engine_id"] for r in d.state.generation_requests()
    ]
    assert engines == ["before-restart", "after-restart"]
    probes = [r for r in new.state.generation_requests() if r.body["prompt"] == "ping"]
    assert len(probes) == 1


def _wait_status(url: str, status: int) -> None:
    wait_until(lambda: httpx.get(url).status_code == status, what=f"{url} to answer {status}")


def test_late_prefill_answer_is_drained_not_cancelled(fake: dict[str, FakeVllmServer]) -> None:
    """Push: P's KV arrives at D before P's HTTP answer reaches the router; D finishes first.
    The router still reads P's answer to the end (usage; the connection stays reusable) instead
    of cancelling it."""
    p, d = fake["p0"], fake["d0"]
    p.state.behavior = FakeBehavior(answer_delay_s=0.3, prompt_cached_tokens=1)
    body = {
        "model": MODEL,
        "prompt": "a b c",
        "max_tokens": 1,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    with running_router(make_settings([p.url], [d.url], identities=_static(p))) as router:
        # Without usage in the stream nothing else waits for P's answer.
        plain = {k: v for k, v in body.items() if k != "stream_options"}
        assert httpx.post(f"{router.url}/v1/completions", json=plain, timeout=10).is_success
        resp = httpx.post(f"{router.url}/v1/completions", json=body, timeout=10)
        assert resp.status_code == 200
        usage = [json.loads(x) for x in sse_payloads(resp.text) if x != "[DONE]"][-1]
        assert usage["usage"]["prompt_tokens_details"] == {"cached_tokens": 1}
    p_legs = p.state.generation_requests()
    assert [r.outcome for r in p_legs] == ["ok", "ok"]


def _spliced_reads(router_url: str) -> float:
    text = httpx.get(f"{router_url}/metrics", timeout=5).text
    found = re.search(r"^disagg_router_relay_spliced_reads_total (\S+)$", text, re.M)
    assert found is not None
    return float(found.group(1))


@pytest.mark.parametrize("migration", [True, False])
def test_a_paced_stream_is_spliced_to_the_client_whole_and_in_order(
    fake: dict[str, FakeVllmServer], migration: bool
) -> None:
    """Tokens 20 ms apart: while the relay waits, D's reads go to the client from the socket's
    callback (counted), rewritten as the relay would (no token ids the client did not ask
    for); the usage event still comes back to the relay and is merged."""
    p, d = fake["p0"], fake["d0"]
    d.state.behavior = FakeBehavior(token_delay_s=0.02)
    extra = {"migration": {"enabled": migration}}
    settings = make_settings([p.url], [d.url], identities=_static(p), **extra)
    body = {
        "model": MODEL,
        "prompt": "a b c",
        "max_tokens": 20,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    with running_router(settings) as router:
        resp = httpx.post(f"{router.url}/v1/completions", json=body, timeout=30)
        spliced = _spliced_reads(router.url)
    assert resp.status_code == 200
    assert sse_text(resp.text, chat=False) == "".join(f" tok{i}" for i in range(20))
    payloads = sse_payloads(resp.text)
    assert payloads[-1] == "[DONE]"
    usage = [json.loads(x)["usage"] for x in payloads[:-1] if json.loads(x).get("usage")]
    assert [(u["prompt_tokens"], u["completion_tokens"]) for u in usage] == [(3, 20)]
    assert "token_ids" not in resp.text
    assert spliced >= 1
