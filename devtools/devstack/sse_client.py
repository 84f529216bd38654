"""Reading an OpenAI event stream as a client: each event's data up to ``[DONE]``.

Who uses it: the demo (:mod:`devstack.demo`), the bench clients (:mod:`bench.client`,
:mod:`bench.clients`) and the tests, over an ``httpx`` response read with ``httpx-sse``. The
readers yield each event's data up to that terminator (not yielded) and raise
:class:`disagg_router.router.upstream.sse.StreamEndedEarly` when the stream ends without it;
``httpx_sse.SSEError`` when the answer is not an event stream; httpx errors propagate.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Iterator

import httpx
from httpx_sse import EventSource

from disagg_router.router.upstream.sse import DONE, StreamEndedEarly


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
