"""The routes beside generation (``/tokenize``, pooling, scoring, ``/v1/responses``) and
``/v1/models``, over real loopback HTTP: a router in front of the fake vLLMs."""

from __future__ import annotations

import json
import os
import signal
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx
import pytest

from devstack.fake_vllm import FakeBehavior, FakeVllmServer, FakeVllmState, UvicornThread
from disagg_router.router.http.passthrough import PASSTHROUGH_PATHS
from tests.integration.router.router_fixtures import MODEL, make_settings, running_router
from tests.integration.router.test_router_lifecycle import _config, _router_process
from tests.support.wait import wait_until

BODIES: dict[str, dict[str, Any]] = {
    "/tokenize": {"prompt": "hello there world"},
    "/detokenize": {"tokens": [1, 2, 3]},
    "/v1/embeddings": {"input": ["a b", "c"]},
    "/v2/embed": {"texts": ["a b"], "input_type": "search_document"},
    "/pooling": {"input": "a b c"},
    "/classify": {"input": ["a", "b"]},
    "/score": {"queries": "q", "documents": ["d1", "d2"]},
    "/v1/score": {"text_1": "q", "text_2": ["d1", "d2"]},
    "/rerank": {"query": "q", "documents": ["d1", "d2"]},
    "/v1/rerank": {"query": "q", "documents": ["d1"]},
    "/v2/rerank": {"query": "q", "documents": ["d1", "d2", "d3"]},
}
"""A valid body per route (as vLLM 0.32 takes it), without ``model``."""

# vLLM's answer's field that each route's answer must carry (the fake's, passed through).
ANSWER_FIELD = {
    "/tokenize": "tokens",
    "/detokenize": "prompt",
    "/v1/embeddings": "data",
    "/v2/embed": "embeddings",
    "/pooling": "data",
    "/classify": "data",
    "/score": "data",
    "/v1/score": "data",
    "/rerank": "results",
    "/v1/rerank": "results",
    "/v2/rerank": "results",
}

MAX_BODY = 2048


@pytest.fixture(scope="module")
def router(fakes: dict[str, FakeVllmServer]) -> Iterator[UvicornThread]:
    """One router (P p0, D d0) for the module; a breaker that injected 5xx do not open."""
    settings = make_settings(
        [fakes["p0"].url],
        [fakes["d0"].url],
        limits={"max_body_bytes": MAX_BODY},
        breaker={"failure_threshold": 1000},
    )
    with running_router(settings) as server:
        yield server


def _post(router: UvicornThread, path: str, body: Any) -> httpx.Response:
    return httpx.post(router.url + path, json=body, timeout=15)


def _paths(fake: dict[str, FakeVllmServer], name: str) -> list[str]:
    """The paths of the requests ``name`` got, but generation (a P's identity probes)."""
    generation = ("/v1/completions", "/v1/chat/completions")
    return [r.path for r in fake[name].state.requests if r.path not in generation]


def test_every_vllm_route_of_the_list_has_a_body_here() -> None:
    assert set(BODIES) == set(PASSTHROUGH_PATHS)


@pytest.mark.parametrize("path", PASSTHROUGH_PATHS)
def test_route_is_forwarded_to_the_decode_pool(
    router: UvicornThread, fake: dict[str, FakeVllmServer], path: str
) -> None:
    resp = _post(router, path, {"model": MODEL, **BODIES[path]})
    assert resp.status_code == 200, resp.text
    assert ANSWER_FIELD[path] in resp.json()
    assert resp.headers["content-type"].startswith("application/json")
    assert resp.headers["x-request-id"]
    assert _paths(fake, "d0") == [path]
    assert _paths(fake, "p0") == []
    sent = fake["d0"].state.requests[0]
    assert sent.body == {"model": MODEL, **BODIES[path]}
    assert sent.headers["x-request-id"] == resp.headers["x-request-id"]


def test_tokenize_answer_is_vllms_and_a_missing_model_is_the_served_one(
    router: UvicornThread, fake: dict[str, FakeVllmServer]
) -> None:
    resp = _post(router, "/tokenize", {"prompt": "a b c"})
    assert resp.status_code == 200, resp.text
    assert resp.json() == {
        "count": 3,
        "max_model_len": 4096,
        "tokens": [1, 2, 3],
        "token_strs": None,
    }


def test_client_kv_transfer_params_never_reach_the_instance(
    router: UvicornThread, fake: dict[str, FakeVllmServer]
) -> None:
    body = {"model": MODEL, "input": "x", "kv_transfer_params": {"do_remote_prefill": True}}
    assert _post(router, "/v1/embeddings", body).status_code == 200
    assert "kv_transfer_params" not in fake["d0"].state.requests[0].body


@pytest.mark.parametrize("path", [*PASSTHROUGH_PATHS, "/v1/responses"])
def test_unknown_model_is_the_routers_404(
    router: UvicornThread, fake: dict[str, FakeVllmServer], path: str
) -> None:
    resp = _post(router, path, {"model": "other", "input": "x"})
    assert resp.status_code == 404
    err = resp.json()["error"]
    assert err["param"] == "model"
    assert err["code"] == "model_not_found"
    assert MODEL in err["message"]
    assert _paths(fake, "d0") == _paths(fake, "p0") == []


@pytest.mark.parametrize(
    ("body", "param"),
    [
        (b"[1]", None),
        (b"{not json", None),
        (b'{"model": 5, "input": "x"}', "model"),
        (b'{"model": "fake-model", "input": "x", "stream": "yes"}', "stream"),
    ],
)
def test_malformed_body_is_a_400_naming_the_field(
    router: UvicornThread, fake: dict[str, FakeVllmServer], body: bytes, param: str | None
) -> None:
    resp = httpx.post(router.url + "/v1/embeddings", content=body, timeout=15)
    assert resp.status_code == 400
    assert resp.json()["error"]["param"] == param
    assert _paths(fake, "d0") == []


@pytest.mark.parametrize("path", ["/v1/embeddings", "/v1/completions", "/v1/chat/completions"])
def test_a_model_list_is_a_400_saying_model_must_be_a_string(
    router: UvicornThread, fake: dict[str, FakeVllmServer], path: str
) -> None:
    body = {"model": [MODEL], "input": "x", "prompt": "x", "messages": []}
    resp = httpx.post(router.url + path, json=body, timeout=15)
    assert resp.status_code == 400
    error = resp.json()["error"]
    assert error["param"] == "model"
    assert "string" in error["message"] and "several" not in error["message"]
    assert _paths(fake, "d0") == []


@pytest.mark.parametrize("path", ["/tokenize", "/v1/embeddings", "/rerank", "/v1/responses"])
def test_oversized_body_is_a_413(
    router: UvicornThread, fake: dict[str, FakeVllmServer], path: str
) -> None:
    resp = _post(router, path, {"model": MODEL, "input": "x" * MAX_BODY, "prompt": "x"})
    assert resp.status_code == 413
    assert resp.json()["error"]["type"] == "invalid_request_error"
    assert _paths(fake, "d0") == []


@pytest.mark.parametrize("path", [*PASSTHROUGH_PATHS, "/v1/responses"])
def test_upstream_4xx_is_passed_through_as_is(
    router: UvicornThread, fake: dict[str, FakeVllmServer], path: str
) -> None:
    """A body vLLM rejects (here: its required field missing) comes back with vLLM's own
    status and body, and does not count against the instance."""
    resp = _post(router, path, {"model": MODEL, "unrelated": 1})
    assert resp.status_code == 400
    err = resp.json()["error"]
    assert err["type"] == "BadRequestError"  # vLLM's words, not the router's
    assert err["message"].startswith("Field required")
    assert err["param"]
    assert _paths(fake, "d0") == [path]


@pytest.mark.parametrize("status", [404, 422, 501])
def test_other_client_statuses_pass_through(
    router: UvicornThread, fake: dict[str, FakeVllmServer], status: int
) -> None:
    fake["d0"].state.behavior = FakeBehavior(fail_status=status)
    resp = _post(router, "/pooling", {"model": MODEL, "input": "x"})
    assert resp.status_code == status
    assert resp.json()["error"]["message"] == "injected failure"
    assert _paths(fake, "d0") == ["/pooling"]  # not retried: the request's fault


@pytest.mark.parametrize("path", ["/tokenize", "/v1/embeddings", "/v2/rerank", "/v1/responses"])
def test_upstream_5xx_is_a_502_in_openai_form(
    router: UvicornThread, fake: dict[str, FakeVllmServer], path: str
) -> None:
    fake["d0"].state.behavior = FakeBehavior(fail_status=500)
    resp = _post(router, path, {"model": MODEL, **BODIES.get(path, {"input": "x"})})
    assert resp.status_code == 502
    err = resp.json()["error"]
    assert err["type"] == "upstream_error"
    assert "decode instance" in err["message"]
    assert set(err) == {"message", "type", "param", "code"}


def test_upstream_down_is_a_503_in_openai_form(fake: dict[str, FakeVllmServer]) -> None:
    """The only D stops after the router has checked it: the connection is refused."""
    decode = FakeVllmServer(FakeVllmState(MODEL))
    decode.start()
    stopped = False
    try:
        settings = make_settings([fake["p0"].url], [decode.url])
        with running_router(settings) as router:
            decode.stop()
            stopped = True
            resp = _post(router, "/tokenize", {"model": MODEL, "prompt": "x"})
            again = _post(router, "/v1/embeddings", {"model": MODEL, "input": "x"})
    finally:
        if not stopped:
            decode.stop()
    assert resp.status_code == 503
    assert resp.json()["error"]["type"] == "service_unavailable"
    assert "connection refused" in resp.json()["error"]["message"]
    assert again.status_code == 503  # its breaker took the instance out: no usable D
    assert again.json()["error"]["type"] == "service_unavailable"


def test_retryable_failure_goes_to_another_instance(fake: dict[str, FakeVllmServer]) -> None:
    settings = make_settings([fake["p0"].url], [fake["d0"].url, fake["d1"].url])
    with running_router(settings) as router:
        fake["d0"].state.behavior = FakeBehavior(fail_status=503)  # round_robin: d0 first
        resp = _post(router, "/v1/embeddings", {"model": MODEL, "input": "x"})
        text = httpx.get(f"{router.url}/metrics").text
    assert resp.status_code == 200, resp.text
    assert _paths(fake, "d0") == _paths(fake, "d1") == ["/v1/embeddings"]
    sent = [fake[d].state.requests[0].headers["x-request-id"] for d in ("d0", "d1")]
    assert sent[0] != sent[1]  # a fresh id for the retry
    assert "disagg_router_retries_total 1.0" in text


def test_passthrough_pool_names_the_pool(fake: dict[str, FakeVllmServer]) -> None:
    settings = make_settings([fake["p0"].url], [fake["d0"].url], passthrough_pool="prefill")
    with running_router(settings) as router:
        resp = _post(router, "/tokenize", {"model": MODEL, "prompt": "x"})
        responses = _post(router, "/v1/responses", {"model": MODEL, "input": "x"})
    assert resp.status_code == responses.status_code == 200
    assert _paths(fake, "p0") == ["/tokenize"]
    assert _paths(fake, "d0") == ["/v1/responses"]  # the Responses API is always D's


def test_responses_non_streamed_by_decode_alone(
    router: UvicornThread, fake: dict[str, FakeVllmServer]
) -> None:
    body = {"model": MODEL, "input": "hi there", "max_output_tokens": 3}
    resp = _post(router, "/v1/responses", {**body, "kv_transfer_params": {"x": 1}})
    assert resp.status_code == 200, resp.text
    answer = resp.json()
    assert answer["object"] == "response"
    assert answer["output"][0]["content"][0]["text"] == " tok0 tok1 tok2"
    assert _paths(fake, "d0") == ["/v1/responses"]
    assert fake["d0"].state.requests[0].body == body
    assert _paths(fake, "p0") == []


def test_responses_streamed_as_vllm_sends_it(
    router: UvicornThread, fake: dict[str, FakeVllmServer]
) -> None:
    body = {"model": MODEL, "input": "hi", "max_output_tokens": 2, "stream": True}
    with httpx.stream("POST", router.url + "/v1/responses", json=body, timeout=15) as resp:
        text = resp.read().decode()
    assert resp.status_code == 200
    assert resp.headers["content-type"].startswith("text/event-stream")
    events = [block for block in text.split("\n\n") if block]
    assert [e.splitlines()[0] for e in events] == [
        "event: response.created",
        "event: response.output_text.delta",
        "event: response.output_text.delta",
        "event: response.completed",
    ]
    completed = json.loads(events[-1].splitlines()[1].removeprefix("data: "))
    assert completed["response"]["status"] == "completed"


def test_responses_stream_that_breaks_ends_with_one_sse_error_event(
    router: UvicornThread, fake: dict[str, FakeVllmServer]
) -> None:
    fake["d0"].state.behavior = FakeBehavior(drop_after_tokens=2)
    body = {"model": MODEL, "input": "hi", "max_output_tokens": 4, "stream": True}
    with httpx.stream("POST", router.url + "/v1/responses", json=body, timeout=15) as resp:
        text = resp.read().decode()
    assert resp.status_code == 200
    events = [block for block in text.split("\n\n") if block]
    assert events[0].startswith("event: response.created")
    error = json.loads(events[-1].removeprefix("data: "))["error"]
    assert error["type"] == "service_unavailable"
    assert "decode instance" in error["message"]
    assert "response.completed" not in text


def test_models_carry_max_model_len_and_pool_status(
    router: UvicornThread, fake: dict[str, FakeVllmServer]
) -> None:
    models = httpx.get(f"{router.url}/v1/models", timeout=15).json()
    (card,) = models["data"]
    assert card["id"] == MODEL
    assert card["object"] == "model"
    assert card["max_model_len"] == 4096  # from the instances' own /v1/models
    assert card["pools"] == {
        "prefill": {"instances": 1, "usable": 1},
        "decode": {"instances": 1, "usable": 1},
    }
    assert fake["d0"].state.requests == []  # answered from what the router keeps


def test_models_show_an_unusable_pool(fake: dict[str, FakeVllmServer]) -> None:
    down = FakeVllmServer()  # port reserved, not serving: connections are refused
    settings = make_settings([fake["p0"].url], [fake["d0"].url, down.url])
    with running_router(settings) as router:
        card = httpx.get(f"{router.url}/v1/models", timeout=15).json()["data"][0]
    assert card["pools"]["decode"] == {"instances": 2, "usable": 1}
    assert card["max_model_len"] == 4096


def test_passthrough_requests_are_counted(fake: dict[str, FakeVllmServer]) -> None:
    with running_router(make_settings([fake["p0"].url], [fake["d0"].url])) as router:
        assert _post(router, "/detokenize", {"model": MODEL, "tokens": [1]}).status_code == 200
        assert _post(router, "/detokenize", {"model": MODEL}).status_code == 400
        assert _post(router, "/detokenize", {"model": "other", "tokens": [1]}).status_code == 404
        text = httpx.get(f"{router.url}/metrics").text
    prefix = 'disagg_router_passthrough_requests_total{outcome="'
    assert prefix + 'ok",route="/detokenize"} 1.0' in text
    assert prefix + 'upstream_rejected",route="/detokenize"} 1.0' in text
    assert prefix + 'invalid_request",route="/detokenize"} 1.0' in text
    assert 'disagg_router_passthrough_seconds_count{route="/detokenize"} 3.0' in text


def test_drain_time_over_aborts_a_passthrough_with_a_503(
    fake: dict[str, FakeVllmServer], tmp_path: Path
) -> None:
    """SIGTERM while a forwarded request waits on its instance: the drain waits for it, then
    aborts it; the client gets a 503 in OpenAI form and the instance's request is closed."""
    p, d = fake["p0"], fake["d0"]
    d.state.behavior = FakeBehavior(hang=True)
    with _router_process(tmp_path, _config(p, d, drain=0.5)) as (proc, url):
        assert proc.pid is not None
        with ThreadPoolExecutor(1) as pool:
            body = {"model": MODEL, "prompt": "x"}
            sent = pool.submit(httpx.post, f"{url}/tokenize", json=body, timeout=30)
            assert d.state.wait_for(lambda s: "/tokenize" in [r.path for r in s.requests])
            os.kill(proc.pid, signal.SIGTERM)
            resp = sent.result()
        wait_until(lambda: proc.poll() is not None, 20, "the router to exit after the drain")
    assert resp.status_code == 503
    assert resp.json()["error"]["type"] == "service_unavailable"
    assert "shutting down" in resp.json()["error"]["message"]
    assert d.state.wait_for(lambda s: s.requests[0].outcome == "error")


def test_passthrough_routes_need_the_api_key(fake: dict[str, FakeVllmServer]) -> None:
    settings = make_settings([fake["p0"].url], [fake["d0"].url], api_keys=["sk-k"])
    with running_router(settings) as router:
        body = {"model": MODEL, "prompt": "x"}
        missing = httpx.post(f"{router.url}/tokenize", json=body, timeout=15)
        ok = httpx.post(
            f"{router.url}/tokenize", json=body, headers={"Authorization": "Bearer sk-k"}
        )
    assert missing.status_code == 401
    assert missing.json()["error"]["code"] == "invalid_api_key"
    assert ok.status_code == 200
    assert _paths(fake, "d0") == ["/tokenize"]
