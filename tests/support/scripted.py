"""Scripted upstream instances: an httpx-style handler (request in, response out) served over
real HTTP, so the router reaches it through its one upstream client, as it reaches vLLM.

A handler is ``handler(request: httpx.Request) -> httpx.Response`` (or a coroutine function);
the request carries the method, the URL the router called (host and port included, so one
handler can serve several instances), the headers and the whole body. The response's status,
headers and body are sent as given (a body without ``Content-Length`` goes out chunked, each
chunk of an async stream as it comes). A handler that raises before answering makes uvicorn
answer 500 (and log the error); a response body that raises mid-way breaks the connection, as
a crashed instance does. To make an instance refuse connections, stop its server.
"""

from __future__ import annotations

import inspect
from collections.abc import Awaitable, Callable, Iterator
from contextlib import ExitStack, contextmanager
from typing import Any

import httpx

from devstack.fakes.server import UvicornThread

Handler = Callable[[httpx.Request], httpx.Response | Awaitable[httpx.Response]]


def handler_app(handler: Handler) -> Callable[..., Awaitable[None]]:
    """An ASGI app answering every HTTP request with ``handler``'s response."""

    async def app(scope: dict[str, Any], receive: Any, send: Any) -> None:
        assert scope["type"] == "http"
        body = b""
        more = True
        while more:
            message = await receive()
            body += message.get("body", b"")
            more = message.get("more_body", False)
        host = dict(scope["headers"]).get(b"host", b"").decode("latin-1")
        query = scope["query_string"].decode("latin-1")
        url = f"http://{host}{scope['path']}" + (f"?{query}" if query else "")
        request = httpx.Request(scope["method"], url, headers=scope["headers"], content=body)
        found = handler(request)
        response = await found if inspect.isawaitable(found) else found
        headers = [(k.lower(), v) for k, v in response.headers.raw if k.lower() != b"connection"]
        start = {"type": "http.response.start", "status": response.status_code, "headers": headers}
        await send(start)
        async for chunk in response.stream:  # type: ignore[union-attr]
            await send({"type": "http.response.body", "body": chunk, "more_body": True})
        await send({"type": "http.response.body", "body": b""})

    return app


@contextmanager
def scripted(handler: Handler, count: int = 1) -> Iterator[list[UvicornThread]]:
    """``count`` servers answering with ``handler``, each on its own free loopback port (its
    ``url``, ``port``), stopped on exit."""
    with ExitStack() as stack:
        app = handler_app(handler)
        yield [stack.enter_context(UvicornThread(app, "off")) for _ in range(count)]
