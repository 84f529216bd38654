"""The streamed relay: what D sent together reaches the client together, in order, complete."""

from __future__ import annotations

import asyncio
import json
from collections.abc import MutableMapping
from typing import Any

import pytest

from disagg_router.router import create_app
from disagg_router.router.config import settings_from_mapping
from disagg_router.router.dispatch.state import END, Mailbox
from tests.unit.router.mock_upstream import Upstream, asgi_messages, pair


async def _relayed(
    tokens: int, body: dict[str, Any], mode: str = "push"
) -> list[MutableMapping[str, Any]]:
    """What a 1P1D router app sends its client for ``body``, over scripted instances whose D
    streams ``tokens`` events in one body (one write, so one read on the router's side)."""
    with pair(Upstream(tokens=tokens)) as (p, d):
        settings = settings_from_mapping(
            {
                "models": ["m"],
                "mode": mode,
                "prefill": {"instances": [{"url": p}]},
                "decode": {"instances": [{"url": d}]},
            }
        )
        return await asgi_messages(create_app(settings), body)


async def test_events_d_sent_together_reach_the_client_in_one_write() -> None:
    body = {"model": "m", "prompt": "hi", "max_tokens": 5, "stream": True}
    messages = await _relayed(5, body)
    writes = [m["body"] for m in messages if m["type"] == "http.response.body"]
    assert len(writes) == 1  # one upstream body: one write to the client, not one per event
    events = [e.removeprefix(b"data: ") for e in writes[0].split(b"\n\n") if e]
    assert events[-1] == b"[DONE]"
    assert [json.loads(e)["choices"][0]["text"] for e in events[:-1]] == ["a"] * 5


async def test_a_usage_event_goes_out_with_the_events_before_it_once_p_has_answered() -> None:
    """P's usage is in hand when D's events come (in pull mode P has answered before D's leg
    goes out): the usage is merged without holding anything back, so D's one body is still one
    write."""
    body = {
        "model": "m",
        "prompt": "hi",
        "max_tokens": 4,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    messages = await _relayed(4, body, mode="pull")
    [written] = [m["body"] for m in messages if m["type"] == "http.response.body"]
    events = [e.removeprefix(b"data: ") for e in written.split(b"\n\n") if e]
    assert events[-1] == b"[DONE]" and len(events) == 6
    assert json.loads(events[-2])["usage"]["completion_tokens"] == 4


async def test_the_stream_s_last_events_end_the_body_in_the_same_message() -> None:
    """No separate empty message (a write of its own) after the events that end the stream."""
    body = {"model": "m", "prompt": "hi", "max_tokens": 3, "stream": True}
    messages = await _relayed(3, body)
    bodies = [m for m in messages if m["type"] == "http.response.body"]
    assert messages[0]["status"] == 200
    assert all(m["body"] for m in bodies)
    assert bodies[-1]["more_body"] is False
    assert bodies[-1]["body"].endswith(b"data: [DONE]\n\n")


async def test_the_mailbox_hands_items_over_in_order_and_a_cancelled_get_takes_none() -> None:
    box = Mailbox()
    with pytest.raises(asyncio.QueueEmpty):
        box.get_nowait()
    waiting = asyncio.ensure_future(box.get())
    await asyncio.sleep(0)  # the reader is now waiting for the first item
    box.put_nowait(b"a")
    box.put_nowait(b"b")
    assert await waiting == b"a"
    assert box.get_nowait() == b"b"
    cancelled = asyncio.ensure_future(box.get())
    await asyncio.sleep(0)
    cancelled.cancel()
    with pytest.raises(asyncio.CancelledError):
        await cancelled
    box.put_nowait(END)
    assert await box.get() is END
