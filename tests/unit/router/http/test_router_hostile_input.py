"""Hostile and malformed client input: always a 4xx in OpenAI error form naming the field where
there is one, never a 5xx or a traceback, and nothing reaches an instance.

A hand-written list of hostile bodies plus a bounded property-based fuzz (hypothesis) over JSON
bodies built from the request fields, all through the real app with scripted upstream servers
that answer like vLLM and counts every generation request it gets.
"""

from __future__ import annotations

import json
import logging
from collections.abc import AsyncIterator
from typing import Any

import httpx
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from disagg_router.router.config import settings_from_mapping
from disagg_router.router.http.app import create_app
from tests.unit.router.mock_upstream import Upstream, pair


@pytest.fixture
async def router() -> AsyncIterator[tuple[httpx.AsyncClient, Upstream]]:
    upstream = Upstream()
    with pair(upstream) as (p, d):
        config = settings_from_mapping(
            {
                "models": ["m"],
                "prefill": {"instances": [{"url": p}]},
                "decode": {"instances": [{"url": d}]},
                "limits": {"max_body_bytes": 65536, "max_tokens": 4096},
            }
        )
        app = create_app(config)
        transport = httpx.ASGITransport(app=app)
        async with (
            app.router.lifespan_context(app),
            httpx.AsyncClient(transport=transport, base_url="http://router") as client,
        ):
            await app.state.runtime.lifecycle.initial_check_done.wait()
            yield client, upstream


def _body(field: bytes) -> bytes:
    return b'{"model": "m", "prompt": "x", ' + field + b"}"


HOSTILE: list[tuple[str, bytes, int, str | None]] = [
    ("empty", b"", 400, None),
    ("not json", b"{not json", 400, None),
    ("truncated", b'{"model": "m", "prompt": "ab', 400, None),
    ("array", b"[1, 2]", 400, None),
    ("string", b'"hi"', 400, None),
    ("null", b"null", 400, None),
    ("latin-1", '{"model": "m", "prompt": "caf\xe9"}'.encode("latin-1"), 400, None),
    ("utf-16", '{"model": "m", "prompt": "x"}'.encode("utf-16"), 400, None),
    (
        "deep arrays",
        b'{"model": "m", "prompt": "x", "a": ' + b"[" * 5000 + b"]" * 5000 + b"}",
        400,
        None,
    ),
    (
        "deep objects",
        b'{"model": "m", "prompt": "x", "a": ' + b'{"a":' * 40 + b"1" + b"}" * 41,
        400,
        None,
    ),
    ("NaN", b'{"model": "m", "prompt": "x", "temperature": NaN}', 400, None),
    ("Infinity", b'{"model": "m", "prompt": "x", "top_p": -Infinity}', 400, None),
    ("overflowing float", b'{"model": "m", "prompt": "x", "temperature": 1e999}', 400, None),
    ("huge int", b'{"model": "m", "prompt": "x", "max_tokens": 1' + b"0" * 5000 + b"}", 400, None),
    (
        "absurd max_tokens",
        b'{"model": "m", "prompt": "x", "max_tokens": 1000000000}',
        400,
        "max_tokens",
    ),
    ("bool max_tokens", b'{"model": "m", "prompt": "x", "max_tokens": true}', 400, "max_tokens"),
    (
        "string temperature",
        b'{"model": "m", "prompt": "x", "temperature": "hot"}',
        400,
        "temperature",
    ),
    ("list top_k", b'{"model": "m", "prompt": "x", "top_k": [1]}', 400, "top_k"),
    ("float seed", b'{"model": "m", "prompt": "x", "seed": 1.5}', 400, "seed"),
    ("stop of ints", b'{"model": "m", "prompt": "x", "stop": [1, 2]}', 400, "stop"),
    ("model number", b'{"model": 7, "prompt": "x"}', 400, "model"),
    ("unknown model", b'{"model": "other", "prompt": "x"}', 404, "model"),
    ("no prompt", b'{"model": "m"}', 400, "prompt"),
    ("prompt object", b'{"model": "m", "prompt": {"a": 1}}', 400, "prompt"),
    ("stream string", b'{"model": "m", "prompt": "x", "stream": "yes"}', 400, "stream"),
    ("n=2", b'{"model": "m", "prompt": "x", "n": 2}', 400, "n"),
    (
        "stream_options list",
        b'{"model": "m", "prompt": "x", "stream_options": []}',
        400,
        "stream_options",
    ),
    ("oversized", b'{"model": "m", "prompt": "' + b"x" * 70000 + b'"}', 413, None),
    ("seed 1e30 as an integer", _body(b'"seed": 1' + b"0" * 30), 400, "seed"),
    ("seed below int64", _body(b'"seed": -9223372036854775809'), 400, "seed"),
    ("401-digit top_k", _body(b'"top_k": 1' + b"0" * 400), 400, "top_k"),
    ("huge token id", b'{"model": "m", "prompt": [1, 1' + b"0" * 30 + b"]}", 400, "prompt"),
    ("negative token id", b'{"model": "m", "prompt": [[5, -1]]}', 400, "prompt"),
]


@pytest.mark.parametrize(("name", "raw", "status", "param"), HOSTILE, ids=[h[0] for h in HOSTILE])
async def test_hostile_body_gets_a_4xx_naming_the_field_and_reaches_no_instance(
    router: tuple[httpx.AsyncClient, Upstream],
    caplog: pytest.LogCaptureFixture,
    name: str,
    raw: bytes,
    status: int,
    param: str | None,
) -> None:
    client, upstream = router
    with caplog.at_level(logging.WARNING):
        resp = await client.post(
            "/v1/completions", content=raw, headers={"content-type": "application/json"}
        )
    assert resp.status_code == status, resp.text
    err = resp.json()["error"]
    assert err["message"] and err["param"] == param
    assert resp.headers["x-request-id"]
    assert upstream.generations == 0
    assert not [r for r in caplog.records if r.exc_info], "no traceback in the log"


async def test_a_valid_body_does_reach_the_instances(
    router: tuple[httpx.AsyncClient, Upstream],
) -> None:
    client, upstream = router
    resp = await client.post("/v1/completions", json={"model": "m", "prompt": "x"})
    assert resp.status_code == 200, resp.text
    assert upstream.generations == 2  # P and D


async def test_integers_at_the_int64_bounds_reach_the_instances(
    router: tuple[httpx.AsyncClient, Upstream],
) -> None:
    client, upstream = router
    body = {"model": "m", "prompt": [0, 2**63 - 1], "seed": -(2**63), "top_k": 2**63 - 1}
    resp = await client.post("/v1/completions", json=body)
    assert resp.status_code == 200, resp.text
    assert upstream.generations == 2


_json = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=20),
    lambda inner: (
        st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner, max_size=4)
    ),
    max_leaves=20,
)
_FIELDS = [
    "model", "prompt", "messages", "stream", "max_tokens", "max_completion_tokens", "n",
    "best_of", "temperature", "top_p", "top_k", "seed", "stop", "stream_options", "logit_bias",
    "echo", "min_tokens", "kv_transfer_params",
]  # fmt: skip
_bodies = st.dictionaries(st.sampled_from(_FIELDS), _json, max_size=6).map(
    lambda d: {"model": "m", **d} if "model" not in d else d
)


@settings(
    max_examples=120,
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)
@given(body=_bodies, chat=st.booleans(), raw=st.binary(max_size=64))
async def test_fuzzed_bodies_never_get_a_5xx_and_rejected_ones_reach_no_instance(
    router: tuple[httpx.AsyncClient, Upstream], body: dict[str, Any], chat: bool, raw: bytes
) -> None:
    client, upstream = router
    path = "/v1/chat/completions" if chat else "/v1/completions"
    for content in (json.dumps(body, allow_nan=True).encode(), raw):
        before = upstream.generations
        resp = await client.post(path, content=content)
        assert resp.status_code < 500, (content, resp.text)
        if resp.status_code >= 400:
            assert upstream.generations == before, content
            assert set(resp.json()["error"]) == {"message", "type", "param", "code"}


@pytest.mark.parametrize("docs", [False, True])
async def test_interactive_docs_only_when_configured(docs: bool) -> None:
    with pair(Upstream()) as (p, d):
        config = settings_from_mapping(
            {
                "models": ["m"],
                "prefill": {"instances": [{"url": p}]},
                "decode": {"instances": [{"url": d}]},
                "limits": {"docs": docs},
            }
        )
        app = create_app(config)
        transport = httpx.ASGITransport(app=app)
        async with (
            app.router.lifespan_context(app),
            httpx.AsyncClient(transport=transport, base_url="http://router") as client,
        ):
            pages = [(await client.get(p)).status_code for p in ("/docs", "/openapi.json")]
    assert pages == ([200, 200] if docs else [404, 404])
