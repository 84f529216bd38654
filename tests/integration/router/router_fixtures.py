"""Helpers for router integration tests: settings, a running router, SSE parsing."""

from __future__ import annotations

import json
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import httpx
from httpx_sse import EventSource

from devstack.fake_vllm import UvicornThread
from disagg_router.router.config import RouterSettings, settings_from_mapping
from disagg_router.router.http.app import create_app
from disagg_router.router.http.protocol import protocol_class
from tests.support.wait import wait_until

MODEL = "fake-model"


def make_settings(
    prefill: list[str],
    decode: list[str],
    mode: str = "push",
    identities: dict[str, dict[str, Any]] | None = None,
    policy: str = "round_robin",
    **extra: Any,
) -> RouterSettings:
    """Settings for the given instance URLs; ``identities`` maps a prefill URL to its identity."""
    identities = identities or {}
    data: dict[str, Any] = {
        "models": [MODEL],
        "mode": mode,
        "prefill": {
            "instances": [
                {"url": u, **({"identity": identities[u]} if u in identities else {})}
                for u in prefill
            ],
            "policy": policy,
        },
        "decode": {"instances": [{"url": u} for u in decode], "policy": policy},
        "health": {"interval": 3600},
        **extra,
    }
    return settings_from_mapping(data)


def _all_checked(url: str) -> bool:
    missing = httpx.get(f"{url}/ready", timeout=5).json()["missing"]
    return "not checked yet" not in missing.values()


def checked_wait(url: str) -> None:
    """Until the router at ``url`` has checked every backend once."""
    wait_until(lambda: _all_checked(url), what="the router's first health checks")


@contextmanager
def running_router(
    settings: RouterSettings, config_path: Path | None = None
) -> Iterator[UvicornThread]:
    """A router app for ``settings`` served on a free loopback port (``config_path``: the file
    it reloads), once it has checked every backend (the checks run in the background after start;
    ``/ready`` lists the backends not checked yet)."""
    app = create_app(settings, config_path=config_path)
    server = UvicornThread(app, http=protocol_class(settings.limits))  # as `serve` runs it
    server.start()
    try:
        checked_wait(server.url)
        yield server
    finally:
        server.stop()


def sse_payloads(text: str) -> list[str]:
    """The data of every event of an SSE body, in order (``[DONE]`` included), read by the
    same library as the router's reader."""
    response = httpx.Response(
        200, headers={"content-type": "text/event-stream"}, content=text.encode()
    )
    return [event.data for event in EventSource(response).iter_sse()]


def sse_text(text: str, chat: bool) -> str:
    """The generated text carried by an SSE body (completions or chat chunks)."""
    out = []
    for payload in sse_payloads(text):
        if payload == "[DONE]":
            continue
        chunk = json.loads(payload)
        for choice in chunk.get("choices", []):
            out.append(choice["delta"].get("content", "") if chat else choice["text"])
    return "".join(out)
