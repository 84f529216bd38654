"""A Kubernetes API stand-in that replays a transcript in the API's JSON wire format.

Who uses it: the Kubernetes discovery tests (no cluster can run on the test machines). It serves
the list and watch calls of one collection (``/apis/discovery.k8s.io/v1/namespaces/NS/
endpointslices`` or ``/api/v1/namespaces/NS/pods``) from files in ``recorded/``: a list answer is a
JSON document, a watch answer is newline-delimited JSON events (ADDED, MODIFIED, DELETED,
BOOKMARK, ERROR) exactly as ``kubectl get --raw '...?watch=true'`` prints them. Lists and watches
are answered in order; a watch ends after its events (as when its timeoutSeconds pass), except
the last, which then stays open (a quiet cluster) until the client goes away. Every request is
recorded (path, query, Authorization). A list entry that is an int answers with that HTTP status
instead (an API outage).
"""

from __future__ import annotations

import asyncio
import json
import threading
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

RECORDED = Path(__file__).parent / "recorded"
TOKEN = "test-token-7f3c"
_GO_TRUE = ("1", "t", "T", "TRUE", "true", "True")  # the API server parses bools like Go


def is_watch(query: dict[str, str]) -> bool:
    return query.get("watch") in _GO_TRUE


def recorded(name: str) -> Any:
    """A list answer (``.json``) or watch transcript (``.jsonl``, a list of events)."""
    text = (RECORDED / name).read_text()
    if name.endswith(".jsonl"):
        return [json.loads(line) for line in text.splitlines() if line.strip()]
    return json.loads(text)


@dataclass(frozen=True)
class Seen:
    path: str
    query: dict[str, str]
    authorization: str | None


class KubeApiTranscript:
    """Answers lists and watches of ``collection`` from ``lists`` and ``watches`` in order."""

    def __init__(
        self,
        collection: str,
        lists: Sequence[dict[str, Any] | int],
        watches: Sequence[Sequence[dict[str, Any]]],
    ) -> None:
        self._lists = list(lists)
        self._watches = [list(w) for w in watches]
        self._lock = threading.Lock()
        self.seen: list[Seen] = []
        self.app = Starlette(routes=[Route(collection, self._serve)])

    def requests(self, watch: bool) -> list[Seen]:
        with self._lock:
            return [s for s in self.seen if is_watch(s.query) == watch]

    async def _serve(self, request: Request) -> Response:
        query = dict(request.query_params)
        with self._lock:
            self.seen.append(Seen(request.url.path, query, request.headers.get("authorization")))
            if request.headers.get("authorization") != f"Bearer {TOKEN}":
                return JSONResponse({"kind": "Status", "code": 401}, status_code=401)
            if is_watch(query):
                events = self._watches.pop(0) if self._watches else []
                quiet = not self._watches  # the last watch stays open; earlier ones time out
                return StreamingResponse(_stream(events, quiet), media_type="application/json")
            answer = self._lists.pop(0) if len(self._lists) > 1 else self._lists[0]
        if isinstance(answer, int):
            body = {"kind": "Status", "apiVersion": "v1", "status": "Failure", "code": answer}
            return JSONResponse(body, status_code=answer)
        return JSONResponse(answer)


async def _stream(events: list[dict[str, Any]], quiet: bool) -> AsyncIterator[bytes]:
    """The events; then the end of the watch (its timeoutSeconds passed) or, for the last one,
    silence until the client leaves."""
    for event in events:
        yield json.dumps(event).encode() + b"\n"
        if event["type"] == "ERROR":
            return  # the API server ends a watch after an ERROR event
    if quiet:
        await asyncio.Event().wait()


def kubeconfig(path: Path, server_url: str) -> Path:
    """A kubeconfig file for ``server_url`` with the transcript's bearer token."""
    config = {
        "apiVersion": "v1",
        "kind": "Config",
        "clusters": [{"name": "test", "cluster": {"server": server_url}}],
        "users": [{"name": "router", "user": {"token": TOKEN}}],
        "contexts": [{"name": "test", "context": {"cluster": "test", "user": "router"}}],
        "current-context": "test",
    }
    path.write_text(json.dumps(config))
    return path
