"""OpenAI-style server-sent events: read with ``httpx-sse``; :func:`encode_data` writes one event.

An OpenAI stream is a sequence of ``data: <JSON>`` events ended by ``data: [DONE]``. The readers
yield each event's data up to that terminator (not yielded) and raise :class:`StreamEndedEarly`
when the stream ends without it; ``httpx_sse.SSEError`` when the answer is not an event stream;
httpx errors propagate. Who uses them: the router's upstream legs, the bench client, the demo and
the tests. :func:`encode_data` is the fake vLLM's (the router's relay writes its events from
bytes, in the dispatch).
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Iterator

import httpx
from httpx_sse import EventSource

DONE = "[DONE]"
"""The data of the event that ends an OpenAI stream."""


class StreamEndedEarly(Exception):
    """The event stream ended before its ``data: [DONE]`` event."""


async def aiter_data(response: httpx.Response) -> AsyncIterator[str]:
    """The data of each event of a streamed ``response`` up to ``[DONE]``.

    After ``[DONE]`` the rest of the body is read to its end (so the connection can be reused);
    a transport error there is ignored, as the stream was already complete.
    """
    done = False
    try:
        async for event in EventSource(response).aiter_sse():
            if done:
                continue
            if event.data == DONE:
                done = True
                continue
            yield event.data
    except httpx.HTTPError:
        if not done:
            raise
    if not done:
        raise StreamEndedEarly("stream ended before [DONE]")


def iter_data(response: httpx.Response) -> Iterator[str]:
    """The data of each event of a streamed ``response`` up to ``[DONE]`` (blocking client)."""
    for event in EventSource(response).iter_sse():
        if event.data == DONE:
            return
        yield event.data
    raise StreamEndedEarly("stream ended before [DONE]")


def encode_data(data: str) -> bytes:
    """One ``data:`` event (``data`` must hold no newline, as JSON from ``json.dumps``)."""
    return b"data: " + data.encode() + b"\n\n"
