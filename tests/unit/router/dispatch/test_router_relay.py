"""The streamed relay: what D sent together reaches the client together, in order, complete."""

from __future__ import annotations

import asyncio
import json

import httpx
import pytest
from fastapi import FastAPI

from router import create_app
from router.config import settings_from_mapping
from router.dispatch.state import END, Mailbox
from tests.unit.router.mock_upstream import D, P, Upstream, asgi_messages


def _app(tokens: int) -> FastAPI:
    """A 1P1D router app over mock instances whose D streams ``tokens`` events in one body."""
    settings = settings_from_mapping(
        {
            "models": ["m"],
            "prefill": {"instances": [{"url": P}]},
            "decode": {"instances": [{"url": D}]},
        }
    )
    return create_app(settings, transport=httpx.MockTransport(Upstream(tokens=tokens)))


async def test_events_d_sent_together_reach_the_client_in_one_write() -> None:
    body = {"model": "m", "prompt": "hi", "max_tokens": 5, "stream": True}
    messages = await asgi_messages(_app(tokens=5), body)
    writes = [m["body"] for m in messages if m["type"] == "http.response.body"]
    assert len(writes) == 1  # one upstream body: one write to the client, not one per event
    events = [e.removeprefix(b"data: ") for e in writes[0].split(b"\n\n") if e]
    assert events[-1] == b"[DONE]"
    assert [json.loads(e)["choices"][0]["text"] for e in events[:-1]] == ["a"] * 5


async def test_a_usage_event_goes_out_with_the_events_before_it_once_p_has_answered() -> None:
    """P's usage is in hand when D's events come (P answered first): the usage is merged
    without holding anything back, so D's one body is still one write."""
    body = {
        "model": "m",
        "prompt": "hi",
        "max_tokens": 4,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    messages = await asgi_messages(_app(tokens=4), body)
    [written] = [m["body"] for m in messages if m["type"] == "http.response.body"]
    events = [e.removeprefix(b"data: ") for e in written.split(b"\n\n") if e]
    assert events[-1] == b"[DONE]" and len(events) == 6
    assert json.loads(events[-2])["usage"]["completion_tokens"] == 4


async def test_the_stream_s_last_events_end_the_body_in_the_same_message() -> None:
    """No separate empty message (a write of its own) after the events that end the stream."""
    body = {"model": "m", "prompt": "hi", "max_tokens": 3, "stream": True}
    messages = await asgi_messages(_app(tokens=3), body)
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
