"""A bug inside a handler still answers OpenAI-style JSON (500), not a bare text page."""

from __future__ import annotations

from typing import Any

import httpx
import pytest

import disagg_router.router.http.app
from disagg_router.router.config import settings_from_mapping
from disagg_router.router.http.app import create_app


async def test_unexpected_error_is_json_500(monkeypatch: pytest.MonkeyPatch) -> None:
    def broken(*_: Any) -> Any:
        raise RuntimeError("boom")

    monkeypatch.setattr(disagg_router.router.http.app, "parse_client_request", broken)
    settings = settings_from_mapping(
        {
            "models": ["m"],
            "prefill": {"instances": [{"url": "http://127.0.0.1:9"}]},
            "decode": {"instances": [{"url": "http://127.0.0.1:9"}]},
        }
    )
    app = create_app(settings)
    transport = httpx.ASGITransport(app=app, raise_app_exceptions=False)
    async with (
        app.router.lifespan_context(app),
        httpx.AsyncClient(transport=transport, base_url="http://router") as client,
    ):
        resp = await client.post("/v1/completions", json={"model": "m", "prompt": "x"})
    assert resp.status_code == 500
    assert resp.json()["error"]["message"].startswith("internal router error")
